"""The planner's patch and network steps (`TopologySteps`): the patch the target GPU's memory holds (grown up to the
median image, else shrunk as nnU-Net v2 shrinks it), spatial model parallelism when one GPU cannot hold nnU-Net's
default-target patch, and the U-Net's filters, strides (nnU-Net's pooling rule), residual units and norm."""

from __future__ import annotations

import dataclasses

import numpy as np

from tfmis.errors import ResourceError
from tfmis.networks.slab_geometry import slab_bounds
from tfmis.planning.decisions import DataDecision, NetworkDecision, ParallelDecision, PatchDecision, Settings
from tfmis.planning.inputs import CPU_PATCH_VOXELS, GPU_MEMORY_SHARE, PlanningInputs
from tfmis.planning.plan_file import fmt_shape
from tfmis.planning.rules import (
    INITIAL_PATCH_VOXELS,
    initial_patch_size,
    pool_and_conv_props,
    shrink_patch,
    square_in_plane,
    training_memory_mb,
)

CPU_FILTERS = (8, 128)  # first level, cap (the demo recipe's 8, 16, 32, 64)
GPU_FILTERS = (32, 320)  # nnU-Net
# nnU-Net v2's default `gpu_memory_target_in_gb` (8): its patch there is the smallest a GPU plan trains before it
# splits the model over several GPUs (one GPU whose budget holds it never splits)
GPU_MEMORY_TARGET_MB = 8 * 1024
# spatial model parallelism: the busiest device holds its slab's share of the activations (the largest slab, cut at
# multiples of the strides' product) times this, for the gathered input of every convolution (slab and halo rows,
# kept for the kernel's gradient) and the halos: the graph count is 1.30-1.41x the largest slab's share
# (benchmarks/model_parallel_memory.py, tests/test_model_parallel_placement.py; docs/model-parallel.md)
SPATIAL_OVERHEAD = 1.4
GROW_STEPS = 24  # at most this many doublings of the initial patch's voxels on a large GPU


def _stride_value(stride: tuple) -> int | list:
    return stride[0] if len(set(stride)) == 1 else list(stride)


def _divisor(strides) -> list[int]:
    """The per-axis product of the strides (each an int or one per axis)."""
    return [int(np.prod([s if isinstance(s, int) else s[a] for s in strides])) for a in range(3)]


def _filters(levels: int, first: int, cap: int) -> list[int]:
    return [min(first * 2**i, cap) for i in range(levels)]


