"""Full-volume segmentation metrics (numpy/scipy): per-class and per-region Dice, 95% Hausdorff distance
and normalised surface Dice (NSD; the surfaces and distances are `tfmis.metrics.surface`'s).

Used on whole validation volumes after sliding-window inference and argmax, so inputs are integer
label maps of the same shape (e.g. (X, Y, Z)).

Empty classes follow MONAI (1.6): a class absent from the ground truth has Dice NaN and is left out
of every mean (`DiceMetric(ignore_empty=True)`), whatever the prediction holds; its HD95 is inf when
exactly one of prediction / ground truth holds the class and NaN when neither does
(`compute_hausdorff_distance`), and means leave out NaN only, so one missed case makes the class's mean
HD95 inf. The accumulator also counts these cases so that they stay visible. (MONAI 1.6's
`percentile=95` path returns NaN instead of inf for a miss, an artefact of interpolating between
infinities that drops misses from its mean: MONAI issue #9095. Its `percentile=None` path, its tests
and the proposed fix give inf, as here.) NSD is NaN when neither map holds the class and 0 when exactly
one does (`compute_surface_dice`).

Memory: label maps stay as stored (uint8 / uint16; other integer or integral float maps are checked and cast to
the smallest unsigned type, a slab at a time for floats); the confusion counts are built `SLAB_SLICES` slices at a
time; each class's or region's masks are built one structure at a time and only inside the bounding box of its
voxels in both maps (found slab by slab), where HD95 and NSD share one pair of surface distances
(`tfmis.metrics.surface.surface_scores`). So the only whole-volume allocation is the cast of a map not stored as
uint8 / uint16; the rest is a slab's or a box's: a structure's padded masks and surfaces and the distance transform's
int32 feature transform, about 15 bytes per voxel of the box (a structure spread over the whole volume makes that the
volume).

Regions are label unions scored like classes on the unioned masks: BraTS's whole tumour, tumour core and
enhancing tumour are {1, 2, 3}, {2, 3} and {3} in MSD Task01's labels (BraTS's own: {1, 2, 4}, {1, 4}, {4}).

Example:
```python
dice = dice_per_class(prediction, target, num_classes=3)          # classes 1 and 2
hd95 = hausdorff_distance_95(prediction, target, 3, spacing=(1.0, 1.0, 2.5))
metrics = SegmentationMetrics(3, hd95=True, class_names=["background", "edema", "tumour"])
metrics.update(prediction, target, spacing=(1.0, 1.0, 2.5), case_id="case_007")
print(metrics.result()["mean_dice"])
regions = {"whole_tumour": [1, 2, 3], "tumour_core": [2, 3], "enhancing_tumour": [3]}
metrics = SegmentationMetrics(4, regions=regions, nsd=True, nsd_tolerance_mm=1.0)
```
"""

from __future__ import annotations

import re

import numpy as np

from tfmis.metrics.boxes import slab_box, union_box
from tfmis.metrics.surface import check_tolerance, empty_mask_scores, off_surface, surface_scores_in_box

SLAB_SLICES = 32  # slices along the first axis per slab of the whole-map passes (confusion, boxes, casts)


def _slabs(length: int, size: int = SLAB_SLICES):
    for start in range(0, length, size):
        yield slice(start, min(start + size, length))


def _unsigned_dtype(num_classes: int) -> np.dtype:
    """The smallest unsigned integer type holding the labels 0..num_classes-1."""
    return np.dtype(np.uint8 if num_classes <= 2**8 else np.uint16 if num_classes <= 2**16 else np.uint32)


def _label_map(array: np.ndarray, name: str, num_classes: int) -> np.ndarray:
    """One map as an unsigned integer array with labels in [0, num_classes); ValueError naming `name` otherwise.

    uint8 and uint16 maps are returned as they are and booleans viewed as uint8 (no copy); other integer maps are
    cast to the smallest unsigned type after their range is checked; float maps (integral values, e.g. nibabel's
    `get_fdata`) are checked and cast a slab at a time.
    """
    if array.dtype == bool:
        return array.view(np.uint8)
    if np.issubdtype(array.dtype, np.integer):
        if array.size:
            _check_range(name, array.min(), array.max(), num_classes)
        if array.dtype.kind == "u" and array.dtype.itemsize <= 2:
            return array
        return array.astype(_unsigned_dtype(num_classes))
    out = np.empty(array.shape, _unsigned_dtype(num_classes))
    low = high = None
    for s in _slabs(len(array)):
        slab = array[s]
        if not np.array_equal(slab, np.round(slab)):
            raise ValueError(f"{name} must hold integer class labels")
        if slab.size:
            slab_low, slab_high = slab.min(), slab.max()
            low = slab_low if low is None else min(low, slab_low)
            high = slab_high if high is None else max(high, slab_high)
            if 0 <= slab_low and slab_high < num_classes:  # else the range check below fails
                out[s] = slab
    if low is not None:
        _check_range(name, low, high, num_classes)
    return out


