"""Full-volume segmentation metrics (numpy/scipy): per-class Dice and 95% Hausdorff distance.

Used on whole validation volumes after sliding-window inference and argmax, so inputs are integer
label maps of the same shape (e.g. (X, Y, Z)).

Example:
```python
dice = dice_per_class(prediction, target, num_classes=3)          # classes 1 and 2
hd95 = hausdorff_distance_95(prediction, target, 3, spacing=(1.0, 1.0, 2.5))
metrics = SegmentationMetrics(3, hd95=True, class_names=["background", "edema", "tumour"])
metrics.update(prediction, target, spacing=(1.0, 1.0, 2.5), case_id="case_007")
print(metrics.result()["mean_dice"])
```
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage


def _label_maps(prediction, target, num_classes: int):
    """Both maps as int64 arrays of one shape with labels in [0, num_classes)."""
    prediction, target = np.asarray(prediction), np.asarray(target)
    if prediction.shape != target.shape:
        raise ValueError(f"prediction shape {prediction.shape} differs from target shape {target.shape}")
    if num_classes < 1:
        raise ValueError("num_classes must be >= 1")
    maps = []
    for name, array in (("prediction", prediction), ("target", target)):
        if not (np.issubdtype(array.dtype, np.integer) or array.dtype == bool):
            if not np.array_equal(array, np.round(array)):
                raise ValueError(f"{name} must hold integer class labels")
        array = array.astype(np.int64)
        if array.size and (array.min() < 0 or array.max() >= num_classes):
            raise ValueError(f"{name} labels must lie in [0, {num_classes}), got [{array.min()}, {array.max()}]")
        maps.append(array)
    return maps


def _classes(num_classes: int, include_background: bool) -> range:
    return range(0 if include_background else 1, num_classes)


def dice_per_class(prediction, target, num_classes: int, include_background: bool = False) -> np.ndarray:
    """Dice 2|P∩G| / (|P| + |G|) of each class in two label maps.

    A class absent from both maps gives NaN (nothing to score, MONAI `ignore_empty`); a class absent
    from the target but predicted gives 0.

    Args:
        prediction: integer label map (after argmax).
        target: integer label map of the same shape.
        num_classes: number of classes, background (0) included.
        include_background: also report class 0.

    Returns:
        float64 array, one entry per class (classes 1..num_classes-1 unless include_background).

    Example:
    ```python
    dice_per_class(np.array([[0, 1]]), np.array([[1, 1]]), num_classes=2)   # array([0.6667])
    ```
    """
    prediction, target = _label_maps(prediction, target, num_classes)
    # one pass over the volume: confusion[t, p] counts voxels of target class t predicted as p
    confusion = np.bincount((target * num_classes + prediction).ravel(), minlength=num_classes ** 2)
    confusion = confusion.reshape(num_classes, num_classes)
    intersection = np.diag(confusion).astype(np.float64)
    total = confusion.sum(axis=0) + confusion.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        dice = np.where(total > 0, 2.0 * intersection / total, np.nan)
    return dice[list(_classes(num_classes, include_background))]


def _nanmean(values) -> float:
    """Mean of the non-NaN values; NaN (without a RuntimeWarning) when there are none."""
    values = np.asarray(values, dtype=np.float64)
    finite = values[~np.isnan(values)]
    return float(finite.mean()) if finite.size else float("nan")


def mean_dice(per_class) -> float:
    """Mean of per-class Dice values ignoring NaN (absent classes); NaN if all are NaN.

    Example:
    ```python
    mean_dice([0.8, np.nan, 0.6])   # 0.7
    ```
    """
    return _nanmean(per_class)


def _bounding_box(mask: np.ndarray) -> tuple[slice, ...]:
    box = []
    for axis in range(mask.ndim):
        other_axes = tuple(a for a in range(mask.ndim) if a != axis)
        indices = np.flatnonzero(mask.any(axis=other_axes))
        box.append(slice(indices[0], indices[-1] + 1))
    return tuple(box)


def _surface(mask: np.ndarray) -> np.ndarray:
    """Mask voxels with a face neighbour outside the mask (voxels outside the volume count as outside)."""
    return mask & ~ndimage.binary_erosion(mask, border_value=0)


def surface_distance_percentile(prediction_mask, target_mask, spacing=None, percentile: float = 95.0) -> float:
    """Symmetric percentile Hausdorff distance between the surfaces of two binary masks, in mm.

    The larger of the two directed distances (percentile of the distances from each prediction
    surface voxel to the nearest target surface voxel, and the reverse), as MONAI
    `compute_hausdorff_distance(percentile=95)`. NaN when either mask is empty.

    Args:
        prediction_mask, target_mask: boolean arrays of one shape.
        spacing: voxel size per axis in mm (default 1 mm).
        percentile: 100 gives the classic Hausdorff distance.

    Example:
    ```python
    surface_distance_percentile(label == 1, prediction == 1, spacing=(1.0, 1.0, 3.0))
    ```
    """
    prediction_mask, target_mask = np.asarray(prediction_mask, bool), np.asarray(target_mask, bool)
    spacing = np.ones(prediction_mask.ndim) if spacing is None else np.asarray(spacing, np.float64)
    if spacing.shape != (prediction_mask.ndim,):
        raise ValueError(f"spacing {tuple(spacing)} does not match {prediction_mask.ndim} dimensions")
    if not prediction_mask.any() or not target_mask.any():
        return float("nan")
    # Work in the bounding box of both masks, padded by one empty voxel: every surface voxel lies
    # inside it, so distances are exact, and the zero padding plays the role of erosion's border.
    box = _bounding_box(prediction_mask | target_mask)
    prediction_surface = _surface(np.pad(prediction_mask[box], 1))
    target_surface = _surface(np.pad(target_mask[box], 1))
    # distance_transform_edt gives each voxel's distance to the nearest zero, i.e. to the surface
    to_target = ndimage.distance_transform_edt(~target_surface, sampling=spacing)[prediction_surface]
    to_prediction = ndimage.distance_transform_edt(~prediction_surface, sampling=spacing)[target_surface]
    return float(max(np.percentile(to_target, percentile), np.percentile(to_prediction, percentile)))


def hausdorff_distance_95(prediction, target, num_classes: int, spacing=(1.0, 1.0, 1.0),
                          include_background: bool = False) -> np.ndarray:
    """Per-class symmetric 95th-percentile Hausdorff distance (mm) between two label maps.

    Args:
        prediction: integer label map (after argmax).
        target: integer label map of the same shape.
        num_classes: number of classes, background (0) included.
        spacing: voxel size per axis in mm.
        include_background: also report class 0.

    Returns:
        float64 array, one entry per class; NaN where the class is absent from either map.

    Example:
    ```python
    hausdorff_distance_95(prediction, target, num_classes=3, spacing=(0.8, 0.8, 2.0))
    ```
    """
    prediction, target = _label_maps(prediction, target, num_classes)
    return np.array([surface_distance_percentile(prediction == c, target == c, spacing, 95.0)
                     for c in _classes(num_classes, include_background)], dtype=np.float64)


class SegmentationMetrics:
    """Accumulates per-case Dice (and optionally HD95) over a validation set.

    `result()` reports, per class, the mean over cases ignoring NaN (cases where the class is
    absent), and `mean_dice` / `mean_hd95` as the mean of those per-class values, so every class
    weighs the same whatever its number of cases.

    Args:
        num_classes: number of classes, background (0) included.
        include_background: also score class 0.
        hd95: also compute the 95% Hausdorff distance (slower: two distance transforms per class).
        class_names: one name per class (background included) for readable keys such as
            `dice_tumour`; optional.

    Example:
    ```python
    metrics = SegmentationMetrics(3, class_names=["background", "liver", "tumour"])
    for case_id, prediction, target in cases:
        metrics.update(prediction, target, case_id=case_id)
    metrics.result()   # {'dice_per_class': [...], 'mean_dice': ..., 'dice_liver': ..., ...}
    ```
    """

    def __init__(self, num_classes: int, include_background: bool = False, hd95: bool = False,
                 class_names=None):
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"got {len(class_names)} class names for {num_classes} classes")
        self.num_classes = int(num_classes)
        self.include_background = bool(include_background)
        self.hd95 = bool(hd95)
        self.class_names = list(class_names) if class_names is not None else None
        self.classes = list(_classes(self.num_classes, self.include_background))
        self.per_case: list[dict] = []

    def reset(self) -> None:
        self.per_case = []

    def _named(self, prefix: str, values) -> dict:
        if self.class_names is None:
            return {}
        return {f"{prefix}_{self.class_names[c]}": float(v) for c, v in zip(self.classes, values)}

    def _summary(self, dice, hd95) -> dict:
        summary = {"dice_per_class": [float(v) for v in dice], "mean_dice": mean_dice(dice)}
        summary.update(self._named("dice", dice))
        if self.hd95:
            summary.update(hd95_per_class=[float(v) for v in hd95], mean_hd95=_nanmean(hd95))
            summary.update(self._named("hd95", hd95))
        return summary

    def update(self, prediction, target, spacing=None, case_id=None) -> dict:
        """Scores one case and returns its entry of `per_case`.

        Args:
            prediction: integer label map (after argmax).
            target: integer label map of the same shape.
            spacing: voxel size in mm for HD95 (default 1 mm per axis).
            case_id: optional identifier kept in the entry.
        """
        dice = dice_per_class(prediction, target, self.num_classes, self.include_background)
        hd95 = None
        if self.hd95:
            spacing = (1.0,) * np.ndim(prediction) if spacing is None else spacing
            hd95 = hausdorff_distance_95(prediction, target, self.num_classes, spacing, self.include_background)
        entry = {"case_id": case_id, **self._summary(dice, hd95)}
        self.per_case.append(entry)
        return entry

    def result(self) -> dict:
        """Per-class means over the cases so far, their mean, and `num_cases` (NaN when empty)."""
        def per_class(key):
            if not self.per_case:
                return np.full(len(self.classes), np.nan)
            table = np.array([case[key] for case in self.per_case], dtype=np.float64)
            return np.array([_nanmean(column) for column in table.T])

        hd95 = per_class("hd95_per_class") if self.hd95 else None
        return {**self._summary(per_class("dice_per_class"), hd95), "num_cases": len(self.per_case)}
