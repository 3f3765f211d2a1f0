"""Full-volume Dice and HD95 against values worked out by hand and against MONAI's formulas.

The MONAI references below are NumPy transcriptions of MONAI 1.6.1's `DiceHelper.compute_channel`
(monai/metrics/meandice.py), `do_metric_reduction` (monai/metrics/utils.py) and the empty-mask rules
of `get_surface_distance` / `compute_hausdorff_distance` (monai/metrics/utils.py, hausdorff_distance.py).
"""

import math

import numpy as np
import pytest
from scipy import ndimage
from scipy.spatial.distance import cdist

from tfmis.metrics import SegmentationMetrics, dice_per_class, hausdorff_distance_95, mean_dice
from tfmis.metrics.surface import surface_distance_percentile

nan = float("nan")

# 2×3×1 label maps, classes 0..4 (class 4 appears in neither)
TARGET = np.array([[0, 1, 1], [2, 2, 0]], np.uint8)[..., None]
PREDICTION = np.array([[0, 1, 2], [2, 0, 3]], np.uint8)[..., None]
# class 0: target {(0,0), (1,2)}, predicted {(0,0), (1,1)}, overlap 1 → 2·1 / (2 + 2) = 0.5
# class 1: target {(0,1), (0,2)}, predicted {(0,1)}, overlap 1        → 2·1 / (2 + 1) = 2/3
# class 2: target {(1,0), (1,1)}, predicted {(0,2), (1,0)}, overlap 1 → 2·1 / (2 + 2) = 0.5
# class 3: not in target, predicted once → NaN (MONAI ignore_empty=True), 0 with ignore_empty=False
# class 4: in neither                    → NaN (ignore_empty=True), 1 with ignore_empty=False
EXPECTED_DICE = [0.5, 2 / 3, 0.5, nan, nan]
EXPECTED_DICE_NOT_IGNORING_EMPTY = [0.5, 2 / 3, 0.5, 0.0, 1.0]


def test_dice_per_class_by_hand():
    np.testing.assert_allclose(dice_per_class(PREDICTION, TARGET, 5), EXPECTED_DICE[1:])
    np.testing.assert_allclose(dice_per_class(PREDICTION, TARGET, 5, include_background=True), EXPECTED_DICE)
    np.testing.assert_allclose(
        dice_per_class(PREDICTION, TARGET, 5, include_background=True, ignore_empty=False),
        EXPECTED_DICE_NOT_IGNORING_EMPTY,
    )
    np.testing.assert_allclose(dice_per_class(TARGET, TARGET, 3), [1.0, 1.0])


# ---------------------------------------------------------------- MONAI reference (NumPy transcription)


def monai_compute_channel(prediction_mask, target_mask, ignore_empty=True):
    """MONAI `DiceHelper.compute_channel`: the Dice of one binary channel of one case."""
    y_o = target_mask.sum()
    if y_o > 0:
        return 2.0 * np.sum(target_mask & prediction_mask) / (y_o + prediction_mask.sum())
    if ignore_empty:
        return nan
    return 1.0 if y_o + prediction_mask.sum() <= 0 else 0.0


def monai_dice(predictions, targets, num_classes, include_background=False, ignore_empty=True):
    """MONAI `DiceMetric` before reduction: (cases, classes) after one-hot encoding both label maps."""
    first = 0 if include_background else 1
    return np.array(
        [
            [monai_compute_channel(p == c, t == c, ignore_empty) for c in range(first, num_classes)]
            for p, t in zip(predictions, targets)
        ]
    )


def monai_do_metric_reduction(f, reduction):
    """MONAI `do_metric_reduction` for "mean" and "mean_batch": NaN entries are left out of every mean
    (and a mean over no values is 0, with not_nans = 0)."""
    f = np.array(f, np.float64)
    not_nans = ~np.isnan(f)
    f[~not_nans] = 0.0
    if reduction == "mean_batch":
        count = not_nans.sum(axis=0)
        return np.where(count > 0, f.sum(axis=0) / np.maximum(count, 1), 0.0), count
    assert reduction == "mean"
    count = not_nans.sum(axis=1)
    per_case = np.where(count > 0, f.sum(axis=1) / np.maximum(count, 1), 0.0)
    cases = (count > 0).sum()
    return (per_case.sum() / cases if cases else 0.0), cases


def random_cases(seed, num_cases=6, num_classes=5, shape=(9, 8, 7)):
    """Label maps where each class is often absent from the target, the prediction or both: each map
    draws its voxels from its own random subset of the classes; the prediction keeps 70 % of the target."""
    rng = np.random.default_rng(seed)

    def some_classes():
        return rng.choice(num_classes, size=rng.integers(1, num_classes), replace=False)

    predictions, targets = [], []
    for _ in range(num_cases):
        t = rng.choice(some_classes(), size=shape)
        p = np.where(rng.random(shape) < 0.7, t, rng.choice(some_classes(), size=shape))
        p[np.isin(p, some_classes()[:1])] = 0  # one class (maybe still in the target) never predicted
        predictions.append(p.astype(np.uint8))
        targets.append(t.astype(np.uint8))
    return predictions, targets


@pytest.mark.parametrize("ignore_empty", [True, False])
@pytest.mark.parametrize("include_background", [False, True])
def test_dice_matches_monai_compute_dice_with_empty_classes(ignore_empty, include_background):
    """Per case and class, `dice_per_class` equals MONAI's compute_channel rule: NaN (ignore_empty) or
    1/0 (not ignoring) for a class absent from the ground truth, whatever the prediction holds."""
    predictions, targets = random_cases(seed=0)
    expected = monai_dice(predictions, targets, 5, include_background, ignore_empty)
    actual = np.array(
        [dice_per_class(p, t, 5, include_background, ignore_empty=ignore_empty) for p, t in zip(predictions, targets)]
    )
    np.testing.assert_allclose(actual, expected)
    # the random cases do exercise every branch of MONAI's rule
    first = 0 if include_background else 1
    gt_empty = np.array([[not (t == c).any() for c in range(first, 5)] for t in targets])
    pred_empty = np.array([[not (p == c).any() for c in range(first, 5)] for p in predictions])
    assert (gt_empty & pred_empty).any() and (gt_empty & ~pred_empty).any() and (~gt_empty).any()


