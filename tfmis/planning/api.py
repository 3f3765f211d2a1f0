"""The front door of planning: plan an MSD folder on this machine, with the GPU-fit search's measurement where
one is cached. `python -m tfmis.plan` and `python -m tfmis.train --source-dir` both come through here.

The only module of `tfmis.planning` that reaches into `tfmis.tune` (for the GPU-fit search's cache): every
stage of a plan gets the cached measurement of its own config.

Example:
```python
plan, fingerprint = plan_dataset("data/Task09_Spleen")
plan.write("runs/Task09_Spleen/plan.yaml")
print(plan.table())
```
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from tfmis.hardware import Hardware, detect_hardware
from tfmis.planning.fingerprint import DatasetFingerprint, fingerprint_from_conversion, fingerprint_msd, has_conversion
from tfmis.planning.inputs import default_dataset_dir, default_output_dir
from tfmis.planning.plan_file import Plan
from tfmis.planning.planner import make_plan
from tfmis.planning.stages import StagedPlan, plan_stages


def dataset_fingerprint(
    source_dir, target_dir, workers: int | None = None, progress: bool = True
) -> DatasetFingerprint:
    """The fingerprint of a finished conversion in `target_dir` when there is one, else a first pass over the
    MSD folder."""
    if has_conversion(target_dir):
        if progress:
            print(f"Fingerprint: the conversion in {target_dir}", file=sys.stderr)
        return fingerprint_from_conversion(target_dir)
    return fingerprint_msd(source_dir, workers=workers, progress=progress)


def cached_gpu_fit_lookup(hardware: Hardware, dataset_dir) -> Callable | None:
    """`config -> the GPU-fit search's cached choice for it, or None` when there is a GPU and `dataset_dir` holds
    a conversion (the cache is keyed by the converted data); None otherwise, and for a target machine (the cache
    holds this machine's measurements, not the target's)."""
    if not hardware.has_gpu or hardware.target_given or not has_conversion(dataset_dir):
        return None
    from tfmis.tuning.fit import cached_choice

    return cached_choice


def replan_with_cached_gpu_fit(
    fingerprint: DatasetFingerprint,
    hardware: Hardware,
    *,
    configuration: str | None = None,
    lookup: Callable | None = None,
    max_minutes: float | None = None,
    **plan_args,
) -> StagedPlan | None:
    """The stages planned again, each with the GPU-fit search's cached measurement of its own config (batch size,
    sliding-window batch size, placement); None without a GPU or when no stage has a measurement.

    Args:
        configuration: the configuration planned before (so the same stages are planned).
        lookup: `config -> fitted values or None` (default: the search's cache, `tfmis.tuning.fit.cached_choice`).
        plan_args: `plan_stages`' folder arguments (source_dir, dataset_dir, output_dir).
    """
    if not hardware.has_gpu or hardware.target_given:
        return None
    if lookup is None:
        from tfmis.tuning.fit import cached_choice as lookup
    staged = plan_stages(
        fingerprint, hardware, configuration=configuration, max_minutes=max_minutes, gpu_fit_for=lookup, **plan_args
    )
    return staged if staged.gpu_fitted else None


def plan_dataset(
    source_dir,
    target_dir=None,
    output_dir=None,
    workers: int | None = None,
    progress: bool = True,
    hardware: Hardware | None = None,
) -> tuple[Plan, DatasetFingerprint]:
    """(Plan, DatasetFingerprint) for an MSD folder on this machine.

    Uses the fingerprint of a finished conversion in `target_dir` when there is one, else a first pass
    over the MSD folder; with a GPU and a converted dataset, the GPU-fit search's cached choice.

    Args:
        source_dir: the MSD folder (with dataset.json).
        target_dir: where the conversion goes (default `<source>_tfrecords` next to it).
        output_dir: the run folder the plan trains into (default `runs/<folder>`).
        workers: processes reading cases in a first pass (default: the CPUs this process may use, at most 8).
        hardware: default `detect_hardware()`; a `Hardware.target` plans for that machine (without the GPU-fit
            search's cached measurements, which are this machine's).
    """
    fingerprint, hardware, plan_args = _planning_inputs(source_dir, target_dir, output_dir, workers, progress, hardware)
    lookup = cached_gpu_fit_lookup(hardware, plan_args["dataset_dir"])
    plan = make_plan(fingerprint, hardware, **plan_args)
    fitted = lookup(plan.config()) if lookup is not None else None
    return (plan if fitted is None else make_plan(fingerprint, hardware, gpu_fit=fitted, **plan_args)), fingerprint


def _planning_inputs(source_dir, target_dir, output_dir, workers, progress, hardware) -> tuple:
    """(fingerprint, hardware, the planner's folder arguments) with the default folders filled in."""
    target_dir = target_dir or default_dataset_dir(source_dir)
    output_dir = output_dir or default_output_dir(source_dir)
    fingerprint = dataset_fingerprint(source_dir, target_dir, workers, progress)
    plan_args = {"source_dir": str(source_dir), "dataset_dir": str(target_dir), "output_dir": str(output_dir)}
    return fingerprint, hardware or detect_hardware(), plan_args


def plan_dataset_stages(
    source_dir,
    target_dir=None,
    output_dir=None,
    workers: int | None = None,
    progress: bool = True,
    hardware: Hardware | None = None,
    max_minutes: float | None = None,
    configuration: str | None = None,
    cpu_patch_voxels: int | None = None,
) -> tuple[StagedPlan, DatasetFingerprint]:
    """(StagedPlan, DatasetFingerprint): the candidates (`plan_dataset`'s full-resolution plan; a low-resolution
    stage and a cascade on it where they pay) and the recommended one (`tfmis.planning.stages`), as the fingerprint
    and the affordable patch decide.

    Args:
        source_dir, target_dir, output_dir, workers, progress, hardware: as `plan_dataset`.
        max_minutes: a training budget (a recommended cascade's stages share it).
        configuration: force the recommendation, "fullres", "lowres" or "cascade" (refused when not a candidate).
        cpu_patch_voxels: a CPU plan's patch voxel target (None: the planner's `CPU_PATCH_VOXELS`).
    """
    fingerprint, hardware, plan_args = _planning_inputs(source_dir, target_dir, output_dir, workers, progress, hardware)
    lookup = cached_gpu_fit_lookup(hardware, plan_args["dataset_dir"])
    if cpu_patch_voxels is not None:
        plan_args["cpu_patch_voxels"] = cpu_patch_voxels
    staged = plan_stages(
        fingerprint, hardware, max_minutes=max_minutes, configuration=configuration, gpu_fit_for=lookup, **plan_args
    )
    return staged, fingerprint
