"""Searches over training configurations: `fit/` (the GPU-fit search: batch sizes and placement from measured
memory and speed) and `hpo/` (hyperparameter search, N trials at once); `kt.py` is their one Keras Tuner
adapter, `cli.py` the command `python -m tfmis.tune fit|hpo`."""