def test_accumulator_aggregates_like_monai_reductions():
    """`result()`: per class MONAI "mean_batch" (NaN left out), `mean_dice_per_case` MONAI "mean",
    `mean_dice` the mean of the per-class values, and per-class counts of scored / absent cases."""
    predictions, targets = random_cases(seed=1, num_cases=8)
    metrics = SegmentationMetrics(5)
    for i, (p, t) in enumerate(zip(predictions, targets)):
        metrics.update(p, t, case_id=f"case_{i}")
    result = metrics.result()
    table = monai_dice(predictions, targets, 5)
    per_class, scored = monai_do_metric_reduction(table, "mean_batch")
    # MONAI reports 0 for a class scored in no case; here it is NaN (nothing was measured)
    np.testing.assert_allclose(result["dice_per_class"], np.where(scored > 0, per_class, nan))
    assert result["dice_cases_per_class"] == scored.tolist()
    assert result["mean_dice"] == pytest.approx(np.nanmean(np.where(scored > 0, per_class, nan)))
    assert result["mean_dice_per_case"] == pytest.approx(monai_do_metric_reduction(table, "mean")[0])
    absent = [sum(not (t == c).any() for t in targets) for c in range(1, 5)]
    assert result["gt_empty_per_class"] == absent and sum(absent) > 0
    false_positive = [
        sum(not (t == c).any() and (p == c).any() for p, t in zip(predictions, targets)) for c in range(1, 5)
    ]
    assert result["predicted_when_gt_empty_per_class"] == false_positive and sum(false_positive) > 0
    assert result["num_cases"] == 8


def test_dice_rejects_mismatched_or_out_of_range_labels():
    with pytest.raises(ValueError, match="shape"):
        dice_per_class(PREDICTION, TARGET[:1], 5)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        dice_per_class(PREDICTION, TARGET, 3)  # the prediction holds a 3
    with pytest.raises(ValueError, match="integer"):
        dice_per_class(PREDICTION + 0.5, TARGET, 5)
    # integral floats (as nibabel's get_fdata returns) are fine
    np.testing.assert_allclose(dice_per_class(PREDICTION.astype(float), TARGET, 5), EXPECTED_DICE[1:])


def test_mean_dice_ignores_nan():
    assert mean_dice([2 / 3, 0.5, 0.0, nan]) == pytest.approx((2 / 3 + 0.5 + 0.0) / 3)
    with np.errstate(all="raise"):  # no RuntimeWarning for an all-NaN mean
        assert math.isnan(mean_dice([nan, nan]))
    assert math.isnan(mean_dice([]))


def test_hd95_of_single_voxels_with_anisotropic_spacing():
    # one voxel each (its own surface), 3 voxels apart along z of 3 mm → 9 mm both ways
    prediction = np.zeros((6, 6, 8), np.uint8)
    target = np.zeros_like(prediction)
    prediction[2, 2, 2] = 1
    target[2, 2, 5] = 1
    assert hausdorff_distance_95(prediction, target, 2, spacing=(1.0, 1.0, 3.0)) == pytest.approx([9.0])
    # 3 voxels along z and 4 along x of 0.5 mm: √(9² + 2²) = √85
    prediction = np.zeros((8, 6, 8), np.uint8)
    target = np.zeros_like(prediction)
    prediction[6, 2, 2] = 1
    target[2, 2, 5] = 1
    assert hausdorff_distance_95(prediction, target, 2, spacing=(0.5, 1.0, 3.0)) == pytest.approx([math.sqrt(85)])


def test_hd95_of_displaced_cubes_with_anisotropic_spacing():
    # Two 10³ cubes, the second shifted by 2 voxels along x, spacing (2, 1, 1) mm.
    # Each surface has 10³ − 8³ = 488 voxels. The 100 voxels of the trailing x face (x = 2 for the
    # first cube) are 2 voxels × 2 mm = 4 mm from the other cube's nearest face, and no surface
    # voxel is farther (the leading face's interior is ≤ 4 mm from a side face or the 4 mm-away
    # x face). 100/488 > 5 %, so the 95th percentile is that maximum: 4 mm both ways.
    first = np.zeros((16, 14, 14), np.uint8)
    second = np.zeros_like(first)
    first[2:12, 2:12, 2:12] = 1
    second[4:14, 2:12, 2:12] = 1
    assert hausdorff_distance_95(second, first, 2, spacing=(2.0, 1.0, 1.0)) == pytest.approx([4.0])
    # the same shift along z, whose voxels are 2.5 mm, gives 2 × 2.5 = 5 mm
    second = np.zeros_like(first)
    second[2:12, 2:12, 4:14] = 1
    assert hausdorff_distance_95(second, first, 2, spacing=(2.0, 1.0, 2.5)) == pytest.approx([5.0])
    assert hausdorff_distance_95(first, first, 2, spacing=(2.0, 1.0, 2.5)) == pytest.approx([0.0])


def monai_hd95_of_empty_masks(prediction_mask, target_mask):
    """MONAI's HD95 where a mask is empty: `get_surface_distance` in both argument orders, then
    `_compute_percentile_hausdorff_distance` and the max of the two. A direction whose target is empty
    gets inf for each of its source's edge voxels, one whose source is empty gets inf for each target
    edge voxel, and an empty list of distances gives NaN.

    The 95th percentile of all-inf distances is taken as inf, as MONAI's max path (percentile=None)
    and its tests ("pred does not have foreground (but gt has), the metric should be inf") do. MONAI
    1.6.1's torch.quantile interpolation turns it into NaN instead (inf - inf), which silently drops
    the miss from the mean: MONAI issue #9095, fixed to inf in MONAI PR #9096.
    """

    def directed(source, target):
        if not target.any():
            distances = np.full(source.sum(), np.inf)  # inf * ones_like(target), indexed by source
        elif not source.any():
            distances = np.full(target.sum(), np.inf)
        else:
            raise AssertionError("only empty masks are transcribed here")
        if not distances.size:
            return nan
        return np.inf if np.isinf(distances).all() else np.percentile(distances, 95)

    both = [directed(prediction_mask, target_mask), directed(target_mask, prediction_mask)]
    return nan if any(math.isnan(d) for d in both) else max(both)  # torch.max propagates NaN


def test_hd95_follows_monai_when_a_mask_is_empty():
    """A class missed (or predicted but absent) scores inf, as MONAI compute_hausdorff_distance does;
    a class absent from both maps is NaN; classes are reported separately."""
    target = np.zeros((6, 6, 6), np.uint8)
    target[1:3, 1:3, 1:3] = 1
    target[4, 4, 4] = 2
    prediction = target.copy()
    prediction[4, 4, 4] = 0  # class 2 missed
    prediction[0, 5, 0] = 4  # class 4 predicted, absent from the target
    hd = hausdorff_distance_95(prediction, target, 5)
    expected = [monai_hd95_of_empty_masks(prediction == c, target == c) for c in (2, 3, 4)]
    assert expected[0] == math.inf and math.isnan(expected[1]) and expected[2] == math.inf
    assert hd[0] == 0.0
    np.testing.assert_array_equal(hd[1:], expected)
    with_background = hausdorff_distance_95(prediction, target, 5, include_background=True)
    assert np.isfinite(with_background[0])
    np.testing.assert_array_equal(with_background[1:], hd)
    assert math.isnan(surface_distance_percentile(target == 9, target == 9))
    assert surface_distance_percentile(target == 2, target == 9) == math.inf
    assert surface_distance_percentile(target == 9, target == 2, percentile=100.0) == math.inf


