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
from tfmis.hardware.cpu import usable_cpu_count
from tfmis.hardware.memory import MB, host_memory, parse_memory_mb

# the share of the usable memory (after any cgroup limit) the input may hold when pipeline.memory_budget is null:
# the rest is the model, its optimizer, the validation windows, TensorFlow's own arenas
BUDGET_SHARE = 0.5
_IMAGE_BYTES = {"float16": 2, "float32": 4, "int16": 2, "uint8": 1}
# batches tf.data may prefetch after the batch being built (pipeline.cache: patches)
PATCH_PREFETCH_BATCHES = 2
# bytes per patch voxel one spatial resampling holds at its peak, besides 32 per channel (its 8 gathered neighbours):
# the peak RSS of `random_spatial` at 128^3 and 64^3, rotation and scaling drawn, was 110-150 B per output voxel
RESAMPLE_BYTES = 160


# the budget of pipeline.memory_budget: null, measured once in a process (at the training's start, when its line is
# printed), so that the line and the pipelines built after it use one number, not the memory free at each moment
_MEASURED_BUDGET: list[float] = []
# bytes one class location takes in memory (fg (K, 3) int32 and fg_class (K,) int32)
LOCATION_BYTES = 16


def pipeline_memory_budget(pipeline) -> float:
    """The input's memory budget in MB: `pipeline.memory_budget`, else `BUDGET_SHARE` of the usable memory when this
    process first asked (the training's start: its `Input memory:` line), the same number every time after."""
    if pipeline.memory_budget is not None:
        try:
            return parse_memory_mb(str(pipeline.memory_budget))
        except ValueError as e:
            raise ConfigError(f"pipeline.memory_budget: {e} (e.g. 6GB), or null for half the usable memory") from e
    if not _MEASURED_BUDGET:
        _MEASURED_BUDGET.append(BUDGET_SHARE * host_memory()["available_mb"])
    return _MEASURED_BUDGET[0]


def patch_input(
    pipeline, channels: int, accumulation_steps: int, budget_mb: float, image_bytes: int = 4, num_classes: int = 2
) -> dict:
    """What one patch-read input pipeline holds, and how many crops it reads at once to stay within `budget_mb`.

    In flight: two windows per reader and two per usable CPU (`train_crop_size`: the patch plus the spatial
    augmentation's margin; float32 image and uint8 label, or as stored with `augment.placement: step`): each
    parallel map, the readers' and the augmentation's, holds its parallelism in flight and as many done. With
    `augment.placement: pipeline`, also one augmentation's copies per usable CPU (with rotation / scaling /
    elastic, the resampling's buffers too). Then the augmented crops in the crop shuffle buffer, the batch being
    built, the prefetched batches and the one the step holds (patch-sized, or window-sized with
    `augment.placement: step`). Readers: two per usable CPU (4 to 16; page faults of one crop wait on the disk
    while another copies), fewer when their windows would pass the budget (a 128³ patch with rotation reads
    windows of ~100-200 MB), at least one. And the class locations `PatchArrays` keeps loaded: `LOCATION_CASES`
    cases of up to `max_foreground_indices` locations for each of the `num_classes` - 1 foreground classes.

    `image_bytes`: the stored image's bytes a voxel (2 for float16 records), what `placement: step` carries.

    Returns {"readers", "windows", "window_mb", "augment_mb", "patches", "patch_mb", "locations_mb", "held_mb"}.
    """
    from tfmis.data.patch_layout import LOCATION_CASES
    from tfmis.transforms.augment import spatial_enabled, train_crop_size  # TensorFlow, only when one is sized

    p, cpus = pipeline, usable_cpu_count()
    step = p.augment.placement == "step"
    # placement step carries the windows as stored (`image_bytes` a voxel, uint8 labels); tf.data augments float32
    window_mb = float(np.prod(train_crop_size(p))) * (channels * (image_bytes if step else 4) + 1) / MB
    patch_mb = window_mb if step else float(np.prod(p.patch_size)) * (channels * 4 + 4) / MB
    # the batch being built, the prefetched ones and the one the training step holds
    patches = p.shuffle_crops + (2 + PATCH_PREFETCH_BATCHES) * p.num_images_per_batch * accumulation_steps
    # each of the `cpus` augmenting calls in tf.data holds a flipped / turned / scaled copy of the patch, and with
    # rotation / scaling / elastic fields its sampling grids, neighbour indices and weights
    augment_mb = 0.0
    if p.augment.placement == "pipeline":
        per_voxel = 8 * channels + 4 + (RESAMPLE_BYTES + 32 * channels if spatial_enabled(p.augment) else 0)
        augment_mb = float(np.prod(p.patch_size)) * per_voxel / MB
    locations_mb = LOCATION_CASES * LOCATION_BYTES * p.max_foreground_indices * max(num_classes - 1, 1) / MB
    readers = min(16, max(4, 2 * cpus))
    while True:
        # each parallel map (the readers', the augmentation's) holds its parallelism in flight and as many done
        windows = 2 * readers + 2 * cpus
        held = windows * window_mb + cpus * augment_mb + patches * patch_mb + locations_mb
        if held <= budget_mb or readers == 1:
            break
        readers -= 1
    return {
        "readers": readers,
        "windows": windows,
        "window_mb": window_mb,
        "augment_mb": augment_mb,
        "patches": patches,
        "patch_mb": patch_mb,
        "locations_mb": locations_mb,
        "held_mb": held,
    }


