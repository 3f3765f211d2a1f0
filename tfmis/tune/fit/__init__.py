"""The GPU-fit search: batch size, sliding-window batch size, placement (recompute, model parallelism) chosen from
measured memory and speed (MONAI Auto3DSeg's "GPU customization").

- `specs.py`: what is searched (`FitSpecs`, `load_specs`, in Auto3DSeg's shape);
- `trial.py`: one measured configuration in a fresh subprocess (`run_trial`);
- `memory.py`: the memory model that prunes candidates predicted over the budget (`MemoryModel`);
- `search.py`: Keras Tuner proposes, the memory model prunes, the choice and its cache (`GpuFitSearch`,
  `fit_config`, `cached_choice` for the planner);
- `report.py`: the trial table and `memory.png`.

`python -m tfmis.tune fit` is the command (`tfmis.tune.cli`).
"""

from tfmis.tune.fit.search import GpuFitSearch, NoConfigurationFits, cached_choice, fit_config
from tfmis.tune.fit.specs import FitSpecs, load_specs

__all__ = ["FitSpecs", "GpuFitSearch", "NoConfigurationFits", "cached_choice", "fit_config", "load_specs"]