def test_accumulator_reports_missed_classes_as_infinite_mean_hd95_with_counts():
    """A miss makes the class's mean HD95 (and `mean_hd95`) inf, as MONAI's NaN-only-excluding
    reduction does; `hd95_inf_count_per_class` counts those cases and `hd95_finite_per_class` /
    `mean_hd95_finite` average the others."""
    target = np.zeros((8, 8, 8), np.uint8)
    target[1:4, 1:4, 1:4] = 1
    target[5:7, 5:7, 5:7] = 2
    shifted = np.zeros_like(target)
    shifted[1:4, 1:4, 2:5] = 1  # class 1 one voxel off along z: HD95 2.5 mm with 2.5 mm slices
    shifted[5:7, 5:7, 5:7] = 2
    missed = shifted.copy()
    missed[missed == 2] = 0  # second case: class 2 missed
    spacing = (1.0, 1.0, 2.5)
    metrics = SegmentationMetrics(3, hd95=True, class_names=["bg", "a", "b"])
    first = metrics.update(shifted, target, spacing=spacing, case_id="found")
    second = metrics.update(missed, target, spacing=spacing, case_id="missed")
    assert first["hd95_per_class"] == pytest.approx([2.5, 0.0]) and first["mean_hd95"] == pytest.approx(1.25)
    assert second["hd95_per_class"][1] == math.inf and second["mean_hd95"] == math.inf
    result = metrics.result()
    # MONAI "mean_batch" over [[2.5, 0], [2.5, inf]] leaves out NaN only: [2.5, inf]
    assert result["hd95_per_class"] == [pytest.approx(2.5), math.inf] and result["mean_hd95"] == math.inf
    assert result["hd95_b"] == math.inf
    assert result["hd95_inf_count_per_class"] == [0, 1]
    assert result["hd95_finite_per_class"] == pytest.approx([2.5, 0.0])
    assert result["mean_hd95_finite"] == pytest.approx(1.25)


def brute_force_hd95(prediction, target, spacing):
    """Independent reference: every pair of surface voxels, no distance transform, no cropping."""

    def surface_points(mask):
        return np.argwhere(mask & ~ndimage.binary_erosion(mask)) * np.asarray(spacing)

    distances = cdist(surface_points(prediction), surface_points(target))
    return max(np.percentile(distances.min(axis=1), 95), np.percentile(distances.min(axis=0), 95))


def test_hd95_matches_brute_force_on_blobs_touching_the_border():
    rng = np.random.default_rng(0)
    spacing = (1.5, 0.7, 3.0)
    for _ in range(3):
        field = ndimage.gaussian_filter(rng.normal(size=(14, 16, 12)), 2.0)
        prediction = field > 0.05
        target = ndimage.shift(field, (1, 0, 2), order=0) > 0.0
        assert prediction[0].any() or prediction[-1].any()  # the border counts as surface
        assert surface_distance_percentile(prediction, target, spacing) == pytest.approx(
            brute_force_hd95(prediction, target, spacing)
        )


def test_accumulator_averages_over_cases():
    metrics = SegmentationMetrics(num_classes=5, hd95=True, class_names=["bg", "a", "b", "c", "d"])
    first = metrics.update(PREDICTION, TARGET, case_id="case_0")
    assert first["case_id"] == "case_0" and first["dice_a"] == pytest.approx(2 / 3)
    np.testing.assert_allclose(first["dice_per_class"], EXPECTED_DICE[1:])
    assert first["gt_empty_per_class"] == [False, False, True, True]
    assert first["predicted_when_gt_empty_per_class"] == [False, False, True, False]
    # second case: perfect, but only class 1 present → dice 1, NaN, NaN, NaN
    perfect = np.zeros((2, 3, 1), np.uint8)
    perfect[0, 0, 0] = 1
    metrics.update(perfect, perfect, spacing=(1.0, 1.0, 1.0))
    result = metrics.result()
    # class 1: (2/3 + 1)/2; class 2: only the first case counts; classes 3, 4: in no target, so NaN
    np.testing.assert_allclose(result["dice_per_class"], [(2 / 3 + 1) / 2, 0.5, nan, nan])
    assert result["dice_cases_per_class"] == [2, 1, 0, 0]
    assert result["gt_empty_per_class"] == [0, 1, 2, 2]
    assert result["predicted_when_gt_empty_per_class"] == [0, 0, 1, 0]
    assert result["mean_dice"] == pytest.approx(((2 / 3 + 1) / 2 + 0.5) / 2)
    # per case first: case 0 (2/3 + 1/2)/2, case 1 1.0
    assert result["mean_dice_per_case"] == pytest.approx(((2 / 3 + 0.5) / 2 + 1.0) / 2)
    assert result["dice_b"] == pytest.approx(0.5) and math.isnan(result["dice_d"])
    assert result["num_cases"] == 2 and len(metrics.per_case) == 2
    assert result["hd95_per_class"][0] == pytest.approx(np.mean([hausdorff_distance_95(PREDICTION, TARGET, 5)[0], 0.0]))
    assert result["hd95_per_class"][2] == math.inf  # class 3 predicted in case 0, in no target
    assert math.isnan(result["hd95_per_class"][3])  # class 4 in neither map of any case
    assert "mean_hd95" in result and "hd95_a" in result


def test_accumulator_without_cases_or_hd95():
    metrics = SegmentationMetrics(num_classes=3)
    empty = metrics.result()
    assert empty["num_cases"] == 0 and math.isnan(empty["mean_dice"]) and "mean_hd95" not in empty
    metrics.update(PREDICTION.clip(0, 2), TARGET, case_id="x")
    metrics.reset()
    assert metrics.per_case == [] and metrics.result()["num_cases"] == 0
    with pytest.raises(ValueError, match="class names"):
        SegmentationMetrics(num_classes=3, class_names=["bg", "a"])


# ---------------------------------------------------------------- predictions.csv and the prediction summary