def _check_range(name: str, low, high, num_classes: int) -> None:
    if low < 0 or high >= num_classes:
        raise ValueError(f"{name} labels must lie in [0, {num_classes}), got [{low}, {high}]")


def label_maps(prediction, target, num_classes: int):
    """Both maps as unsigned integer arrays of one shape with labels in [0, num_classes) (`_label_map`): uint8 and
    uint16 maps are not copied."""
    prediction, target = np.atleast_1d(np.asarray(prediction)), np.atleast_1d(np.asarray(target))
    if prediction.shape != target.shape:
        raise ValueError(f"prediction shape {prediction.shape} differs from target shape {target.shape}")
    if num_classes < 1:
        raise ValueError("num_classes must be >= 1")
    return [_label_map(array, name, num_classes) for name, array in (("prediction", prediction), ("target", target))]


def _classes(num_classes: int, include_background: bool) -> range:
    return range(0 if include_background else 1, num_classes)


def confusion_matrix(prediction, target, num_classes: int) -> np.ndarray:
    """confusion[t, p]: the number of voxels of target class t predicted as p, `SLAB_SLICES` slices at a time."""
    confusion = np.zeros(num_classes**2, np.int64)
    for s in _slabs(len(prediction)):
        codes = target[s].astype(np.intp)
        codes *= num_classes
        codes += prediction[s]
        confusion += np.bincount(codes.ravel(order="K"), minlength=num_classes**2)
    return confusion.reshape(num_classes, num_classes)


def _voxel_counts(prediction, target, num_classes: int):
    """(intersection, predicted, ground-truth) voxel counts per class, in one pass over the volume."""
    confusion = confusion_matrix(prediction, target, num_classes)
    return np.diag(confusion).astype(np.float64), confusion.sum(axis=0), confusion.sum(axis=1)


def _region_counts(confusion: np.ndarray, regions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(intersection, predicted, ground-truth) voxel counts of each label union, from the class confusion:
    a voxel is in region R's intersection when both its target and its predicted label are in R."""
    counts = np.zeros((3, len(regions)))
    for i, labels in enumerate(regions):
        labels = list(labels)
        counts[:, i] = confusion[np.ix_(labels, labels)].sum(), confusion[:, labels].sum(), confusion[labels].sum()
    return counts[0], counts[1], counts[2]


def check_regions(regions, num_classes: int, class_names=None) -> dict[str, tuple[int, ...]]:
    """Label unions {name: labels} checked against the classes; ValueError naming `validation.regions`.

    Names are identifiers (they become metric keys and CSV columns such as `dice_whole_tumour`) that no
    class name takes; labels are foreground classes of this dataset, each once.
    """
    checked = {}
    for name, labels in dict(regions or {}).items():
        key = f"validation.regions.{name}"
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name):
            raise ValueError(
                f"{key}: a region name is a letter then letters, digits or _ (it names metrics and CSV "
                "columns), e.g. whole_tumour"
            )
        if class_names is not None and name in class_names:
            raise ValueError(f"{key}: '{name}' is also a class name, so dice_{name} would mean both: rename the region")
        labels = list(labels) if isinstance(labels, (list, tuple)) else [labels]
        bad = [v for v in labels if isinstance(v, bool) or not isinstance(v, (int, np.integer))]
        bad += [v for v in labels if v not in bad and not 1 <= v < num_classes]
        if not labels or bad or len(set(labels)) != len(labels):
            raise ValueError(
                f"{key}: expected a list of distinct foreground labels in 1..{num_classes - 1} (the classes it "
                f"unites), got {labels}"
            )
        checked[name] = tuple(int(v) for v in labels)
    return checked


