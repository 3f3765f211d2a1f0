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

import datetime
import math
import textwrap
from pathlib import Path

import numpy as np

from tfmis.hardware import GPU_RESERVED_MB, Hardware, recommended_precision
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

# CPU: a patch of at most 48^3 voxels keeps a training step of the small network near 0.3 s on the 2-core
# development CPU (measured 0.26-0.40 s at batch 2), so ~1000 steps take about ten minutes
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


class ExperimentPlanner:
    """Plans a training config for a dataset fingerprint on this hardware, as nnU-Net v2's `ExperimentPlanner`:
    `plan()` runs the `determine_*` steps in order, each setting its config keys with their reasons on the
    `Plan` and leaving what later steps need as attributes. Subclass and override one step to change one
    decision (e.g. `determine_patch` for another patch budget) and keep the rest.

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
        max_minutes: `training.max_minutes` of this stage (null: none).
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
        self.dataset_dir = dataset_dir or default_dataset_dir(self.source_dir)
        self.output_dir = output_dir or default_output_dir(self.source_dir)
        self.fp, self.hardware, self.gpu_fit, self.split, self.seed = fingerprint, hardware, gpu_fit, split, seed
        self.gpu = hardware.has_gpu
        self.in_channels, self.num_classes = len(fingerprint.modalities), len(fingerprint.labels)
        self.precision, self.precision_reason = recommended_precision(hardware)
        self.fixed_spacing, self.roi_margin_mm, self.coarse_run = spacing, roi_margin_mm, coarse_run
        self.training_share, self.max_minutes = training_share, max_minutes

    def plan(self) -> Plan:
        """The plan: every step in order, then the header and the summary."""
        plan = Plan()
        self.determine_data(plan)
        self.determine_patch(plan)
        self.determine_model_parallel(plan)
        self.determine_network(plan)
        self.determine_batch(plan)
        self.determine_sampling(plan)
        self.determine_schedule(plan)
        self.determine_validation(plan)
        self.determine_cascade(plan)
        self.determine_runtime(plan)
        self.describe(plan)
        return plan

    # ------------------------------------------------------------------ data and conversion

    def determine_data(self, plan: Plan) -> None:
        """Source and target folders, target spacing (nnU-Net's rule), CT window and normalisation, split, shards.

        Sets: `spacing`, `median_shape` (at that spacing), `norm` (per-channel normalisation lines), `n_train`.
        """
        from tfmis.data.convert import assign_splits

        fp = self.fp
        plan.set("data.source_dir", str(self.source_dir), "the MSD folder this plan was made from")
        plan.set("data.dataset_dir", str(self.dataset_dir), "converted TFRecords (written on first use)")
        spacing, spacing_reason = self.fixed_spacing or target_spacing(fp.spacings, fp.crop_shapes)
        self.spacing = [float(round(s, 4)) for s in spacing]
        plan.set("data.conversion.spacing", self.spacing, spacing_reason + " (mm, R,A,S)")
        self.norm = normalisation_lines(fp)
        plan.notes["data.conversion"] = [
            "Normalisation, done by the conversion from the modality names: "
            + "; ".join(self.norm)
            + " (nnU-Net: CT clipped to the foreground percentiles, "
            "then z-scored with the foreground statistics; MRI z-score per case)."
        ]
        if fp.ct_channels:
            lo, hi = fp.ct_window
            plan.set(
                "data.conversion.ct_window",
                [float(lo), float(hi)],
                f"CT: the 0.5/99.5 percentiles of the labelled-foreground HU ({fp.source}), as nnU-Net clips",
            )
            plan.set(
                "data.conversion.ct_normalization",
                "zscore",
                "CT after clipping: minus the labelled-foreground mean, over its std, both over all training "
                "cases (nnU-Net's CTNormalization; the conversion measures them)",
            )
        ids = assign_splits(list(fp.case_ids), self.split, None, self.seed)
        self.n_train = len(ids["train"])
        plan.set(
            "data.conversion.split",
            list(self.split),
            f"train/val/test: {self.n_train}/{len(ids['val'])}/{len(ids.get('test', []))} cases (or folds: 5 "
            f"as nnU-Net)",
        )
        shards = max(1, min(8, self.n_train // 4))
        plan.set("data.conversion.shards", shards, f"about 4 training cases per shard ({self.n_train} training cases)")
        self.median_shape = fp.median_shape_at(self.spacing)
        if self.roi_margin_mm is not None:
            self.median_shape = roi_median_shape(fp, self.spacing, self.roi_margin_mm)
            plan.set(
                "data.conversion.crop_to_label_mm",
                float(self.roi_margin_mm),
                f"the fine stage trains on the labels' box grown by {self.roi_margin_mm:g} mm per side, the region "
                f"the coarse stage cuts at prediction (median {fmt_shape(self.median_shape)} voxels)",
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

    def determine_patch(self, plan: Plan) -> None:
        """The patch: the median shape's aspect ratio, shrunk (nnU-Net v2) until the budget holds, divisible by
        the stride products. Sets: `patch`, `strides`, `initial_patch`, `divisor`."""
        median_shape, spacing = self.median_shape, self.spacing
        fits, budget_text = self.patch_budget()
        square = square_in_plane(spacing, median_shape)
        shape_for_patch = np.array(median_shape, dtype=np.float64)
        if square:  # the in-plane median sizes' geometric mean for both: a square patch keeps quarter turns possible
            shape_for_patch[:2] = np.sqrt(median_shape[0] * median_shape[1])
        self.initial_patch = initial_patch_size(spacing, shape_for_patch)
        self.patch, self.strides, self.divisor, steps = shrink_patch(
            spacing, median_shape, self.initial_patch, fits, square=square
        )
        self.shrink_steps, self.square = steps, square
        square_text = (
            f"; square in-plane (x, y medians {median_shape[0]:.0f}, {median_shape[1]:.0f} within 1.5x: "
            f"their geometric mean for both, so quarter turns can augment)"
            if square
            else ""
        )
        plan.set(
            "pipeline.patch_size",
            [int(p) for p in self.patch],
            f"from the median shape {fmt_shape(median_shape)} at the target spacing: aspect ratio of the physical "
            f"extent, clipped to the median shape ({fmt_shape(self.initial_patch)}){square_text}, shrunk {steps} "
            f"step(s) to {budget_text}, divisible by the stride products {fmt_shape(self.divisor)} (nnU-Net v2)",
        )

    def determine_model_parallel(self, plan: Plan) -> None:
        """Weighs spatial model parallelism against the smaller patch `determine_patch` chose: on a machine with
        several GPUs, when the patch the dataset wants (`initial_patch`) is over one GPU's budget, the smallest
        number of GPUs N (2, 4, 8) whose slabs of it each fit that budget takes it, and the remaining GPUs
        become data-parallel groups. Per GPU: the weights, 1/N of the activations plus a halo share, and the
        whole patch's logits for the loss (`runtime.model_parallel`, docs/model-parallel.md). The reason says
        both sides in numbers. Sets: `model_parallel` (None or (mode, N, groups)); may restore `patch`,
        `strides` and `divisor` to the initial patch's."""
        self.model_parallel = None
        gpus = len(self.hardware.gpus)
        why_not = None
        if not self.gpu:
            why_not = "no GPU (logical CPU devices share the same cores and memory: no gain)"
        elif not self.shrink_steps:
            why_not = "the patch the dataset wants fits one GPU"
        elif gpus < 2:
            why_not = "one GPU"
        choice = None if why_not else self._spatial_choice(gpus)
        if choice is None:
            if why_not is None:  # what N GPUs would give, for a user who wants the larger patch anyway
                n = 1 << (min(gpus, 8).bit_length() - 1)
                larger = self._shrunk_patch(
                    lambda patch, strides: self._spatial_mb(patch, strides, n)[0] <= self._gpu_target_mb()
                )
                why_not = (
                    f"the patch the dataset wants, {fmt_shape(self.initial_patch)}, does not fit even when split over "
                    f"this machine's {gpus} GPUs; split over {n} it could be {fmt_shape(larger)} "
                    f"({np.prod(larger) / np.prod(self.patch):.2f}x the voxels of {fmt_shape(self.patch)}): set "
                    f"runtime.model_parallel.mode=spatial, runtime.model_parallel.devices={n} and that patch to use it"
                )
            plan.set("runtime.model_parallel.mode", "none", f"one model per device: {why_not}")
            return
        n, per_device_mb, full_mb, target_mb, axis = choice
        _, strides, patch, divisor = pool_and_conv_props(self.spacing, self.initial_patch)
        shrunk = [int(p) for p in self.patch]
        ratio = float(np.prod(patch) / np.prod(shrunk))
        self.patch, self.strides, self.divisor = list(patch), strides, divisor
        self.model_parallel = ("spatial", n, gpus // n)
        plan.set(
            "pipeline.patch_size",
            [int(p) for p in patch],
            f"the patch the median shape {fmt_shape(self.median_shape)} wants (nnU-Net's initial patch), not shrunk: "
            f"it is split over {n} GPUs (runtime.model_parallel); on one GPU it would shrink to {fmt_shape(shrunk)}, "
            f"{ratio:.2f}x fewer voxels",
        )
        plan.set(
            "runtime.model_parallel.mode",
            "spatial",
            f"the patch {fmt_shape(patch)} needs ~{full_mb / 1024:.1f} GB per step at batch 2, over one GPU's "
            f"{target_mb / 1024:.1f} GB budget; cut along axis {axis} into {n} slabs it needs "
            f"~{per_device_mb / 1024:.1f} GB per GPU (the alternatives: a {ratio:.2f}x smaller patch, which costs "
            f"Dice on large structures, or a low-resolution stage / cascade); costs: halo exchanges every "
            f"convolution, and {n} GPUs per model",
        )
        plan.set(
            "runtime.model_parallel.devices", n, f"the fewest GPUs whose slabs fit the {target_mb / 1024:.1f} GB budget"
        )
        plan.set(
            "runtime.model_parallel.axis", axis, "the longest axis of the patch that can be cut into aligned slabs"
        )
        if gpus // n > 1:
            plan.set("runtime.model_parallel.data", gpus // n, f"{gpus} GPUs: {gpus // n} data-parallel groups of {n}")
        plan.set("runtime.distribution", "none", "one process drives all its GPUs (runtime.model_parallel)")

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

    def _shrunk_patch(self, fits) -> list[int]:
        return [
            int(p)
            for p in shrink_patch(self.spacing, self.median_shape, self.initial_patch, fits, square=self.square)[0]
        ]

    def _spatial_choice(self, gpus: int):
        """(N, per-GPU MB, one-GPU MB, budget MB, axis) of the fewest GPUs whose slabs of the initial patch fit the
        budget, or None."""
        _, strides, patch, divisor = pool_and_conv_props(self.spacing, self.initial_patch)
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

    def determine_network(self, plan: Plan) -> None:
        """Filters, per-axis strides (nnU-Net's pooling rule, from `determine_patch`), residual units, norm,
        kernel. Sets: `filters`."""
        first, cap = self.filter_range()
        strides, gpu = self.strides, self.gpu
        pools = [sum(1 for s in strides if s[a] == 2) for a in range(3)]
        self.filters = _filters(len(strides), first, cap)
        plan.set(
            "model.filters",
            self.filters,
            f"{first} doubling per level, capped at {cap} ("
            + ("nnU-Net)" if gpu else "small enough for a CPU, as configs/demo.yaml)"),
        )
        thin = [a for a in range(3) if strides[1][a] == 1] if len(strides) > 1 else []
        thin_text = (
            f"; axis {', '.join(map(str, thin))} is not pooled at level 1 (its spacing is >= 2x the "
            f"finest), only once the others have caught up"
            if thin
            else ""
        )
        plan.set(
            "model.strides",
            [_stride_value(s) for s in strides],
            f"nnU-Net: pool an axis while its feature map stays >= 4 voxels and its spacing < 2x the finest, at "
            f"most 5 times: {pools[0]}/{pools[1]}/{pools[2]} poolings per axis{thin_text}",
        )
        plan.set(
            "model.num_res_units",
            self.num_res_units(),
            "two convolutions per level in a residual unit (nnU-Net: two per stage)"
            if gpu
            else "one residual unit per level (for CPU speed)",
        )
        plan.set("model.norm", "instance", "instance normalisation (nnU-Net): per-sample statistics, small batches")
        plan.set(
            "model.kernel_size",
            3,
            "3x3x3 at every level (nnU-Net uses 1 along a much coarser axis early on; "
            "tfmis has one kernel size for all levels)",
        )

    # ------------------------------------------------------------------ batch and sampling

    def determine_batch(self, plan: Plan) -> None:
        """Images per step: measured (GPU-fit search), estimated from the memory model (GPU), or 2 (CPU).
        Sets: `batch`, `memory` (the estimate at batch 2)."""
        patch, hardware = self.patch, self.hardware
        self.memory = memory = training_memory_mb(
            patch,
            self.strides,
            self.filters,
            self.num_res_units(),
            self.in_channels,
            self.num_classes,
            2,
            self.precision,
        )
        total_voxels = float(np.prod(self.fp.shapes_at(self.spacing), axis=1).sum())
        coverage_cap = max(2, round(DATASET_COVERAGE * total_voxels / float(np.prod(patch))))
        if self.gpu and self.gpu_fit:
            batch = int(self.gpu_fit["num_images_per_batch"])
            batch_reason = f"measured by the GPU-fit search ({self.gpu_fit.get('source', 'its cache')})"
        elif self.gpu and self.model_parallel is not None:
            # one model over N GPUs: nnU-Net's 2 per model, the data groups make the step's batch
            _, n, groups = self.model_parallel
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
        self.batch = batch
        plan.set("pipeline.num_images_per_batch", batch, batch_reason)

    def determine_sampling(self, plan: Plan) -> None:
        """Crops per volume, crop centres per class (small classes oversampled), the cache, quarter turns."""
        fp, patch = self.fp, self.patch
        plan.set(
            "pipeline.num_crops_per_image", 4, "4 crops per volume read (MONAI num_samples): fewer decodes per step"
        )
        fractions = fp.class_fraction
        small = [i for i in range(1, self.num_classes) if fractions[i] < SMALL_CLASS_FRACTION]
        if small:
            ratios = [1] + [2 if i in small else 1 for i in range(1, self.num_classes)]
            names = ", ".join(f"{fp.labels[i]} {100 * fractions[i]:.2g}%" for i in small)
            plan.set(
                "pipeline.class_ratios",
                ratios,
                f"crop centres per class [background, ...]: classes under {SMALL_CLASS_FRACTION:.0%} of the "
                f"voxels get twice the share ({names})",
            )
        else:
            plan.set(
                "pipeline.pos_neg_ratio",
                [2, 1],
                "every class has >= 1% of the voxels: 2 foreground-centred crops per background one",
            )
        volume_voxels = fp.shapes_at(self.spacing).prod(axis=1)
        # float16 image, uint8 label, slack
        cache_mb = float(volume_voxels.sum()) * (2 * self.in_channels + 1 + 4) / 2**20
        if cache_mb <= 0.3 * self.hardware.host_available_mb:
            plan.set(
                "pipeline.cache",
                "memory",
                f"the converted volumes (~{cache_mb:.0f} MB) fit in 30% of the available RAM: decoded once",
            )
        else:
            plan.set(
                "pipeline.cache",
                "file",
                f"~{cache_mb / 1024:.1f} GB of volumes do not fit in 30% of the RAM: cached on disk in cache_dir",
            )
            dataset_dir = Path(self.dataset_dir)
            plan.set(
                "pipeline.cache_dir",
                str(dataset_dir.parent / (dataset_dir.name + "_cache")),
                "on-disk cache, reused by later runs",
            )
        plan.set(
            "pipeline.augment.rot90_prob",
            0.5 if patch[0] == patch[1] else 0.0,
            "in-plane quarter turns: the patch is square in x, y"
            if patch[0] == patch[1]
            else "no quarter turns: the patch is not square in x, y",
        )

    # ------------------------------------------------------------------ loss, optimizer, length

    def determine_schedule(self, plan: Plan) -> None:
        """Loss, optimizer and learning-rate schedule, training length, precision, XLA, seed: nnU-Net's on a GPU,
        the demo recipe's on a CPU. Sets: `steps_per_epoch`, `epochs`, `validations`."""
        plan.set("loss.name", "dice_ce", "Dice + cross-entropy (nnU-Net)")
        plan.set("loss.include_background", False, "Dice over the foreground classes")
        steps_per_epoch = max(1, math.ceil(self.n_train * 4 / self.batch))
        if self.gpu:
            plan.set("optimizer.name", "sgd", "nnU-Net: SGD, Nesterov momentum 0.99")
            plan.set("optimizer.learning_rate", 0.01, "nnU-Net's initial learning rate")
            plan.set("optimizer.momentum", 0.99, "nnU-Net")
            plan.set("optimizer.nesterov", True, "nnU-Net")
            plan.set("optimizer.weight_decay", 3e-5, "nnU-Net")
            plan.set("optimizer.schedule", "poly", "nnU-Net: polynomial decay (power 0.9)")
            plan.set("optimizer.warmup_epochs", 0.0, "none (nnU-Net)")
            steps_per_epoch = GPU_STEPS_PER_EPOCH
            epochs = GPU_EPOCHS
            plan.set("training.steps_per_epoch", steps_per_epoch, "nnU-Net: 250 iterations per epoch")
            plan.set("training.epochs", epochs, "nnU-Net: 1000 epochs (250k iterations)")
            self.validations = GPU_VALIDATIONS
        else:
            plan.set(
                "optimizer.name",
                "adamw",
                "AdamW converges in the short CPU budget (the demo recipe's measured "
                "choice; nnU-Net's SGD needs its 250k iterations)",
            )
            plan.set("optimizer.learning_rate", 0.003, "MONAI's demo recipe's (benchmarks/monai_demo.py)")
            plan.set("optimizer.weight_decay", 1e-5, "the demo recipe's (and MONAI's there)")
            plan.set("optimizer.schedule", "cosine", "cosine decay to 0 over the run")
            plan.set("optimizer.warmup_epochs", 1.0, "one epoch of linear warm-up")
            budget = round(CPU_TRAINING_STEPS * self.training_share)
            share = f"{self.training_share:.0%} of " if self.training_share < 1 else ""
            epochs = max(1, round(budget / steps_per_epoch))
            plan.set(
                "training.epochs",
                epochs,
                f"{share}a CPU budget of ~{CPU_TRAINING_STEPS} optimizer steps ({steps_per_epoch} per epoch: "
                f"{self.n_train} training volumes x 4 crops / batch {self.batch}); about ten minutes on 2 cores at "
                f"48^3 for the whole budget",
            )
            self.validations = CPU_VALIDATIONS
        self.steps_per_epoch, self.epochs = steps_per_epoch, epochs
        plan.set("training.precision", self.precision, self.precision_reason)
        plan.set(
            "training.jit_compile",
            False,
            "XLA: ~10x slower than plain TensorFlow on the development CPU"
            if not self.gpu
            else "off: XLA's gain on 3D convolutions varies by GPU; try true and compare epoch times",
        )
        plan.set("training.seed", self.seed, "split and weight initialisation")
        if self.max_minutes is not None:
            plan.set(
                "training.max_minutes",
                round(float(self.max_minutes), 2),
                f"{share if self.training_share < 1 else ''}the time budget given to the plan",
            )

    # ------------------------------------------------------------------ validation

    def determine_validation(self, plan: Plan) -> None:
        """How often, the window (the patch), windows per forward pass, overlap, blending, where the volume lives."""
        gpu, gpu_fit, patch = self.gpu, self.gpu_fit, self.patch
        plan.set(
            "validation.val_interval",
            max(1, round(self.epochs / self.validations)),
            f"about {self.validations} validations over the run",
        )
        plan.set("validation.roi_size", [int(p) for p in patch], "the training patch (nnU-Net)")
        window_mb = inference_window_mb(patch, self.strides, self.filters, self.num_classes, self.precision)
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
        plan.set("validation.num_sw_batch_size", sw, sw_reason)
        overlap = 0.5 if gpu else 0.25
        plan.set(
            "validation.overlap",
            overlap,
            "nnU-Net's half-window step" if gpu else "a quarter: fewer windows on a CPU (nnU-Net uses 0.5)",
        )
        plan.set("validation.mode", "gaussian", "Gaussian-weighted window blending (nnU-Net)")
        plan.set("validation.validation_data_device", placement, placement_reason)
        plan.set("output.dir", str(self.output_dir), "the run folder")

    def determine_cascade(self, plan: Plan) -> None:
        """The fine stage of a cascade: which coarse run finds its region, and the margin around it."""
        if self.roi_margin_mm is None or self.coarse_run is None:
            return
        plan.set("cascade.coarse_run", str(self.coarse_run), "the coarse stage finds the region on the whole scan")
        plan.set(
            "cascade.margin_mm",
            float(self.roi_margin_mm),
            "kept around each piece of the coarse stage's foreground, as around the labels in training",
        )

    def determine_runtime(self, plan: Plan) -> None:
        """oneDNN: decided on each machine that trains (the plan may travel), with this machine's decision."""
        here = f"; here: {self.hardware.onednn}" if self.hardware.onednn else ""
        plan.set(
            "runtime.onednn",
            "auto",
            "TensorFlow's oneDNN CPU kernels, decided on the machine that trains before TensorFlow starts: on for "
            f"x86-64 CPUs with AVX2 and FMA, TensorFlow's default elsewhere{here}",
        )

    # ------------------------------------------------------------------ header and summary

    def describe(self, plan: Plan) -> None:
        """The plan file's header (fingerprint, hardware, input parallelism) and the numbers behind the plan."""
        fp, hardware = self.fp, self.hardware
        fractions_text = ", ".join(f"{name} {100 * f:.3g}%" for name, f in zip(fp.labels, fp.class_fraction))
        parallel = (
            f"{hardware.cpu_count} cores: the conversion uses {max(1, min(hardware.cpu_count, 8))} worker "
            f"processes, tf.data runs its map and interleave stages on all cores (AUTOTUNE)"
        )
        if hardware.cpu_count <= 4:
            parallel += "; with so few cores the volumes are cached decoded so the step does not wait for input"
        plan.header = [
            f"tfmis plan for {fp.name}, made by python -m tfmis.plan on "
            f"{datetime.datetime.now().isoformat(timespec='minutes')}.",
            f"Fingerprint ({fp.source}): modalities {', '.join(fp.modalities)}; voxels per class {fractions_text}; "
            f"median spacing {fmt_mm(fp.median_spacing)} mm; median shape at the target spacing "
            f"{fmt_shape(self.median_shape)}"
            + (f"; {len(fp.skipped)} unreadable case(s) skipped" if fp.skipped else ""),
            f"Hardware: {hardware.describe()}.",
            f"Input parallelism: {parallel}.",
            "Every planned value carries its reason; keys not written keep tfmis's defaults.",
        ]
        plan.header = [w for line in plan.header for w in (textwrap.wrap(line, 114, subsequent_indent="  ") or [""])]
        plan.summary = {
            "name": fp.name,
            "num_cases": fp.num_cases,
            "modalities": list(fp.modalities),
            "hardware": hardware.describe(),
            "median_shape": [float(s) for s in self.median_shape],
            "normalisation": self.norm,
            "steps_per_epoch": self.steps_per_epoch,
            "num_train": self.n_train,
            "memory_mb": self.memory,
            "initial_patch": self.initial_patch,
            "divisor": list(self.divisor),
        }


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
