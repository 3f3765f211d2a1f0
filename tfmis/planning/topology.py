"""The planner's patch and network steps (`TopologySteps`): the patch within this machine's memory budget
(nnU-Net v2's shrinking), spatial model parallelism against a smaller patch on several GPUs, and the U-Net's filters,
strides (nnU-Net's pooling rule), residual units and norm."""

from __future__ import annotations

import dataclasses

import numpy as np

from tfmis.errors import ResourceError
from tfmis.hardware import GPU_RESERVED_MB
from tfmis.planning.decisions import DataDecision, NetworkDecision, ParallelDecision, PatchDecision, Settings
from tfmis.planning.plan_file import fmt_shape
from tfmis.planning.rules import (
    initial_patch_size,
    pool_and_conv_props,
    shrink_patch,
    square_in_plane,
    training_memory_mb,
)

# CPU: patches of at most 48^3 voxels and 1000 steps, so that the small network trains in about ten minutes on 2
# cores (its step time at batch 2: docs/benchmarks.md, "First epoch, precision and other costs")
CPU_PATCH_VOXELS = 48**3
CPU_FILTERS = (8, 128)  # first level, cap (the demo recipe's 8, 16, 32, 64)
GPU_FILTERS = (32, 320)  # nnU-Net
# spatial model parallelism: a slab's activations with its halos and the concatenations that make them, against
# 1/N of the whole (the graph count of benchmarks/model_parallel_memory.py, on equal slabs; with slabs cut at
# multiples of the deepest stride the busiest device holds more: docs/model-parallel.md)
SPATIAL_OVERHEAD = 1.15
GPU_MEMORY_TARGET_MB = 8 * 1024  # nnU-Net plans its 3d_fullres patch for 8 GB at batch 2


def _stride_value(stride: tuple) -> int | list:
    return stride[0] if len(set(stride)) == 1 else list(stride)


def _filters(levels: int, first: int, cap: int) -> list[int]:
    return [min(first * 2**i, cap) for i in range(levels)]


class TopologySteps:
    """`ExperimentPlanner`'s patch, model-parallel and network steps, and the budget they share (the planner's
    attributes: `ExperimentPlanner.__init__`)."""

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
            f"a CPU target of {CPU_PATCH_VOXELS:,} voxels (48^3: a training step of ~0.3 s on 2 cores, measured)"
            + (
                f" and an estimated training peak of at most {memory_cap:.0f} MB (half the available)"
                if available
                else ""
            ),
        )

    def _no_patch_fits(self, patch, budget_text: str) -> str:
        """The line for a budget no trainable patch fits: the memory planned for, and how to plan for more."""
        if self.gpu:
            memory = f"{(self.hardware.gpu_memory_mb or 16 * 1024) / 1024:.1f} GB of GPU memory"
            fix = "plan for a larger GPU (--gpu-memory 24GB)"
        else:
            memory = f"{self.hardware.host_available_mb:.0f} MB of available memory (after any cgroup limit)"
            fix = (
                "give this process more memory, or plan here for the machine the training runs on (--host-memory 16GB)"
            )
        return (
            f"no patch of a network with 2 or more levels fits {memory}: the planner shrank it to "
            f"{fmt_shape(patch)} within {budget_text}; {fix}"
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
        if not fits(patch, strides) or len(strides) < 2:
            raise ResourceError(self._no_patch_fits(patch, budget_text))
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
        become data-parallel groups. Per GPU: the weights and 1/N of the activations plus a halo share; the
        loss is summed slab by slab, so no GPU holds the whole patch's logits (`runtime.model_parallel`,
        docs/model-parallel.md). The reason says
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
        # the planned loss (Dice + CE) is summed slab by slab on the slabs' devices (`ModelParallel.loss`): the
        # first GPU holds its slab's logits, softmax, gradient and one-hot, not the whole patch's, so the GPUs
        # share the activations alike (tests/test_model_parallel_placement.py checks it against the graph count)
        activations = memory["total_mb"] - memory["fixed_mb"]
        return memory["fixed_mb"] + activations * SPATIAL_OVERHEAD / n, memory["total_mb"]

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
