"""Hyperparameter search with N trials at once: Keras Tuner's distributed mode on one machine (DistMIS's
experiment parallelism, with Keras Tuner in place of Ray Tune).

- `space.py`: the space file and the objective (`load_space`, `parse_space`, `Objective`);
- `devices.py`: each worker's share of the GPUs and cores, and the pinning of its training processes;
- `folder.py`: the search folder's files, the definition and the runs log;
- `workers.py`: the chief (serves the oracle) and the workers (run trials as `tfmis.train` processes);
- `search.py`: `HpoSearch`, the parent that starts them, watches, resumes and reports;
- `report.py`: the trials collected from the folder, the table and `hpo_dice.png`.

`python -m tfmis.tune hpo` is the command (`tfmis.tune`).
"""

from tfmis.tuning.hpo.devices import assign_devices
from tfmis.tuning.hpo.folder import BEST_FILE, PLOT_FILE, REPORT_FILE, TRIALS_DIR
from tfmis.tuning.hpo.search import HpoSearch, SearchFailed
from tfmis.tuning.hpo.space import NOT_REACHED_SECONDS, Objective, SearchSpace, load_space, parse_space

__all__ = [
    "BEST_FILE",
    "NOT_REACHED_SECONDS",
    "PLOT_FILE",
    "REPORT_FILE",
    "TRIALS_DIR",
    "HpoSearch",
    "Objective",
    "SearchFailed",
    "SearchSpace",
    "assign_devices",
    "load_space",
    "parse_space",
]
