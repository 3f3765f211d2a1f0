"""The weights files of a training run folder, named once for the trainer that writes them and the predictors that
read them.

- `best.weights.h5`: the inference model at the epoch with the best validation mean Dice (chosen on the run's
  validation split);
- `final.weights.h5`: the inference model when training ended (its last epoch, whatever stopped it). Out-of-fold
  predictions use these by default: a fold's validation split is its held-out fold, so weights chosen on it would
  make the out-of-fold Dice optimistic (nnU-Net predicts its validation folds with `checkpoint_final.pth`).
"""

from __future__ import annotations

from pathlib import Path

BEST_WEIGHTS = "best.weights.h5"
FINAL_WEIGHTS = "final.weights.h5"
WEIGHTS_FILES = {"best": BEST_WEIGHTS, "final": FINAL_WEIGHTS}


def weights_file(run_dir: str | Path, which: str = "best") -> Path:
    """`<run_dir>/best.weights.h5` or `<run_dir>/final.weights.h5` (`which`: "best" or "final")."""
    if which not in WEIGHTS_FILES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS_FILES)}, got {which!r}")
    return Path(run_dir) / WEIGHTS_FILES[which]
