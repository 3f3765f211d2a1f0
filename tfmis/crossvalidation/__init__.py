"""K-fold cross-validation, model selection and postprocessing as nnU-Net does them, with the folds run as parallel
experiments (`tfmis-crossval`, docs/crossval.md).

- `experiment.py`: the CV folder, its configurations, folds and job configs;
- `jobs.py`: the workers: each takes its share of the folds, trains them and predicts their held-out cases;
- `oof.py`: the out-of-fold predictions on the original grid and their scores;
- `selection.py`: the configuration (or two averaged) chosen by out-of-fold Dice, the postprocessing, the report;
- `driver.py`: a cross-validation run from start to end (the library of `tfmis-crossval`, `tfmis.crossval`, and
  `tfmis-auto`); `protocol.py`: plan, cross-validate, choose (`tfmis-auto`); `pilot.py`: `--pilot`;
  `ranks.py`: a launch's ranks.
"""
