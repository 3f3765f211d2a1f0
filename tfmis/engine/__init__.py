"""The training engine: the one custom loop, its distribution backends and run history."""