def test_predictions_csv_and_summary_report_classes_absent_from_the_label(tmp_path):
    """predict's per-case Dice (MONAI ignore_empty): a class absent from a case's label is NaN in
    predictions.csv, named in its `absent_from_label` column and left out of `dice_mean`; the printed
    summary averages each class over the cases that have it and says how many did not."""
    import csv

    from tfmis.inference.outputs import CaseResult, dice_line, write_csv

    names = ["background", "organ", "core"]
    label = np.zeros((6, 6, 4), np.uint8)
    label[1:5, 1:5, 1:3] = 1
    with_core = label.copy()
    with_core[2:4, 2:4, 1:3] = 2
    prediction = with_core.copy()
    # organ: 32 label voxels; predicted 32 - 8 (core) - 8 (row x = 1) = 16, all inside: 2·16 / (16 + 32) = 2/3
    prediction[1, 1:5, 1:3] = 0
    dice_0 = dict(zip(names[1:], map(float, dice_per_class(prediction, label, 3))))  # core absent, predicted
    dice_1 = dict(zip(names[1:], map(float, dice_per_class(with_core, with_core, 3))))
    assert dice_0["organ"] == pytest.approx(2 / 3) and math.isnan(dice_0["core"])
    results = [
        CaseResult("case_0", "ok", (6, 6, 4), dice=dice_0),
        CaseResult("case_1", "ok", (6, 6, 4), dice=dice_1),
        CaseResult("unlabelled", "ok", (6, 6, 4)),
    ]
    write_csv(results, tmp_path / "predictions.csv", names)
    rows = {r["case"]: r for r in csv.DictReader(open(tmp_path / "predictions.csv"))}
    assert rows["case_0"]["dice_organ"] == "0.6667" and rows["case_0"]["dice_core"] == "nan"
    assert float(rows["case_0"]["dice_mean"]) == pytest.approx(2 / 3)  # core left out, not scored 0
    assert rows["case_0"]["absent_from_label"] == "core" and rows["case_1"]["absent_from_label"] == ""
    assert rows["unlabelled"]["dice_organ"] == "" and rows["unlabelled"]["absent_from_label"] == ""
    summary = dice_line(results, names)
    # organ (2/3 + 1) / 2; core only from case_1; the mean weighs each class once: (5/6 + 1) / 2
    assert summary.startswith("mean Dice over 2 case(s): organ 0.8333, core 1.0000 (absent from 1 of 2 labels)")
    assert summary.endswith("; mean 0.9167")


# ---------------------------------------------------------------- normalised surface Dice (NSD) and regions


def listed_surface_voxels(mask):
    """Independent reference surface: every voxel of the mask listed with a face neighbour outside the mask
    or the volume, checked one voxel and one neighbour at a time (no erosion)."""
    points = []
    for voxel in np.argwhere(mask):
        for axis in range(mask.ndim):
            for step in (-1, 1):
                neighbour = voxel.copy()
                neighbour[axis] += step
                outside = not 0 <= neighbour[axis] < mask.shape[axis] or not mask[tuple(neighbour)]
                if outside:
                    points.append(voxel)
                    break
            else:
                continue
            break
    return np.array(points).reshape(-1, mask.ndim)


def brute_force_nsd(prediction, target, tolerance, spacing):
    """NSD written out: (|pred surface within tol of gt surface| + |gt surface within tol of pred surface|)
    / (|pred surface| + |gt surface|), with all pairwise distances in mm; MONAI's empty-mask rules."""
    if not prediction.any() and not target.any():
        return nan
    if not prediction.any() or not target.any():
        return 0.0
    p, t = listed_surface_voxels(prediction), listed_surface_voxels(target)
    # index offsets times the spacing: a one-voxel step is exactly one spacing, so ties with the tolerance
    # (tolerance = a spacing below) are decided as a distance transform decides them
    distances = np.sqrt((((p[:, None, :] - t[None, :, :]) * np.asarray(spacing)) ** 2).sum(-1))
    within = (distances.min(axis=1) <= tolerance).sum() + (distances.min(axis=0) <= tolerance).sum()
    return within / (len(p) + len(t))


def test_nsd_matches_brute_force_on_random_shapes_with_anisotropic_spacing():
    from tfmis.metrics import surface_dice

    rng = np.random.default_rng(1)
    for trial in range(4):
        shape = tuple(rng.integers(6, 12, size=3))
        spacing = tuple(rng.uniform(0.4, 3.0, size=3))
        field = ndimage.gaussian_filter(rng.normal(size=shape), 1.5)
        prediction = field > rng.uniform(-0.05, 0.05)
        target = (ndimage.shift(field, rng.integers(-2, 3, size=3), order=0) + rng.normal(0, 0.05, shape)) > 0.0
        assert prediction.any() and target.any()
        for tolerance in (0.0, 0.5, min(spacing), 1.7, 3.0, 10.0):
            assert surface_dice(prediction, target, tolerance, spacing) == pytest.approx(
                brute_force_nsd(prediction, target, tolerance, spacing), abs=1e-12
            ), (trial, tolerance)


def test_nsd_of_a_shifted_cube_below_and_above_the_shift():
    """A 4×4×4 cube and the same cube one slice (2.5 mm) on along z. Each has 56 surface voxels: 16 in
    each end face, 12 in each of the two middle rings. Of the first cube's: the ring at z=3 lies on the
    second cube's end face and the ring at z=4 and the ring of its face at z=5 on the second's rings
    (0 mm, 36 voxels); the 4 inner voxels of its face at z=5 are 1 mm (in-plane) from the second's ring
    at z=5; its face at z=2 is 2.5 mm from the second's face at z=3. The other way round is the mirror."""
    from tfmis.metrics import normalized_surface_dice, surface_dice

    a = np.zeros((8, 8, 9), bool)
    a[2:6, 2:6, 2:6] = True
    b = np.roll(a, 1, axis=2)
    spacing = (1.0, 1.0, 2.5)
    assert surface_dice(a, b, 0.0, spacing) == pytest.approx(2 * 36 / 112)
    assert surface_dice(a, b, 0.99, spacing) == pytest.approx(2 * 36 / 112)
    assert surface_dice(a, b, 1.0, spacing) == pytest.approx(2 * 40 / 112)  # inclusive, as MONAI (d <= tau)
    assert surface_dice(a, b, 2.49, spacing) == pytest.approx(2 * 40 / 112)  # below the shift
    assert surface_dice(a, b, 2.5, spacing) == 1.0  # at and above the shift: every surface voxel
    assert surface_dice(b, a, 3.0, spacing) == 1.0
    # the same shift along x (1 mm) is within a 1 mm tolerance
    assert surface_dice(a, np.roll(a, 1, axis=0), 1.0, spacing) == 1.0
    # disjoint slabs 2 slices (5 mm) apart: the facing layers are 2.5 mm off, the far ones 5 mm
    slab = np.zeros((6, 6, 8), bool)
    slab[1:5, 1:5, 1:3] = True
    moved = np.roll(slab, 2, axis=2)
    assert [surface_dice(slab, moved, t, spacing) for t in (2.4, 2.5, 4.9, 5.0)] == [0.0, 0.5, 0.5, 1.0]
    # per class from label maps, one tolerance per class
    labels_a, labels_b = a.astype(np.uint8), b.astype(np.uint8)
    labels_a[slab.nonzero()[0] + 0, slab.nonzero()[1], slab.nonzero()[2] + 6] = 2
    labels_b[moved.nonzero()[0], moved.nonzero()[1], moved.nonzero()[2] + 1] = 2
    np.testing.assert_allclose(
        normalized_surface_dice(labels_b, labels_a, 3, [2.0, 2.5], spacing),
        [
            surface_dice(labels_b == 1, labels_a == 1, 2.0, spacing),
            surface_dice(labels_b == 2, labels_a == 2, 2.5, spacing),
        ],
    )


