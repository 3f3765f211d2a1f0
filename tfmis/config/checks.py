"""The config's cross-field checks: what types alone cannot express, each error naming the key and the fix.

`validate` runs them all on a parsed `Config` (`tfmis.config.parse.parse_config` calls it) and derives the splits
`data.split` asks for (`_resolve_data_split`); `region_paint_labels` is the painting order `model.output: regions`
needs, also used to paint region outputs into a label map.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tfmis.config.schema import Config, DataConfig, OptimizerConfig, ValidationConfig
from tfmis.errors import ConfigError
from tfmis.networks.architecture import expand_per_axis, required_divisor
from tfmis.networks.slab_geometry import most_slabs


def validate(config: Config) -> None:
    """Cross-field checks that types alone cannot express (and the splits `data.split` derives)."""
    _resolve_data_split(config.data)
    p = config.pipeline
    if len(p.patch_size) != 3 or min(p.patch_size) < 1:
        raise ConfigError(f"pipeline.patch_size: expected three positive sizes, got {p.patch_size}")
    if len(p.pos_neg_ratio) != 2 or min(p.pos_neg_ratio) < 0 or sum(p.pos_neg_ratio) <= 0:
        raise ConfigError(f"pipeline.pos_neg_ratio: expected [pos, neg] >= 0, got {p.pos_neg_ratio}")
    if p.num_images_per_batch < 1 or p.num_crops_per_image < 1:
        raise ConfigError("pipeline.num_images_per_batch and pipeline.num_crops_per_image must be >= 1")
    if p.cache == "file" and not p.cache_dir:
        raise ConfigError(
            "pipeline.cache is 'file' but pipeline.cache_dir is not set: give the folder for the "
            "on-disk cache, e.g. pipeline.cache_dir=/scratch/tfmis-cache"
        )
    if p.memory_budget is not None:
        from tfmis.hardware.memory import parse_memory_mb

        try:
            parse_memory_mb(str(p.memory_budget))
        except ValueError as e:
            raise ConfigError(f"pipeline.memory_budget: {e} (e.g. 6GB), or null for half the usable memory") from e
    if p.cache_num is not None and p.cache_num < 1:
        raise ConfigError(
            f"pipeline.cache_num must be >= 1 volume (or null to use pipeline.cache_rate), got {p.cache_num}"
        )
    if p.cache_num is not None and p.cache != "partial":
        raise ConfigError(
            f"pipeline.cache_num={p.cache_num} only bounds pipeline.cache=partial, but pipeline.cache "
            f"is {p.cache!r}: set pipeline.cache=partial (or pipeline.cache_num=null)"
        )
    if not 0 < p.cache_rate <= 1:
        raise ConfigError(
            f"pipeline.cache_rate must be in (0, 1] (the share of the training volumes held by "
            f"pipeline.cache=partial), got {p.cache_rate}"
        )
    if not 0 < p.replace_rate <= 1:
        raise ConfigError(
            f"pipeline.replace_rate must be in (0, 1] (the share of the partial cache replaced per "
            f"pass over it, e.g. 0.2), got {p.replace_rate}"
        )
    o = config.optimizer
    _validate_optimizer(o)
    if o.lr_reference_batch is not None and o.lr_reference_batch < 1:
        raise ConfigError(
            f"optimizer.lr_reference_batch must be a batch size >= 1 (or null), got {o.lr_reference_batch}"
        )
    if config.training.max_minutes is not None and config.training.max_minutes <= 0:
        raise ConfigError(f"training.max_minutes must be > 0 (or null), got {config.training.max_minutes}")
    if config.training.accumulation_steps < 1:
        raise ConfigError("training.accumulation_steps must be >= 1")
    check_model_parallel(config)
    if config.training.steps_per_loop < 1:
        raise ConfigError(
            f"training.steps_per_loop must be >= 1 (optimizer steps per host round-trip; 1 = "
            f"read every step's loss), got {config.training.steps_per_loop}"
        )
    if not 0 <= config.validation.overlap < 1:
        raise ConfigError(f"validation.overlap must be in [0, 1), got {config.validation.overlap}")
    if config.validation.roi_size is not None and len(config.validation.roi_size) != 3:
        raise ConfigError(f"validation.roi_size: expected three sizes, got {config.validation.roi_size}")
    _validate_surface_and_regions(config.validation)
    if config.model.output == "regions":
        _validate_region_output(config)


def _resolve_data_split(data: DataConfig) -> None:
    """With `data.split` set: K folds from the conversion (data.conversion.folds = K, split null) in
    `folds_dataset_dir` (unless data.conversion.folds already said data.dataset_dir holds them), trained on every
    fold but `fold` (data.train_split, the joined fold names) and validated on `fold` (data.val_split). Derived the
    same every time, so a run folder's config.yaml loads to the same splits (and one made for another fold is
    re-derived for this one).

    Raises:
        ConfigError: a fold out of range, fewer than 2 folds, a bad splits file, or a conflicting
            data.conversion.split / folds or data.train_split / val_split (named, with the fix).
    """
    import re

    from tfmis.data.folds import DEFAULT_SPLIT, read_splits_file
    from tfmis.data.records import SPLIT_JOIN, cross_validation_splits

    s = data.split
    if s is None:
        return
    # K from the file; a run folder's config.yaml whose file has gone keeps the K it was made with
    if s.file is not None and Path(s.file).is_file():
        try:
            s.folds = len(read_splits_file(s.file))
        except (OSError, ValueError) as e:
            raise ConfigError(f"data.split.file: {e}") from None
    if s.folds < 2:
        raise ConfigError(f"data.split.folds must be at least 2 (nnU-Net uses 5), got {s.folds}")
    if not 0 <= s.fold < s.folds:
        raise ConfigError(
            f"data.split.fold={s.fold} is out of range for {s.folds} folds: set data.split.fold to 0..{s.folds - 1}"
        )
    c = data.conversion
    if c.split is not None and c.split != DEFAULT_SPLIT:
        raise ConfigError(
            f"data.conversion.split={list(c.split)} asks for train/val/test fractions, but data.split asks for "
            f"{s.folds} folds: set data.conversion.split=null (data.split sets data.conversion.folds)"
        )
    if c.folds is not None and c.folds != s.folds:
        raise ConfigError(
            f"data.conversion.folds={c.folds} but data.split makes {s.folds} folds: set data.conversion.folds=null "
            "(data.split sets it)"
        )
    train, val = cross_validation_splits(s.folds, s.fold)
    for key, default in (("train_split", "train"), ("val_split", "val")):
        value = getattr(data, key)
        derived_before = all(re.fullmatch(r"fold\d+", part) for part in value.split(SPLIT_JOIN))
        if value != default and not derived_before:
            raise ConfigError(
                f"data.{key}={value!r} conflicts with data.split (fold {s.fold} of {s.folds} trains on {train} and "
                f"validates on {val}): remove data.{key}"
            )
    data.train_split, data.val_split = train, val
    if c.folds is None:  # not a folder the config says holds these folds: the one tfmis-crossval converts into
        data.dataset_dir = folds_dataset_dir(data.dataset_dir, s.folds)
    data.conversion = dataclasses.replace(c, split=None, folds=s.folds)


def folds_dataset_dir(dataset_dir: str, folds: int) -> str:
    """Where the K-fold conversion of a config's data goes: `<dataset_dir>-folds<K>`, next to its train/val/test
    conversion (a folder holds one conversion), shared by every fold and configuration of `tfmis-crossval` and by a
    `tfmis-train` run with `data.split`; a folder already so named is kept.

    Example:
        >>> folds_dataset_dir("data/demo/tfrecords", 5), folds_dataset_dir("data/demo/tfrecords-folds5", 5)
        ('data/demo/tfrecords-folds5', 'data/demo/tfrecords-folds5')
    """
    base = str(dataset_dir).rstrip("/")
    return base if base.endswith(f"-folds{folds}") else f"{base}-folds{folds}"


BRATS_REGIONS_EXAMPLE = "{whole_tumour: [1, 2, 3], tumour_core: [2, 3], enhancing_tumour: [3]}"


def region_paint_labels(regions: dict[str, list[int]]) -> list[int]:
    """The label each region paints when region outputs become a label map (`model.output: regions`).

    The label map starts as background and the regions are painted in their order, each where its sigmoid
    exceeds 0.5, with the one label it holds that no later region holds (nnU-Net's `regions_class_order`): for
    BraTS's {whole_tumour: [1, 2, 3], tumour_core: [2, 3], enhancing_tumour: [3]} that is 1, 2, 3. So a region
    must add exactly one label to the regions after it; then painting the true regions of a label map gives that
    label map back.

    Raises:
        ConfigError: a region adds no label or several (named, with the fix).

    Example:
        >>> region_paint_labels({"whole_tumour": [1, 2, 3], "tumour_core": [2, 3], "enhancing_tumour": [3]})
        [1, 2, 3]
        >>> region_paint_labels({"organ": [1, 2], "lesion": [2]})
        [1, 2]
    """
    names = list(regions)
    paint = []
    for i, name in enumerate(names):
        later = {label for other in names[i + 1 :] for label in regions[other]}
        own = sorted(set(regions[name]) - later)
        if len(own) != 1:
            what = "no label" if not own else f"the labels {own}"
            raise ConfigError(
                f"validation.regions.{name}: with model.output=regions the regions are painted into a label map "
                f"in their order, each painting the one label that no later region holds, but {name} adds {what}. "
                f"List the regions from the largest to the smallest, each adding exactly one label to the ones "
                f"after it, e.g. BraTS {BRATS_REGIONS_EXAMPLE}, or set model.output=classes"
            )
        paint.append(own[0])
    return paint


def _validate_region_output(config: Config) -> None:
    """model.output: regions needs regions to predict, a sigmoid per channel and a painting order; that the regions
    cover every foreground class is checked with the dataset's classes (`tfmis.task.SegmentationTask`)."""
    if not config.validation.regions:
        raise ConfigError(
            "model.output is regions but validation.regions is empty: give the label unions the model predicts, "
            f"largest first, e.g. validation.regions={BRATS_REGIONS_EXAMPLE} (BraTS), or set model.output=classes"
        )
    if config.loss.activation != "sigmoid":
        raise ConfigError(
            f"model.output is regions but loss.activation is {config.loss.activation!r}: regions overlap, so each "
            "has its own sigmoid: set loss.activation=sigmoid"
        )
    region_paint_labels(config.validation.regions)


def _validate_optimizer(o: OptimizerConfig) -> None:
    """Hyperparameters no optimizer can use (a negative learning rate trains uphill): named with the fix."""
    import math

    def finite(x) -> bool:
        return isinstance(x, (int, float)) and math.isfinite(x)

    if not (finite(o.learning_rate) and o.learning_rate > 0):
        raise ConfigError(f"optimizer.learning_rate must be a number > 0 (e.g. 0.001), got {o.learning_rate}")
    for key, hint in (
        ("min_learning_rate", "where the schedule ends"),
        ("weight_decay", "0 = off"),
        ("warmup_epochs", "0 = no warm-up"),
    ):
        value = getattr(o, key)
        if not (finite(value) and value >= 0):
            raise ConfigError(f"optimizer.{key} must be a number >= 0 ({hint}), got {value}")
    for key in ("momentum", "beta_1", "beta_2"):
        value = getattr(o, key)
        if not (finite(value) and 0 <= value < 1):
            raise ConfigError(f"optimizer.{key} must be in [0, 1) (e.g. 0.9), got {value}")
    if not (finite(o.power) and o.power > 0):
        raise ConfigError(f"optimizer.power must be > 0 (the poly schedule's exponent, e.g. 0.9), got {o.power}")
    if o.clipnorm is not None and not (finite(o.clipnorm) and o.clipnorm > 0):
        raise ConfigError(f"optimizer.clipnorm must be > 0 (or null = no clipping), got {o.clipnorm}")


def _validate_surface_and_regions(v: ValidationConfig) -> None:
    """validation.nsd / nsd_tolerance_mm / regions; the labels are checked against the dataset's classes when the
    metrics are built (tfmis.metrics.check_regions), as the config does not know them."""
    import math
    import re

    tolerances = v.nsd_tolerance_mm if isinstance(v.nsd_tolerance_mm, list) else [v.nsd_tolerance_mm]
    if v.nsd and v.nsd_tolerance_mm is None:
        raise ConfigError(
            "validation.nsd is true but validation.nsd_tolerance_mm is not set: give the accepted surface "
            "deviation in mm, one number or one per foreground class, e.g. validation.nsd_tolerance_mm=2.0"
        )
    if v.nsd_tolerance_mm is not None and (not tolerances or not all(math.isfinite(t) and t >= 0 for t in tolerances)):
        raise ConfigError(
            f"validation.nsd_tolerance_mm: expected distances >= 0 mm (one, or one per foreground class), "
            f"got {v.nsd_tolerance_mm}"
        )
    for name, labels in v.regions.items():
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name):
            raise ConfigError(
                f"validation.regions: the name {name!r} must be a letter then letters, digits or _ (it names "
                "metrics and CSV columns, e.g. dice_whole_tumour): rename it, e.g. whole_tumour"
            )
        if not labels or min(labels) < 1 or len(set(labels)) != len(labels):
            raise ConfigError(
                f"validation.regions.{name}: expected a list of distinct foreground labels >= 1 (the classes "
                f"it unites, e.g. [1, 2, 3]), got {labels}"
            )


