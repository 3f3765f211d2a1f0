"""Postprocessing chosen by out-of-fold Dice (`tfmis.postprocessing`) against nnU-Net v2's definitions.

The references below are written out independently, on whole volumes: `largest_pieces_reference` transcribes
nnU-Net v2's `remove_all_but_largest_component_from_segmentation` (nnunetv2/postprocessing/
remove_connected_components.py) with acvl_utils' `remove_all_but_largest_component` (full connectivity; every piece
as large as the largest kept), using `scipy.ndimage.label` with a full 3x3x3 structure on the whole volume;
`dice_reference` is nnU-Net's `compute_metrics` (2TP / (2TP + FP + FN), NaN when TP + FP + FN = 0); means are
np.nanmean per structure and np.mean over structures (`compute_metrics_on_folder`); `determine_reference` is
`determine_postprocessing`'s decision procedure with every map in memory.
"""

from __future__ import annotations

import json
import math
import tracemalloc
import warnings

import nibabel as nib
import numpy as np
import pytest
from conftest import lps_affine, write_nifti
from scipy import ndimage

from tfmis.config import PostprocessingConfig
from tfmis.metrics.nnunet_scores import dice_summary, structure_dice
from tfmis.postprocessing import (
    apply_postprocessing,
    case_dice,
    choose_postprocessing,
    keep_largest_component,
)

FULL = np.ones((3, 3, 3), bool)  # 26-connectivity


# ---------------------------------------------------------------- independent references


def largest_pieces_reference(labels: np.ndarray, structure_labels) -> np.ndarray:
    """nnU-Net's step on a copy, on the whole volume: pieces by full connectivity, all pieces of the largest size
    kept, the structure's other voxels set to 0."""
    out = labels.copy()
    mask = np.isin(labels, list(structure_labels))
    pieces, count = ndimage.label(mask, structure=FULL)
    if count == 0:
        return out
    sizes = np.bincount(pieces.ravel())[1:]
    keep = 1 + np.flatnonzero(sizes == sizes.max())
    out[mask & ~np.isin(pieces, keep)] = 0
    return out


def dice_reference(prediction: np.ndarray, reference: np.ndarray, labels) -> float:
    """nnU-Net's compute_metrics Dice of one structure (a label union)."""
    p, r = np.isin(prediction, list(labels)), np.isin(reference, list(labels))
    tp, fp, fn = int(np.sum(p & r)), int(np.sum(p & ~r)), int(np.sum(~p & r))
    return math.nan if tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn)


def summary_reference(predictions, references, structures: dict) -> tuple[dict, float]:
    """(per-structure np.nanmean over cases, np.mean of those), as compute_metrics_on_folder."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # nanmean of all-NaN
        means = {
            name: float(np.nanmean([dice_reference(p, r, labels) for p, r in zip(predictions, references)]))
            for name, labels in structures.items()
        }
    return means, float(np.mean(list(means.values())))


def determine_reference(predictions, references, class_labels, regions=None):
    """determine_postprocessing's decisions, every map in memory: [(structure, before, after, kept)] and the spec."""
    structures = dict(regions) if regions else {str(c): [c] for c in class_labels}
    source = [p.copy() for p in predictions]
    base = summary_reference(source, references, structures)
    tried = [largest_pieces_reference(p, class_labels) for p in source]
    after = summary_reference(tried, references, structures)
    keep = after[1] > base[1] and not any(after[0][s] < base[0][s] for s in structures)
    steps = [("foreground", base, after, keep)]
    spec = PostprocessingConfig(largest_foreground_component=keep)
    if keep:
        source, base = tried, after
    if len(structures) > 1:
        for name, labels in structures.items():
            tried = [largest_pieces_reference(p, labels) for p in source]
            after = summary_reference(tried, references, structures)
            keep = after[0][name] > base[0][name]
            steps.append((name, base, after, keep))
            if keep:
                spec.largest_component_labels.append(list(labels))
                source, base = tried, after
    return steps, spec


def same(reported, expected) -> bool:
    """A report number (NaN as null) equals the reference's."""
    if reported is None or math.isnan(reported):
        return math.isnan(expected)
    return reported == pytest.approx(expected, rel=1e-12, abs=1e-15)


