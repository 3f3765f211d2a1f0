"""Typed training configuration: dataclasses, YAML files and `--set key=value` overrides.

A YAML file mirrors the dataclass tree (`data`, `pipeline`, `model`, `loss`, `optimizer`,
`training`, `validation`, `runtime`, `profile`, `output`, `cascade`, `postprocessing`, `planning`). Unknown keys
and wrong types are errors that name the key (and suggest the closest valid one); values not given keep the
defaults below.

- `schema.py`: the sections' dataclasses and `Config`, their tree (the defaults);
- `parse.py`: nested dicts and `--set` overrides to a checked `Config` (`from_dict`, `apply_override`,
  `parse_config`);
- `checks.py`: the cross-field checks (`validate`), the splits `data.split` derives, `region_paint_labels`;
- `files.py`: YAML files (`read_yaml`, `load_config`, `save_config`, `to_dict`) and stages files (`write_stages`,
  `load_stages`).

Every public name is imported from here (`from tfmis.config import load_config`): this package is the interface.

Example:
```python
config = load_config("configs/demo.yaml", overrides=["training.epochs=3", "pipeline.patch_size=[48,48,48]"])
print(config.training.epochs)
save_config(config, "runs/demo/config.yaml")
```
"""

from tfmis.config.checks import (
    BRATS_REGIONS_EXAMPLE,
    check_model_parallel,
    folds_dataset_dir,
    region_paint_labels,
    validate,
)
from tfmis.config.files import (
    STAGES_KEY,
    load_config,
    load_stages,
    read_yaml,
    save_config,
    to_dict,
    write_stages,
)
from tfmis.config.parse import (
    MOVED_KEYS,
    apply_override,
    from_dict,
    parse_config,
    set_key,
)
from tfmis.config.schema import (
    AugmentConfig,
    CascadeConfig,
    Config,
    DataConfig,
    LossConfig,
    ModelParallelConfig,
    OptimizerConfig,
    OutputConfig,
    PipelineConfig,
    PlannedFor,
    PlanningConfig,
    PostprocessingConfig,
    ProfileConfig,
    RuntimeConfig,
    SplitConfig,
    TrainingConfig,
    ValidationConfig,
)
from tfmis.data.conversion_options import ConversionOptions
from tfmis.errors import ConfigError  # config.ConfigError: part of this package's interface
from tfmis.networks.architecture import UNetArchitecture

__all__ = [
    "BRATS_REGIONS_EXAMPLE",
    "MOVED_KEYS",
    "STAGES_KEY",
    "AugmentConfig",
    "CascadeConfig",
    "Config",
    "ConfigError",
    "ConversionOptions",
    "DataConfig",
    "LossConfig",
    "ModelParallelConfig",
    "OptimizerConfig",
    "OutputConfig",
    "PipelineConfig",
    "PlannedFor",
    "PlanningConfig",
    "PostprocessingConfig",
    "ProfileConfig",
    "RuntimeConfig",
    "SplitConfig",
    "TrainingConfig",
    "UNetArchitecture",
    "ValidationConfig",
    "apply_override",
    "check_model_parallel",
    "folds_dataset_dir",
    "from_dict",
    "load_config",
    "load_stages",
    "parse_config",
    "read_yaml",
    "region_paint_labels",
    "save_config",
    "set_key",
    "to_dict",
    "validate",
    "write_stages",
]