def keeps_pages(index: dict, split: str, room_mb: float) -> bool:
    """Whether `pipeline.cache: patches` reads keep their pages in the page cache: when the split's arrays fit in
    `room_mb` (the budget less what the input holds), so that later epochs read them from memory; else each read
    gives its pages back (`PatchArrays(drop_pages=True)`): a cache smaller than the arrays, read at random, would
    keep few of them, and a cgroup is charged for every page it keeps."""
    from tfmis.data.patch_layout import arrays_size

    entries = split_cases(index, split)
    return arrays_size(entries, index["preprocessing"]["image_dtype"]) <= room_mb * MB


def image_bytes(index: dict) -> int:
    """Bytes a voxel of one image channel as the records store it (float16: 2, float32: 4)."""
    return _IMAGE_BYTES.get(index["preprocessing"]["image_dtype"], 4)


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
        plan = patch_read_plan(config, index)  # what each pipeline will build from: one definition
        held = input_pipelines * plan["held_mb"]
        what = (
            f"no volume: per input pipeline {plan['readers']} readers, {plan['windows']} crop windows of "
            f"{plan['window_mb']:.1f} MB"
            + (f", {usable_cpu_count()} augmentations of {plan['augment_mb']:.1f} MB" if plan["augment_mb"] else "")
            + f", {plan['patches']} batched crops of {plan['patch_mb']:.1f} MB in flight and class locations of "
            f"{plan['locations_mb']:.1f} MB; the arrays read "
            + (
                "with their pages dropped (larger than the room left)"
                if plan["drop_pages"]
                else "through the page cache (they fit beside)"
            )
        )
    else:
        held = 3 * largest
        what = f"the volumes being read from the TFRecords (pipeline.cache={p.cache})"
    line = f"Input memory: {held:,.0f} MB held ({what}); budget {budget:,.0f} MB"
    return {"cache": p.cache, "held_mb": held, "budget_mb": budget, "fits": held <= budget, "what": what, "line": line}


def patch_read_plan(config, index: dict) -> dict:
    """What one patch-read pipeline of this run uses: `patch_input`'s plan at the run's budget (measured once,
    `pipeline_memory_budget`) and `drop_pages` (not `keeps_pages`): the numbers its `Input memory:` line said."""
    p = config.pipeline
    budget = pipeline_memory_budget(p)
    plan = patch_input(
        p,
        len(index["source"]["modalities"]),
        config.training.accumulation_steps,
        budget,
        image_bytes(index),
        len(index["source"]["labels"]),
    )
    return {**plan, "drop_pages": not keeps_pages(index, config.data.train_split, budget - plan["held_mb"])}


def check_input_memory(config, index: dict, input_pipelines: int = 1) -> dict:
    """`input_memory`, refusing in one line (ConfigError naming the fix) an input that would hold more than its
    budget: a cache of volumes (`memory`, `partial`), or patch-read windows too large even for one reader."""
    held = input_memory(config, index, input_pipelines)
    if held["fits"]:
        return held
    if held["cache"] == "memory":
        raise ConfigError(
            f"pipeline.cache=memory would hold {held['held_mb']:,.0f} MB of decoded volumes, above the input's "
            f"budget of {held['budget_mb']:,.0f} MB (pipeline.memory_budget, or half the usable memory): set "
            "pipeline.cache=patches to read each crop from memory-mapped arrays, or raise pipeline.memory_budget"
        )
    if held["cache"] == "patches":
        raise ConfigError(
            f"pipeline.cache=patches would hold {held['held_mb']:,.0f} MB even reading one case at a time ("
            f"{held['what']}), above the input's budget of {held['budget_mb']:,.0f} MB (pipeline.memory_budget, or "
            "half the usable memory): lower pipeline.patch_size or pipeline.num_crops_per_image, set "
            "pipeline.augment.enlarge_crop=false (rotation and scaling read a window larger than the patch), or "
            "raise pipeline.memory_budget"
        )
    if held["cache"] == "partial":
        raise ConfigError(
            f"pipeline.cache=partial would hold up to {held['held_mb']:,.0f} MB ({held['what']}), above the input's "
            f"budget of {held['budget_mb']:,.0f} MB (pipeline.memory_budget, or half the usable memory): lower "
            "pipeline.cache_num, or set "
            "pipeline.cache=patches (no volume held)"
        )
    return held
