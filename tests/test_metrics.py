"""Full-volume Dice and HD95 against values worked out by hand."""

import math

import numpy as np
import pytest
from scipy import ndimage
from scipy.spatial.distance import cdist

from tfmis.metrics import SegmentationMetrics, dice_per_class, hausdorff_distance_95, mean_dice
from tfmis.metrics.segmentation import surface_distance_percentile

nan = float("nan")

# 2×3×1 label maps, classes 0..4 (class 4 appears in neither)
TARGET = np.array([[0, 1, 1],
                   [2, 2, 0]], np.uint8)[..., None]
PREDICTION = np.array([[0, 1, 2],
                       [2, 0, 3]], np.uint8)[..., None]
# class 0: target {(0,0), (1,2)}, predicted {(0,0), (1,1)}, overlap 1 → 2·1 / (2 + 2) = 0.5
# class 1: target {(0,1), (0,2)}, predicted {(0,1)}, overlap 1        → 2·1 / (2 + 1) = 2/3
# class 2: target {(1,0), (1,1)}, predicted {(0,2), (1,0)}, overlap 1 → 2·1 / (2 + 2) = 0.5
# class 3: not in target, predicted once                              → 0
# class 4: in neither                                                 → NaN
EXPECTED_DICE = [0.5, 2 / 3, 0.5, 0.0, nan]


def test_dice_per_class_by_hand():
    np.testing.assert_allclose(dice_per_class(PREDICTION, TARGET, 5), EXPECTED_DICE[1:])
    np.testing.assert_allclose(dice_per_class(PREDICTION, TARGET, 5, include_background=True), EXPECTED_DICE)
    np.testing.assert_allclose(dice_per_class(TARGET, TARGET, 3), [1.0, 1.0])


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


def test_hd95_is_nan_when_a_mask_is_empty_and_reports_classes_separately():
    target = np.zeros((6, 6, 6), np.uint8)
    target[1:3, 1:3, 1:3] = 1
    target[4, 4, 4] = 2
    prediction = target.copy()
    prediction[4, 4, 4] = 0  # class 2 missed
    hd = hausdorff_distance_95(prediction, target, 4)
    assert hd[0] == 0.0 and math.isnan(hd[1]) and math.isnan(hd[2])  # class 3 in neither
    with_background = hausdorff_distance_95(prediction, target, 4, include_background=True)
    assert np.isfinite(with_background[0])
    np.testing.assert_array_equal(with_background[1:], hd)


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
            brute_force_hd95(prediction, target, spacing))


def test_accumulator_averages_over_cases():
    metrics = SegmentationMetrics(num_classes=5, hd95=True, class_names=["bg", "a", "b", "c", "d"])
    first = metrics.update(PREDICTION, TARGET, case_id="case_0")
    assert first["case_id"] == "case_0" and first["dice_a"] == pytest.approx(2 / 3)
    np.testing.assert_allclose(first["dice_per_class"], EXPECTED_DICE[1:])
    # second case: perfect, but only class 1 present → dice 1, NaN, NaN, NaN
    perfect = np.zeros((2, 3, 1), np.uint8)
    perfect[0, 0, 0] = 1
    metrics.update(perfect, perfect, spacing=(1.0, 1.0, 1.0))
    result = metrics.result()
    # class 1: (2/3 + 1)/2; classes 2, 3: only the first case counts; class 4: NaN everywhere
    np.testing.assert_allclose(result["dice_per_class"], [(2 / 3 + 1) / 2, 0.5, 0.0, nan])
    assert result["mean_dice"] == pytest.approx(((2 / 3 + 1) / 2 + 0.5 + 0.0) / 3)
    assert result["dice_b"] == pytest.approx(0.5) and math.isnan(result["dice_d"])
    assert result["num_cases"] == 2 and len(metrics.per_case) == 2
    assert result["hd95_per_class"][0] == pytest.approx(
        np.mean([hausdorff_distance_95(PREDICTION, TARGET, 5)[0], 0.0]))
    assert math.isnan(result["hd95_per_class"][2])  # class 3 never in a target
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