def test_nsd_follows_monai_when_a_mask_is_empty():
    from tfmis.metrics import normalized_surface_dice, surface_dice

    empty, cube = np.zeros((5, 5, 5), bool), np.zeros((5, 5, 5), bool)
    cube[1:3, 1:3, 1:3] = True
    assert math.isnan(surface_dice(empty, empty, 1.0))  # nothing to score
    assert surface_dice(cube, empty, 100.0) == 0.0 and surface_dice(empty, cube, 100.0) == 0.0
    # class 1 in both, class 2 predicted only (Dice NaN with ignore_empty, NSD 0), class 3 in neither
    prediction = np.where(cube, 1, 0)
    prediction[4, 4, 4] = 2
    scores = normalized_surface_dice(prediction, cube.astype(int), 4, 1.0)
    assert scores[0] == 1.0 and scores[1] == 0.0 and math.isnan(scores[2])
    with pytest.raises(ValueError, match="finite distance >= 0"):
        surface_dice(cube, cube, -1.0)
    with pytest.raises(ValueError, match="one per class"):
        normalized_surface_dice(prediction, cube.astype(int), 4, [1.0, 2.0])


# BraTS-like label maps (MSD Task01 labels: 1 edema, 2 non-enhancing tumour, 3 enhancing tumour)
BRATS_REGIONS = {"whole_tumour": [1, 2, 3], "tumour_core": [2, 3], "enhancing_tumour": [3]}


def random_brats_maps(rng, shape=(9, 10, 8)):
    field = ndimage.gaussian_filter(rng.normal(size=shape), 1.2)
    target = np.digitize(field, [0.0, 0.05, 0.1]).astype(np.uint8)  # nested shells: 1 ⊃ 2 ⊃ 3
    noisy = ndimage.gaussian_filter(field + rng.normal(0, 0.05, shape), 0.5)
    prediction = np.digitize(noisy, [0.01, 0.05, 0.12]).astype(np.uint8)
    return prediction, target


def union_dice_by_hand(prediction, target, labels):
    p, t = np.isin(prediction, labels), np.isin(target, labels)
    return 2 * (p & t).sum() / (p.sum() + t.sum()) if t.any() else nan


def test_region_dice_is_the_dice_of_the_unioned_masks():
    from tfmis.metrics import region_dice

    rng = np.random.default_rng(2)
    for _ in range(3):
        prediction, target = random_brats_maps(rng)
        expected = [union_dice_by_hand(prediction, target, labels) for labels in BRATS_REGIONS.values()]
        np.testing.assert_allclose(region_dice(prediction, target, 4, BRATS_REGIONS), expected)
    # a region of one label is that class's Dice; a region absent from the target is NaN (ignore_empty)
    np.testing.assert_allclose(region_dice(PREDICTION, TARGET, 5, {"b": [2], "cd": [3, 4]}), [0.5, nan])
    # by hand on the 2×3 maps: {1, 2} target 4 voxels, predicted 3 ((0,1), (0,2), (1,0)), all 3 inside
    assert region_dice(PREDICTION, TARGET, 5, {"ab": [1, 2]})[0] == pytest.approx(2 * 3 / (3 + 4))


def test_accumulator_scores_regions_and_nsd_like_the_brute_force_formulas():
    rng = np.random.default_rng(3)
    spacing = (0.9, 1.3, 2.2)
    names = ["background", "edema", "non_enhancing", "enhancing"]
    tolerances = [1.0, 2.0, 1.5]
    metrics = SegmentationMetrics(
        4, hd95=True, class_names=names, regions=BRATS_REGIONS, nsd=True, nsd_tolerance_mm=tolerances
    )
    cases = [random_brats_maps(rng) for _ in range(3)]
    expected_region_dice, expected_region_nsd, expected_class_nsd = [], [], []
    for i, (prediction, target) in enumerate(cases):
        entry = metrics.update(prediction, target, spacing=spacing, case_id=f"case_{i}")
        region_dice = [union_dice_by_hand(prediction, target, labels) for labels in BRATS_REGIONS.values()]
        # a region without its own tolerance takes the smallest of its labels': 1.0, 1.5, 1.5
        region_nsd = [
            brute_force_nsd(np.isin(prediction, labels), np.isin(target, labels), tol, spacing)
            for labels, tol in zip(BRATS_REGIONS.values(), [1.0, 1.5, 1.5])
        ]
        class_nsd = [brute_force_nsd(prediction == c, target == c, tolerances[c - 1], spacing) for c in (1, 2, 3)]
        np.testing.assert_allclose(entry["dice_per_region"], region_dice)
        np.testing.assert_allclose(entry["nsd_per_region"], region_nsd)
        np.testing.assert_allclose(entry["nsd_per_class"], class_nsd)
        assert entry["dice_whole_tumour"] == pytest.approx(region_dice[0])
        assert entry["nsd_enhancing_tumour"] == pytest.approx(region_nsd[2])
        assert entry["hd95_tumour_core"] == pytest.approx(
            brute_force_hd95(np.isin(prediction, [2, 3]), np.isin(target, [2, 3]), spacing)
        )
        np.testing.assert_allclose(entry["dice_per_class"], dice_per_class(prediction, target, 4))
        expected_region_dice.append(region_dice)
        expected_region_nsd.append(region_nsd)
        expected_class_nsd.append(class_nsd)
    result = metrics.result()
    np.testing.assert_allclose(result["dice_per_region"], np.nanmean(expected_region_dice, axis=0))
    np.testing.assert_allclose(result["nsd_per_region"], np.nanmean(expected_region_nsd, axis=0))
    np.testing.assert_allclose(result["nsd_per_class"], np.nanmean(expected_class_nsd, axis=0))
    assert result["dice_whole_tumour"] == pytest.approx(np.mean([d[0] for d in expected_region_dice]))
    assert result["mean_region_dice"] == pytest.approx(np.mean(np.nanmean(expected_region_dice, axis=0)))
    assert result["mean_nsd"] == pytest.approx(np.mean(np.nanmean(expected_class_nsd, axis=0)))
    assert result["dice_cases_per_region"] == [3, 3, 3] and result["num_cases"] == 3
    # the workers' table round trip (tfmis.engine.trainer.evaluate with several workers) keeps every number
    table = metrics.case_table()
    assert table.shape == (3, metrics.table_width) == (3, 5 * (3 + 3))
    again = SegmentationMetrics(
        4, hd95=True, class_names=names, regions=BRATS_REGIONS, nsd=True, nsd_tolerance_mm=tolerances
    )
    again.add_case_table(table)
    _assert_same(again.result(), result)