def write_cases(tmp_path, cases) -> list[tuple]:
    """Each (prediction, reference) pair as uint8 NIfTI files; returns the path pairs."""
    pairs = []
    for i, (prediction, reference) in enumerate(cases):
        p = write_nifti(tmp_path / "pred" / f"case_{i:03d}.nii.gz", prediction, lps_affine(), np.uint8)
        r = write_nifti(tmp_path / "ref" / f"case_{i:03d}.nii.gz", reference, lps_affine(), np.uint8)
        pairs.append((p, r))
    return pairs


def check_against_reference(report, spec, cases, class_labels, regions=None):
    """Every step's structure, Dice before/after, foreground mean and decision, and the spec, as the reference."""
    steps, expected_spec = determine_reference(
        [p for p, _ in cases], [r for _, r in cases], class_labels, regions=regions
    )
    assert spec == expected_spec
    assert [s["structure"] for s in report["steps"]] == [name for name, *_ in steps]
    for entry, (name, before, after, kept) in zip(report["steps"], steps):
        assert entry["kept"] == kept, name
        for key, scores in (("before", before), ("after", after)):
            assert same(entry[key]["foreground_mean"], scores[1]), (name, key)
            for structure, value in scores[0].items():
                assert same(entry[key]["dice"][structure], value), (name, key, structure)


def traced_peak(function, *args, **kwargs) -> int:
    """The peak traced allocation (bytes) while `function` runs."""
    tracemalloc.start()
    try:
        function(*args, **kwargs)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ---------------------------------------------------------------- keep_largest_component


def random_blobs(seed: int, shape=(18, 16, 14), labels=(1, 2, 3), density=0.03) -> np.ndarray:
    """Sparse random voxels of several labels, dilated into many small pieces, some touching only diagonally."""
    rng = np.random.default_rng(seed)
    out = np.zeros(shape, np.uint8)
    for label in labels:
        seeds = rng.random(shape) < density
        grown = ndimage.binary_dilation(seeds, iterations=int(rng.integers(0, 2)))
        out[grown & (rng.random(shape) < 0.8)] = label
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("structure", [[1], [2], [1, 2], [1, 2, 3]])
def test_keep_largest_component_matches_whole_volume_full_connectivity_labelling(seed, structure):
    """On random maps of many small pieces, the result equals the whole-volume reference (scipy.ndimage.label with
    a 3x3x3 structure, all largest pieces kept) and the return value counts the voxels set to 0."""
    labels = random_blobs(seed)
    expected = largest_pieces_reference(labels, structure)
    removed = keep_largest_component(labels, structure)
    np.testing.assert_array_equal(labels, expected)
    assert removed == int(np.sum(random_blobs(seed) != expected))


def test_keep_largest_component_joins_pieces_touching_only_at_a_corner():
    """Three voxels in a diagonal chain (corner contact only) are one piece of 3 under 26-connectivity, so they
    outlast a face-connected pair; under 6-connectivity the pair would win (checked, so the map tells them apart)."""
    labels = np.zeros((10, 10, 10), np.uint8)
    for i in range(3):
        labels[1 + i, 1 + i, 1 + i] = 1  # the diagonal chain
    labels[7, 7, 5:7] = 1  # the face-connected pair
    six_connected = labels.copy()
    pieces, _ = ndimage.label(six_connected == 1)  # scipy's default: faces only
    sizes = np.bincount(pieces.ravel())[1:]
    six_connected[(pieces > 0) & (pieces != 1 + int(np.argmax(sizes)))] = 0
    assert six_connected[7, 7, 5] == 1 and six_connected[1, 1, 1] == 0

    assert keep_largest_component(labels, [1]) == 2
    assert labels[1, 1, 1] == labels[2, 2, 2] == labels[3, 3, 3] == 1
    assert labels[7, 7, 5] == labels[7, 7, 6] == 0


def test_keep_largest_component_keeps_every_piece_tied_for_largest():
    """Two pieces of 8 voxels and one of 1: both 8-voxel pieces stay (nnU-Net keeps all pieces of the largest
    size), the single voxel goes."""
    labels = np.zeros((12, 12, 12), np.uint8)
    labels[0:2, 0:2, 0:2] = 2
    labels[8:10, 8:10, 8:10] = 2
    labels[5, 0, 11] = 2
    assert keep_largest_component(labels, [2]) == 1
    assert labels[5, 0, 11] == 0 and labels.sum() == 2 * 16