def _in(label_map: np.ndarray, labels) -> np.ndarray:
    """The voxels whose label is one of `labels`, as a union of equalities (np.isin's table would take an int64
    copy of the map)."""
    labels = list(labels)
    mask = label_map == labels[0]
    for label in labels[1:]:
        mask |= label_map == label
    return mask


def region_masks(label_map, labels) -> np.ndarray:
    """The voxels of `label_map` whose label is one of `labels` (a label union, e.g. BraTS's whole tumour)."""
    return _in(np.asarray(label_map), labels)


def _structure_box(label_map: np.ndarray, labels) -> tuple[slice, ...] | None:
    """The bounding box of the voxels labelled with one of `labels`, found a slab at a time; None if there are
    none."""
    return slab_box(label_map, lambda slab: _in(slab, labels), SLAB_SLICES)


def _padded_mask(label_map: np.ndarray, labels, box) -> np.ndarray:
    """The voxels of `box` labelled with one of `labels`, padded by one empty voxel on every side."""
    padded = np.zeros(tuple(s.stop - s.start + 2 for s in box), bool)
    padded[tuple(slice(1, -1) for _ in box)] = _in(label_map[box], labels)
    return padded


def _spacing(spacing, ndim: int) -> np.ndarray:
    spacing = np.ones(ndim) if spacing is None else np.asarray(spacing, np.float64)
    if spacing.shape != (ndim,):
        raise ValueError(f"spacing {tuple(spacing)} does not match {ndim} dimensions")
    return spacing


def _surface_scores(prediction, target, structures, spacing, percentile, tolerances):
    """(HD, NSD) of each structure (a tuple of labels) of two checked label maps, as
    `tfmis.metrics.surface.surface_scores` of its masks: one structure at a time, its masks only inside the
    bounding box of its voxels in both maps, padded by one voxel, and one pair of surface distances for both
    scores. `percentile` None: no HD; a tolerance None: no NSD."""
    spacing = _spacing(spacing, prediction.ndim)
    for labels, tolerance in zip(structures, tolerances):
        prediction_box, target_box = _structure_box(prediction, labels), _structure_box(target, labels)
        if prediction_box is None or target_box is None:
            yield empty_mask_scores(prediction_box is not None, target_box is not None, percentile, tolerance)
            continue
        box = union_box(prediction_box, target_box)
        off_prediction = off_surface(_padded_mask(prediction, labels, box))
        off_target = off_surface(_padded_mask(target, labels, box))
        yield surface_scores_in_box(off_prediction, off_target, spacing, percentile, tolerance)


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
    prediction, target = label_maps(prediction, target, num_classes)
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


def region_dice(prediction, target, num_classes: int, regions, ignore_empty: bool = True) -> np.ndarray:
    """Dice of label unions (regions) in two label maps: 2|P_R ∩ G_R| / (|P_R| + |G_R|) where P_R, G_R hold
    the voxels labelled with any label of region R, with `dice_per_class`'s rule for a region absent from
    the ground truth (NaN with `ignore_empty`).

    Args:
        regions: {name: labels}, e.g. BraTS's {"whole_tumour": [1, 2, 3], "tumour_core": [2, 3],
            "enhancing_tumour": [3]} (MSD Task01 labels: 1 edema, 2 non-enhancing tumour, 3 enhancing).

    Returns:
        float64 array, one entry per region in the mapping's order.

    Example:
    ```python
    region_dice(np.array([[1, 2]]), np.array([[2, 2]]), 3, {"either": [1, 2]})   # array([1.0])
    ```
    """
    regions = check_regions(regions, num_classes)
    prediction, target = label_maps(prediction, target, num_classes)
    counts = _region_counts(confusion_matrix(prediction, target, num_classes), regions.values())
    return _dice_from_counts(*counts, ignore_empty)


def _tolerances(tolerance_mm, count: int, what: str = "class") -> list[float]:
    """One tolerance per scored structure from one number or a list of `count`."""
    if np.ndim(tolerance_mm) == 0:
        return [check_tolerance(tolerance_mm)] * count
    if len(tolerance_mm) != count:
        raise ValueError(f"expected one NSD tolerance or one per {what} ({count}), got {len(tolerance_mm)}")
    return [check_tolerance(t) for t in tolerance_mm]