def _assert_same(a: dict, b: dict):
    assert list(a) == list(b)
    for key in a:
        np.testing.assert_allclose(np.asarray(a[key], float), np.asarray(b[key], float), err_msg=key)


def test_accumulator_keys_are_unchanged_without_regions_or_nsd():
    """Existing outputs stay as they were: the same keys, in the same order, and the same table layout."""
    metrics = SegmentationMetrics(5, hd95=True, class_names=["bg", "a", "b", "c", "d"])
    entry = metrics.update(PREDICTION, TARGET, case_id="x")
    assert list(entry) == [
        "case_id", "dice_per_class", "mean_dice", "dice_a", "dice_b", "dice_c", "dice_d", "hd95_per_class",
        "mean_hd95", "hd95_a", "hd95_b", "hd95_c", "hd95_d", "gt_empty_per_class", "predicted_when_gt_empty_per_class",
    ]  # fmt: skip
    assert list(metrics.result()) == [
        "dice_per_class", "mean_dice", "dice_a", "dice_b", "dice_c", "dice_d", "hd95_per_class", "mean_hd95",
        "hd95_a", "hd95_b", "hd95_c", "hd95_d", "mean_dice_per_case", "dice_cases_per_class", "gt_empty_per_class",
        "predicted_when_gt_empty_per_class", "hd95_inf_count_per_class", "hd95_finite_per_class", "mean_hd95_finite",
        "num_cases",
    ]  # fmt: skip
    row = metrics.case_table()[0]
    np.testing.assert_allclose(row[:4], EXPECTED_DICE[1:])  # Dice, then ground truth empty, predicted when empty, HD95
    np.testing.assert_array_equal(row[4:12], [0, 0, 1, 1, 0, 0, 1, 0])


def test_regions_and_tolerances_are_checked_against_the_classes():
    with pytest.raises(ValueError, match=r"validation.regions.whole_tumour: .* labels in 1..3"):
        SegmentationMetrics(4, regions={"whole_tumour": [1, 2, 4]})  # BraTS's own 4 is label 3 in MSD Task01
    with pytest.raises(ValueError, match="also a class name"):
        SegmentationMetrics(3, class_names=["background", "organ", "core"], regions={"core": [2]})
    with pytest.raises(ValueError, match="nsd_tolerance_mm"):
        SegmentationMetrics(3, nsd=True)
    with pytest.raises(ValueError, match="one per scored class"):
        SegmentationMetrics(4, nsd=True, nsd_tolerance_mm=[1.0, 2.0], regions=BRATS_REGIONS)
    # one per class then one per region
    metrics = SegmentationMetrics(4, nsd=True, nsd_tolerance_mm=[1, 2, 3, 4, 5, 6], regions=BRATS_REGIONS)
    assert metrics.nsd_tolerances == [1, 2, 3, 4, 5, 6]


def test_config_keys_for_regions_and_nsd():
    from tfmis.config import ConfigError, load_config, parse_config, to_dict

    default = load_config(None).validation
    assert (default.nsd, default.nsd_tolerance_mm, default.regions) == (False, None, {})  # off by default
    config = load_config(
        None,
        [
            "validation.regions={whole_tumour: [1, 2, 3], tumour_core: [2, 3], enhancing_tumour: [3]}",
            "validation.nsd=true",
            "validation.nsd_tolerance_mm=[1, 2.5, 1]",
        ],
    )
    assert config.validation.regions == BRATS_REGIONS and config.validation.nsd_tolerance_mm == [1.0, 2.5, 1.0]
    assert parse_config(to_dict(config)).validation == config.validation  # what save_config writes reads back
    assert load_config(None, ["validation.nsd_tolerance_mm=2"]).validation.nsd_tolerance_mm == 2.0
    for override, message in [
        ("validation.nsd=true", "validation.nsd is true but validation.nsd_tolerance_mm is not set"),
        ("validation.nsd_tolerance_mm=-1", "validation.nsd_tolerance_mm: expected distances >= 0"),
        ("validation.regions={whole tumour: [1]}", "rename it"),
        ("validation.regions={wt: [0, 1]}", r"validation.regions.wt: expected a list of distinct foreground"),
        ("validation.regions={wt: [1, x]}", r"validation.regions.wt\[1\]: expected an integer"),
        ("validation.regions=[1, 2]", "validation.regions: expected a mapping"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override])


def test_predictions_csv_appends_region_hd95_and_nsd_columns(tmp_path):
    """The class columns keep their names and order; the scores follow, blank for an unlabelled case."""
    import csv

    from tfmis.inference.outputs import CaseResult, score_columns, score_keys, write_csv

    names = ["background", "edema", "non_enhancing", "enhancing"]
    metrics = SegmentationMetrics(
        4, hd95=True, class_names=names, regions=BRATS_REGIONS, nsd=True, nsd_tolerance_mm=1.0
    )
    columns = score_columns(metrics)
    assert columns == [
        "dice_whole_tumour", "dice_tumour_core", "dice_enhancing_tumour", "dice_mean_regions",
        "hd95_edema", "hd95_non_enhancing", "hd95_enhancing", "hd95_whole_tumour", "hd95_tumour_core",
        "hd95_enhancing_tumour", "nsd_edema", "nsd_non_enhancing", "nsd_enhancing", "nsd_whole_tumour",
        "nsd_tumour_core", "nsd_enhancing_tumour", "nsd_mean",
    ]  # fmt: skip
    prediction, target = random_brats_maps(np.random.default_rng(4))
    entry = metrics.update(prediction, target)
    scores = {column: entry[key] for column, key in score_keys(metrics).items()}
    dice = dict(zip(names[1:], entry["dice_per_class"]))
    results = [CaseResult("case_0", "ok", (9, 10, 8), dice=dice, scores=scores), CaseResult("test_0", "ok", (9, 10, 8))]
    write_csv(results, tmp_path / "predictions.csv", names, columns)
    header = next(csv.reader(open(tmp_path / "predictions.csv")))
    assert header[:15] == [
        "case", "status", "shape", "seconds", "peak_rss_mb", "foreground_voxels", "device", "output", "reason",
        "dice_edema", "dice_non_enhancing", "dice_enhancing", "dice_mean", "absent_from_label", "dice_whole_tumour",
    ]  # fmt: skip
    assert header[14:] == columns
    rows = {r["case"]: r for r in csv.DictReader(open(tmp_path / "predictions.csv"))}
    assert float(rows["case_0"]["dice_whole_tumour"]) == pytest.approx(
        union_dice_by_hand(prediction, target, [1, 2, 3]), abs=1e-4
    )
    assert float(rows["case_0"]["nsd_mean"]) == pytest.approx(entry["mean_nsd"], abs=1e-4)
    assert all(rows["test_0"][c] == "" for c in columns)
    # without regions, HD95 or NSD nothing is appended: the file is as before
    assert score_columns(SegmentationMetrics(4, class_names=names)) == []


