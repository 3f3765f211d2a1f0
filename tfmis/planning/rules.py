"""nnU-Net v2's planning rules (Isensee et al., nnU-Net, Nature Methods 2021; nnunetv2's
ExperimentPlanner), as plain functions of numbers, plus a memory estimate for tfmis's U-Net.

- `target_spacing`: the median spacing per axis; for anisotropic data whose coarse axis also has few
  voxels, that axis takes its 10th-percentile spacing instead.
- `pool_and_conv_props` (nnU-Net's `get_pool_and_conv_props`): pool an axis while its feature map
  stays >= `min_feature_map` voxels and its spacing is less than twice the finest current spacing, so
  a thick-slice axis is not pooled until the others have caught up; the patch is padded up to a
  multiple of the per-axis stride products.
- `initial_patch_size` and `shrink_patch`: a patch with the aspect ratio of the physical extent,
  clipped to the median shape, shrunk one axis at a time (the one largest relative to the median
  shape) until it fits a budget.
- `activation_elements` / `training_memory_mb`: the tensors a tfmis U-Net keeps for the backward pass.

Example:
```python
spacing, why = target_spacing(spacings, crop_shapes)
pools, strides, patch, divisor = pool_and_conv_props(spacing, initial_patch_size(spacing, median_shape))
```
"""

from __future__ import annotations

import math

import numpy as np

ANISOTROPY_THRESHOLD = 3.0  # nnU-Net: an axis 3x coarser than the others is "anisotropic"
MIN_FEATURE_MAP = 4  # nnU-Net: pool while the feature map stays at least this large
MAX_POOLINGS = 5  # per axis
INITIAL_PATCH_VOXELS = 256**3  # nnU-Net v2: the initial patch before clipping to the median shape
# peak training memory per image / counted activations, from the CPU's peak-RSS slope per image
# (docs/benchmarks.md, "First epoch, precision and other costs")
MEMORY_OVERHEAD = 1.25


def fmt_mm(values) -> str:
    """0.79x0.79x2.5 (mm values, compact)."""
    return "x".join(f"{v:.3g}" for v in values)


def target_spacing(spacings, crop_shapes, threshold: float = ANISOTROPY_THRESHOLD) -> tuple[np.ndarray, str]:
    """nnU-Net v2's full-resolution target spacing and the reason, in words.

    Args:
        spacings: (N, 3) original spacings (mm).
        crop_shapes: (N, 3) cropped shapes on the original grids (voxels).
        threshold: the anisotropy ratio.

    Returns:
        (spacing (3,), reason).

    Example:
        >>> s, why = target_spacing([[0.8, 0.8, 2.5]] * 3, [[100, 100, 40]] * 3)
        >>> s.tolist()
        [0.8, 0.8, 2.5]
        >>> why.split("; ")[0]
        'spacing 0.8x0.8x2.5: median per axis of 3 cases'
    """
    spacings = np.asarray(spacings, dtype=np.float64)
    sizes = np.asarray(crop_shapes, dtype=np.float64)
    target = np.percentile(spacings, 50, axis=0)
    target_size = np.percentile(sizes, 50, axis=0)
    worst = int(np.argmax(target))
    others = [i for i in range(3) if i != worst]
    other_spacing = max(target[i] for i in others)
    ratio = target[worst] / other_spacing
    has_aniso_spacing = target[worst] > threshold * other_spacing
    has_aniso_voxels = target_size[worst] * threshold < min(target_size[i] for i in others)
    n = len(spacings)
    if has_aniso_spacing and has_aniso_voxels:
        median = target[worst]
        chosen = float(np.percentile(spacings[:, worst], 10))
        if chosen < other_spacing:
            chosen = max(other_spacing, chosen) + 1e-5
        target[worst] = chosen
        return target, (
            f"spacing {fmt_mm(target)}: median per axis of {n} cases, except axis {worst}: its median "
            f"{median:.3g} mm is {ratio:.1f}x the finer spacing and it has few voxels "
            f"({target_size[worst]:.0f} x {threshold:g} < {min(target_size[i] for i in others):.0f}), so "
            f"it takes its 10th percentile {chosen:.3g} mm (nnU-Net: thin-slice cases keep their detail)"
        )
    why = f"spacing {fmt_mm(target)}: median per axis of {n} cases"
    if ratio > threshold:
        why += f"; axis {worst} kept anisotropic because {ratio:.1f}x the finer spacing"
        why += (
            f" (its {target_size[worst]:.0f} voxels are not few enough for nnU-Net's 10th-percentile rule)"
            if has_aniso_spacing and not has_aniso_voxels
            else ""
        )
    return target, why