def normalized_surface_dice(
    prediction, target, num_classes: int, tolerance_mm, spacing=(1.0, 1.0, 1.0), include_background: bool = False
) -> np.ndarray:
    """Per-class normalised surface Dice (NSD) of two label maps, as MONAI `compute_surface_dice`.

    See `tfmis.metrics.surface.surface_dice` for the definition and conventions.

    Args:
        tolerance_mm: one tolerance in mm, or one per scored class (foreground unless include_background).
        spacing: voxel size per axis in mm.

    Returns:
        float64 array, one entry per class; NaN where neither map holds the class, 0 where one does.

    Example:
    ```python
    normalized_surface_dice(prediction, target, num_classes=3, tolerance_mm=[2.0, 1.0], spacing=(0.8, 0.8, 2.0))
    ```
    """
    prediction, target = label_maps(prediction, target, num_classes)
    classes = _classes(num_classes, include_background)
    tolerances = _tolerances(tolerance_mm, len(classes))
    scores = _surface_scores(prediction, target, [(c,) for c in classes], spacing, None, tolerances)
    return np.array([nsd for _, nsd in scores], np.float64)


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
    prediction, target = label_maps(prediction, target, num_classes)
    classes = _classes(num_classes, include_background)
    scores = _surface_scores(prediction, target, [(c,) for c in classes], spacing, 95.0, [None] * len(classes))
    return np.array([hd for hd, _ in scores], np.float64)


def _finite_mean(values) -> float:
    """Mean of the finite values; NaN when there are none."""
    values = np.asarray(values, dtype=np.float64)
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else float("nan")