MP = "runtime.model_parallel"


def check_model_parallel(config: Config, windows: str | None = None, flag: str | None = None) -> None:
    """`runtime.model_parallel` against the rest of the config, before anything is built (docs/model-parallel.md):
    XLA, another distribution strategy, micro-batches that do not divide the batch, a patch or window that cannot be
    cut into the slabs, a network whose upsampling the slabs cannot split. Each error is one line naming the setting
    and the fix.

    Args:
        windows: prediction: how to name the sliding-window size (e.g. `--roi-size`); only the windows are
            checked then, not training's settings. None: training (the patch and the validation windows).
        flag: prediction: the command-line flag that set the mode and devices (`--model-parallel`), or None when
            they are the config's.

    Raises:
        ConfigError: naming the setting and the fix.

    Example:
        >>> from tfmis.config import load_config
        >>> load_config(None, ["runtime.model_parallel.mode=spatial", "runtime.model_parallel.devices=16"])
        Traceback (most recent call last):
        ...
        tfmis.errors.ConfigError: runtime.model_parallel.mode=spatial, runtime.model_parallel.devices=16: ... fewer, ...
    """
    mp = config.runtime.model_parallel
    if not mp.enabled:
        return
    setting = f"{flag} {mp.mode}:{mp.devices}" if flag else f"{MP}.mode={mp.mode}"
    if windows is None:
        _check_model_parallel_training(config, setting)
    if mp.mode != "spatial":
        return
    _check_spatial_kernels(config.model, setting)
    roi = config.validation.roi_size
    if windows is not None:
        sizes = [(windows, roi or config.pipeline.patch_size)]
    else:
        sizes = [("pipeline.patch_size", config.pipeline.patch_size)] + ([("validation.roi_size", roi)] if roi else [])
    divisor = required_divisor(config.model.strides)
    for key, patch in sizes:
        if len(patch) != 3 or any(int(p) < 1 or int(p) % d for p, d in zip(patch, divisor)):
            continue  # not a multiple of the strides' product: the trainer's (or the window's) size check says so
        fits, best = most_slabs(patch, divisor, mp.axis)
        if fits >= mp.devices:
            continue
        named = f"{setting}:" if flag else f"{setting}, {MP}.devices={mp.devices}:"
        along = f" along axis {mp.axis} ({MP}.axis)" if mp.axis is not None else ""
        fewer = f"{flag} spatial:{fits}" if flag else f"{MP}.devices={fits}"
        raise ConfigError(
            f"{named} {key} {list(patch)} cannot be cut{along} into {mp.devices} slabs whose sides are multiples of "
            f"the strides' product {divisor} (model.strides): at most {fits} fit (along axis {best}); "
            + (f"set {fewer} or fewer, or make {key} larger" if fits >= 2 else f"make {key} larger")
        )


