"""Full-volume segmentation metrics (numpy/scipy): per-class Dice and 95% Hausdorff distance.

Used on whole validation volumes after sliding-window inference and argmax, so inputs are integer
label maps of the same shape (e.g. (X, Y, Z)).

Empty classes follow MONAI (1.6): a class absent from the ground truth has Dice NaN and is left out
of every mean (`DiceMetric(ignore_empty=True)`), whatever the prediction holds; its HD95 is inf when
exactly one of prediction / ground truth holds the class and NaN when neither does
(`compute_hausdorff_distance`), and means leave out NaN only, so one missed case makes the class's mean
HD95 inf. The accumulator also counts these cases so that they stay visible. (MONAI 1.6's
`percentile=95` path returns NaN instead of inf for a miss, an artefact of interpolating between
infinities that drops misses from its mean: MONAI issue #9095. Its `percentile=None` path, its tests
and the proposed fix give inf, as here.)

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


def _voxel_counts(prediction, target, num_classes: int):
    """(intersection, predicted, ground-truth) voxel counts per class, in one pass over the volume."""
    # confusion[t, p] counts voxels of target class t predicted as p
    confusion = np.bincount((target * num_classes + prediction).ravel(), minlength=num_classes**2)
    confusion = confusion.reshape(num_classes, num_classes)
    return np.diag(confusion).astype(np.float64), confusion.sum(axis=0), confusion.sum(axis=1)


def _dice_from_counts(intersection, predicted, truth, ignore_empty: bool) -> np.ndarray:
    """MONAI `DiceHelper.compute_channel` per class from the voxel counts."""
    with np.errstate(invalid="ignore", divide="ignore"):
        dice = 2.0 * intersection / (predicted + truth)
    empty_truth = truth == 0
    if ignore_empty:
        return np.where(empty_truth, np.nan, dice)
    return np.where(empty_truth, np.where(predicted == 0, 1.0, 0.0), dice)


def dice_per_class(
    prediction, target, num_classes: int, include_background: bool = False, ignore_empty: bool = True
) -> np.ndarray:
    """Dice 2|P∩G| / (|P| + |G|) of each class in two label maps, as MONAI `compute_dice`.

    A class absent from the ground truth has no Dice to measure: NaN with `ignore_empty` (MONAI's
    default; means then leave it out), whatever the prediction holds. Without `ignore_empty` it
    scores 1.0 when the prediction lacks it too and 0.0 when the prediction holds it.

    Args:
        prediction: integer label map (after argmax).
        target: integer label map of the same shape.
        num_classes: number of classes, background (0) included.
        include_background: also report class 0.
        ignore_empty: NaN for classes absent from `target` (MONAI `ignore_empty=True`).

    Returns:
        float64 array, one entry per class (classes 1..num_classes-1 unless include_background).

    Example:
    ```python
    dice_per_class(np.array([[0, 1]]), np.array([[1, 1]]), num_classes=2)   # array([0.6667])
    dice_per_class(np.array([[0, 2]]), np.array([[1, 1]]), num_classes=3)   # array([0.0, nan])
    ```
    """
    prediction, target = _label_maps(prediction, target, num_classes)
    dice = _dice_from_counts(*_voxel_counts(prediction, target, num_classes), ignore_empty)
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
    prediction_mask, target_mask = np.asarray(prediction_mask, bool), np.asarray(target_mask, bool)
    spacing = np.ones(prediction_mask.ndim) if spacing is None else np.asarray(spacing, np.float64)
    if spacing.shape != (prediction_mask.ndim,):
        raise ValueError(f"spacing {tuple(spacing)} does not match {prediction_mask.ndim} dimensions")
    if not prediction_mask.any() or not target_mask.any():
        return float("nan") if prediction_mask.any() == target_mask.any() else float("inf")
    # Work in the bounding box of both masks, padded by one empty voxel: every surface voxel lies
    # inside it, so distances are exact, and the zero padding plays the role of erosion's border.
    box = _bounding_box(prediction_mask | target_mask)
    prediction_surface = _surface(np.pad(prediction_mask[box], 1))
    target_surface = _surface(np.pad(target_mask[box], 1))
    # distance_transform_edt gives each voxel's distance to the nearest zero, i.e. to the surface
    to_target = ndimage.distance_transform_edt(~target_surface, sampling=spacing)[prediction_surface]
    to_prediction = ndimage.distance_transform_edt(~prediction_surface, sampling=spacing)[target_surface]
    return float(max(np.percentile(to_target, percentile), np.percentile(to_prediction, percentile)))


def hausdorff_distance_95(
    prediction, target, num_classes: int, spacing=(1.0, 1.0, 1.0), include_background: bool = False
) -> np.ndarray:
    """Per-class symmetric 95th-percentile Hausdorff distance (mm) between two label maps.

    Args:
        prediction: integer label map (after argmax).
        target: integer label map of the same shape.
        num_classes: number of classes, background (0) included.
        spacing: voxel size per axis in mm.
        include_background: also report class 0.

    Returns:
        float64 array, one entry per class; inf where exactly one map holds the class, NaN where
        neither does (MONAI semantics).

    Example:
    ```python
    hausdorff_distance_95(prediction, target, num_classes=3, spacing=(0.8, 0.8, 2.0))
    ```
    """
    prediction, target = _label_maps(prediction, target, num_classes)
    return np.array(
        [
            surface_distance_percentile(prediction == c, target == c, spacing, 95.0)
            for c in _classes(num_classes, include_background)
        ],
        dtype=np.float64,
    )


def _finite_mean(values) -> float:
    """Mean of the finite values; NaN when there are none."""
    values = np.asarray(values, dtype=np.float64)
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else float("nan")


class SegmentationMetrics:
    """Accumulates per-case Dice (and optionally HD95) over a validation set, with MONAI's semantics.

    Per case and class: Dice as `dice_per_class` (NaN for a class absent from the ground truth, with
    `ignore_empty`), HD95 as `hausdorff_distance_95` (inf when exactly one map holds the class).

    `result()` aggregates like MONAI's metric reductions, leaving out NaN (never inf):

    - `dice_per_class`: per class, the mean over the cases where it was scored (MONAI
      `reduction="mean_batch"`; NaN for a class scored in no case, where MONAI reports 0).
    - `mean_dice`: the mean of those per-class values, so every class weighs the same whatever its
      number of cases (nnU-Net's foreground mean). `mean_dice_per_case` is MONAI's `reduction="mean"`
      instead: the mean over cases of each case's mean over its scored classes.
    - `dice_cases_per_class` (MONAI's `not_nans`), `gt_empty_per_class` (cases whose ground truth
      lacks the class) and `predicted_when_gt_empty_per_class` (of those, the cases where it was
      predicted anyway: false positives that no Dice shows under `ignore_empty`).
    - `hd95_per_class` / `mean_hd95`: means over cases (then classes) with NaN left out and inf kept,
      so one missed (or spurious) class makes them inf; `hd95_inf_count_per_class` counts such cases,
      and `hd95_finite_per_class` / `mean_hd95_finite` average the finite values only.

    Args:
        num_classes: number of classes, background (0) included.
        include_background: also score class 0.
        hd95: also compute the 95% Hausdorff distance (slower: two distance transforms per class).
        class_names: one name per class (background included) for readable keys such as
            `dice_tumour`; optional.
        ignore_empty: Dice NaN for classes absent from the ground truth (MONAI default); False scores
            them 1.0 if also absent from the prediction, else 0.0.

    Example:
    ```python
    metrics = SegmentationMetrics(3, class_names=["background", "liver", "tumour"])
    for case_id, prediction, target in cases:
        metrics.update(prediction, target, case_id=case_id)
    metrics.result()   # {'dice_per_class': [...], 'mean_dice': ..., 'dice_liver': ..., ...}
    ```
    """

    def __init__(
        self,
        num_classes: int,
        include_background: bool = False,
        hd95: bool = False,
        class_names=None,
        ignore_empty: bool = True,
    ):
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"got {len(class_names)} class names for {num_classes} classes")
        self.num_classes = int(num_classes)
        self.include_background = bool(include_background)
        self.hd95 = bool(hd95)
        self.ignore_empty = bool(ignore_empty)
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
        prediction, target = _label_maps(prediction, target, self.num_classes)
        intersection, predicted, truth = (c[self.classes] for c in _voxel_counts(prediction, target, self.num_classes))
        dice = _dice_from_counts(intersection, predicted, truth, self.ignore_empty)
        hd95 = None
        if self.hd95:
            spacing = (1.0,) * np.ndim(prediction) if spacing is None else spacing
            hd95 = hausdorff_distance_95(prediction, target, self.num_classes, spacing, self.include_background)
        return self._add(
            case_id, dice, hd95, [t == 0 for t in truth], [t == 0 and p > 0 for t, p in zip(truth, predicted)]
        )

    def _add(self, case_id, dice, hd95, gt_empty, predicted_when_gt_empty) -> dict:
        entry = {
            "case_id": case_id,
            **self._summary(dice, hd95),
            "gt_empty_per_class": [bool(v) for v in gt_empty],
            "predicted_when_gt_empty_per_class": [bool(v) for v in predicted_when_gt_empty],
        }
        self.per_case.append(entry)
        return entry

    def case_table(self) -> np.ndarray:
        """The cases so far as float64 rows: Dice, ground truth empty, predicted when empty (and HD95) per class.

        Workers that scored different cases put their rows at the cases' positions in a zero table and sum
        the tables (`Backend.all_reduce_sum`); `add_case_table` turns the sum back into cases (NaN and inf
        survive a sum with zeros).
        """
        keys = ["dice_per_class", "gt_empty_per_class", "predicted_when_gt_empty_per_class"]
        keys += ["hd95_per_class"] if self.hd95 else []
        return np.array(
            [np.concatenate([np.asarray(case[k], np.float64) for k in keys]) for case in self.per_case],
            dtype=np.float64,
        ).reshape(len(self.per_case), len(keys) * len(self.classes))

    def add_case_table(self, table, case_ids=None) -> None:
        """Adds the cases of a `case_table()` (e.g. summed over workers), in row order."""
        n = len(self.classes)
        for i, row in enumerate(np.asarray(table, np.float64)):
            hd95 = row[3 * n : 4 * n] if self.hd95 else None
            self._add(
                None if case_ids is None else case_ids[i], row[:n], hd95, row[n : 2 * n] > 0.5, row[2 * n : 3 * n] > 0.5
            )

    def result(self) -> dict:
        """Per-class means over the cases so far, their means, the counts above and `num_cases`
        (NaN means and zero counts when there are no cases)."""

        def table(key):
            if not self.per_case:
                return np.zeros((0, len(self.classes)))
            return np.array([case[key] for case in self.per_case], dtype=np.float64)

        def per_class(values, reduce=_nanmean):
            return np.array([reduce(column) for column in values.T])

        def counts(values):
            return [int(n) for n in values.sum(axis=0)]

        dice = table("dice_per_class")
        hd95 = table("hd95_per_class") if self.hd95 else None
        result = self._summary(per_class(dice), per_class(hd95) if self.hd95 else None)
        per_case_means = [_nanmean(row) for row in dice]
        result.update(
            mean_dice_per_case=_nanmean(per_case_means),
            dice_cases_per_class=counts(~np.isnan(dice)),
            gt_empty_per_class=counts(table("gt_empty_per_class")),
            predicted_when_gt_empty_per_class=counts(table("predicted_when_gt_empty_per_class")),
        )
        if self.hd95:
            finite = per_class(hd95, _finite_mean)
            result.update(
                hd95_inf_count_per_class=counts(np.isinf(hd95)),
                hd95_finite_per_class=[float(v) for v in finite],
                mean_hd95_finite=_nanmean(finite),
            )
        result["num_cases"] = len(self.per_case)
        return result
