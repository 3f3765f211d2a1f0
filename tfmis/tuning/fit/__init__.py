"""The GPU-fit search: batch size, sliding-window batch size, placement (recompute, model parallelism) chosen from
measured memory and speed (MONAI Auto3DSeg's "GPU customization").

- `specs.py`: what is searched (`FitSpecs`, `load_specs`, in Auto3DSeg's shape);
- `trial.py`: one measured configuration in a fresh subprocess (`run_trial`);
- `memory.py`: the memory model that prunes candidates predicted over the budget (`MemoryModel`);
- `candidates.py`: the searched values and where they live in the config, the objective, which candidates cannot
  run here, the choice and the config it gives (`apply_values`, `choose`, `fitted_config`);
- `strategies.py`: the Keras Tuner search space and each strategy's oracle (`bayesian`, `grid`);
- `cache.py`: the cache key, and reading a cached report that still holds;
- `search.py`: Keras Tuner proposes, the memory model prunes, the trials measure (`GpuFitSearch`, `fit_config`,
  `cached_choice` for the planner);
- `report.py`: a trial's line, the report (fit_report.json) and files written, the trial table and `memory.png`.

`python -m tfmis.tune fit` is the command (`tfmis.tune`).
"""

from tfmis.tuning.fit.search import GpuFitSearch, NoConfigurationFits, cached_choice, fit_config
from tfmis.tuning.fit.specs import FitSpecs, load_specs

__all__ = ["FitSpecs", "GpuFitSearch", "NoConfigurationFits", "cached_choice", "fit_config", "load_specs"]
