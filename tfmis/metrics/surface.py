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

Memory: HD95 and NSD come from one pair of distances (`surface_scores`), computed in the bounding box of both
masks padded by one voxel (every surface voxel lies inside it, so the distances are exact), with only the
distance transform's feature transform held (`distances_to_surface`: 12 bytes per voxel of that box instead of
about 50), one direction at a time, each direction's distances reduced to their percentile and count within the
tolerance before the next. `tfmis.metrics.segmentation` builds each structure's masks inside its box only.

Example:
```python
surface_dice(prediction == 1, label == 1, tolerance_mm=2.0, spacing=(0.8, 0.8, 3.0))
surface_distance_percentile(prediction == 1, label == 1, spacing=(0.8, 0.8, 3.0))   # HD95
hd95, nsd = surface_scores(prediction == 1, label == 1, spacing=(0.8, 0.8, 3.0), tolerance_mm=2.0)  # one pass
```
"""

from __future__ import annotations

import math

import numpy as np
from scipy import ndimage

from tfmis.metrics.boxes import mask_box, union_box

QUERY_SLICES = 32  # slices of a box whose surface voxels look up their nearest feature at a time


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


def off_surface(mask: np.ndarray) -> np.ndarray:
    """`~surface(mask)`: True off the mask's surface (outside the mask or inside its erosion), which is what the
    distance transform takes, built without a second temporary of the mask's size.

    Example:
    ```python
    off_surface(np.ones((3, 3, 3), bool)).sum()   # 1: the centre voxel
    ```
    """
    mask = np.asarray(mask, bool)
    off = ndimage.binary_erosion(mask, border_value=0)
    off |= ~mask
    return off


def _nearest_distances(off_points: np.ndarray, off_features: np.ndarray, spacing) -> np.ndarray:
    """`distances_to_surface(~off_points, ~off_features, spacing)`, from the complements (`off_surface`'s), so that
    the distance transform takes `off_features` as it is and the points are read a few slices at a time."""
    spacing = np.asarray(spacing, np.float64)
    nearest = ndimage.distance_transform_edt(
        off_features, sampling=spacing, return_distances=False, return_indices=True
    )  # (ndim, *shape) int32: the nearest feature voxel of every voxel
    distances = []
    for start in range(0, off_points.shape[0], QUERY_SLICES):
        where = np.nonzero(~off_points[start : start + QUERY_SLICES])
        where = (where[0] + start, *where[1:])
        squared = None
        for axis, index in enumerate(where):  # distance_transform_edt's arithmetic, at these voxels only
            offset = (nearest[axis][where] - index).astype(np.float64)
            offset *= spacing[axis]
            offset *= offset
            squared = offset if squared is None else np.add(squared, offset, out=squared)
        distances.append(np.sqrt(squared, out=squared))
    del nearest  # before the distances are joined
    return np.concatenate(distances) if distances else np.zeros(0)


def distances_to_surface(points: np.ndarray, features: np.ndarray, spacing) -> np.ndarray:
    """The distance in mm from each voxel of `points` (in C order) to the nearest voxel of `features`: boolean
    arrays of one shape, `features` holding at least one voxel; float64.

    scipy's exact Euclidean distance transform of `~features` with `sampling=spacing`, of which only the feature
    transform is kept (the nearest feature voxel of every voxel, int32 per axis: 12 bytes per voxel). The distances
    are then computed at `points` alone, a few slices at a time, with the arithmetic `distance_transform_edt`
    applies to every voxel (index offset as float64, times the spacing, squared, summed over the axes in order,
    square root): the same numbers as `distance_transform_edt(~features, sampling=spacing)[points]`, without its
    whole-array float64 offsets and distances (about 50 bytes per voxel).

    Example:
    ```python
    distances_to_surface(surface(a), surface(b), spacing=(0.8, 0.8, 2.0))   # from a's surface to b's
    ```
    """
    return _nearest_distances(~np.asarray(points, bool), ~np.asarray(features, bool), spacing)


def surface_distances(prediction_mask, target_mask, spacing=None) -> tuple[np.ndarray, np.ndarray]:
    """(distance of each prediction surface voxel to the target's surface, and the reverse), in mm.

    Both masks must hold at least one voxel (each then has a surface). Float64, in the voxels' C order. Computed in
    the bounding box of both masks padded by one empty voxel: every surface voxel lies inside it, so the distances
    are exact, and the padding plays the role of erosion's border.

    Example:
    ```python
    to_target, to_prediction = surface_distances(prediction == 1, label == 1, spacing=(1.0, 1.0, 2.5))
    ```
    """
    prediction_mask, target_mask, spacing = _masks_and_spacing(prediction_mask, target_mask, spacing)
    prediction_box, target_box = mask_box(prediction_mask), mask_box(target_mask)
    if prediction_box is None or target_box is None:
        raise ValueError("surface distances need two non-empty masks")
    box = union_box(prediction_box, target_box)
    off_prediction = off_surface(np.pad(prediction_mask[box], 1))
    off_target = off_surface(np.pad(target_mask[box], 1))
    return distances_between_surfaces(off_prediction, off_target, spacing)


def distances_between_surfaces(off_prediction, off_target, spacing) -> tuple[np.ndarray, np.ndarray]:
    """`surface_distances` from `off_surface` of both masks in a box holding both, padded by one voxel: one
    feature transform per direction, one after the other (the box's two boolean arrays, the transform's int8
    input and its int32 feature transform: about 15 bytes per voxel of the box at the peak)."""
    to_target = _nearest_distances(off_prediction, off_target, spacing)
    to_prediction = _nearest_distances(off_target, off_prediction, spacing)
    return to_target, to_prediction


def check_tolerance(tolerance_mm) -> float:
    """A tolerance as a float; ValueError unless finite and >= 0 (MONAI's `class_thresholds` rule)."""
    tolerance = float(tolerance_mm)
    if not math.isfinite(tolerance) or tolerance < 0:
        raise ValueError(f"an NSD tolerance is a finite distance >= 0 mm, got {tolerance_mm}")
    return tolerance


def empty_mask_scores(has_prediction: bool, has_target: bool, percentile=95.0, tolerance_mm=None):
    """(HD, NSD) as MONAI when a mask is empty: (NaN, NaN) when both are (nothing to measure), (inf, 0.0) when one
    is (a missed or spurious structure is infinitely far off); None for a score not asked for (`percentile` or
    `tolerance_mm` None)."""
    both = has_prediction == has_target
    return (
        None if percentile is None else (math.nan if both else math.inf),
        None if tolerance_mm is None else (math.nan if both else 0.0),
    )


def _directed_summary(distances, percentile, tolerance):
    """(percentile of one direction's distances or None, how many lie within `tolerance` or None, how many)."""
    return (
        None if percentile is None else np.percentile(distances, percentile),
        None if tolerance is None else np.count_nonzero(distances <= tolerance),
        distances.size,
    )


def _scores_from_summaries(first, second, percentile, tolerance):
    """(HD, NSD) from the two directions' `_directed_summary`: the larger percentile, and the share of both surfaces
    within the tolerance."""
    hd = None if percentile is None else float(max(first[0], second[0]))
    nsd = None if tolerance is None else float((first[1] + second[1]) / (first[2] + second[2]))
    return hd, nsd


def surface_scores_in_box(off_prediction, off_target, spacing, percentile=95.0, tolerance_mm=None):
    """(percentile Hausdorff distance, NSD) from `off_surface` of two non-empty masks in a box holding both, padded by
    one voxel (`distances_between_surfaces`' distances); None for a score not asked for (`percentile` or
    `tolerance_mm` None). Each direction's distances are reduced to their percentile and their count within the
    tolerance before the other direction's feature transform is made, so they are never held next to it."""
    tolerance = None if tolerance_mm is None else check_tolerance(tolerance_mm)
    first = _directed_summary(_nearest_distances(off_prediction, off_target, spacing), percentile, tolerance)
    second = _directed_summary(_nearest_distances(off_target, off_prediction, spacing), percentile, tolerance)
    return _scores_from_summaries(first, second, percentile, tolerance)


def surface_scores(prediction_mask, target_mask, spacing=None, percentile=95.0, tolerance_mm=None):
    """(percentile Hausdorff distance, NSD) of two binary masks from ONE pair of surface distances: the values of
    `surface_distance_percentile` and `surface_dice` for the distance transforms of one of them. A score is None
    when its parameter is (`percentile=None` or `tolerance_mm=None`).

    Example:
    ```python
    hd95, nsd = surface_scores(prediction == 1, label == 1, spacing=(0.8, 0.8, 2.0), tolerance_mm=2.0)
    ```
    """
    if tolerance_mm is not None:
        check_tolerance(tolerance_mm)
    prediction_mask, target_mask, spacing = _masks_and_spacing(prediction_mask, target_mask, spacing)
    has_prediction, has_target = bool(prediction_mask.any()), bool(target_mask.any())
    if not has_prediction or not has_target:
        return empty_mask_scores(has_prediction, has_target, percentile, tolerance_mm)
    if percentile is None and tolerance_mm is None:
        return None, None
    box = union_box(mask_box(prediction_mask), mask_box(target_mask))
    off_prediction = off_surface(np.pad(prediction_mask[box], 1))
    off_target = off_surface(np.pad(target_mask[box], 1))
    return surface_scores_in_box(off_prediction, off_target, spacing, percentile, tolerance_mm)


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
    return surface_scores(prediction_mask, target_mask, spacing, percentile=percentile)[0]


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
    return surface_scores(prediction_mask, target_mask, spacing, percentile=None, tolerance_mm=tolerance_mm)[1]