def test_keep_largest_component_of_an_absent_or_single_piece_structure_changes_nothing():
    """No voxel of the structure, or a single piece: 0 removed, the map unchanged (other labels included)."""
    labels = random_blobs(3, labels=(1,))
    labels[0:3, 0:3, 0:3] = 2
    before = labels.copy()
    assert keep_largest_component(labels, [3]) == 0
    assert keep_largest_component(labels, [2]) == 0
    np.testing.assert_array_equal(labels, before)
    assert keep_largest_component(np.zeros((4, 4, 4), np.uint8), [1]) == 0


def test_keep_largest_component_of_a_region_takes_the_union_of_its_labels():
    """Labels 1 and 2 touching form one piece of the region [1, 2]: a lone label-1 voxel far away goes, while the
    class [1] alone would also lose the smaller of its pieces; other labels are untouched."""
    labels = np.zeros((14, 14, 14), np.uint8)
    labels[2:6, 2:6, 2:6] = 1  # 64 voxels of 1
    labels[6:9, 2:6, 2:6] = 2  # 48 voxels of 2, face to face with the 1s
    labels[6:9, 9:12, 2:4] = 1  # 18 voxels of 1 apart from the rest
    labels[12, 12, 12] = 1  # a lone voxel
    labels[0, 13, 0] = 3  # another class, its own piece
    region = labels.copy()
    assert keep_largest_component(region, [1, 2]) == 19
    np.testing.assert_array_equal(region, largest_pieces_reference(labels, [1, 2]))
    assert region[0, 13, 0] == 3
    single = labels.copy()
    assert keep_largest_component(single, [1]) == 19
    np.testing.assert_array_equal(single, largest_pieces_reference(labels, [1]))


def test_keep_largest_component_rejects_background_as_a_structure():
    with pytest.raises(ValueError, match="structure_labels"):
        keep_largest_component(np.zeros((3, 3, 3), np.uint8), [0, 1])


def test_keep_largest_component_works_in_the_structures_box_on_a_large_map():
    """A 512x512x600 uint8 map with a 36,000-voxel structure and a speck: the peak traced allocation stays below an
    eighth of the map's size (a slab's masks; the box's labels), where labelling the whole map would allocate at
    least its bool mask and int32 labels, 5x its size."""
    labels = np.zeros((512, 512, 600), np.uint8)
    labels[200:230, 300:330, 100:140] = 1
    labels[260:262, 300:302, 100:102] = 1
    removed = []
    peak = traced_peak(lambda: removed.append(keep_largest_component(labels, [1])))
    assert removed == [8]
    assert labels[260, 300, 100] == 0 and labels[215, 315, 120] == 1
    assert int(np.count_nonzero(labels)) == 30 * 30 * 40
    assert peak < labels.nbytes / 8, f"peak {peak / 2**20:.1f} MiB for a {labels.nbytes / 2**20:.0f} MiB map"


def test_keep_largest_component_over_a_whole_map_stays_near_four_bytes_per_voxel():
    """Two pieces at opposite corners make the box the whole 256x256x128 map: the peak traced allocation stays below
    4.5 bytes per voxel (uint16 piece numbers, the removed mask and a comparison's temporary), where an int64 copy
    of the piece numbers (np.bincount on the whole box) alone would take 8."""
    labels = np.zeros((256, 256, 128), np.uint8)
    labels[:40, :40, :40] = 1
    labels[-10:, -10:, -10:] = 1
    removed = []
    peak = traced_peak(lambda: removed.append(keep_largest_component(labels, [1])))
    assert removed == [1000] and int(np.count_nonzero(labels)) == 40**3
    assert peak < 4.5 * labels.size, f"peak {peak / labels.size:.2f} bytes per voxel"