def pool_and_conv_props(spacing, patch_size, min_feature_map: int = MIN_FEATURE_MAP, max_numpool: int = MAX_POOLINGS):
    """nnU-Net's `get_pool_and_conv_props`: per-axis poolings for a patch at a spacing.

    Args:
        spacing: the target spacing (3,).
        patch_size: the patch (3,) before padding.
        min_feature_map: an axis is pooled only while it has at least 2x this many voxels.
        max_numpool: poolings per axis at most.

    Returns:
        (poolings per axis, strides (one (sx, sy, sz) per level, the first (1, 1, 1)), the patch padded
        up to the divisor, the divisor (per-axis stride product)).

    Example:
        >>> pools, strides, patch, divisor = pool_and_conv_props([0.8, 0.8, 2.5], [80, 80, 40])
        >>> strides[1], patch, divisor
        ((2, 2, 1), [80, 80, 40], (16, 16, 8))
    """
    dim = len(spacing)
    current_spacing = [float(s) for s in spacing]
    current_size = [float(s) for s in patch_size]
    num_pool = [0] * dim
    strides = [(1,) * dim]
    while True:
        valid = [i for i in range(dim) if current_size[i] >= 2 * min_feature_map]
        if not valid:
            break
        finest = min(current_spacing[i] for i in valid)
        valid = [i for i in valid if current_spacing[i] / finest < 2]
        valid = [i for i in valid if num_pool[i] < max_numpool]
        if len(valid) == 1 and current_size[valid[0]] < 3 * min_feature_map:
            break
        if not valid:
            break
        stride = [1] * dim
        for i in valid:
            stride[i] = 2
            num_pool[i] += 1
            current_spacing[i] *= 2
            current_size[i] = math.ceil(current_size[i] / 2)
        strides.append(tuple(stride))
    divisor = tuple(2**n for n in num_pool)
    padded = [int(math.ceil(p / d) * d) for p, d in zip(patch_size, divisor)]
    return num_pool, strides, padded, divisor


def initial_patch_size(spacing, median_shape, voxels: int = INITIAL_PATCH_VOXELS) -> list[int]:
    """nnU-Net v2: `voxels` voxels with the aspect ratio of a cube in mm, clipped to the median shape.

    Example:
        >>> initial_patch_size([0.8, 0.8, 2.5], [80, 70, 40])
        [80, 70, 40]
    """
    inverse = 1.0 / np.asarray(spacing, dtype=np.float64)
    patch = [round(v) for v in inverse * (voxels / np.prod(inverse)) ** (1 / 3)]
    return [int(min(p, m)) for p, m in zip(patch, np.asarray(median_shape).round().astype(int))]


def square_in_plane(spacing, median_shape, max_ratio: float = 1.5) -> bool:
    """True when axes 0 and 1 have the same spacing (within 10%) and median sizes within `max_ratio`: the
    patch can then be square in-plane, which tfmis's quarter-turn augmentation (rot90_prob) needs.

    Example:
        >>> square_in_plane([2.5, 2.5, 2.5], [58, 74, 62]), square_in_plane([0.8, 0.8, 2.5], [200, 90, 40])
        (True, False)
    """
    close_spacing = max(spacing[0], spacing[1]) <= 1.1 * min(spacing[0], spacing[1])
    return bool(close_spacing and max(median_shape[:2]) <= max_ratio * min(median_shape[:2]))