def test_workers_tables_summed_give_the_cases_of_one_accumulator():
    """Trainer.evaluate on several workers: each scores every other case, puts its rows at the cases'
    positions in a zero table of `table_width` columns, the tables are summed; NaN (absent) and inf (missed)
    survive the sum, so the summed table gives what one accumulator over all cases gives."""
    rng = np.random.default_rng(5)
    cases = [random_brats_maps(rng) for _ in range(3)]
    missed = cases[2][0].copy()
    missed[missed == 3] = 2  # enhancing tumour missed: HD95 inf, NSD 0
    cases.append((missed, cases[2][1]))
    kwargs = dict(hd95=True, regions=BRATS_REGIONS, nsd=True, nsd_tolerance_mm=1.0)
    one = SegmentationMetrics(4, **kwargs)
    for prediction, target in cases:
        one.update(prediction, target, spacing=(1.0, 1.2, 2.0))
    assert math.isinf(one.result()["hd95_per_class"][2]) and one.result()["nsd_per_region"][2] < 1
    summed = np.zeros((len(cases), one.table_width))
    for rank in (0, 1):
        worker = SegmentationMetrics(4, **kwargs)
        for prediction, target in cases[rank::2]:
            worker.update(prediction, target, spacing=(1.0, 1.2, 2.0))
        table = np.zeros_like(summed)
        table[rank::2] = worker.case_table()
        summed += table
    merged = SegmentationMetrics(4, **kwargs)
    merged.add_case_table(summed)
    _assert_same(merged.result(), one.result())
    np.testing.assert_allclose(
        [c["nsd_per_region"] for c in merged.per_case], [c["nsd_per_region"] for c in one.per_case]
    )


# ---------------------------------------------------------------- bounded memory: label types, boxes, one distance pair


def uncropped_surface_distances(prediction, target, spacing):
    """The reference computation written out on the whole volume, without any crop: surfaces by erosion (the
    volume's border counts as outside), scipy's distance transform (with distances) of the whole volume, read at
    the other mask's surface voxels."""
    prediction_surface = prediction & ~ndimage.binary_erosion(prediction)
    target_surface = target & ~ndimage.binary_erosion(target)
    return (
        ndimage.distance_transform_edt(~target_surface, sampling=spacing)[prediction_surface],
        ndimage.distance_transform_edt(~prediction_surface, sampling=spacing)[target_surface],
    )


def small_structures_in_a_large_volume(rng, shape=(70, 40, 36)):
    """Label maps (classes 0..3) whose structures fill a small part of a volume longer than two slabs along the
    first axis: class 1 blobs against the volume's border (x = 0 and the last y), class 2 blobs in the middle with
    a displaced prediction, class 3 in opposite corners of the label and the prediction (boxes far apart)."""
    target, prediction = np.zeros(shape, np.uint8), np.zeros(shape, np.uint8)
    corner = (slice(0, 12), slice(shape[1] - 10, shape[1]), slice(4, 16))
    blob = ndimage.gaussian_filter(rng.normal(size=(12, 10, 12)), 1.5)
    target[corner] = np.where(blob > 0.0, 1, 0)
    prediction[corner] = np.where(ndimage.shift(blob, (1, 0, -1), order=0) > 0.02, 1, 0)
    middle = (slice(30, 44), slice(14, 26), slice(12, 24))
    blob = ndimage.gaussian_filter(rng.normal(size=(14, 12, 12)), 1.5)
    target[middle] = np.where(blob > 0.0, 2, target[middle])
    prediction[middle] = np.where(np.roll(blob, 2, axis=0) > -0.02, 2, prediction[middle])
    target[60:66, 2:7, 28:33] = 3
    prediction[3:7, 30:35, 1:5] = 3
    return prediction, target


def test_distances_to_surface_are_scipys_distances_at_the_points():
    """`distances_to_surface` keeps only the feature transform and computes distances at the points, a few slices at
    a time: the very numbers of scipy's distance transform (with distances) read at those points, bit for bit, with
    anisotropic spacing and points spread over several query slabs."""
    from tfmis.metrics.surface import QUERY_SLICES, distances_to_surface

    rng = np.random.default_rng(11)
    for spacing in [(0.8, 0.8, 2.5), (1.3, 0.7, 0.9)]:
        field = ndimage.gaussian_filter(rng.normal(size=(3 * QUERY_SLICES + 5, 17, 13)), 2.0)
        features, points = field > 0.05, field < -0.05
        expected = ndimage.distance_transform_edt(~features, sampling=spacing)[points]
        actual = distances_to_surface(points, features, spacing)
        assert actual.dtype == np.float64 and actual.size == points.sum() > 1000
        np.testing.assert_array_equal(actual, expected)


def test_surface_distances_in_the_union_box_equal_the_uncropped_distance_transform():
    """Every surface voxel lies in the bounding box of both masks, so distances computed in that box (padded by one
    voxel) are the whole volume's: structures against the volume's border, displaced, and far apart."""
    from tfmis.metrics import surface, surface_distances
    from tfmis.metrics.surface import off_surface

    rng = np.random.default_rng(12)
    spacing = (0.9, 1.4, 2.2)
    for _ in range(3):
        prediction, target = small_structures_in_a_large_volume(rng)
        assert np.array_equal(off_surface(target == 2), ~surface(target == 2))
        for c in (1, 2, 3):
            expected = uncropped_surface_distances(prediction == c, target == c, spacing)
            actual = surface_distances(prediction == c, target == c, spacing)
            for a, e in zip(actual, expected):
                assert a.size == e.size > 0
                np.testing.assert_allclose(a, e, rtol=1e-12, atol=0)


