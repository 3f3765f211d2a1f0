"""Surface metrics of binary masks (numpy/scipy): the one definition of a mask's surface, the distances
between two surfaces, the percentile Hausdorff distance (HD95) and the normalised surface Dice (NSD).

Conventions are MONAI 1.6's (`monai.metrics.utils.get_mask_edges` / `get_surface_distance`, used by both
`compute_hausdorff_distance` and `compute_surface_dice` with their defaults, `use_subvoxels=False`):

- **surface** of a mask: its voxels with at least one of their 2·ndim face neighbours (6 in 3D; scipy's
  `binary_erosion` default structure) outside the mask, `mask ^ binary_erosion(mask)`. Voxels outside
  the volume count as outside, so a mask touching the border has a surface there (MONAI crops to the
  masks' bounding box with a margin of one and pads beyond the volume, which does the same).
- **distances**: from each surface voxel of one mask to the nearest surface voxel of the other, by the
  exact Euclidean distance transform with `sampling=spacing`, so anisotropic voxels are measured in mm
  (centre to centre).
- a surface's **size** is its number of voxels: every surface voxel weighs one. DeepMind's
  surface-distance `compute_surface_dice_at_tolerance` (MONAI's `use_subvoxels=True`) instead weighs
  each surface element by its area and places surfaces between voxels; the two differ by a few percent on
  coarse or anisotropic grids (MONAI issue #4103), so compare NSD values only within one convention.

Example:
```python
surface_dice(prediction == 1, label == 1, tolerance_mm=2.0, spacing=(0.8, 0.8, 3.0))
surface_distance_percentile(prediction == 1, label == 1, spacing=(0.8, 0.8, 3.0))   # HD95
```
"""

from __future__ import annotations

import math

import numpy as np
from scipy import ndimage


def _bounding_box(mask: np.ndarray) -> tuple[slice, ...]:
    box = []
    for axis in range(mask.ndim):
        other_axes = tuple(a for a in range(mask.ndim) if a != axis)
        indices = np.flatnonzero(mask.any(axis=other_axes))
        box.append(slice(indices[0], indices[-1] + 1))
    return tuple(box)


def surface(mask: np.ndarray) -> np.ndarray:
    """Mask voxels with a face neighbour outside the mask (voxels outside the volume count as outside).

    Example:
    ```python
    surface(np.ones((3, 3, 3), bool)).sum()   # 26: all but the centre voxel
    ```
    """
    mask = np.asarray(mask, bool)
    return mask & ~ndimage.binary_erosion(mask, border_value=0)


def _masks_and_spacing(prediction_mask, target_mask, spacing):
    prediction_mask, target_mask = np.asarray(prediction_mask, bool), np.asarray(target_mask, bool)
    if prediction_mask.shape != target_mask.shape:
        raise ValueError(f"mask shapes differ: {prediction_mask.shape} and {target_mask.shape}")
    spacing = np.ones(prediction_mask.ndim) if spacing is None else np.asarray(spacing, np.float64)
    if spacing.shape != (prediction_mask.ndim,):
        raise ValueError(f"spacing {tuple(spacing)} does not match {prediction_mask.ndim} dimensions")
    return prediction_mask, target_mask, spacing


def surface_distances(prediction_mask, target_mask, spacing=None) -> tuple[np.ndarray, np.ndarray]:
    """(distance of each prediction surface voxel to the target's surface, and the reverse), in mm.

    Both masks must hold at least one voxel (each then has a surface). Float64, in the voxels' C order.

    Example:
    ```python
    to_target, to_prediction = surface_distances(prediction == 1, label == 1, spacing=(1.0, 1.0, 2.5))
    ```
    """
    prediction_mask, target_mask, spacing = _masks_and_spacing(prediction_mask, target_mask, spacing)
    if not prediction_mask.any() or not target_mask.any():
        raise ValueError("surface distances need two non-empty masks")
    # Work in the bounding box of both masks, padded by one empty voxel: every surface voxel lies
    # inside it, so distances are exact, and the zero padding plays the role of erosion's border.
    box = _bounding_box(prediction_mask | target_mask)
    prediction_surface = surface(np.pad(prediction_mask[box], 1))
    target_surface = surface(np.pad(target_mask[box], 1))
    # distance_transform_edt gives each voxel's distance to the nearest zero, i.e. to the surface
    to_target = ndimage.distance_transform_edt(~target_surface, sampling=spacing)[prediction_surface]
    to_prediction = ndimage.distance_transform_edt(~prediction_surface, sampling=spacing)[target_surface]
    return to_target, to_prediction