def test_keep_largest_component_with_more_pieces_than_uint16_numbers():
    """120,000 isolated voxels (every second voxel on each axis) and one 2-voxel piece apart: beyond 65535 pieces
    the piece numbers are int32, with the same result as the whole-volume reference."""
    labels = np.zeros((100, 100, 100), np.uint8)
    labels[:96:2, ::2, ::2] = 3
    labels[99, 0:2, 0] = 3
    expected = largest_pieces_reference(labels, [3])
    assert keep_largest_component(labels, [3]) == 120_000
    np.testing.assert_array_equal(labels, expected)


def test_apply_postprocessing_runs_the_foreground_step_before_each_listed_structure_in_order():
    """Class 1: a 100-voxel piece; class 2: a 10-voxel piece touching it and a 20-voxel piece apart. The foreground
    first removes the 20-voxel class-2 piece, then class 2's step has one piece left: class 1 and the touching
    class-2 piece stay. (The reverse order would keep the 20-voxel piece, then drop it as foreground.)"""
    labels = np.zeros((16, 16, 16), np.uint8)
    labels[1:6, 1:6, 1:5] = 1  # 100
    labels[6, 1:6, 1:3] = 2  # 10, touching the 1s
    labels[12:14, 10:15, 10:12] = 2  # 20, apart
    spec = PostprocessingConfig(largest_foreground_component=True, largest_component_labels=[[2]])
    expected = largest_pieces_reference(largest_pieces_reference(labels, [1, 2]), [2])
    reverse = largest_pieces_reference(largest_pieces_reference(labels, [2]), [1, 2])
    assert not np.array_equal(expected, reverse)
    result = apply_postprocessing(labels, spec)
    assert result is labels
    np.testing.assert_array_equal(labels, expected)
    assert np.sum(labels == 2) == 10


def test_apply_postprocessing_of_the_default_spec_changes_nothing():
    labels = random_blobs(1)
    before = labels.copy()
    apply_postprocessing(labels, PostprocessingConfig())
    np.testing.assert_array_equal(labels, before)


# ---------------------------------------------------------------- nnU-Net's scores


def test_structure_dice_is_nnunets_formula_with_nan_only_when_both_maps_lack_the_structure():
    """Random maps against 2TP/(2TP+FP+FN); a class in neither map is NaN; a class only predicted scores 0 (not
    NaN, unlike MONAI's rule in tfmis.metrics)."""
    structures = {"1": [1], "2": [2], "3": [3], "4": [4], "whole": [1, 2, 3]}
    for seed in range(4):
        prediction, reference = random_blobs(seed), random_blobs(seed + 10, labels=(1, 2))
        prediction[prediction == 3] = 0
        prediction[0, 0, 0] = 4  # predicted only
        scores = structure_dice(prediction, reference, structures | {"5": [5]})
        for name, labels in structures.items():
            assert same(scores[name], dice_reference(prediction, reference, labels)), name
        assert math.isnan(scores["3"]) and math.isnan(scores["5"]) and scores["4"] == 0.0


def test_case_dice_reads_the_nifti_pair_and_names_structures_as_choose_postprocessing(tmp_path):
    """Per class ("1", "2") or per region name, from the files; equal to the formula on the arrays."""
    prediction, reference = case_with_speck_and_true_second_piece()
    [(prediction_path, reference_path)] = write_cases(tmp_path, [(prediction, reference)])
    scores = case_dice(prediction_path, reference_path, [1, 2])
    assert scores == pytest.approx({"1": dice_reference(prediction, reference, [1]), "2": 1.0})
    regions = {"whole": [1, 2], "core": [2]}
    scores = case_dice(prediction_path, reference_path, [1, 2], regions)
    assert scores == pytest.approx({name: dice_reference(prediction, reference, r) for name, r in regions.items()})


def test_dice_summary_is_nanmean_per_structure_and_plain_mean_over_structures():
    """'mean': np.nanmean over cases (NaN cases left out; all NaN -> NaN); 'foreground_mean': np.mean of those, so
    NaN when one structure never has a Dice."""
    per_case = [{"1": 0.5, "2": math.nan}, {"1": math.nan, "2": 0.9}, {"1": 0.7, "2": 0.6}]
    summary = dice_summary(per_case)
    assert summary["mean"]["1"] == pytest.approx(0.6) and summary["mean"]["2"] == pytest.approx(0.75)
    assert summary["foreground_mean"] == pytest.approx(0.675)
    summary = dice_summary([{"1": 0.5, "2": math.nan}])
    assert math.isnan(summary["mean"]["2"]) and math.isnan(summary["foreground_mean"])