class SegmentationMetrics:
    """Accumulates per-case Dice (optionally HD95 and NSD, of classes and of label unions) over a validation
    set, with MONAI's semantics.

    Per case and class: Dice as `dice_per_class` (NaN for a class absent from the ground truth, with
    `ignore_empty`), HD95 as `hausdorff_distance_95` (inf when exactly one map holds the class), NSD as
    `normalized_surface_dice` (NaN when neither map holds the class, 0 when one does). Each region (a
    label union, e.g. BraTS's whole tumour) is scored the same way on its unioned masks.

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
    - with `nsd`: `nsd_per_class` / `mean_nsd` and `nsd_<class>`, means leaving out NaN.
    - with `regions`: the same per region under `_per_region` keys (`dice_per_region`, `gt_empty_per_region`,
      `hd95_per_region`, `nsd_per_region`, ...), `dice_<region>` (`hd95_<region>`, `nsd_<region>`) and
      `mean_region_dice` (`mean_region_nsd`), the mean over regions. Class keys and `mean_dice` are the
      same with or without regions.

    Args:
        num_classes: number of classes, background (0) included.
        include_background: also score class 0.
        hd95: also compute the 95% Hausdorff distance (slower: two distance transforms per class and region, in
            the bounding box of its masks; shared with NSD).
        class_names: one name per class (background included) for readable keys such as
            `dice_tumour`; optional.
        ignore_empty: Dice NaN for classes absent from the ground truth (MONAI default); False scores
            them 1.0 if also absent from the prediction, else 0.0.
        regions: {name: labels} label unions to score besides the classes (`check_regions`).
        nsd: also compute the normalised surface Dice (the same two distance transforms as HD95's).
        nsd_tolerance_mm: its tolerance in mm: one number, one per scored class, or one per scored class
            then one per region (without those, a region takes the smallest tolerance of its classes).

    Example:
    ```python
    metrics = SegmentationMetrics(3, class_names=["background", "liver", "tumour"], regions={"both": [1, 2]})
    for case_id, prediction, target in cases:
        metrics.update(prediction, target, case_id=case_id)
    metrics.result()   # {'dice_per_class': [...], 'mean_dice': ..., 'dice_liver': ..., 'dice_both': ..., ...}
    ```
    """

    def __init__(
        self,
        num_classes: int,
        include_background: bool = False,
        hd95: bool = False,
        class_names=None,
        ignore_empty: bool = True,
        regions=None,
        nsd: bool = False,
        nsd_tolerance_mm=None,
    ):
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"got {len(class_names)} class names for {num_classes} classes")
        self.num_classes = int(num_classes)
        self.include_background = bool(include_background)
        self.hd95 = bool(hd95)
        self.nsd = bool(nsd)
        self.ignore_empty = bool(ignore_empty)
        self.class_names = list(class_names) if class_names is not None else None
        self.classes = list(_classes(self.num_classes, self.include_background))
        self.regions = check_regions(regions, self.num_classes, self.class_names)
        self.nsd_tolerances = self._nsd_tolerances(nsd_tolerance_mm) if self.nsd else None
        self.per_case: list[dict] = []
        self._rows: list[dict] = []  # per case: arrays over the classes, then the regions

    def _nsd_tolerances(self, tolerance_mm) -> list[float]:
        if tolerance_mm is None:
            raise ValueError("nsd needs nsd_tolerance_mm (validation.nsd_tolerance_mm): the accepted deviation in mm")
        n, r = len(self.classes), len(self.regions)
        if np.ndim(tolerance_mm) == 1 and len(tolerance_mm) == n + r and r:
            return _tolerances(tolerance_mm, n + r)
        per_class = _tolerances(tolerance_mm, n, "scored class (or one per class, then one per region)")
        by_class = dict(zip(self.classes, per_class))
        return per_class + [min(by_class[label] for label in labels) for labels in self.regions.values()]

    @property
    def keys(self) -> list[str]:
        """The per-structure arrays of a case, in `case_table` order."""
        return ["dice", "gt_empty", "predicted_when_gt_empty"] + ["hd95"] * self.hd95 + ["nsd"] * self.nsd

    @property
    def table_width(self) -> int:
        """Columns of `case_table()`."""
        return len(self.keys) * (len(self.classes) + len(self.regions))

    def reset(self) -> None:
        self.per_case = []
        self._rows = []

    def _named(self, prefix: str, values) -> dict:
        """{prefix_<class>: value} (with class names) then {prefix_<region>: value}, from values over both."""
        names = (
            [self.class_names[c] for c in self.classes] if self.class_names is not None else [None] * len(self.classes)
        )
        names += list(self.regions)
        return {f"{prefix}_{name}": float(v) for name, v in zip(names, values) if name is not None}

    def _split(self, values) -> tuple[list[float], list[float]]:
        n = len(self.classes)
        return [float(v) for v in values[:n]], [float(v) for v in values[n:]]

    def _summary(self, dice, hd95=None, nsd=None) -> dict:
        dice_classes, dice_regions = self._split(dice)
        summary = {"dice_per_class": dice_classes, "mean_dice": mean_dice(dice_classes)}
        summary.update(self._named("dice", dice))
        if self.regions:
            summary.update(dice_per_region=dice_regions, mean_region_dice=_nanmean(dice_regions))
        if self.hd95:
            hd95_classes, hd95_regions = self._split(hd95)
            summary.update(hd95_per_class=hd95_classes, mean_hd95=_nanmean(hd95_classes))
            summary.update(self._named("hd95", hd95))
            if self.regions:
                summary.update(hd95_per_region=hd95_regions)
        if self.nsd:
            nsd_classes, nsd_regions = self._split(nsd)
            summary.update(nsd_per_class=nsd_classes, mean_nsd=_nanmean(nsd_classes))
            summary.update(self._named("nsd", nsd))
            if self.regions:
                summary.update(nsd_per_region=nsd_regions, mean_region_nsd=_nanmean(nsd_regions))
        return summary

    def update(self, prediction, target, spacing=None, case_id=None) -> dict:
        """Scores one case and returns its entry of `per_case`.

        Args:
            prediction: integer label map (after argmax).
            target: integer label map of the same shape.
            spacing: voxel size in mm for HD95 and NSD (default 1 mm per axis).
            case_id: optional identifier kept in the entry.
        """
        prediction, target = label_maps(prediction, target, self.num_classes)
        confusion = confusion_matrix(prediction, target, self.num_classes)
        intersection, predicted, truth = self._counts(confusion)
        row = {
            "dice": _dice_from_counts(intersection, predicted, truth, self.ignore_empty),
            "gt_empty": (truth == 0).astype(np.float64),
            "predicted_when_gt_empty": ((truth == 0) & (predicted > 0)).astype(np.float64),
        }
        if self.hd95 or self.nsd:
            structures = [(c,) for c in self.classes] + list(self.regions.values())
            tolerances = self.nsd_tolerances if self.nsd else [None] * len(structures)
            percentile = 95.0 if self.hd95 else None
            scores = list(_surface_scores(prediction, target, structures, spacing, percentile, tolerances))
            if self.hd95:
                row["hd95"] = np.array([hd for hd, _ in scores], np.float64)
            if self.nsd:
                row["nsd"] = np.array([nsd for _, nsd in scores], np.float64)
        return self._add(case_id, row)

    def _counts(self, confusion):
        """(intersection, predicted, ground-truth) over the scored classes, then the regions."""
        classes = (
            np.diag(confusion)[self.classes],
            confusion.sum(axis=0)[self.classes],
            confusion.sum(axis=1)[self.classes],
        )
        regions = _region_counts(confusion, self.regions.values())
        return tuple(np.concatenate([c.astype(np.float64), r]) for c, r in zip(classes, regions))

    def _add(self, case_id, row: dict) -> dict:
        gt_empty, predicted = (self._split(row[k] > 0.5) for k in ("gt_empty", "predicted_when_gt_empty"))
        entry = {
            "case_id": case_id,
            **self._summary(row["dice"], row.get("hd95"), row.get("nsd")),
            "gt_empty_per_class": [bool(v) for v in gt_empty[0]],
            "predicted_when_gt_empty_per_class": [bool(v) for v in predicted[0]],
        }
        if self.regions:
            entry["gt_empty_per_region"] = [bool(v) for v in gt_empty[1]]
            entry["predicted_when_gt_empty_per_region"] = [bool(v) for v in predicted[1]]
        self.per_case.append(entry)
        self._rows.append(row)
        return entry

    def case_table(self) -> np.ndarray:
        """The cases so far as float64 rows: per key of `keys` (Dice, ground truth empty, predicted when
        empty, then HD95 and NSD when on), its values over the classes then the regions.

        Workers that scored different cases put their rows at the cases' positions in a zero table and sum
        the tables (`Backend.all_reduce_sum`); `add_case_table` turns the sum back into cases (NaN and inf
        survive a sum with zeros).
        """
        return np.array(
            [np.concatenate([np.asarray(row[k], np.float64) for k in self.keys]) for row in self._rows],
            dtype=np.float64,
        ).reshape(len(self._rows), self.table_width)

    def add_case_table(self, table, case_ids=None) -> None:
        """Adds the cases of a `case_table()` (e.g. summed over workers), in row order."""
        width = len(self.classes) + len(self.regions)
        for i, values in enumerate(np.asarray(table, np.float64)):
            row = {k: values[j * width : (j + 1) * width] for j, k in enumerate(self.keys)}
            self._add(None if case_ids is None else case_ids[i], row)

    def result(self) -> dict:
        """Per-class (and per-region) means over the cases so far, their means, the counts above and
        `num_cases` (NaN means and zero counts when there are no cases)."""
        width = len(self.classes) + len(self.regions)

        def table(key):
            if not self._rows:
                return np.zeros((0, width))
            return np.array([row[key] for row in self._rows], dtype=np.float64)

        def per_structure(values, reduce=_nanmean):
            return np.array([reduce(column) for column in values.T])

        def counts(values):
            classes, regions = self._split(values.sum(axis=0))
            return [int(n) for n in classes], [int(n) for n in regions]

        def add_counts(name, values):
            classes, regions = counts(values)
            result[f"{name}_per_class"] = classes
            if self.regions:
                result[f"{name}_per_region"] = regions

        dice = table("dice")
        hd95 = table("hd95") if self.hd95 else None
        nsd = table("nsd") if self.nsd else None
        result = self._summary(
            per_structure(dice),
            per_structure(hd95) if self.hd95 else None,
            per_structure(nsd) if self.nsd else None,
        )
        result["mean_dice_per_case"] = _nanmean([_nanmean(row[: len(self.classes)]) for row in dice])
        add_counts("dice_cases", ~np.isnan(dice))
        add_counts("gt_empty", table("gt_empty"))
        add_counts("predicted_when_gt_empty", table("predicted_when_gt_empty"))
        if self.hd95:
            add_counts("hd95_inf_count", np.isinf(hd95))
            finite_classes, finite_regions = self._split(per_structure(hd95, _finite_mean))
            result.update(hd95_finite_per_class=finite_classes, mean_hd95_finite=_nanmean(finite_classes))
            if self.regions:
                result["hd95_finite_per_region"] = finite_regions
        result["num_cases"] = len(self._rows)
        return result
