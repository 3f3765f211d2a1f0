"""Auto-configuration: a training plan from the dataset fingerprint and the hardware (nnU-Net v2's rules).

Example:
```python
from tfmis.planning import detect_hardware, fingerprint_msd, make_plan

plan = make_plan(fingerprint_msd("data/Task09_Spleen"), detect_hardware())
plan.write("runs/Task09_Spleen/plan.yaml")
```
or from a shell: `python -m tfmis.plan --source-dir data/Task09_Spleen`.
"""

from tfmis.planning.fingerprint import (DatasetFingerprint, fingerprint_from_conversion, fingerprint_msd,
                                        has_conversion)
from tfmis.planning.hardware import (Hardware, detect_hardware, hardware_warnings, recommended_precision,
                                     resolve_precision)
from tfmis.planning.planner import Plan, cached_gpu_fit, default_dataset_dir, default_output_dir, make_plan

__all__ = ["DatasetFingerprint", "Hardware", "Plan", "cached_gpu_fit", "default_dataset_dir", "default_output_dir",
           "detect_hardware", "fingerprint_from_conversion", "fingerprint_msd", "has_conversion",
           "hardware_warnings", "make_plan", "recommended_precision", "resolve_precision"]