def shrink_patch(spacing, median_shape, patch_size, fits, square: bool = False, max_steps: int = 1000):
    """nnU-Net v2's loop: shrink the axis largest relative to the median shape until `fits(patch, strides)`.

    Each step takes one divisor step off that axis (recomputing the divisor after a first step, so no
    valid size is skipped), then recomputes the topology. With `square`, axes 0 and 1 are compared
    against their common (geometric mean) median and shrunk together, so the patch stays square in-plane.

    Args:
        spacing, median_shape: the target spacing and median preprocessed shape.
        patch_size: the initial patch (square in-plane when `square`).
        fits: `fits(patch, strides) -> bool`.
        square: keep patch[0] == patch[1].

    Returns:
        (patch, strides, divisor, steps taken).
    """
    median = np.asarray(median_shape, dtype=np.float64).copy()
    if square:
        median[:2] = np.sqrt(median[0] * median[1])
    _, strides, patch, divisor = pool_and_conv_props(spacing, patch_size)
    steps = 0
    while not fits(patch, strides) and steps < max_steps:
        axis = int(np.argsort([p / m for p, m in zip(patch, median)])[-1])
        axes = (0, 1) if square and axis in (0, 1) else (axis,)
        trial = list(patch)
        for a in axes:
            trial[a] -= divisor[a]
        if min(trial[a] for a in axes) < 1:
            break
        _, _, _, trial_divisor = pool_and_conv_props(spacing, trial)
        patch = list(patch)
        step = max(trial_divisor[a] for a in axes)
        for a in axes:
            patch[a] -= step
        if min(patch[a] for a in axes) < 1:
            break
        _, strides, patch, divisor = pool_and_conv_props(spacing, patch)
        steps += 1
    return patch, strides, divisor, steps


# ---------------------------------------------------------------- a low-resolution stage

LOWRES_COVERAGE = 0.25  # nnU-Net v2 (lowres_creation_threshold): plan 3d_lowres when the patch covers less
LOWRES_SPACING_STEP = 1.03  # nnU-Net v2 (spacing_increase_factor): the spacing grows 3% a step


def patch_coverage(patch_size, median_shape) -> float:
    """Share of the median image's voxels one patch covers (capped at 1).

    Example:
        >>> round(patch_coverage([48, 48, 48], [96, 96, 96]), 3)
        0.125
    """
    return float(
        min(
            1.0, np.prod(np.asarray(patch_size, dtype=np.float64)) / np.prod(np.asarray(median_shape, dtype=np.float64))
        )
    )


def lowres_spacing(
    spacing,
    median_shape,
    patch_at,
    threshold: float = LOWRES_COVERAGE,
    step: float = LOWRES_SPACING_STEP,
    max_steps: int = 1000,
):
    """nnU-Net v2's 3d_lowres spacing: grow the spacing by `step` (only the axes more than 2x finer than the
    coarsest while there are such, so an anisotropic grid becomes less so first) until the patch planned at that
    spacing covers `threshold` of the median image there.

    Args:
        spacing: the full-resolution target spacing (mm).
        median_shape: the median image shape at that spacing (voxels).
        patch_at: `patch_at(spacing, median_shape) -> patch` (the planner's patch at another spacing).

    Returns:
        (spacing, median shape at it, patch, steps taken).

    Example:
        >>> s, m, p, n = lowres_spacing([1, 1, 1], [160, 160, 160], lambda s, m: [min(48, round(x)) for x in m])
        >>> [float(round(v, 2)) for v in s], p, round(patch_coverage(p, m), 2), n
        ([2.16, 2.16, 2.16], [48, 48, 48], 0.27, 26)
    """
    full = np.asarray(spacing, dtype=np.float64)
    current = full.copy()
    median = np.asarray(median_shape, dtype=np.float64)
    shape, patch, steps = median, patch_at(current, median), 0
    while patch_coverage(patch, shape) < threshold and steps < max_steps:
        fine_axes = current.max() / current > 2
        current = current * np.where(fine_axes, step, 1.0) if fine_axes.any() else current * step
        shape = full / current * median
        patch = patch_at(current, shape)
        steps += 1
    return current, shape, patch, steps


