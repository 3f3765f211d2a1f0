"""What the GPU-fit search measures and how it chooses: the searched values and where they live in the config, the
dataset facts the trials and the objective need, a candidate's config, which model-parallel candidates cannot run
here, and the choice among the measured trials (with the config it gives).

The objective (minimised): the estimated epoch time, training patches per epoch / measured images/s + validation
cases x measured sliding-window seconds / `val_interval` (`estimated_epoch_seconds`). The choice: the fastest
measured configuration whose peak is within `memory_margin` of the budget (`choose`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from tfmis.config import Config, check_model_parallel, from_dict, to_dict
from tfmis.errors import ConfigError, DataError, MissingInput
from tfmis.tuning.fit.memory import NO_MODEL_PARALLEL, is_memory_failure
from tfmis.tuning.fit.specs import (
    MODEL_PARALLEL_KEY,
    FitSpecs,
    SpecsError,
    model_parallel_setting,
    parse_model_parallel,
)

OBJECTIVE = "epoch_seconds"

# the searched values and where they live in the config
VALUE_KEYS = {
    "num_images_per_batch": ("pipeline", "num_images_per_batch"),
    "num_sw_batch_size": ("validation", "num_sw_batch_size"),
    "validation_data_device": ("validation", "validation_data_device"),
    "recompute": ("model", "recompute"),
    # `none` or `mode:devices`: runtime.model_parallel.mode and .devices (apply_values)
    "model_parallel": ("runtime", "model_parallel"),
}


def search_context(config: Config) -> dict:
    """What the trials and the objective need from the converted dataset (index.json, fingerprint.json)."""
    from tfmis.data.records import load_index, split_entry

    dataset_dir = Path(config.data.dataset_dir)
    index = load_index(dataset_dir)
    fingerprint_path = dataset_dir / "fingerprint.json"
    if not fingerprint_path.is_file():
        raise MissingInput(
            f"{fingerprint_path}: not found; the GPU-fit search sizes its sliding-window test "
            "volume from the dataset fingerprint: convert the dataset again with tfmis-convert"
        )
    fingerprint = json.loads(fingerprint_path.read_text())
    volume_shape = [int(s) for s in fingerprint["dataset"]["shape_p99_5"]]
    try:
        train_cases = len(split_entry(index, config.data.train_split)["cases"])
        val_cases = len(split_entry(index, config.data.val_split)["cases"])
    except KeyError as e:
        raise DataError(f"data: {e.args[0]} ({dataset_dir})") from None
    if config.validation.max_cases is not None:
        val_cases = min(val_cases, config.validation.max_cases)
    return {
        "volume_shape": volume_shape,
        "in_channels": len(index["source"]["modalities"]),
        "num_classes": len(index["source"]["labels"]),
        "train_patches_per_epoch": train_cases * config.pipeline.num_crops_per_image,
        "validation_cases": val_cases,
        "val_interval": config.validation.val_interval,
    }


def estimated_epoch_seconds(images_per_second: float, sw_seconds: float, context: dict) -> float:
    """Training patches ÷ images/s + validation cases × sliding-window seconds, per epoch."""
    train = context["train_patches_per_epoch"] / images_per_second
    validation = context["validation_cases"] * sw_seconds / context["val_interval"]
    return train + validation


def apply_values(config: Config, values: dict) -> Config:
    """A copy of `config` with the searched values set.

    `model_parallel` (`none`, `spatial:2`, ...) sets `runtime.model_parallel.mode` and `.devices`, and with a
    mode `runtime.distribution: none` (one process runs the model over its devices); `micro_batches`, `axis`
    and `data` stay the config's.
    """
    data = to_dict(config)
    for name, value in values.items():
        section, key = VALUE_KEYS[name]
        if name == "model_parallel":
            mode, devices = parse_model_parallel(value)
            data["runtime"]["model_parallel"]["mode"] = mode
            if mode != NO_MODEL_PARALLEL:
                data["runtime"]["model_parallel"]["devices"] = devices
                data["runtime"]["distribution"] = "none"
            continue
        data[section][key] = value
    return from_dict(Config, data)


def model_parallel_settings(config: Config, specs: FitSpecs) -> list[str]:
    """The model-parallel settings searched: the specs' `range_model_parallel`, else the config's own one."""
    if specs.range_model_parallel is not None:
        return list(specs.range_model_parallel)
    mp = config.runtime.model_parallel
    return [model_parallel_setting(mp.mode, mp.devices) if mp.enabled else NO_MODEL_PARALLEL]


def model_parallel_skip_reason(config: Config, values: dict, gpu_count: int | None) -> str | None:
    """Why a candidate's model-parallel setting cannot run here (no trial is started), or None.

    Args:
        config: the searched config (its `runtime.model_parallel.data`, `micro_batches`, `training.jit_compile`).
        values: the candidate (`model_parallel`, `num_images_per_batch`).
        gpu_count: the GPUs visible to the search; None on a machine without GPUs (logical CPU devices: any N).

    Example:
        >>> from tfmis.config import Config
        >>> values = {"model_parallel": "spatial:4", "num_images_per_batch": 2}
        >>> model_parallel_skip_reason(Config(), values, gpu_count=2)
        'spatial:4 needs 4 GPUs (devices 4 x runtime.model_parallel.data 1) but 2 are visible'
        >>> model_parallel_skip_reason(Config(), values, gpu_count=None) is None
        True
    """
    setting = values.get("model_parallel") or NO_MODEL_PARALLEL
    mode, devices = parse_model_parallel(setting)
    if mode == NO_MODEL_PARALLEL:
        return None
    mp = config.runtime.model_parallel
    needed = devices * mp.data
    if gpu_count is not None and needed > gpu_count:
        return (
            f"{setting} needs {needed} GPUs (devices {devices} x runtime.model_parallel.data {mp.data}) "
            f"but {gpu_count} {'is' if gpu_count == 1 else 'are'} visible"
        )
    if config.training.jit_compile:
        return (
            f"{setting}: training.jit_compile: true does not work with runtime.model_parallel (XLA compiles for one "
            "device); search with training.jit_compile=false to measure it"
        )
    groups = mp.data * (mp.micro_batches if mode == "pipeline" else 1)
    batch = values["num_images_per_batch"]
    if batch % groups:
        what = f"data {mp.data} x micro_batches {mp.micro_batches}" if mode == "pipeline" else f"data {mp.data}"
        return (
            f"{setting}: batch {batch} is not a multiple of runtime.model_parallel.{what} (the step's images are "
            "split over them)"
        )
    problem = model_parallel_problem(config, setting, batch)
    return f"{setting}: {problem}" if problem else None


def model_parallel_problem(config: Config, setting: str, batch: int | None = None) -> str | None:
    """Why `setting` (`spatial:4`, ...) cannot run with this config on any machine, or None: the config's
    `check_model_parallel` of the candidate (a patch or validation window that cannot be cut into its slabs, a
    network the slabs cannot split, XLA, micro-batches that do not divide `batch`; default: a batch they divide)."""
    mode, _ = parse_model_parallel(setting)
    if mode == NO_MODEL_PARALLEL:
        return None
    mp = config.runtime.model_parallel
    values = {"model_parallel": setting, "num_images_per_batch": batch or mp.data * mp.micro_batches}
    try:
        check_model_parallel(apply_values(config, values))
    except ConfigError as e:
        return str(e)
    return None


def check_model_parallel_range(config: Config, specs: FitSpecs) -> None:
    """A `range_model_parallel` none of whose settings can run with this config (`model_parallel_problem`) is a
    specs error naming the first one's reason; some that cannot run are skipped by the search, each with its reason.
    Cheap: checked before the dataset is converted."""
    settings = specs.range_model_parallel
    if not settings or NO_MODEL_PARALLEL in settings:
        return
    problems = [model_parallel_problem(config, setting) for setting in settings]
    if all(problems):
        raise SpecsError(
            f"{MODEL_PARALLEL_KEY}: none of {', '.join(settings)} can run with this config; "
            f"{settings[0]}: {problems[0]}"
        )


# ---------------------------------------------------------------------------------------------- choosing


def choose(records: list[dict], budget_mb: float, margin: float) -> dict | None:
    """The measured trial with the shortest estimated epoch whose peak is within margin × budget."""
    eligible = [r for r in records if r["status"] == "ok" and r["peak_mb"] <= margin * budget_mb]
    if not eligible:
        return None
    return min(eligible, key=lambda r: (r[OBJECTIVE], r["peak_mb"]))


def fitted_config(config: Config, chosen: dict, records: list[dict], context: dict) -> Config:
    """The config with the chosen values, its validation placement turned into a memory policy.

    A chosen accelerator placement becomes `auto` (volumes larger than the measured 99.5th
    percentile fall back instead of ending the run). When the accelerator ran out of memory on
    the test volume at the chosen sw batch, the CPU is chosen but smaller volumes may still fit:
    `auto` with `cpu_from_voxels` seeded with that volume's size sends the large ones to the CPU
    straight away.
    """
    values = dict(chosen["values"])
    extra = {}
    placement = values["validation_data_device"]
    voxels = int(np.prod(context["volume_shape"]))
    policy_known = "cpu_from_voxels" in {f.name for f in dataclasses.fields(type(config.validation))}
    if policy_known and placement == "accelerator":
        values["validation_data_device"] = "auto"
    elif (
        policy_known
        and placement == "cpu"
        and any(
            is_memory_failure(r)
            and r.get("failed_phase") == "validation"
            and r["values"]["validation_data_device"] == "accelerator"
            and r["values"]["num_sw_batch_size"] <= values["num_sw_batch_size"]
            for r in records
        )
    ):
        values["validation_data_device"] = "auto"
        extra["cpu_from_voxels"] = voxels
    fitted = apply_values(config, values)
    for key, value in extra.items():
        setattr(fitted.validation, key, value)
    return fitted
