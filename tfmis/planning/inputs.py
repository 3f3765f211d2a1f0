"""What every planning step reads (`PlanningInputs`): the dataset's fingerprint, the hardware planned for and the
planner's arguments, resolved once (default folders, the precision this hardware trains best in) and checked.

`ExperimentPlanner` makes one and hands it to each group of its steps (`DataSteps`, `TopologySteps`,
`TrainingSteps`); no step reads anything else of the planner.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tfmis.errors import UsageError
from tfmis.hardware import GPU_RESERVED_MB, Hardware, recommended_precision
from tfmis.planning.fingerprint import DatasetFingerprint

# a training step's budget on a GPU: this share of its memory after GPU_RESERVED_MB (CUDA's context and libraries).
# The target GPU's memory (detected, or --gpu-memory / --gpu) sets the patch and the batch from it, as nnU-Net v2's
# `gpu_memory_target_in_gb` sets both from its reference
GPU_MEMORY_SHARE = 0.85
# CPU: patches of at most 48^3 voxels and 1000 steps, so that the small network trains in about ten minutes on 2
# cores (its step time at batch 2: docs/benchmarks.md, "First epoch, precision and other costs")
CPU_PATCH_VOXELS = 48**3


def cpu_patch_voxels(edge: int | None) -> int | None:
    """`--cpu-patch EDGE` as the planner's voxel target (None: the planner's default), refusing an edge under 16."""
    if edge is None:
        return None
    if edge < 16:
        raise UsageError(f"--cpu-patch {edge}: the patch cube's edge in voxels, at least 16, e.g. --cpu-patch 64")
    return int(edge) ** 3


def default_dataset_dir(source_dir: str | Path) -> str:
    """Where a plan converts an MSD folder to: `<parent>/<folder>_tfrecords` (next to it, never inside it)."""
    source = Path(source_dir)
    return str(source.parent / f"{source.name}_tfrecords")


def default_output_dir(source_dir: str | Path) -> str:
    return str(Path("runs") / Path(source_dir).name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanningInputs:
    """The planner's inputs (`ExperimentPlanner`'s arguments, documented there), resolved by `resolve`.

    Attributes:
        fp: the `DatasetFingerprint`; hardware: the `Hardware` planned for.
        source_dir, dataset_dir, output_dir: the dataset folder, where its conversion goes, the run folder.
        gpu_fit: the GPU-fit search's measured values, or None.
        split, seed: train/val/test fractions; the split and training seed.
        fixed_spacing: `(spacing, reason)` instead of nnU-Net's full-resolution rule, or None.
        roi_margin_mm, coarse_run: a cascade's fine stage (its crop margin and the coarse stage's run), or None.
        training_share, max_minutes: this stage's share of the step budget; its `training.max_minutes`.
        cpu_patch_voxels: a CPU plan's patch voxel target.
        precision, precision_reason: the precision this hardware trains best in, and why.
    """

    fp: DatasetFingerprint
    hardware: Hardware
    source_dir: str
    dataset_dir: str
    output_dir: str
    gpu_fit: dict | None
    split: tuple
    seed: int
    fixed_spacing: tuple | None
    roi_margin_mm: float | None
    coarse_run: str | None
    training_share: float
    max_minutes: float | None
    cpu_patch_voxels: int
    precision: str
    precision_reason: str

    @classmethod
    def resolve(
        cls,
        fingerprint: DatasetFingerprint,
        hardware: Hardware,
        *,
        source_dir: str | None = None,
        dataset_dir: str | None = None,
        output_dir: str | None = None,
        gpu_fit: dict | None = None,
        split=(0.7, 0.15, 0.15),
        seed: int = 0,
        spacing: tuple | None = None,
        roi_margin_mm: float | None = None,
        coarse_run: str | None = None,
        training_share: float = 1.0,
        max_minutes: float | None = None,
        cpu_patch_voxels: int = CPU_PATCH_VOXELS,
    ) -> PlanningInputs:
        """The inputs of `ExperimentPlanner(fingerprint, hardware, ...)` (its arguments); a `max_minutes` that
        rounds (to hundredths) to no training is a `UsageError`."""
        source_dir = source_dir or fingerprint.source_dir
        if source_dir is None:
            raise ValueError("make_plan: source_dir is unknown (the fingerprint does not name its MSD folder); pass it")
        if max_minutes is not None and round(float(max_minutes), 2) <= 0:
            total = max_minutes / training_share if training_share > 0 else max_minutes
            part = f"this stage's {training_share:.0%} share is" if training_share < 1 else "that is"
            raise UsageError(
                f"max_minutes {total:g} (--max-minutes, training.max_minutes): {part} {round(float(max_minutes), 2):g} "
                f"minutes of training in hundredths of a minute; give at least {0.01 / min(training_share, 1):.2g} "
                f"minutes, or no time budget"
            )
        precision, precision_reason = recommended_precision(hardware)
        if hardware.target_given and hardware.has_gpu and hardware.compute_capability is None:
            precision_reason += " (name the target's GPU with --gpu, e.g. --gpu A100-80GB, to plan its precision)"
        return cls(
            fp=fingerprint,
            hardware=hardware,
            source_dir=source_dir,
            dataset_dir=dataset_dir or default_dataset_dir(source_dir),
            output_dir=output_dir or default_output_dir(source_dir),
            gpu_fit=gpu_fit,
            split=split,
            seed=seed,
            fixed_spacing=spacing,
            roi_margin_mm=roi_margin_mm,
            coarse_run=coarse_run,
            training_share=training_share,
            max_minutes=max_minutes,
            cpu_patch_voxels=int(cpu_patch_voxels),
            precision=precision,
            precision_reason=precision_reason,
        )

    @property
    def gpu(self) -> bool:
        """The plan is for a GPU."""
        return self.hardware.has_gpu

    @property
    def in_channels(self) -> int:
        return len(self.fp.modalities)

    @property
    def num_classes(self) -> int:
        return len(self.fp.labels)

    def gpu_budget_mb(self) -> float:
        """A training step's memory on one of the target's GPUs: `GPU_MEMORY_SHARE` of its memory after
        `GPU_RESERVED_MB` (the patch at batch 2, then the batch, are planned within it)."""
        return GPU_MEMORY_SHARE * ((self.hardware.gpu_memory_mb or 16 * 1024) - GPU_RESERVED_MB)
