"""A training plan from a dataset fingerprint and the hardware, written as a commented tfmis config.

`ExperimentPlanner` (`make_plan`) applies nnU-Net v2's rules (`tfmis.planning.rules`) and this machine's
strengths (`tfmis.hardware`) in overridable `determine_*` steps and records every decision with its reason;
`Plan.to_yaml` writes a normal config file with a comment on each planned value, which `load_config` reads
like any other.

What is planned, in order: the conversion (target spacing with nnU-Net's anisotropy rule, CT window,
split, shards), the patch (median preprocessed shape, aspect ratio of the physical extent, a voxel
target on CPUs or a memory target on GPUs, divisible by the stride products), the U-Net (depth and
per-axis strides by nnU-Net's pooling rule, filters, instance norm), crops (class ratios that
oversample classes under 1% of the voxels), batch size, cache, loss, optimizer, training length,
precision and XLA, validation (roi = patch, sliding-window batch, overlap, placement).

Example:
```python
from tfmis.hardware import detect_hardware
from tfmis.planning import fingerprint_msd, make_plan

plan = make_plan(fingerprint_msd("data/Task09_Spleen"), detect_hardware(), source_dir="data/Task09_Spleen")
plan.write("runs/Task09_Spleen/plan.yaml")     # validated with load_config
print(plan.table())
```
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import textwrap
from pathlib import Path

import numpy as np

from tfmis.errors import UsageError
from tfmis.hardware import GPU_RESERVED_MB, MAX_CASE_WORKERS, Hardware, recommended_precision
from tfmis.planning.fingerprint import DatasetFingerprint
from tfmis.planning.plan_file import SECTIONS, Plan, fmt_shape, fmt_stride, format_value  # noqa: F401 (re-exported)
from tfmis.planning.rules import (
    fmt_mm,
    inference_window_mb,
    initial_patch_size,
    pool_and_conv_props,
    shrink_patch,
    square_in_plane,
    target_spacing,
    training_memory_mb,
)

# CPU: patches of at most 48^3 voxels and 1000 steps, so that the small network trains in about ten minutes on 2
# cores (its step time at batch 2: docs/benchmarks.md, "First epoch, precision and other costs")
CPU_PATCH_VOXELS = 48**3
CPU_TRAINING_STEPS = 1000
CPU_VALIDATIONS = 15
CPU_FILTERS = (8, 128)  # first level, cap (the demo recipe's 8, 16, 32, 64)
GPU_FILTERS = (32, 320)  # nnU-Net
# spatial model parallelism: a slab's activations with its halos and the concatenations that make them, against
# 1/N of the whole (the graph count of benchmarks/model_parallel_memory.py)
SPATIAL_OVERHEAD = 1.15
GPU_MEMORY_TARGET_MB = 8 * 1024  # nnU-Net plans its 3d_fullres patch for 8 GB at batch 2
GPU_STEPS_PER_EPOCH, GPU_EPOCHS = 250, 1000  # nnU-Net
GPU_VALIDATIONS = 50
SMALL_CLASS_FRACTION = 0.01  # classes under 1% of the labelled voxels get twice the crop centres
DATASET_COVERAGE = 0.05  # nnU-Net: one batch covers at most 5% of the dataset's voxels


def default_dataset_dir(source_dir: str | Path) -> str:
    """Where a plan converts an MSD folder to: `<parent>/<folder>_tfrecords` (next to it, never inside it)."""
    source = Path(source_dir)
    return str(source.parent / f"{source.name}_tfrecords")


def default_output_dir(source_dir: str | Path) -> str:
    return str(Path("runs") / Path(source_dir).name)


def _stride_value(stride: tuple) -> int | list:
    return stride[0] if len(set(stride)) == 1 else list(stride)


def _filters(levels: int, first: int, cap: int) -> list[int]:
    return [min(first * 2**i, cap) for i in range(levels)]


def normalisation_lines(fingerprint: DatasetFingerprint) -> list[str]:
    """Per channel, what the conversion does to it (from its modality name)."""
    lines = []
    for i, m in enumerate(fingerprint.modalities):
        if i in fingerprint.ct_channels:
            lo, hi = fingerprint.ct_window
            lines.append(
                f"channel {i} {m}: clip to [{lo:g}, {hi:g}] HU, then z-score with the labelled-foreground "
                f"mean and std of the training cases (measured by the conversion)"
            )
        else:
            lines.append(
                f"channel {i} {m}: z-score per case over the foreground (voxels unlike the background: 0, or a "
                "z-scored scan's border constant)"
            )
    return lines


Setting = tuple  # (dotted config key, value, reason)


class Settings(list):
    """A step's config keys with their reasons, in writing order, collected as `Plan.set` takes them."""

    def set(self, key: str, value, reason: str) -> None:
        self.append((key, value, reason))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
    """What one planning step decided: the config keys it sets with their reasons, in writing order, and comment
    lines above config sections. A key set again by a later step takes the new value and reason in its place."""

    settings: tuple[Setting, ...] = ()
    notes: dict = dataclasses.field(default_factory=dict)

    def record(self, plan: Plan) -> None:
        """Sets this decision's keys (with their reasons) and notes on `plan`."""
        for key, value, reason in self.settings:
            plan.set(key, value, reason)
        plan.notes.update(self.notes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataDecision(Decision):
    """`determine_data`: the target spacing (mm), the median preprocessed shape there (for a cascade's fine stage:
    of the labels' boxes grown by the margin), the per-channel normalisation lines, the number of training cases."""

    spacing: list
    median_shape: np.ndarray
    norm: list
    n_train: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class PatchDecision(Decision):
    """`determine_patch`: the patch, the strides per level, the divisor (the stride products), nnU-Net's initial
    patch before shrinking, the shrinking steps taken, and whether the patch is square in-plane."""

    patch: list
    strides: list
    divisor: tuple
    initial_patch: list
    shrink_steps: int
    square: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelDecision(Decision):
    """`determine_model_parallel`: `model_parallel` None or ("spatial", GPUs per model, data-parallel groups), and
    the patch the later steps use (the proposed one, or the initial patch split over the GPUs)."""

    model_parallel: tuple | None
    patch: PatchDecision


@dataclasses.dataclass(frozen=True, kw_only=True)
class NetworkDecision(Decision):
    """`determine_network`: the filters per level."""

    filters: list


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchDecision(Decision):
    """`determine_batch`: images per step and the memory estimate at batch 2 (`rules.training_memory_mb`)."""

    batch: int
    memory: dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleDecision(Decision):
    """`determine_schedule`: optimizer steps per epoch, epochs, and about how many validations over the run."""

    steps_per_epoch: int
    epochs: int
    validations: int


@dataclasses.dataclass(frozen=True)
class Decisions:
    """Every step's decision, in the order `ExperimentPlanner.decide` makes them and `plan` records them."""

    data: DataDecision
    proposed_patch: PatchDecision
    parallel: ParallelDecision
    network: NetworkDecision
    batch: BatchDecision
    sampling: Decision
    schedule: ScheduleDecision
    validation: Decision
    cascade: Decision
    runtime: Decision

    @property
    def patch(self) -> PatchDecision:
        """The patch the network trains on (`determine_patch`'s, or the initial one split over GPUs)."""
        return self.parallel.patch

    def in_order(self) -> list[Decision]:
        return [getattr(self, field.name) for field in dataclasses.fields(self)]


class ExperimentPlanner:
    """Plans a training config for a dataset fingerprint on this hardware, as nnU-Net v2's `ExperimentPlanner`:
    `decide()` runs the `determine_*` steps in order, each given the earlier decisions it needs and returning its
    own (a `Decision`: its config keys with their reasons, and the values later steps read); `plan()` records them
    on a `Plan`. The steps leave nothing on the planner, so each can be called alone. Subclass and override one
    step to change one decision (e.g. `determine_patch` for another patch budget) and keep the rest.

    Args:
        fingerprint: a `DatasetFingerprint` (first pass or conversion).
        hardware: a `tfmis.hardware.Hardware` (`detect_hardware()`).
        source_dir: the MSD folder (default: the fingerprint's).
        dataset_dir: where the conversion goes (default: `<source>_tfrecords` next to the source).
        output_dir: the run folder (default: `runs/<source folder name>`).
        gpu_fit: measured values of the GPU-fit search (num_images_per_batch, num_sw_batch_size,
            validation_data_device, source) to use instead of estimates.
        split: train/val/test fractions.
        seed: split and training seed.
        spacing: a fixed target spacing (mm) with its reason, `(spacing, reason)`, instead of nnU-Net's
            full-resolution rule (a low-resolution stage; `tfmis.planning.stages`).
        roi_margin_mm: plan the fine stage of a cascade: cases cropped to their labels' box grown by this many mm
            (the median of those boxes sizes the patch) and `cascade.coarse_run` set to `coarse_run`.
        coarse_run: the coarse stage's run folder (with `roi_margin_mm`).
        training_share: share of the CPU step budget this stage gets (stages share one budget).
        max_minutes: `training.max_minutes` of this stage (null: none); refused (`UsageError`) when it rounds (to
            hundredths) to no training.
    """

    def __init__(
        self,
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
    ):
        self.source_dir = source_dir or fingerprint.source_dir
        if self.source_dir is None:
            raise ValueError("make_plan: source_dir is unknown (the fingerprint does not name its MSD folder); pass it")
        if max_minutes is not None and round(float(max_minutes), 2) <= 0:
            total = max_minutes / training_share if training_share > 0 else max_minutes
            part = f"this stage's {training_share:.0%} share is" if training_share < 1 else "that is"
            raise UsageError(
                f"max_minutes {total:g} (--max-minutes, training.max_minutes): {part} {round(float(max_minutes), 2):g} "
                f"minutes of training in hundredths of a minute; give at least {0.01 / min(training_share, 1):.2g} "
                f"minutes, or no time budget"
            )
        self.dataset_dir = dataset_dir or default_dataset_dir(self.source_dir)
        self.output_dir = output_dir or default_output_dir(self.source_dir)
        self.fp, self.hardware, self.gpu_fit, self.split, self.seed = fingerprint, hardware, gpu_fit, split, seed
        self.gpu = hardware.has_gpu
        self.in_channels, self.num_classes = len(fingerprint.modalities), len(fingerprint.labels)
        self.precision, self.precision_reason = recommended_precision(hardware)
        if hardware.target_given and hardware.has_gpu and hardware.compute_capability is None:
            self.precision_reason += " (name the target's GPU with --gpu, e.g. --gpu A100-80GB, to plan its precision)"
        self.fixed_spacing, self.roi_margin_mm, self.coarse_run = spacing, roi_margin_mm, coarse_run
        self.training_share, self.max_minutes = training_share, max_minutes

    def decide(self) -> Decisions:
        """Every step in order, each given the earlier decisions it needs."""
        data = self.determine_data()
        proposed = self.determine_patch(data)
        parallel = self.determine_model_parallel(data, proposed)
        patch = parallel.patch  # the initial patch when it is split over GPUs, else the proposed one
        network = self.determine_network(patch)
        batch = self.determine_batch(data, patch, network, parallel)
        sampling = self.determine_sampling(data, patch)
        schedule = self.determine_schedule(data, batch)
        validation = self.determine_validation(patch, network, schedule)
        return Decisions(
            data,
            proposed,
            parallel,
            network,
            batch,
            sampling,
            schedule,
            validation,
            self.determine_cascade(),
            self.determine_runtime(),
        )

    def plan(self, decisions: Decisions | None = None) -> Plan:
        """The plan of `decisions` (default: `decide()`): every step's keys with their reasons in order, then the
        header and the summary."""
        decisions = decisions or self.decide()
        plan = Plan()
        for decision in decisions.in_order():
            decision.record(plan)
        hardware = self.hardware
        plan.set(
            "planning.planned_for",
            hardware.planned_for(),
            f"the hardware this plan is for: {hardware.planned_for_text()}; training warns in one line on a machine "
            "with fewer GPUs, smaller ones or none",
        )
        plan.header, plan.summary = self.describe(decisions)
        return plan

    # ------------------------------------------------------------------ data and conversion

    def determine_data(self) -> DataDecision:
        """Source and target folders, target spacing (nnU-Net's rule, or the fixed one), CT window and
        normalisation, split, shards; the median shape at the target spacing."""
        from tfmis.data.folds import assign_splits

        fp = self.fp
        out = Settings()
        out.set("data.source_dir", str(self.source_dir), "the MSD folder this plan was made from")
        out.set("data.dataset_dir", str(self.dataset_dir), "converted TFRecords (written on first use)")
        spacing, spacing_reason = self.fixed_spacing or target_spacing(fp.spacings, fp.crop_shapes)
        spacing = [float(round(s, 4)) for s in spacing]
        out.set("data.conversion.spacing", spacing, spacing_reason + " (mm, R,A,S)")
        norm = normalisation_lines(fp)
        notes = {
            "data.conversion": [
                "Normalisation, done by the conversion from the modality names: "
                + "; ".join(norm)
                + " (nnU-Net: CT clipped to the foreground percentiles, "
                "then z-scored with the foreground statistics; MRI z-score per case)."
            ]
        }
        if fp.ct_channels:
            lo, hi = fp.ct_window
            out.set(
                "data.conversion.ct_window",
                [float(lo), float(hi)],
                f"CT: the 0.5/99.5 percentiles of the labelled-foreground HU ({fp.source}), as nnU-Net clips",
            )
            out.set(
                "data.conversion.ct_normalization",
                "zscore",
                "CT after clipping: minus the labelled-foreground mean, over its std, both over all training "
                "cases (nnU-Net's CTNormalization; the conversion measures them)",
            )
        ids = assign_splits(list(fp.case_ids), self.split, None, self.seed)
        n_train = len(ids["train"])
        out.set(
            "data.conversion.split",
            list(self.split),
            f"train/val/test: {n_train}/{len(ids['val'])}/{len(ids.get('test', []))} cases (or folds: 5 as nnU-Net)",
        )
        shards = max(1, min(8, n_train // 4))
        out.set("data.conversion.shards", shards, f"about 4 training cases per shard ({n_train} training cases)")
        median_shape = fp.median_shape_at(spacing)
        if self.roi_margin_mm is not None:
            median_shape = roi_median_shape(fp, spacing, self.roi_margin_mm)
            out.set(
                "data.conversion.crop_to_label_mm",
                float(self.roi_margin_mm),
                f"the fine stage trains on the labels' box grown by {self.roi_margin_mm:g} mm per side, the "
                f"region the coarse stage cuts at prediction (median {fmt_shape(median_shape)} voxels)",
            )
        return DataDecision(
            settings=tuple(out),
            notes=notes,
            spacing=spacing,
            median_shape=median_shape,
            norm=norm,
            n_train=n_train,
        )

    # ------------------------------------------------------------------ patch and network

    def patch_budget(self):
        """(fits(patch, strides) -> bool, the budget in words): the memory this machine affords a training step
        at batch 2 (a GPU: nnU-Net's 8 GB target within 85% of the GPU; a CPU: `CPU_PATCH_VOXELS` and half the
        available RAM)."""
        first, cap = self.filter_range()
        num_res_units = self.num_res_units()

        def estimate(patch, strides):
            return training_memory_mb(
                patch,
                strides,
                _filters(len(strides), first, cap),
                num_res_units,
                self.in_channels,
                self.num_classes,
                2,
                self.precision,
            )["total_mb"]

        if self.gpu:
            usable = (self.hardware.gpu_memory_mb or 16 * 1024) - GPU_RESERVED_MB
            target_mb = min(GPU_MEMORY_TARGET_MB, 0.85 * usable)
            return (
                lambda patch, strides: estimate(patch, strides) <= target_mb,
                f"an estimated training peak of at most {target_mb / 1024:.1f} GB at batch 2 (nnU-Net plans for 8 GB)",
            )
        available = self.hardware.host_available_mb
        memory_cap = 0.5 * available if available else float("inf")
        return (
            lambda patch, strides: int(np.prod(patch)) <= CPU_PATCH_VOXELS and estimate(patch, strides) <= memory_cap,
            f"a CPU target of {CPU_PATCH_VOXELS:,} voxels (48^3: a training step of ~0.3 s on 2 cores, measured)",
        )

    def filter_range(self) -> tuple[int, int]:
        """(first level's filters, cap): nnU-Net's 32 to 320 on a GPU; the demo's 8 to 128 on a CPU."""
        return GPU_FILTERS if self.gpu else CPU_FILTERS

    def num_res_units(self) -> int:
        return 2 if self.gpu else 1

    def determine_patch(self, data: DataDecision) -> PatchDecision:
        """The patch: the median shape's aspect ratio, shrunk (nnU-Net v2) until the budget holds, divisible by
        the stride products."""
        median_shape, spacing = data.median_shape, data.spacing
        fits, budget_text = self.patch_budget()
        square = square_in_plane(spacing, median_shape)
        shape_for_patch = np.array(median_shape, dtype=np.float64)
        if square:  # the in-plane median sizes' geometric mean for both: a square patch keeps quarter turns possible
            shape_for_patch[:2] = np.sqrt(median_shape[0] * median_shape[1])
        initial_patch = initial_patch_size(spacing, shape_for_patch)
        patch, strides, divisor, steps = shrink_patch(spacing, median_shape, initial_patch, fits, square=square)
        square_text = (
            f"; square in-plane (x, y medians {median_shape[0]:.0f}, {median_shape[1]:.0f} within 1.5x: "
            f"their geometric mean for both, so quarter turns can augment)"
            if square
            else ""
        )
        reason = (
            f"from the median shape {fmt_shape(median_shape)} at the target spacing: aspect ratio of the physical "
            f"extent, clipped to the median shape ({fmt_shape(initial_patch)}){square_text}, shrunk {steps} "
            f"step(s) to {budget_text}, divisible by the stride products {fmt_shape(divisor)} (nnU-Net v2)"
        )
        return PatchDecision(
            settings=(("pipeline.patch_size", [int(p) for p in patch], reason),),
            patch=patch,
            strides=strides,
            divisor=divisor,
            initial_patch=initial_patch,
            shrink_steps=steps,
            square=square,
        )

    def determine_model_parallel(self, data: DataDecision, patch: PatchDecision) -> ParallelDecision:
        """Weighs spatial model parallelism against the smaller patch `determine_patch` chose: on a machine with
        several GPUs, when the patch the dataset wants (`initial_patch`) is over one GPU's budget, the smallest
        number of GPUs N (2, 4, 8) whose slabs of it each fit that budget takes it, and the remaining GPUs
        become data-parallel groups. Per GPU: the weights, 1/N of the activations plus a halo share, and the
        whole patch's logits for the loss (`runtime.model_parallel`, docs/model-parallel.md). The reason says
        both sides in numbers. Its `patch` is `patch`, or the initial patch (with its strides and divisor)
        when split."""
        gpus = len(self.hardware.gpus)
        why_not = None
        if not self.gpu:
            why_not = "no GPU (logical CPU devices share the same cores and memory: no gain)"
        elif not patch.shrink_steps:
            why_not = "the patch the dataset wants fits one GPU"
        elif gpus < 2:
            why_not = "one GPU"
        choice = None if why_not else self._spatial_choice(data.spacing, patch.initial_patch, gpus)
        if choice is None:
            if why_not is None:  # what N GPUs would give, for a user who wants the larger patch anyway
                n = 1 << (min(gpus, 8).bit_length() - 1)
                larger = self._shrunk_patch(
                    data,
                    patch,
                    lambda p, strides: self._spatial_mb(p, strides, n)[0] <= self._gpu_target_mb(),
                )
                why_not = (
                    f"the patch the dataset wants, {fmt_shape(patch.initial_patch)}, does not fit even when split "
                    f"over this machine's {gpus} GPUs; split over {n} it could be {fmt_shape(larger)} "
                    f"({np.prod(larger) / np.prod(patch.patch):.2f}x the voxels of {fmt_shape(patch.patch)}): set "
                    f"runtime.model_parallel.mode=spatial, runtime.model_parallel.devices={n} and that patch to use it"
                )
            return ParallelDecision(
                settings=(("runtime.model_parallel.mode", "none", f"one model per device: {why_not}"),),
                model_parallel=None,
                patch=patch,
            )
        n, per_device_mb, full_mb, target_mb, axis = choice
        _, strides, wanted, divisor = pool_and_conv_props(data.spacing, patch.initial_patch)
        shrunk = [int(p) for p in patch.patch]
        ratio = float(np.prod(wanted) / np.prod(shrunk))
        groups = gpus // n
        out = Settings()
        out.set(
            "pipeline.patch_size",
            [int(p) for p in wanted],
            f"the patch the median shape {fmt_shape(data.median_shape)} wants (nnU-Net's initial patch), not "
            f"shrunk: it is split over {n} GPUs (runtime.model_parallel); on one GPU it would shrink to "
            f"{fmt_shape(shrunk)}, {ratio:.2f}x fewer voxels",
        )
        out.set(
            "runtime.model_parallel.mode",
            "spatial",
            f"the patch {fmt_shape(wanted)} needs ~{full_mb / 1024:.1f} GB per step at batch 2, over one GPU's "
            f"{target_mb / 1024:.1f} GB budget; cut along axis {axis} into {n} slabs it needs "
            f"~{per_device_mb / 1024:.1f} GB per GPU (the alternatives: a {ratio:.2f}x smaller patch, which costs "
            f"Dice on large structures, or a low-resolution stage / cascade); costs: halo exchanges every "
            f"convolution, and {n} GPUs per model",
        )
        out.set(
            "runtime.model_parallel.devices", n, f"the fewest GPUs whose slabs fit the {target_mb / 1024:.1f} GB budget"
        )
        out.set("runtime.model_parallel.axis", axis, "the longest axis of the patch that can be cut into aligned slabs")
        if groups > 1:
            out.set("runtime.model_parallel.data", groups, f"{gpus} GPUs: {groups} data-parallel groups of {n}")
        out.set("runtime.distribution", "none", "one process drives all its GPUs (runtime.model_parallel)")
        return ParallelDecision(
            settings=tuple(out),
            model_parallel=("spatial", n, groups),
            patch=dataclasses.replace(patch, settings=(), patch=list(wanted), strides=strides, divisor=divisor),
        )

    def _gpu_target_mb(self) -> float:
        usable = (self.hardware.gpu_memory_mb or 16 * 1024) - GPU_RESERVED_MB
        return min(GPU_MEMORY_TARGET_MB, 0.85 * usable)

    def _spatial_mb(self, patch, strides, n: int) -> tuple[float, float]:
        """(estimated training peak per GPU at batch 2 with the patch split over `n` GPUs, the same on one GPU)."""
        first, cap = self.filter_range()
        memory = training_memory_mb(
            patch,
            strides,
            _filters(len(strides), first, cap),
            self.num_res_units(),
            self.in_channels,
            self.num_classes,
            2,
            self.precision,
        )
        if n == 1:
            return memory["total_mb"], memory["total_mb"]
        logits_mb = 2 * int(np.prod(patch)) * self.num_classes * 4 * 4 / 2**20  # logits, softmax, gradient, one-hot
        activations = memory["total_mb"] - memory["fixed_mb"]
        return memory["fixed_mb"] + activations * SPATIAL_OVERHEAD / n + logits_mb, memory["total_mb"]

    def _shrunk_patch(self, data: DataDecision, patch: PatchDecision, fits) -> list[int]:
        """The initial patch shrunk (as `determine_patch` does) until `fits(patch, strides)`."""
        shrunk = shrink_patch(data.spacing, data.median_shape, patch.initial_patch, fits, square=patch.square)[0]
        return [int(p) for p in shrunk]

    def _spatial_choice(self, spacing, initial_patch, gpus: int):
        """(N, per-GPU MB, one-GPU MB, budget MB, axis) of the fewest GPUs whose slabs of the initial patch fit the
        budget, or None."""
        _, strides, patch, divisor = pool_and_conv_props(spacing, initial_patch)
        target_mb = self._gpu_target_mb()
        units = [p // d for p, d in zip(patch, divisor)]
        axis = int(np.argmax(units))
        for n in (2, 4, 8):
            if n > gpus or units[axis] < n:
                break
            per_device, full = self._spatial_mb(patch, strides, n)
            if per_device <= target_mb:
                return n, per_device, full, target_mb, axis
        return None

    def determine_network(self, patch: PatchDecision) -> NetworkDecision:
        """Filters, per-axis strides (nnU-Net's pooling rule, from the patch decision), residual units, norm,
        kernel."""
        first, cap = self.filter_range()
        strides, gpu = patch.strides, self.gpu
        pools = [sum(1 for s in strides if s[a] == 2) for a in range(3)]
        filters = _filters(len(strides), first, cap)
        thin = [a for a in range(3) if strides[1][a] == 1] if len(strides) > 1 else []
        thin_text = (
            f"; axis {', '.join(map(str, thin))} is not pooled at level 1 (its spacing is >= 2x the "
            f"finest), only once the others have caught up"
            if thin
            else ""
        )
        out = Settings()
        out.set(
            "model.filters",
            filters,
            f"{first} doubling per level, capped at {cap} ("
            + ("nnU-Net)" if gpu else "small enough for a CPU, as configs/demo.yaml)"),
        )
        out.set(
            "model.strides",
            [_stride_value(s) for s in strides],
            f"nnU-Net: pool an axis while its feature map stays >= 4 voxels and its spacing < 2x the finest, at "
            f"most 5 times: {pools[0]}/{pools[1]}/{pools[2]} poolings per axis{thin_text}",
        )
        out.set(
            "model.num_res_units",
            self.num_res_units(),
            "two convolutions per level in a residual unit (nnU-Net: two per stage)"
            if gpu
            else "one residual unit per level (for CPU speed)",
        )
        out.set("model.norm", "instance", "instance normalisation (nnU-Net): per-sample statistics, small batches")
        out.set(
            "model.kernel_size",
            3,
            "3x3x3 at every level (nnU-Net uses 1 along a much coarser axis early on; "
            "tfmis has one kernel size for all levels)",
        )
        return NetworkDecision(settings=tuple(out), filters=filters)

    # ------------------------------------------------------------------ batch and sampling

    def determine_batch(
        self, data: DataDecision, patch: PatchDecision, network: NetworkDecision, parallel: ParallelDecision
    ) -> BatchDecision:
        """Images per step: measured (GPU-fit search), estimated from the memory model (GPU), or 2 (CPU); with the
        memory estimate at batch 2."""
        hardware = self.hardware
        memory = training_memory_mb(
            patch.patch,
            patch.strides,
            network.filters,
            self.num_res_units(),
            self.in_channels,
            self.num_classes,
            2,
            self.precision,
        )
        total_voxels = float(np.prod(self.fp.shapes_at(data.spacing), axis=1).sum())
        coverage_cap = max(2, round(DATASET_COVERAGE * total_voxels / float(np.prod(patch.patch))))
        if self.gpu and self.gpu_fit:
            batch = int(self.gpu_fit["num_images_per_batch"])
            batch_reason = f"measured by the GPU-fit search ({self.gpu_fit.get('source', 'its cache')})"
        elif self.gpu and parallel.model_parallel is not None:
            # one model over N GPUs: nnU-Net's 2 per model, the data groups make the step's batch
            _, n, groups = parallel.model_parallel
            batch = 2 * groups
            batch_reason = (
                f"2 images per model (nnU-Net's minimum; the patch was sized for it on {n} GPUs) x {groups} "
                f"data-parallel group(s) (runtime.model_parallel.data)"
            )
        elif self.gpu:
            budget = 0.85 * ((hardware.gpu_memory_mb or 16 * 1024) - GPU_RESERVED_MB) - memory["fixed_mb"]
            fit = max(2, int(budget // memory["per_image_mb"]))
            batch = max(2, min(fit, coverage_cap))
            batch_reason = (
                f"estimated: {memory['per_image_mb']:.0f} MB per image fits {fit} in 85% of the GPU; at "
                f"most 5% of the dataset's voxels per batch ({coverage_cap}), at least 2 (nnU-Net); "
                f"`python -m tfmis.train --gpu-customization` measures it"
            )
        else:
            batch = 2
            batch_reason = (
                f"nnU-Net's minimum; on a CPU more images per step only lengthen the step (estimated peak "
                f"{memory['fixed_mb'] + 2 * memory['per_image_mb']:.0f} MB of "
                f"{hardware.host_available_mb / 1024:.1f} GB available)"
            )
        return BatchDecision(
            settings=(("pipeline.num_images_per_batch", batch, batch_reason),), batch=batch, memory=memory
        )

    def determine_sampling(self, data: DataDecision, patch: PatchDecision) -> Decision:
        """Crops per volume, crop centres per class (small classes oversampled), the cache, quarter turns."""
        fp, square = self.fp, patch.patch[0] == patch.patch[1]
        out = Settings()
        out.set(
            "pipeline.num_crops_per_image", 4, "4 crops per volume read (MONAI num_samples): fewer decodes per step"
        )
        fractions = fp.class_fraction
        small = [i for i in range(1, self.num_classes) if fractions[i] < SMALL_CLASS_FRACTION]
        if small:
            ratios = [1] + [2 if i in small else 1 for i in range(1, self.num_classes)]
            names = ", ".join(f"{fp.labels[i]} {100 * fractions[i]:.2g}%" for i in small)
            out.set(
                "pipeline.class_ratios",
                ratios,
                f"crop centres per class [background, ...]: classes under {SMALL_CLASS_FRACTION:.0%} of the "
                f"voxels get twice the share ({names})",
            )
        else:
            out.set(
                "pipeline.pos_neg_ratio",
                [2, 1],
                "every class has >= 1% of the voxels: 2 foreground-centred crops per background one",
            )
        volume_voxels = fp.shapes_at(data.spacing).prod(axis=1)
        # float16 image, uint8 label, slack
        cache_mb = float(volume_voxels.sum()) * (2 * self.in_channels + 1 + 4) / 2**20
        if cache_mb <= 0.3 * self.hardware.host_available_mb:
            out.set(
                "pipeline.cache",
                "memory",
                f"the converted volumes (~{cache_mb:.0f} MB) fit in 30% of the available RAM: decoded once",
            )
        else:
            out.set(
                "pipeline.cache",
                "file",
                f"~{cache_mb / 1024:.1f} GB of volumes do not fit in 30% of the RAM: cached on disk in cache_dir",
            )
            dataset_dir = Path(self.dataset_dir)
            out.set(
                "pipeline.cache_dir",
                str(dataset_dir.parent / (dataset_dir.name + "_cache")),
                "on-disk cache, reused by later runs",
            )
        out.set(
            "pipeline.augment.rot90_prob",
            0.5 if square else 0.0,
            "in-plane quarter turns: the patch is square in x, y"
            if square
            else "no quarter turns: the patch is not square in x, y",
        )
        return Decision(settings=tuple(out))

    # ------------------------------------------------------------------ loss, optimizer, length

    def determine_schedule(self, data: DataDecision, batch: BatchDecision) -> ScheduleDecision:
        """Loss, optimizer and learning-rate schedule, training length, precision, XLA, seed: nnU-Net's on a GPU,
        the demo recipe's on a CPU."""
        out = Settings()
        out.set("loss.name", "dice_ce", "Dice + cross-entropy (nnU-Net)")
        out.set("loss.include_background", False, "Dice over the foreground classes")
        steps_per_epoch = max(1, math.ceil(data.n_train * 4 / batch.batch))
        share = f"{self.training_share:.0%} of " if self.training_share < 1 else ""
        if self.gpu:
            out.set("optimizer.name", "sgd", "nnU-Net: SGD, Nesterov momentum 0.99")
            out.set("optimizer.learning_rate", 0.01, "nnU-Net's initial learning rate")
            out.set("optimizer.momentum", 0.99, "nnU-Net")
            out.set("optimizer.nesterov", True, "nnU-Net")
            out.set("optimizer.weight_decay", 3e-5, "nnU-Net")
            out.set("optimizer.schedule", "poly", "nnU-Net: polynomial decay (power 0.9)")
            out.set("optimizer.warmup_epochs", 0.0, "none (nnU-Net)")
            steps_per_epoch = GPU_STEPS_PER_EPOCH
            epochs = GPU_EPOCHS
            out.set("training.steps_per_epoch", steps_per_epoch, "nnU-Net: 250 iterations per epoch")
            out.set(
                "training.epochs",
                epochs,
                "nnU-Net: 1000 epochs (250k iterations)"
                + (
                    "; at most: the trainer fits the learning-rate schedule to training.max_minutes from the "
                    "measured step time"
                    if self.max_minutes is not None
                    else ""
                ),
            )
            validations = GPU_VALIDATIONS
        else:
            out.set(
                "optimizer.name",
                "adamw",
                "AdamW converges in the short CPU budget (the demo recipe's measured "
                "choice; nnU-Net's SGD needs its 250k iterations)",
            )
            out.set("optimizer.learning_rate", 0.003, "MONAI's demo recipe's (benchmarks/monai_demo.py)")
            out.set("optimizer.weight_decay", 1e-5, "the demo recipe's (and MONAI's there)")
            out.set("optimizer.schedule", "cosine", "cosine decay to 0 over the run")
            out.set("optimizer.warmup_epochs", 1.0, "one epoch of linear warm-up")
            budget = round(CPU_TRAINING_STEPS * self.training_share)
            epochs = max(1, round(budget / steps_per_epoch))
            if self.max_minutes is None:
                out.set(
                    "training.epochs",
                    epochs,
                    f"{share}a CPU budget of ~{CPU_TRAINING_STEPS} optimizer steps ({steps_per_epoch} per epoch: "
                    f"{data.n_train} training volumes x 4 crops / batch {batch.batch}); about ten minutes on 2 "
                    f"cores at 48^3 for the whole budget",
                )
            else:
                # the trainer sets the schedule's length from the epoch time it measures (tfmis.engine.budget);
                # training.epochs only bounds it, at this many times the step budget's pace (a faster CPU than the
                # development one still fits). The validations are spaced for the step budget's pace scaled to the
                # minutes (CPU_TRAINING_STEPS per ten minutes): `epochs` below is that estimate
                CPU_BUDGET_EPOCH_FACTOR = 10
                epochs = max(1, round(CPU_TRAINING_STEPS * float(self.max_minutes) / 10 / steps_per_epoch))
                out.set(
                    "training.epochs",
                    CPU_BUDGET_EPOCH_FACTOR * epochs,
                    f"from the measured step time: the trainer fits the learning-rate schedule to "
                    f"training.max_minutes after its first epochs; this bounds it ({CPU_BUDGET_EPOCH_FACTOR}x the "
                    f"~{epochs} epochs of ~{CPU_TRAINING_STEPS} optimizer steps per ten minutes on 2 cores, "
                    f"{steps_per_epoch} per epoch)",
                )
            validations = CPU_VALIDATIONS
        out.set("training.precision", self.precision, self.precision_reason)
        out.set(
            "training.jit_compile",
            False,
            "XLA: ~10x slower than plain TensorFlow on the development CPU"
            if not self.gpu
            else "off: XLA's gain on 3D convolutions varies by GPU; try true and compare epoch times",
        )
        out.set("training.seed", self.seed, "split and weight initialisation")
        if self.max_minutes is not None:
            out.set(
                "training.max_minutes", round(float(self.max_minutes), 2), f"{share}the time budget given to the plan"
            )
        return ScheduleDecision(
            settings=tuple(out), steps_per_epoch=steps_per_epoch, epochs=epochs, validations=validations
        )

    # ------------------------------------------------------------------ validation

    def determine_validation(
        self, patch: PatchDecision, network: NetworkDecision, schedule: ScheduleDecision
    ) -> Decision:
        """How often, the window (the patch), windows per forward pass, overlap, blending, where the volume lives."""
        gpu, gpu_fit = self.gpu, self.gpu_fit
        out = Settings()
        out.set(
            "validation.val_interval",
            max(1, round(schedule.epochs / schedule.validations)),
            f"about {schedule.validations} validations over the run",
        )
        out.set("validation.roi_size", [int(p) for p in patch.patch], "the training patch (nnU-Net)")
        window_mb = inference_window_mb(patch.patch, patch.strides, network.filters, self.num_classes, self.precision)
        if gpu and gpu_fit:
            sw = int(gpu_fit["num_sw_batch_size"])
            sw_reason = f"measured by the GPU-fit search ({gpu_fit.get('source', 'its cache')})"
            placement = gpu_fit["validation_data_device"]
            placement_reason = f"measured by the GPU-fit search ({gpu_fit.get('source', 'its cache')})"
        elif gpu:
            budget = 0.25 * ((self.hardware.gpu_memory_mb or 16 * 1024) - GPU_RESERVED_MB)
            sw = max([s for s in (1, 2, 4, 8) if s * window_mb <= budget] or [1])
            sw_reason = (
                f"estimated: {window_mb:.0f} MB per window within a quarter of the GPU, at most 8; "
                f"--gpu-customization measures it"
            )
            placement = "auto"
            placement_reason = "the GPU, falling back to the CPU on out-of-memory"
        else:
            sw = 4
            sw_reason = f"4 windows per forward pass (~{window_mb:.0f} MB each): the demo recipe's on a CPU"
            placement = "cpu"
            placement_reason = "no accelerator"
        overlap = 0.5 if gpu else 0.25
        out.set("validation.num_sw_batch_size", sw, sw_reason)
        out.set(
            "validation.overlap",
            overlap,
            "nnU-Net's half-window step" if gpu else "a quarter: fewer windows on a CPU (nnU-Net uses 0.5)",
        )
        out.set("validation.mode", "gaussian", "Gaussian-weighted window blending (nnU-Net)")
        out.set("validation.validation_data_device", placement, placement_reason)
        out.set("output.dir", str(self.output_dir), "the run folder")
        return Decision(settings=tuple(out))

    def determine_cascade(self) -> Decision:
        """The fine stage of a cascade: which coarse run finds its region, and the margin around it."""
        if self.roi_margin_mm is None or self.coarse_run is None:
            return Decision()
        return Decision(
            settings=(
                ("cascade.coarse_run", str(self.coarse_run), "the coarse stage finds the region on the whole scan"),
                (
                    "cascade.margin_mm",
                    float(self.roi_margin_mm),
                    "kept around each piece of the coarse stage's foreground, as around the labels in training",
                ),
            )
        )

    def determine_runtime(self) -> Decision:
        """oneDNN: decided on each machine that trains (the plan may travel), with this machine's decision."""
        here = f"; here: {self.hardware.onednn}" if self.hardware.onednn else ""
        return Decision(
            settings=(
                (
                    "runtime.onednn",
                    "auto",
                    "TensorFlow's oneDNN CPU kernels, decided on the machine that trains before TensorFlow starts: on "
                    f"for x86-64 CPUs with AVX2 and FMA, TensorFlow's default elsewhere{here}",
                ),
            )
        )

    # ------------------------------------------------------------------ header and summary

    def describe(self, decisions: Decisions) -> tuple[list[str], dict]:
        """(the plan file's header: fingerprint, hardware, input parallelism; the numbers behind the plan)."""
        fp, hardware, data = self.fp, self.hardware, decisions.data
        fractions_text = ", ".join(f"{name} {100 * f:.3g}%" for name, f in zip(fp.labels, fp.class_fraction))
        parallel = (
            f"{hardware.cpu_count} cores: the conversion uses {max(1, min(hardware.cpu_count, MAX_CASE_WORKERS))} "
            f"worker processes, tf.data runs its map and interleave stages on all cores (AUTOTUNE)"
        )
        if hardware.cpu_count <= 4:
            parallel += "; with so few cores the volumes are cached decoded so the step does not wait for input"
        header = [
            f"tfmis plan for {fp.name}, made by python -m tfmis.plan on "
            f"{datetime.datetime.now().isoformat(timespec='minutes')}.",
            f"Fingerprint ({fp.source}): modalities {', '.join(fp.modalities)}; voxels per class {fractions_text}; "
            f"median spacing {fmt_mm(fp.median_spacing)} mm; median shape at the target spacing "
            f"{fmt_shape(data.median_shape)}"
            + (f"; {len(fp.skipped)} unreadable case(s) skipped" if fp.skipped else ""),
            f"Hardware: {hardware.describe()}.",
            f"Planned for: {hardware.planned_for_text()}.",
            f"Input parallelism: {parallel}.",
            "Every planned value carries its reason; keys not written keep tfmis's defaults.",
        ]
        header = [w for line in header for w in (textwrap.wrap(line, 114, subsequent_indent="  ") or [""])]
        summary = {
            "name": fp.name,
            "num_cases": fp.num_cases,
            "modalities": list(fp.modalities),
            "hardware": hardware.describe(),
            "planned_for": hardware.planned_for(),
            "planned_for_text": hardware.planned_for_text(),
            "median_shape": [float(s) for s in data.median_shape],
            "normalisation": data.norm,
            "steps_per_epoch": decisions.schedule.steps_per_epoch,
            "num_train": data.n_train,
            "memory_mb": decisions.batch.memory,
            "initial_patch": decisions.patch.initial_patch,
            "divisor": list(decisions.patch.divisor),
        }
        return header, summary


def roi_median_shape(fingerprint: DatasetFingerprint, spacing, margin_mm: float) -> np.ndarray:
    """Median shape (voxels at `spacing`) of the cases' labelled boxes grown by `margin_mm` per side, each within
    its foreground crop; a case with no labelled voxels, or a fingerprint without label boxes, counts its crop."""
    spacing = np.asarray(spacing, dtype=np.float64)
    crop_mm = fingerprint.crop_shapes * fingerprint.spacings
    extents = fingerprint.label_extents_mm
    if extents is None:
        extents = np.full_like(crop_mm, np.nan)
    roi_mm = np.where(np.isnan(extents), crop_mm, np.minimum(extents + 2 * margin_mm, crop_mm))
    return np.median(np.maximum(np.round(roi_mm / spacing), 1), axis=0)


def make_plan(fingerprint: DatasetFingerprint, hardware: Hardware, **kwargs) -> Plan:
    """The plan of `ExperimentPlanner(fingerprint, hardware, **kwargs)` (see its arguments)."""
    return ExperimentPlanner(fingerprint, hardware, **kwargs).plan()