def _check_model_parallel_training(config: Config, setting: str) -> None:
    """What training adds: XLA, the distribution strategy, the batch split over data groups and micro-batches."""
    mp = config.runtime.model_parallel
    if config.training.jit_compile:
        raise ConfigError(
            f"training.jit_compile=true does not work with {setting} (XLA compiles for one device): set "
            f"training.jit_compile=false, or {MP}.mode=none"
        )
    if config.runtime.distribution not in ("auto", "none"):
        raise ConfigError(
            f"runtime.distribution={config.runtime.distribution} does not work with {setting} (one process runs "
            f"the model over its devices): set runtime.distribution=none; for data parallelism with it, "
            f"{MP}.data=<groups of devices>"
        )
    split = mp.data * (mp.micro_batches if mp.mode == "pipeline" else 1)
    batch = config.pipeline.num_images_per_batch
    if batch % split:
        what = f"{MP}.data ({mp.data})" + (
            f" x {MP}.micro_batches ({mp.micro_batches})" if mp.mode == "pipeline" else ""
        )
        raise ConfigError(
            f"pipeline.num_images_per_batch={batch} is not a multiple of {what} with {setting}: the step's images "
            f"are split over the data groups and then into micro-batches; make the batch a multiple of {split}, or "
            f"lower {MP}.micro_batches"
        )


def _check_spatial_kernels(model, setting: str) -> None:
    """Spatial slabs cannot split a transposed convolution whose kernel is smaller than its stride (the decoder's
    upsampling: `model.kernel_size` with each level's stride)."""
    kernel = expand_per_axis(model.kernel_size, "kernel_size")
    for level, stride in enumerate(model.strides):
        stride = expand_per_axis(stride, "each stride")
        if any(k < s for k, s in zip(kernel, stride)):
            raise ConfigError(
                f"{setting} cannot split this network: its upsampling at level {level} is a transposed convolution "
                f"whose kernel (model.kernel_size={model.kernel_size}) is smaller than its stride {stride} "
                f"(model.strides): use {MP}.mode=pipeline, or a model.kernel_size of at least {max(stride)}"
            )