def surface_distance_percentile(prediction_mask, target_mask, spacing=None, percentile: float = 95.0) -> float:
    """Symmetric percentile Hausdorff distance between the surfaces of two binary masks, in mm.

    The larger of the two directed distances (percentile of the distances from each prediction
    surface voxel to the nearest target surface voxel, and the reverse), as MONAI
    `compute_hausdorff_distance(percentile=95)`. As there: inf when exactly one mask is empty (a
    missed or spurious structure is infinitely far off), NaN when both are (nothing to measure).

    Args:
        prediction_mask, target_mask: boolean arrays of one shape.
        spacing: voxel size per axis in mm (default 1 mm).
        percentile: 100 gives the classic Hausdorff distance.

    Example:
    ```python
    surface_distance_percentile(label == 1, prediction == 1, spacing=(1.0, 1.0, 3.0))
    ```
    """
    prediction_mask, target_mask, spacing = _masks_and_spacing(prediction_mask, target_mask, spacing)
    if not prediction_mask.any() or not target_mask.any():
        return float("nan") if prediction_mask.any() == target_mask.any() else float("inf")
    to_target, to_prediction = surface_distances(prediction_mask, target_mask, spacing)
    return float(max(np.percentile(to_target, percentile), np.percentile(to_prediction, percentile)))


def check_tolerance(tolerance_mm) -> float:
    """A tolerance as a float; ValueError unless finite and >= 0 (MONAI's `class_thresholds` rule)."""
    tolerance = float(tolerance_mm)
    if not math.isfinite(tolerance) or tolerance < 0:
        raise ValueError(f"an NSD tolerance is a finite distance >= 0 mm, got {tolerance_mm}")
    return tolerance


def surface_dice(prediction_mask, target_mask, tolerance_mm: float, spacing=None) -> float:
    """Normalised surface Dice (NSD) of two binary masks at a tolerance in mm, as MONAI `compute_surface_dice`.

    NSD = (|prediction surface within tolerance of the target's| + |target surface within tolerance of the
    prediction's|) / (|prediction surface| + |target surface|): the share of both surfaces that lies at
    most `tolerance_mm` (inclusive, `d <= tolerance`) from the other, surfaces and distances as in the
    module docstring (voxel counts, Euclidean distances in mm with `spacing`). In [0, 1].

    Empty masks, as MONAI: NaN when both are empty (no surface to score; means leave it out), 0.0 when
    exactly one is (every voxel of the other surface is infinitely far off). Unlike Dice with
    `ignore_empty`, a structure predicted where the ground truth has none therefore scores 0, not NaN.

    Distances are float64 here; MONAI compares float32 ones, so a distance within ~1e-7 (relative) of
    the tolerance may count differently there.

    Args:
        prediction_mask, target_mask: boolean arrays of one shape.
        tolerance_mm: the accepted deviation of a surface, >= 0 (the MSD set one per task and class).
        spacing: voxel size per axis in mm (default 1 mm, i.e. the tolerance is then in voxels).

    Example:
    ```python
    a = np.zeros((8, 8, 8), bool)
    a[2:6, 2:6, 2:6] = True
    b = np.roll(a, 1, axis=2)  # one slice (2.5 mm) on: the end faces are 2.5 mm off, the rest is on b's surface
    surface_dice(a, b, tolerance_mm=2.0, spacing=(1, 1, 2.5))  # 5/7
    surface_dice(a, b, tolerance_mm=2.5, spacing=(1, 1, 2.5))  # 1.0
    ```
    """
    tolerance = check_tolerance(tolerance_mm)
    prediction_mask, target_mask, spacing = _masks_and_spacing(prediction_mask, target_mask, spacing)
    if not prediction_mask.any() or not target_mask.any():
        return float("nan") if prediction_mask.any() == target_mask.any() else 0.0
    to_target, to_prediction = surface_distances(prediction_mask, target_mask, spacing)
    within = np.count_nonzero(to_target <= tolerance) + np.count_nonzero(to_prediction <= tolerance)
    return float(within / (to_target.size + to_prediction.size))
