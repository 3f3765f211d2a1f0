"""Where the windows of a sliding-window pass go, and how much each voxel of a window weighs: MONAI's
formulas (scan intervals, window corners, symmetric padding, the gaussian importance map), in numpy.

Example:
    >>> number_of_windows((96, 96, 96), 48, 0.25)
    27
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

BLEND_MODES = ("constant", "gaussian")
SPATIAL_DIMS = 3

# MONAI's floor for importance weights, so far window corners still count and Σ(weight) > 0.
MIN_IMPORTANCE = 1e-3

# ----------------------------------------------------------------------------------------------
# Window geometry (pure Python / numpy: MONAI's formulas)
# ----------------------------------------------------------------------------------------------


def per_axis(value: Any, name: str) -> tuple:
    """`value` repeated for the three spatial axes, or checked to have one entry per axis."""
    if value is None or np.isscalar(value):
        return (value,) * SPATIAL_DIMS
    values = tuple(value)
    if len(values) != SPATIAL_DIMS:
        raise ValueError(
            f"{name} must be a single value or one per spatial axis (X, Y, Z), got {len(values)} values: {value!r}"
        )
    return values


def resolve_roi_size(roi_size: int | Sequence[int | None], image_size: Sequence[int]) -> tuple[int, ...]:
    """The window size, with None or non-positive entries replaced by the image size (as MONAI).

    Args:
        roi_size: one size for all axes or one per axis (X, Y, Z).
        image_size: spatial size of the volume.

    Example:
        >>> resolve_roi_size((32, -1, None), (64, 50, 40))
        (32, 50, 40)
    """
    sizes = per_axis(roi_size, "roi_size")
    resolved = []
    for size, image in zip(sizes, image_size):
        if size is not None and not float(size).is_integer():
            raise ValueError(f"roi_size entries must be whole numbers of voxels, got {roi_size!r}")
        resolved.append(int(image) if size is None or size <= 0 else int(size))
    return tuple(resolved)


def scan_intervals(
    image_size: Sequence[int], roi_size: Sequence[int], overlap: float | Sequence[float]
) -> tuple[int, ...]:
    """Step between window starts per axis: `int(roi · (1 - overlap))`, at least 1 (as MONAI).

    An axis the window covers exactly gets a step of the whole roi (one window).

    Args:
        image_size: spatial size of the (padded) volume, never smaller than `roi_size`.
        roi_size: window size per axis.
        overlap: fraction of a window shared with its neighbour, one value or one per axis.

    Example:
        >>> scan_intervals((96, 96, 96), (48, 48, 48), 0.25)
        (36, 36, 36)
    """
    overlaps = per_axis(overlap, "overlap")
    intervals = []
    for image, roi, axis_overlap in zip(image_size, roi_size, overlaps):
        if roi == image:
            intervals.append(int(roi))
        else:
            intervals.append(max(int(roi * (1 - axis_overlap)), 1))
    return tuple(intervals)


def window_starts(image_size: Sequence[int], roi_size: Sequence[int], scan_interval: Sequence[int]) -> np.ndarray:
    """Start corners of all windows, in MONAI's order (last axis fastest).

    Starts step by `scan_interval`; the last one on each axis is moved back to `image - roi` so the
    windows end flush with the volume and never leave it.

    Args:
        image_size: spatial size of the (padded) volume, never smaller than `roi_size`.
        roi_size: window size per axis.
        scan_interval: step per axis, from `scan_intervals`.

    Returns:
        int32 array (num_windows, 3).

    Example:
        >>> window_starts((10, 4, 4), (4, 4, 4), (3, 4, 4))[:, 0].tolist()
        [0, 3, 6]
    """
    axis_starts = []
    for image, roi, step in zip(image_size, roi_size, scan_interval):
        last_start = image - roi
        # the first window that reaches the end closes the axis (MONAI's scan_num)
        count = -(-last_start // step) + 1 if step > 0 else 1
        axis_starts.append([min(i * step, last_start) for i in range(count)])
    return np.asarray(list(itertools.product(*axis_starts)), np.int32).reshape(-1, SPATIAL_DIMS)


def symmetric_padding(image_size: Sequence[int], roi_size: Sequence[int]) -> list[tuple[int, int]]:
    """(before, after) padding per axis that grows an image smaller than the window to its size.

    Example:
        >>> symmetric_padding((10, 3, 20), (8, 8, 8))
        [(0, 0), (2, 3), (0, 0)]
    """
    padding = []
    for image, roi in zip(image_size, roi_size):
        missing = max(roi - image, 0)
        padding.append((missing // 2, missing - missing // 2))
    return padding


# ----------------------------------------------------------------------------------------------
# Importance map
# ----------------------------------------------------------------------------------------------


def importance_map(
    roi_size: Sequence[int], mode: str = "constant", sigma_scale: float | Sequence[float] = 0.125
) -> tf.Tensor:
    """Weight of each voxel of a window when overlapping predictions are blended.

    Args:
        roi_size: window size per axis (X, Y, Z).
        mode: `constant` (all ones) or `gaussian` (1 at the centre, falling to the edges with
            sigma = sigma_scale · roi per axis).
        sigma_scale: one value or one per axis; gaussian mode only.

    Returns:
        float32 tensor of shape `roi_size`, clipped below at max(min, 1e-3) as MONAI does, so no
        voxel gets zero weight.

    Example:
        >>> weights = importance_map((5, 5, 5), "gaussian")
        >>> float(weights[2, 2, 2]), float(weights[0, 0, 0]) < 0.01
        (1.0, True)
    """
    return tf.constant(importance_array(roi_size, mode, sigma_scale))


def importance_array(roi_size: Sequence[int], mode: str, sigma_scale: float | Sequence[float]) -> np.ndarray:
    """`importance_map` as a read-only numpy array, computed once per window size, mode and sigma."""
    mode = check_choice(mode, BLEND_MODES, "mode")
    roi_size = tuple(int(s) for s in roi_size)
    if mode == "constant":
        return _cached_importance(roi_size, mode, ())
    scales = tuple(per_axis(sigma_scale, "sigma_scale"))
    if any(scale is None or not scale > 0 for scale in scales):
        raise ValueError(f"sigma_scale must be positive for gaussian mode, got {sigma_scale!r}")
    return _cached_importance(roi_size, mode, tuple(float(scale) for scale in scales))


@functools.lru_cache(maxsize=16)
def _cached_importance(roi_size: tuple[int, ...], mode: str, sigma_scale: tuple[float, ...]) -> np.ndarray:
    if mode == "constant":
        weights = np.ones(roi_size, np.float64)
    else:
        sigmas = [scale * size for scale, size in zip(sigma_scale, roi_size)]
        # separable gaussian: one 1D profile per axis, centred between voxels for even sizes
        profiles = [
            np.exp(-((np.arange(size) - (size - 1) / 2.0) ** 2) / (2 * sigma**2))
            for size, sigma in zip(roi_size, sigmas)
        ]
        weights = profiles[0][:, None, None] * profiles[1][None, :, None] * profiles[2][None, None, :]
    weights = weights.astype(np.float32)
    weights = np.maximum(weights, max(float(weights.min()), MIN_IMPORTANCE))
    weights.flags.writeable = False  # shared by every call with these arguments
    return weights


def check_choice(value: str, choices: Sequence[str], name: str) -> str:
    lowered = str(value).lower()
    if lowered not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return lowered


def number_of_windows(
    image_size: Sequence[int], roi_size: int | Sequence[int], overlap: float | Sequence[float] = 0.25
) -> int:
    """How many windows cover one image (the predictor sees batch × this many in total).

    Example:
        >>> number_of_windows((96, 96, 96), 48, 0.25)
        27
    """
    roi = resolve_roi_size(roi_size, image_size)
    padded = tuple(max(i, r) for i, r in zip(image_size, roi))
    return len(window_starts(padded, roi, scan_intervals(padded, roi, overlap)))