class TopologySteps:
    """`ExperimentPlanner`'s patch, model-parallel and network steps and the memory model they share, from the
    planner's `inputs` alone."""

    def __init__(self, inputs: PlanningInputs):
        self.inputs = inputs

    def _training_mb(self, patch, strides) -> dict:
        """The planner's memory model (`training_memory_mb`) of its network at `patch`, batch 2."""
        first, cap = self.filter_range()
        return training_memory_mb(
            patch,
            strides,
            _filters(len(strides), first, cap),
            self.num_res_units(),
            self.inputs.in_channels,
            self.inputs.num_classes,
            2,
            self.inputs.precision,
        )

    def patch_budget(self):
        """(fits(patch, strides) -> bool, the budget in words): the memory the target affords a training step at
        batch 2 (a GPU: `gpu_budget_mb`, 85% of its memory after 1 GB for CUDA; a CPU: `cpu_patch_voxels`, default
        `CPU_PATCH_VOXELS`, and half the available RAM)."""
        if self.inputs.gpu:
            target_mb = self.inputs.gpu_budget_mb()
            memory_gb = (self.inputs.hardware.gpu_memory_mb or 16 * 1024) / 1024
            return (
                lambda patch, strides: self._training_mb(patch, strides)["total_mb"] <= target_mb,
                f"an estimated training peak of at most {target_mb / 1024:.1f} GB at batch 2 "
                f"({GPU_MEMORY_SHARE:.0%} of the target GPU's {memory_gb:.0f} GB after 1 GB for CUDA: the GPU sets "
                "the patch, as nnU-Net's gpu_memory_target)",
            )
        available, voxels = self.inputs.hardware.host_available_mb, self.inputs.cpu_patch_voxels
        memory_cap = 0.5 * available if available else float("inf")
        return (
            lambda patch, strides: (
                int(np.prod(patch)) <= self.inputs.cpu_patch_voxels
                and self._training_mb(patch, strides)["total_mb"] <= memory_cap
            ),
            (
                f"a CPU target of {CPU_PATCH_VOXELS:,} voxels (48^3: a training step of ~0.3 s on 2 cores, measured)"
                if voxels == CPU_PATCH_VOXELS
                else f"a CPU target of {voxels:,} voxels (given: cpu_patch_voxels, e.g. a pilot's)"
            )
            + (
                f" and an estimated training peak of at most {memory_cap:.0f} MB (half the available)"
                if available
                else ""
            ),
        )

    def _no_patch_fits(self, patch, budget_text: str) -> str:
        """The line for a budget no trainable patch fits: the memory planned for, and how to plan for more."""
        if self.inputs.gpu:
            memory = f"{(self.inputs.hardware.gpu_memory_mb or 16 * 1024) / 1024:.1f} GB of GPU memory"
            fix = "plan for a larger GPU (--gpu-memory 24GB)"
        else:
            memory = f"{self.inputs.hardware.host_available_mb:.0f} MB of available memory (after any cgroup limit)"
            fix = (
                "give this process more memory, or plan here for the machine the training runs on (--host-memory 16GB)"
            )
        return (
            f"no patch of a network with 2 or more levels fits {memory}: the planner shrank it to "
            f"{fmt_shape(patch)} within {budget_text}; {fix}"
        )

    def filter_range(self) -> tuple[int, int]:
        """(first level's filters, cap): nnU-Net's 32 to 320 on a GPU; the demo's 8 to 128 on a CPU."""
        return GPU_FILTERS if self.inputs.gpu else CPU_FILTERS

    def num_res_units(self) -> int:
        return 2

    def _shape_for_patch(self, data: DataDecision) -> tuple[np.ndarray, bool]:
        """(the shape the initial patch is clipped to, square in-plane): the median shape, its in-plane sizes'
        geometric mean for both when the patch can be square (quarter turns)."""
        median_shape = data.median_shape
        square = square_in_plane(data.spacing, median_shape)
        shape = np.array(median_shape, dtype=np.float64)
        if square:
            shape[:2] = np.sqrt(median_shape[0] * median_shape[1])
        return shape, square

    def _grown_initial_patch(self, spacing, shape, fits) -> tuple[list[int], int]:
        """(nnU-Net's initial patch, and on a GPU whose budget holds it whole, the larger one towards the median
        image: its voxels doubled while the budget still holds it and it is not yet clipped to `shape` on every
        axis; the first that does not fit is shrunk afterwards; doublings). nnU-Net starts from 256^3 voxels, which
        a large GPU can exceed ("this may need to be adapted when using absurdly large GPU memory targets")."""
        initial = initial_patch_size(spacing, shape)
        if not self.inputs.gpu:
            return initial, 0
        whole = [int(m) for m in np.asarray(shape).round().astype(int)]
        voxels, grown = INITIAL_PATCH_VOXELS, 0
        while grown < GROW_STEPS and initial != whole:
            _, strides, padded, _ = pool_and_conv_props(spacing, initial)
            if not fits(padded, strides):
                break
            voxels *= 2
            initial = initial_patch_size(spacing, shape, voxels)
            grown += 1
        return initial, grown

    def determine_patch(self, data: DataDecision) -> PatchDecision:
        """The patch: the median shape's aspect ratio, grown on a large GPU up to the median image, shrunk
        (nnU-Net v2) until the target's budget holds it, divisible by the stride products."""
        median_shape, spacing = data.median_shape, data.spacing
        fits, budget_text = self.patch_budget()
        shape_for_patch, square = self._shape_for_patch(data)
        initial_patch, grown = self._grown_initial_patch(spacing, shape_for_patch, fits)
        patch, strides, divisor, steps = shrink_patch(spacing, median_shape, initial_patch, fits, square=square)
        if not fits(patch, strides) or len(strides) < 2:
            raise ResourceError(self._no_patch_fits(patch, budget_text))
        square_text = (
            f"; square in-plane (x, y medians {median_shape[0]:.0f}, {median_shape[1]:.0f} within 1.5x: "
            f"their geometric mean for both, so quarter turns can augment)"
            if square
            else ""
        )
        grown_text = (
            f"nnU-Net's 256^3 voxels grown {grown} doubling(s) towards the median image for this GPU, " if grown else ""
        )
        reason = (
            f"from the median shape {fmt_shape(median_shape)} at the target spacing: aspect ratio of the physical "
            f"extent, {grown_text}clipped to the median shape ({fmt_shape(initial_patch)}){square_text}, shrunk "
            f"{steps} step(s) to {budget_text}, divisible by the stride products {fmt_shape(divisor)} (nnU-Net v2)"
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

    def smallest_sensible_patch(self, data: DataDecision) -> tuple[list[int], list, tuple]:
        """(patch, strides, divisor) nnU-Net v2 plans at its default 8 GB target (`GPU_MEMORY_TARGET_MB`, in this
        planner's memory model and precision): its initial patch shrunk until batch 2 fits 8 GB. A GPU plan trains
        no smaller patch when several GPUs can hold this one split (`determine_model_parallel`)."""
        shape_for_patch, square = self._shape_for_patch(data)
        initial = initial_patch_size(data.spacing, shape_for_patch)
        patch, strides, divisor, _ = shrink_patch(
            data.spacing,
            data.median_shape,
            initial,
            lambda p, s: self._training_mb(p, s)["total_mb"] <= GPU_MEMORY_TARGET_MB,
            square=square,
        )
        return [int(p) for p in patch], strides, divisor

    def determine_model_parallel(self, data: DataDecision, patch: PatchDecision) -> ParallelDecision:
        """Spatial model parallelism, only when one GPU cannot hold the smallest sensible patch: nnU-Net's patch at
        its default 8 GB target (`smallest_sensible_patch`). One GPU whose budget (`gpu_budget_mb`) holds that patch
        trains the patch its own memory sets (`determine_patch`, often larger); on a smaller GPU with several of
        them, the fewest N (2, 4, 8) whose busiest GPU holds its slab of that patch take it, and the remaining GPUs
        become data-parallel groups. Per GPU: the weights and the largest slab's activations with their gathered
        inputs and halos (`spatial_mb`); the loss is summed slab by slab, so no GPU holds the whole patch's logits
        (`runtime.model_parallel`, docs/model-parallel.md). The reason says both sides in numbers. Its `patch` is
        `patch`, or the sensible patch (with its strides and divisor) when split."""
        gpus = len(self.inputs.hardware.gpus)

        def none(why: str) -> ParallelDecision:
            return ParallelDecision(
                settings=(("runtime.model_parallel.mode", "none", f"one model per device: {why}"),),
                model_parallel=None,
                patch=patch,
            )

        if not self.inputs.gpu:
            return none("no GPU (logical CPU devices share the same cores and memory: no gain)")
        budget = self.inputs.gpu_budget_mb()
        sensible, strides, divisor = self.smallest_sensible_patch(data)
        full_mb = self.spatial_mb(sensible, strides, 1)[0]
        planned = fmt_shape(patch.patch)
        if full_mb <= budget:
            return none(
                f"one GPU's {budget / 1024:.1f} GB budget holds the patch {planned}, at least nnU-Net's patch at its "
                f"default 8 GB target ({fmt_shape(sensible)}, ~{full_mb / 1024:.1f} GB at batch 2)"
            )
        ratio = float(np.prod(sensible) / np.prod(patch.patch))
        if gpus < 2:
            return none(
                f"one GPU: its {budget / 1024:.1f} GB budget holds the patch {planned}, {ratio:.2f}x fewer voxels than "
                f"nnU-Net's patch at its default 8 GB target ({fmt_shape(sensible)}, ~{full_mb / 1024:.1f} GB at "
                f"batch 2); with several such GPUs the plan splits it over them (runtime.model_parallel)"
            )
        choice = self._spatial_choice(sensible, strides, divisor, gpus)
        if choice is None:  # what a split would give, for a user who wants a larger patch anyway
            return none(self._split_alternative(data, patch, sensible, gpus, budget))
        n, per_device_mb, axis, slabs = choice
        groups = gpus // n
        out = Settings()
        out.set(
            "pipeline.patch_size",
            sensible,
            f"nnU-Net's patch at its default 8 GB target for the median shape {fmt_shape(data.median_shape)} (the "
            f"smallest this plan trains): it is split over {n} GPUs (runtime.model_parallel); on one GPU it would "
            f"shrink to {planned}, {ratio:.2f}x fewer voxels",
        )
        out.set(
            "runtime.model_parallel.mode",
            "spatial",
            f"the patch {fmt_shape(sensible)} needs ~{full_mb / 1024:.1f} GB per step at batch 2, over one GPU's "
            f"{budget / 1024:.1f} GB budget; cut along axis {axis} into {n} slabs of {'/'.join(map(str, slabs))} "
            f"rows the busiest GPU needs ~{per_device_mb / 1024:.1f} GB (its slab's activations x{SPATIAL_OVERHEAD:g} "
            f"for the gathered inputs and halos, and the weights; the alternatives: the {ratio:.2f}x smaller patch, "
            f"which costs Dice on large structures, or a low-resolution stage / cascade); costs: halo exchanges "
            f"every convolution, and {n} GPUs per model",
        )
        out.set(
            "runtime.model_parallel.devices",
            n,
            f"the fewest GPUs whose busiest one holds its slab within the {budget / 1024:.1f} GB budget",
        )
        out.set(
            "runtime.model_parallel.axis",
            axis,
            "the axis whose largest aligned slab is the smallest share of the patch (the busiest GPU holds the least)",
        )
        if groups > 1:
            out.set("runtime.model_parallel.data", groups, f"{gpus} GPUs: {groups} data-parallel groups of {n}")
        out.set("runtime.distribution", "none", "one process drives all its GPUs (runtime.model_parallel)")
        return ParallelDecision(
            settings=tuple(out),
            model_parallel=("spatial", n, groups),
            patch=dataclasses.replace(patch, settings=(), patch=list(sensible), strides=strides, divisor=divisor),
        )

    @staticmethod
    def spatial_cut(patch, divisor, n: int, axis: int | None = None) -> tuple[int, list[int]] | None:
        """(axis, rows of each slab) of `patch` cut into `n` slabs aligned to `divisor` (`slab_bounds`, as
        `ModelParallel` cuts them) along `axis`, or along the axis whose largest slab is the smallest share of its
        side (then the longer side); None when it cannot be cut so."""
        axes = range(3) if axis is None else [axis]
        cuts = []
        for a in axes:
            if patch[a] % divisor[a] or patch[a] // divisor[a] < n:
                continue
            rows = [stop - start for start, stop in slab_bounds(int(patch[a]), int(divisor[a]), n)]
            cuts.append((max(rows) / patch[a], -patch[a], a, rows))
        if not cuts:
            return None
        _, _, a, rows = min(cuts)
        return a, rows

    def spatial_mb(self, patch, strides, n: int, axis: int | None = None) -> tuple[float, float]:
        """(estimated training peak at batch 2 of the busiest GPU with the patch split over `n` GPUs, the same on
        one GPU); the split's is infinite when the patch cannot be cut into `n` aligned slabs. The busiest GPU holds
        the weights and the largest slab's activations (`spatial_cut`, along `axis` or the planner's axis) times
        `SPATIAL_OVERHEAD`: as the traced graph's count, not 1/N of the whole when the slabs are uneven."""
        memory = self._training_mb(patch, strides)
        if n == 1:
            return memory["total_mb"], memory["total_mb"]
        cut = self.spatial_cut(patch, _divisor(strides), n, axis)
        if cut is None:
            return float("inf"), memory["total_mb"]
        a, rows = cut
        slab = [int(p) for p in patch]
        slab[a] = max(rows)
        # the planned loss (Dice + CE) is summed slab by slab on the slabs' devices (`ModelParallel.loss`): the
        # first GPU holds its slab's logits, softmax, gradient and one-hot, not the whole patch's
        activations = self._training_mb(slab, strides)["total_mb"] - memory["fixed_mb"]
        return memory["fixed_mb"] + activations * SPATIAL_OVERHEAD, memory["total_mb"]

    def _split_alternative(self, data: DataDecision, patch: PatchDecision, sensible, gpus: int, budget: float) -> str:
        """Why no split was planned when even all GPUs cannot hold the sensible patch, and the largest patch a split
        over N (2, 4, 8) of them would hold instead (the initial patch shrunk, as `determine_patch` does, until the
        busiest GPU's slab fits), when that is larger than the one-GPU patch."""
        planned = fmt_shape(patch.patch)
        best = None
        for n in (2, 4, 8):
            if n > gpus:
                break

            def fits(p, s, n=n):
                return self.spatial_mb(p, s, n)[0] <= budget

            larger, strides, _, _ = shrink_patch(
                data.spacing, data.median_shape, patch.initial_patch, fits, square=patch.square
            )
            if fits(larger, strides) and np.prod(larger) > np.prod(patch.patch):
                if best is None or np.prod(larger) > np.prod(best[1]):
                    best = (n, [int(p) for p in larger])
        text = (
            f"nnU-Net's patch at its default 8 GB target, {fmt_shape(sensible)}, does not fit even when split over "
            f"this machine's {gpus} GPUs"
        )
        if best is None:
            return f"{text}, and no split holds a larger patch than the one GPU's {planned}"
        n, larger = best
        return (
            f"{text}; split over {n} it could be {fmt_shape(larger)} ({np.prod(larger) / np.prod(patch.patch):.2f}x "
            f"the voxels of {planned}): set runtime.model_parallel.mode=spatial, runtime.model_parallel.devices={n} "
            "and that patch to use it"
        )

    def _spatial_choice(self, patch, strides, divisor, gpus: int):
        """(N, busiest GPU's MB, axis, rows per slab) of the fewest GPUs (2, 4, 8) whose slabs of `patch` fit the
        budget, or None."""
        budget = self.inputs.gpu_budget_mb()
        for n in (2, 4, 8):
            if n > gpus:
                break
            cut = self.spatial_cut(patch, divisor, n)
            if cut is None:
                break
            per_device, _ = self.spatial_mb(patch, strides, n)
            if per_device <= budget:
                return n, per_device, cut[0], cut[1]
        return None

    def determine_network(self, patch: PatchDecision) -> NetworkDecision:
        """Filters, per-axis strides (nnU-Net's pooling rule, from the patch decision), residual units, norm,
        kernel; on a CPU the layout of the measured CPU recipe (`cpu_network`)."""
        first, cap = self.filter_range()
        strides, gpu = patch.strides, self.inputs.gpu
        pools = [sum(1 for s in strides if s[a] == 2) for a in range(3)]
        filters = _filters(len(strides), first, cap)
        thin = [a for a in range(3) if strides[1][a] == 1] if len(strides) > 1 else []
        thin_text = (
            f"; axis {', '.join(map(str, thin))} is not pooled at level 1 (its spacing is >= 2x the "
            f"finest), only once the others have caught up"
            if thin
            else ""
        )
        pooling = (
            f"nnU-Net: pool an axis while its feature map stays >= 4 voxels and its spacing < 2x the finest, at "
            f"most 5 times: {pools[0]}/{pools[1]}/{pools[2]} poolings per axis{thin_text}"
        )
        out = Settings()
        out.set(
            "model.filters",
            filters,
            f"{first} doubling per level, capped at {cap} ("
            + ("nnU-Net)" if gpu else "small enough for a CPU, as configs/demo.yaml)"),
        )
        if gpu:
            out.set("model.strides", [_stride_value(s) for s in strides], pooling)
        else:
            out.extend(self.cpu_network(strides, pooling))
        out.set(
            "model.num_res_units",
            self.num_res_units(),
            "two convolutions per level in a residual unit (nnU-Net: two per stage)"
            if gpu
            else "two residual units per level (MONAI's tutorials and configs/demo.yaml; part of the CPU recipe)",
        )
        out.set("model.norm", "instance", "instance normalisation (nnU-Net): per-sample statistics, small batches")
        out.set(
            "model.kernel_size",
            3,
            "3x3x3 at every level (nnU-Net uses 1 along a much coarser axis early on; "
            "tfmis has one kernel size for all levels)",
        )
        return NetworkDecision(settings=tuple(out), filters=filters, num_res_units=self.num_res_units())

    @staticmethod
    def cpu_network(strides, pooling: str) -> Settings:
        """The CPU recipe's layout (configs/demo.yaml's, MONAI's UNet): the first convolution takes nnU-Net's first
        pooling (the full-resolution level is the dearest on a CPU: about half the step), a transposed convolution
        plus a convolution of the image bring the logits back (`transposed_image`), deep supervision at 1/2 and
        1/4, PyTorch's initialisation. Measured against nnU-Net's layout at the same patch and budget on the
        planner zoo (docs/benchmarks.md, "The planner zoo")."""
        out = Settings()
        shifted = [*strides[1:], (1,) * len(strides[0])]
        out.set(
            "model.strides",
            [_stride_value(s) for s in shifted],
            f"{pooling}; the first convolution takes the first pooling (a CPU: the full-resolution level costs "
            "about half the step; the logits come back by model.output_upsampling)",
        )
        out.set(
            "model.output_upsampling",
            "transposed_image",
            "a transposed convolution and a convolution of the image at full resolution (configs/demo.yaml's)",
        )
        out.set("model.deep_supervision", 2, "loss heads at 1/2 and 1/4 resolution too (configs/demo.yaml's)")
        out.set("model.kernel_initializer", "pytorch", "MONAI's (kaiming-uniform), as configs/demo.yaml")
        return out