def equivalent_diameter_mm(volume_mm3: float) -> float:
    """Diameter of the sphere of that volume: a structure's size in one number.

    Example:
        >>> round(equivalent_diameter_mm(4 / 3 * math.pi * 10**3), 6)
        20.0
    """
    return float((6.0 * max(volume_mm3, 0.0) / math.pi) ** (1.0 / 3.0))


# ---------------------------------------------------------------- memory of tfmis's U-Net


def level_voxels(patch_size, strides) -> list[int]:
    """Voxels of the feature map at each level (level i downsampled by strides[0..i])."""
    shape = np.array(patch_size, dtype=np.float64)
    out = []
    for s in strides:
        shape = np.ceil(shape / np.array(s if isinstance(s, (tuple, list)) else (s,) * 3))
        out.append(int(np.prod(shape)))
    return out


def activation_elements(patch_size, strides, filters, num_res_units: int, in_channels: int, num_classes: int) -> int:
    """Elements of the tensors one image keeps for the backward pass in `tfmis.networks.unet`'s U-Net.

    Encoder level: `num_res_units` conv-norm-activation sub-units (3 tensors each) plus the residual
    projection and the sum; decoder level: the upsampling conv-norm-activation, the concatenation (two
    levels' worth) and a fusing residual unit (5); plus input and logits/softmax.
    """
    voxels = level_voxels(patch_size, strides)
    encoder = 3 * num_res_units + 2 if num_res_units > 0 else 3
    decoder = 3 + 2 + (5 if num_res_units > 0 else 3)
    total = sum(encoder * f * v for f, v in zip(filters, voxels))
    total += sum(decoder * f * v for f, v in zip(filters[:-1], voxels[:-1]))
    return int(total + (in_channels + 3 * num_classes) * voxels[0])


def parameter_count(filters, strides, num_res_units: int, in_channels: int, num_classes: int, kernel: int = 3) -> int:
    """Approximate trainable parameters (convolution weights) of the U-Net."""
    k = kernel**3
    total, c_in = 0, in_channels
    for f in filters:
        total += k * c_in * f + (max(num_res_units, 1) - 1) * k * f * f + k * c_in * f  # units + projection
        c_in = f
    for lower, f in zip(filters[1:][::-1], filters[:-1][::-1]):
        total += k * lower * f + k * 2 * f * f + 2 * f * f
    return int(total + filters[0] * num_classes)


def training_memory_mb(
    patch_size, strides, filters, num_res_units: int, in_channels: int, num_classes: int, batch: int, precision: str
) -> dict:
    """Estimated peak training memory: {"per_image_mb", "fixed_mb", "total_mb"}.

    Activations: `activation_elements` x bytes (2 under mixed precision, else 4) x `MEMORY_OVERHEAD`
    (gradient buffers and workspace: measured as the per-image slope of the peak RSS on the CPU);
    fixed: weights, gradients and two optimizer moments in float32, plus 300 MB of framework and
    convolution workspace.
    """
    bytes_per = 2 if precision.startswith("mixed") else 4
    per_image = (
        activation_elements(patch_size, strides, filters, num_res_units, in_channels, num_classes)
        * bytes_per
        * MEMORY_OVERHEAD
        / 2**20
    )
    fixed = parameter_count(filters, strides, num_res_units, in_channels, num_classes) * 16 / 2**20 + 300
    return {"per_image_mb": per_image, "fixed_mb": fixed, "total_mb": fixed + batch * per_image}


def inference_window_mb(patch_size, strides, filters, num_classes: int, precision: str) -> float:
    """Estimated memory of one sliding window in a forward pass (no activations kept): the widest
    level's few live tensors plus the window's logits and Gaussian-weighted probabilities."""
    bytes_per = 2 if precision.startswith("mixed") else 4
    voxels = level_voxels(patch_size, strides)
    widest = max(6 * f * v for f, v in zip(filters, voxels))
    return (widest * bytes_per + 3 * num_classes * voxels[0] * 4) / 2**20
