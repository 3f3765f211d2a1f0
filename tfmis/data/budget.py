"""What the training input holds in memory, in bytes, against the pipeline's budget (`pipeline.memory_budget`).

Each cache holds something else: `memory` every decoded training volume (and the validation volumes), `partial`
its window of volumes, `patches` only crops in flight. `input_memory` counts it from `index.json` (the decoded
shapes, before anything is read) so a run says at start what it will hold, and a `memory` cache that would not fit
its budget is refused before it fills the host instead of being killed halfway through its first epoch.

Example:
```python
held = input_memory(config, index)     # {"cache": "memory", "held_mb": 912.0, "budget_mb": 6144.0, "line": "..."}
```
"""

from __future__ import annotations

import numpy as np

from tfmis.data.records import split_cases, split_entry
from tfmis.data.smart_cache import partial_cache_bound, partial_cache_size
from tfmis.errors import ConfigError
from tfmis.hardware.memory import MB, host_memory, parse_memory_mb

# the share of the usable memory (after any cgroup limit) the input may hold when pipeline.memory_budget is null:
# the rest is the model, its optimizer, the validation windows, TensorFlow's own arenas
BUDGET_SHARE = 0.5
_IMAGE_BYTES = {"float16": 2, "float32": 4, "int16": 2, "uint8": 1}
# the crops a patch-read input pipeline may hold besides its batch: its readers' crops (patch_readers() x
# num_crops_per_image), the augmentation's outputs, the crop shuffle buffer, and tf.data's prefetched batches
_PATCH_PREFETCH_BATCHES = 2


def pipeline_memory_budget(pipeline) -> float:
    """The input's memory budget in MB: `pipeline.memory_budget`, else `BUDGET_SHARE` of the usable memory now."""
    if pipeline.memory_budget is not None:
        try:
            return parse_memory_mb(str(pipeline.memory_budget))
        except ValueError as e:
            raise ConfigError(f"pipeline.memory_budget: {e} (e.g. 6GB), or null for half the usable memory") from e
    return BUDGET_SHARE * host_memory()["available_mb"]


def volume_mb(index: dict, case: dict, float32: bool = False) -> float:
    """MB one decoded case takes in the volume caches: its image (stored dtype, or float32) and uint8 label."""
    shape = case["image_shape"]
    image = _IMAGE_BYTES.get(index["preprocessing"]["image_dtype"], 4) if not float32 else 4
    return float(np.prod(shape[:3])) * (shape[3] * image + 1) / MB


def input_memory(config, index: dict, input_pipelines: int = 1) -> dict:
    """What this run's training input holds at most, per host, and the line that says so.

    Returns {"cache", "held_mb", "budget_mb", "fits", "what", "line"}. `memory`: every training volume of the split and
    every validation volume, decoded; `partial`: its bound (`partial_cache_bound`) of the largest volumes;
    `patches`: the crops in flight; `none`/`file`: the volumes being read (a few of the largest).
    """
    p = config.pipeline
    budget = pipeline_memory_budget(p)
    train = [volume_mb(index, c) for c in split_cases(index, config.data.train_split)]
    largest = max(train, default=0.0)
    if p.cache == "memory":
        val = [volume_mb(index, c) for c in split_cases(index, config.data.val_split)] if config.data.val_split else []
        held = sum(train) + sum(val)
        what = f"{len(train)} training and {len(val)} validation volumes decoded in memory"
    elif p.cache == "partial":
        share = max(1, len(split_entry(index, config.data.train_split)["cases"]) // max(input_pipelines, 1))
        bound = partial_cache_bound(*partial_cache_size(p, share))
        held = input_pipelines * min(bound, len(train)) * largest
        what = f"at most {min(bound, len(train))} decoded volumes per input pipeline"
    elif p.cache == "patches":
        from tfmis.data.pipeline import patch_readers, train_crop_size

        channels = len(index["source"]["modalities"])
        crop_mb = float(np.prod(train_crop_size(p))) * (channels * 4 + 4) / MB
        batch = p.num_images_per_batch * config.training.accumulation_steps
        crops = patch_readers() * p.num_crops_per_image + p.shuffle_crops + (1 + _PATCH_PREFETCH_BATCHES) * batch
        held = input_pipelines * crops * crop_mb
        what = f"no volume: {crops} crops of {crop_mb:.1f} MB in flight per input pipeline, read from the arrays"
    else:
        held = 3 * largest
        what = f"the volumes being read from the TFRecords (pipeline.cache={p.cache})"
    line = f"Input memory: {held:,.0f} MB held ({what}); budget {budget:,.0f} MB"
    return {"cache": p.cache, "held_mb": held, "budget_mb": budget, "fits": held <= budget, "what": what, "line": line}


def check_input_memory(config, index: dict, input_pipelines: int = 1) -> dict:
    """`input_memory`, refusing in one line (ConfigError naming the fix) a cache of volumes (`memory`, `partial`)
    that would hold more than its budget."""
    held = input_memory(config, index, input_pipelines)
    if held["fits"]:
        return held
    if held["cache"] == "memory":
        raise ConfigError(
            f"pipeline.cache=memory would hold {held['held_mb']:,.0f} MB of decoded volumes, above the input's "
            f"budget of {held['budget_mb']:,.0f} MB (pipeline.memory_budget, or half the usable memory): set "
            "pipeline.cache=patches to read each crop from memory-mapped arrays, or raise pipeline.memory_budget"
        )
    if held["cache"] == "partial":
        raise ConfigError(
            f"pipeline.cache=partial would hold up to {held['held_mb']:,.0f} MB ({held['what']}), above the input's "
            f"budget of {held['budget_mb']:,.0f} MB (pipeline.memory_budget, or half the usable memory): lower "
            "pipeline.cache_num, or set "
            "pipeline.cache=patches (no volume held)"
        )
    return held