def test_hd95_and_nsd_come_from_one_distance_pair_and_equal_the_reference_formulas(monkeypatch):
    """`surface_scores` gives `surface_distance_percentile` and `surface_dice` (and the brute-force formulas) from one
    pair of distances, with MONAI's empty-mask values; the accumulator with HD95 and NSD runs one distance
    transform per direction per structure present in both maps (two per structure, where HD95 and NSD took two
    each before)."""
    import importlib

    from tfmis.metrics import surface_dice, surface_scores

    surface_module = importlib.import_module("tfmis.metrics.surface")  # the package's `surface` is the function

    rng = np.random.default_rng(13)
    spacing = (0.9, 1.4, 2.2)
    prediction, target = small_structures_in_a_large_volume(rng)
    for c in (1, 2, 3):
        p, t = prediction == c, target == c
        hd95, nsd = surface_scores(p, t, spacing, 95.0, 2.0)
        assert hd95 == surface_distance_percentile(p, t, spacing) == pytest.approx(brute_force_hd95(p, t, spacing))
        assert nsd == surface_dice(p, t, 2.0, spacing) == pytest.approx(brute_force_nsd(p, t, 2.0, spacing))
        assert surface_scores(p, t, spacing, None, 2.0) == (None, nsd)
        assert surface_scores(p, t, spacing, 95.0, None) == (hd95, None)
    empty = np.zeros_like(prediction, bool)
    assert surface_scores(prediction == 1, empty, spacing, 95.0, 1.0) == (math.inf, 0.0)
    assert all(math.isnan(v) for v in surface_scores(empty, empty, spacing, 95.0, 1.0))

    calls = []
    edt = ndimage.distance_transform_edt
    monkeypatch.setattr(
        surface_module.ndimage, "distance_transform_edt", lambda *a, **k: calls.append(1) or edt(*a, **k)
    )
    prediction[prediction == 3] = 0  # class 3 missed: HD95 inf, NSD 0, no distance transform
    metrics = SegmentationMetrics(4, hd95=True, nsd=True, nsd_tolerance_mm=2.0, regions={"one_two": [1, 2]})
    entry = metrics.update(prediction, target, spacing=spacing)
    assert len(calls) == 2 * 3  # classes 1, 2 and the region
    assert entry["hd95_per_class"][2] == math.inf and entry["nsd_per_class"][2] == 0.0
    union_p, union_t = np.isin(prediction, [1, 2]), np.isin(target, [1, 2])
    assert entry["nsd_per_region"][0] == pytest.approx(brute_force_nsd(union_p, union_t, 2.0, spacing))
    assert entry["hd95_per_region"][0] == pytest.approx(brute_force_hd95(union_p, union_t, spacing))


def test_accumulator_on_small_structures_in_a_large_volume_equals_the_reference_formulas():
    """Counts slab by slab (70 slices: three slabs) and each structure's masks inside its box only give Dice equal to
    MONAI's per-channel formula (to the last bit), HD95 and NSD equal to the brute-force formulas over listed surface
    voxels, with structures against the volume's border and structures whose boxes are far apart; maps stored as
    uint8, uint16, int64 and float64, or in Fortran order, give the same numbers to the last bit."""
    from tfmis.metrics.segmentation import SLAB_SLICES

    rng = np.random.default_rng(14)
    spacing = (0.9, 1.4, 2.2)
    tolerances = [1.0, 2.0, 1.5]
    regions = {"one_two": [1, 2], "all": [1, 2, 3]}
    prediction, target = small_structures_in_a_large_volume(rng)
    assert prediction.shape[0] > 2 * SLAB_SLICES
    reference = None
    for p, t in [
        (prediction, target),
        (prediction.astype(np.uint16), target.astype(np.uint16)),
        (prediction.astype(np.int64), target.astype(np.float64)),
        (np.asfortranarray(prediction), np.asfortranarray(target)),
    ]:
        metrics = SegmentationMetrics(4, hd95=True, regions=regions, nsd=True, nsd_tolerance_mm=tolerances)
        entry = metrics.update(p, t, spacing=spacing)
        if reference is None:
            reference = entry
            for i, c in enumerate((1, 2, 3)):
                assert entry["dice_per_class"][i] == monai_compute_channel(prediction == c, target == c)
                assert entry["hd95_per_class"][i] == pytest.approx(
                    brute_force_hd95(prediction == c, target == c, spacing), rel=1e-12
                )
                assert entry["nsd_per_class"][i] == pytest.approx(
                    brute_force_nsd(prediction == c, target == c, tolerances[i], spacing), rel=1e-12
                )
            for i, (labels, tolerance) in enumerate(zip(regions.values(), [1.0, 1.0])):
                p_union, t_union = np.isin(prediction, labels), np.isin(target, labels)
                assert entry["dice_per_region"][i] == union_dice_by_hand(prediction, target, labels)
                assert entry["hd95_per_region"][i] == pytest.approx(brute_force_hd95(p_union, t_union, spacing))
                assert entry["nsd_per_region"][i] == pytest.approx(
                    brute_force_nsd(p_union, t_union, tolerance, spacing)
                )
        else:
            assert list(entry) == list(reference)
            for key in entry:
                np.testing.assert_array_equal(np.asarray(entry[key], float), np.asarray(reference[key], float), key)


def test_label_maps_are_kept_as_stored_or_cast_to_the_smallest_unsigned_type():
    """uint8 and uint16 maps are scored without a copy (booleans as a uint8 view); other integer maps and integral
    float maps become uint8 (uint16 beyond 256 classes) with the same labels; the errors are unchanged."""
    from tfmis.metrics.segmentation import label_maps

    labels = np.arange(24).reshape(2, 3, 4) % 3
    for stored in (np.uint8, np.uint16):
        array = labels.astype(stored)
        kept, _ = label_maps(array, array, 3)
        assert kept is array
    mask = labels > 0
    viewed, _ = label_maps(mask, mask, 2)
    assert viewed.dtype == np.uint8 and np.shares_memory(viewed, mask)
    for stored in (np.int64, np.int16, np.float64, np.float32, np.uint32):
        cast, _ = label_maps(labels.astype(stored), labels, 3)
        assert cast.dtype == np.uint8 and np.array_equal(cast, labels)
    wide, _ = label_maps(labels.astype(np.int32) * 100, labels, 300)
    assert wide.dtype == np.uint16 and np.array_equal(wide, labels * 100)
    with pytest.raises(ValueError, match=r"target labels must lie in \[0, 3\), got \[0, 5\]"):
        label_maps(labels, labels + 3 * (labels == 2), 3)
    with pytest.raises(ValueError, match=r"prediction labels must lie in \[0, 3\), got \[-1, 2\]"):
        label_maps(labels - (labels == 0), labels, 3)
    with pytest.raises(ValueError, match="target must hold integer class labels"):
        label_maps(labels, np.where(labels == 1, np.nan, labels), 3)