# ---------------------------------------------------------------- choose_postprocessing

SHAPE = (20, 20, 20)


def case_with_speck_and_true_second_piece(speck: int = 3, small_piece: bool = True):
    """Class 1: a 6^3 block (216), predicted with an isolated speck^3 false positive. Class 2: a 6x2x6 block (72)
    face to face with class 1 and, when `small_piece`, a truly separate 1-voxel piece, both predicted."""
    reference = np.zeros(SHAPE, np.uint8)
    reference[2:8, 2:8, 2:8] = 1
    reference[2:8, 8:10, 2:8] = 2
    if small_piece:
        reference[15, 15, 3] = 2
    prediction = reference.copy()
    prediction[14 : 14 + speck, 2 : 2 + speck, 14 : 14 + speck] = 1
    return prediction, reference


def perfect_case(with_class_2: bool = True):
    """Predicted exactly; without class 2 in either map its Dice is NaN for this case."""
    reference = np.zeros(SHAPE, np.uint8)
    reference[4:10, 4:10, 4:10] = 1
    if with_class_2:
        reference[10:12, 4:10, 4:10] = 2
    return reference.copy(), reference


def test_choose_postprocessing_keeps_a_class_step_that_removes_a_false_positive_and_not_one_that_cuts_a_true_piece(
    tmp_path,
):
    """Removing class 1's speck raises its Dice (kept); removing class 2's true 1-voxel piece lowers its Dice (not
    kept). The whole-foreground step, tried first, raises the foreground mean but lowers class 2, so nnU-Net's
    defensive check rejects it. Every number as the whole-volume reference; the report is strict JSON."""
    cases = [case_with_speck_and_true_second_piece(), perfect_case(), perfect_case(with_class_2=False)]
    spec, report = choose_postprocessing(write_cases(tmp_path, cases), [1, 2])

    assert spec == PostprocessingConfig(largest_foreground_component=False, largest_component_labels=[[1]])
    foreground, class_1, class_2 = report["steps"]
    assert [foreground["structure"], class_1["structure"], class_2["structure"]] == ["foreground", "1", "2"]
    assert foreground["after"]["foreground_mean"] > foreground["before"]["foreground_mean"]
    assert foreground["after"]["dice"]["2"] < foreground["before"]["dice"]["2"] and not foreground["kept"]
    assert class_1["kept"] and class_1["voxels_removed"] == 27 and class_1["cases_changed"] == 1
    assert not class_2["kept"] and class_2["voxels_removed"] == 1
    # the formula by hand for case 0: class 1 2*216/(2*216+27) -> 1; class 2 1 -> 2*72/(2*72+1); case 2 has no class 2
    assert class_1["before"]["dice"]["1"] == pytest.approx((2 * 216 / (2 * 216 + 27) + 2) / 3)
    assert class_2["after"]["dice"]["2"] == pytest.approx((2 * 72 / (2 * 72 + 1) + 1) / 2)
    check_against_reference(report, spec, cases, [1, 2])
    assert report["final"]["classes"]["after"]["dice"] == {"1": 1.0, "2": 1.0}
    assert report["final"]["per_case"][2]["after"] == {"1": 1.0, "2": None}
    json.dumps(report, allow_nan=False)


def test_choose_postprocessing_decides_each_class_on_predictions_with_the_kept_foreground_step_applied(tmp_path):
    """Without a true second piece, the foreground step removes the speck and is kept; class 1's step is then tried
    on those predictions, where it removes nothing and so is not kept (on the raw predictions it would have been)."""
    cases = [case_with_speck_and_true_second_piece(small_piece=False), perfect_case()]
    spec, report = choose_postprocessing(write_cases(tmp_path, cases), [1, 2])

    assert spec == PostprocessingConfig(largest_foreground_component=True, largest_component_labels=[])
    foreground, class_1, _ = report["steps"]
    assert foreground["kept"] and foreground["voxels_removed"] == 27
    assert class_1["before"] == foreground["after"] and class_1["after"] == class_1["before"]
    assert class_1["voxels_removed"] == 0 and not class_1["kept"]
    references = [r for _, r in cases]
    raw_before = summary_reference([p for p, _ in cases], references, {"1": [1]})[0]["1"]
    raw_after = summary_reference([largest_pieces_reference(p, [1]) for p, _ in cases], references, {"1": [1]})[0]["1"]
    assert raw_after > raw_before  # on the raw predictions class 1's step would have been kept
    check_against_reference(report, spec, cases, [1, 2])


