"""Auto-configuration: a training plan from the dataset fingerprint and the hardware (nnU-Net v2's rules).

- `api.py`: `plan_dataset` (the front door: fingerprint, hardware, plan, the GPU-fit search's cached measurement);
- `planner.py`: `ExperimentPlanner` (overridable `determine_*` steps), `make_plan`; its steps are in `data_steps.py`,
  `topology.py` and `training_steps.py`, what they return in `decisions.py`; `plan_file.py`: `Plan` (values with
  reasons, written as a commented config);
- `stages.py`: `StagePlanner` / `plan_stages`: the candidates (full resolution; low resolution and a coarse-to-fine
  cascade where they pay) and the recommended one;
- `rules.py`: nnU-Net's formulas (target spacing, pooling, patch shrinking, memory estimates);
- `fingerprint.py`: `DatasetFingerprint` from a first pass over an MSD folder or from a conversion.

Example:
```python
from tfmis.planning import plan_dataset

plan, fingerprint = plan_dataset("data/Task09_Spleen")
plan.write("runs/Task09_Spleen/plan.yaml")
```
or from a shell: `python -m tfmis.plan --source-dir data/Task09_Spleen`.
"""

from tfmis.planning.api import plan_dataset, plan_dataset_stages, replan_with_cached_gpu_fit
from tfmis.planning.fingerprint import DatasetFingerprint, fingerprint_from_conversion, fingerprint_msd, has_conversion
from tfmis.planning.inputs import default_dataset_dir, default_output_dir
from tfmis.planning.plan_file import Plan
from tfmis.planning.planner import ExperimentPlanner, make_plan

__all__ = [
    "DatasetFingerprint",
    "ExperimentPlanner",
    "Plan",
    "default_dataset_dir",
    "default_output_dir",
    "fingerprint_from_conversion",
    "fingerprint_msd",
    "has_conversion",
    "make_plan",
    "plan_dataset",
    "plan_dataset_stages",
    "replan_with_cached_gpu_fit",
]
