"""GPU-fit search and hyperparameter tuning."""