def test_choose_postprocessing_lists_kept_steps_in_trial_order(tmp_path):
    """Classes 1 and 2 each with a false-positive speck, class 3 with a true second piece (so the foreground step,
    which would cut it, is not kept): the report tries foreground, 1, 2, 3 in that order and the spec lists [1], [2]."""
    reference = np.zeros(SHAPE, np.uint8)
    reference[2:8, 2:8, 2:8] = 1
    reference[10:16, 2:8, 2:8] = 2
    reference[2:8, 12:18, 12:18] = 3
    reference[17, 17, 2] = 3
    prediction = reference.copy()
    prediction[16:18, 12:14, 5:7] = 1
    prediction[12, 14, 14] = 2
    cases = [(prediction, reference), perfect_case()]
    spec, report = choose_postprocessing(write_cases(tmp_path, cases), [1, 2, 3])
    assert [s["structure"] for s in report["steps"]] == ["foreground", "1", "2", "3"]
    assert spec == PostprocessingConfig(largest_foreground_component=False, largest_component_labels=[[1], [2]])
    check_against_reference(report, spec, cases, [1, 2, 3])


def test_choose_postprocessing_with_one_class_tries_only_the_foreground_step(tmp_path):
    """nnU-Net tries per-structure steps only with more than one structure."""
    prediction, reference = case_with_speck_and_true_second_piece(small_piece=False)
    prediction[prediction == 2], reference[reference == 2] = 0, 0
    spec, report = choose_postprocessing(write_cases(tmp_path, [(prediction, reference)]), [1])
    assert [s["structure"] for s in report["steps"]] == ["foreground"]
    assert spec == PostprocessingConfig(largest_foreground_component=True)


def random_box(rng, low: int, high: int) -> tuple[slice, ...]:
    """A box of random size (low..high-1 per axis) at a random place inside SHAPE."""
    size = [int(z) for z in rng.integers(low, high, 3)]
    start = [int(rng.integers(0, s - z + 1)) for s, z in zip(SHAPE, size)]
    return tuple(slice(a, a + z) for a, z in zip(start, size))


def random_oof_case(rng, classes, compact: bool):
    """A reference and an imperfect out-of-fold prediction of it. Compact: class classes[0] a 10^3 block holding the
    other classes' boxes, sometimes (60%) a true second piece of some class apart; scattered: every class 1-2
    boxes anywhere. The prediction: the reference shifted by up to a voxel per axis (half the scattered ones),
    plus 0-2 false-positive specks."""
    reference = np.zeros(SHAPE, np.uint8)
    if compact:
        reference[4:14, 4:14, 4:14] = classes[0]
        for c in classes[1:]:
            reference[tuple(slice(b.start // 2 + 4, b.stop // 2 + 4) for b in random_box(rng, 4, 12))] = c
        if rng.random() < 0.6:
            reference[16:19, 2:4, 2 : 2 + int(rng.integers(1, 4))] = rng.choice(classes)
    else:
        for c in classes:
            for _ in range(rng.integers(1, 3)):
                reference[random_box(rng, 2, 7)] = c
    shifted = compact or rng.random() < 0.5
    prediction = np.roll(reference, rng.integers(-1, 2, 3), axis=(0, 1, 2)) if shifted else reference.copy()
    for _ in range(rng.integers(0, 3)):
        prediction[random_box(rng, 1, 3)] = rng.choice(classes)
    return prediction, reference


@pytest.mark.parametrize(
    "class_labels, regions",
    [([1, 2, 3], None), ([1, 2], {"whole": [1, 2], "core": [2]})],
    ids=["classes", "regions"],
)
def test_choose_postprocessing_matches_determine_postprocessing_on_random_cases(tmp_path, class_labels, regions):
    """Random out-of-fold cases (12 sets of 3, compact and scattered): every step's structure, Dice before/after,
    foreground mean, decision, and the spec as the in-memory transcription of determine_postprocessing; with
    regions, the regions are what is scored and decided. Across the sets both kinds of step are both kept and
    rejected after removing voxels, so the comparison is not vacuous."""
    decisions = set()
    for seed in range(12):
        rng = np.random.default_rng(seed)
        cases = [random_oof_case(rng, class_labels, compact=seed % 2 == 0) for _ in range(3)]
        spec, report = choose_postprocessing(write_cases(tmp_path / str(seed), cases), class_labels, regions)
        check_against_reference(report, spec, cases, class_labels, regions)
        if regions:
            assert report["structures"] == regions and set(report["final"]) == {"classes", "regions", "per_case"}
        decisions |= {(s["structure"] == "foreground", s["kept"]) for s in report["steps"] if s["voxels_removed"] > 0}
    assert decisions == {(True, True), (True, False), (False, True), (False, False)}


def test_choose_postprocessing_writes_the_postprocessed_predictions_when_asked(tmp_path):
    """output_folder: each prediction with the chosen spec applied, under its own name, with its affine."""
    cases = [case_with_speck_and_true_second_piece(), perfect_case()]
    pairs = write_cases(tmp_path, cases)
    spec, _ = choose_postprocessing(pairs, [1, 2], output_folder=tmp_path / "postprocessed")
    for (prediction, _), (path, _) in zip(cases, pairs):
        written = nib.load(str(tmp_path / "postprocessed" / path.name))
        np.testing.assert_array_equal(np.asarray(written.dataobj), apply_postprocessing(prediction.copy(), spec))
        np.testing.assert_allclose(written.affine, lps_affine())


def test_choose_postprocessing_holds_one_case_at_a_time(tmp_path):
    """Twelve 160x40x40 cases: the peak traced allocation is that of one case (within half a case's maps), and below
    half the twelve cases' predictions and references (uint8) held at once."""
    shape = (160, 40, 40)
    cases = []
    for i in range(12):
        reference = np.zeros(shape, np.uint8)
        reference[5:60, 5:30, 5:30] = 1
        reference[60:90, 5:30, 5:30] = 2
        prediction = reference.copy()
        prediction[150, 35, i % 40] = 1 + i % 2
        cases.append((prediction, reference))
    pairs = write_cases(tmp_path, cases)
    choose_postprocessing(pairs[:1], [1, 2])  # first-call imports and caches out of the measurement
    one, twelve = (
        traced_peak(choose_postprocessing, pairs[:1], [1, 2]),
        traced_peak(choose_postprocessing, pairs, [1, 2]),
    )
    pair_bytes = 2 * int(np.prod(shape))
    assert twelve < one + pair_bytes / 2, f"peak {twelve / 2**20:.2f} MiB for 12 cases, {one / 2**20:.2f} MiB for 1"
    assert twelve < 12 * pair_bytes / 2


def test_choose_postprocessing_names_the_file_and_fix_for_user_errors(tmp_path):
    prediction, reference = perfect_case()
    pairs = write_cases(tmp_path, [(prediction, reference)])
    with pytest.raises(FileNotFoundError, match="reference .*missing.nii.gz not found"):
        choose_postprocessing([(pairs[0][0], tmp_path / "missing.nii.gz")], [1, 2])
    small = write_nifti(tmp_path / "small.nii.gz", np.zeros((4, 4, 4)), lps_affine(), np.uint8)
    with pytest.raises(ValueError, match="small.nii.gz has shape"):
        choose_postprocessing([(pairs[0][0], small)], [1, 2])
    with pytest.raises(ValueError, match="outside the classes 0..1"):
        choose_postprocessing(pairs, [1])
    with pytest.raises(ValueError, match="class_labels"):
        choose_postprocessing(pairs, [0, 1])
    with pytest.raises(ValueError, match="regions.core"):
        choose_postprocessing(pairs, [1, 2], regions={"core": [3]})
    with pytest.raises(ValueError, match="no cases"):
        choose_postprocessing([], [1, 2])
