"""The cascade's regions at real anatomy: one region per structure, small pieces kept, the coarse stage finding nothing,
regions at the scan's border, flipped and anisotropic affines.

Both stages are real `Predictor`s (run folders, preprocessing, sliding window, restore to the scan's grid) whose
network is a fixed per-voxel intensity classifier (a 1x1x1 convolution: background below 0.5, class 1 from 0.5,
class 2 from 1.5), so what each stage finds is known without training: the full-resolution reference is the fine
network over the whole scan, and the cascade must equal it wherever the coarse stage found a structure.
"""

from __future__ import annotations

import json

import keras
import nibabel as nib
import numpy as np
import pytest

from tfmis.config import load_config, save_config
from tfmis.data.preprocess import PreprocessConfig
from tfmis.data.records import RUN_DATA_FILE
from tfmis.inference import cascade as cascade_module
from tfmis.inference.cascade import CascadePredictor, coarse_regions, make_predictor
from tfmis.inference.inputs import InputCase
from tfmis.inference.outputs import write_csv
from tfmis.inference.predictor import Predictor
from tfmis.metrics.boxes import merge_boxes
from tfmis.task import SegmentationTask

CLASSES = ["background", "organ", "lesion"]
FINE_SPACING = (1.0, 1.0, 2.0)
COARSE_SPACING = (2.0, 2.0, 4.0)


def threshold_network(never_foreground: bool = False) -> keras.Model:
    """logits (0, 4x - 2, 8x - 8): argmax 0 below x = 0.5, 1 in [0.5, 1.5), 2 from 1.5; all background when asked."""
    inputs = keras.Input((None, None, None, 1))
    conv = keras.layers.Conv3D(3, 1)
    model = keras.Model(inputs, conv(inputs))
    kernel = np.array([0.0, 4.0, 8.0], np.float32).reshape(1, 1, 1, 1, 3)
    bias = np.array([0.0, -2.0, -8.0], np.float32) - (np.array([0, 100, 100], np.float32) if never_foreground else 0)
    conv.set_weights([kernel, bias])
    return model


def make_run(folder, spacing, patch, **cascade) -> None:
    """A run folder the `Predictor` reads: config.yaml, the training data's description and (unused) weights."""
    folder.mkdir(parents=True)
    overrides = [
        f"output.dir={folder}",
        f"data.dataset_dir={folder / 'records'}",
        f"pipeline.patch_size=[{patch[0]},{patch[1]},{patch[2]}]",
        "model.filters=[4,8]",
        "model.strides=[1,2]",
        "model.deep_supervision=0",
        "validation.num_sw_batch_size=2",
    ] + [f"cascade.{k}={v}" for k, v in cascade.items()]
    config = load_config(None, overrides)
    save_config(config, folder / "config.yaml")
    preprocessing = PreprocessConfig(spacing=spacing, normalization=("none",), image_dtype="float32")
    info = {
        "preprocessing": preprocessing.to_dict(),
        "source": {"labels": CLASSES, "modalities": ["MR"]},
        "cases": {},
    }
    (folder / RUN_DATA_FILE).write_text(json.dumps(info))
    SegmentationTask(config, data_info=info).build_inference_model().save_weights(str(folder / "best.weights.h5"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(coarse run folder, fine run folder) of a cascade on a 2x2x4 mm and a 1x1x2 mm grid."""
    root = tmp_path_factory.mktemp("cascade_regions")
    make_run(root / "coarse", COARSE_SPACING, (16, 16, 8))
    make_run(root / "fine", FINE_SPACING, (24, 24, 12), coarse_run=str(root / "coarse"), margin_mm=6.0)
    return root / "coarse", root / "fine"


def cascade(runs, coarse_never_finds: bool = False, **cascade_settings) -> CascadePredictor:
    """The cascade of `runs` with both networks replaced by the intensity classifier."""
    coarse_dir, fine_dir = runs
    config = load_config(fine_dir / "config.yaml")
    for key, value in cascade_settings.items():
        setattr(config.cascade, key, value)
    predictor = make_predictor(config, fine_dir, device="cpu")
    predictor.fine.model = threshold_network()
    predictor.coarse.model = threshold_network(never_foreground=coarse_never_finds)
    return predictor


def reference(runs, image, affine) -> np.ndarray:
    """The full-resolution reference: the fine network over the whole scan."""
    predictor = Predictor(load_config(runs[1] / "config.yaml"), runs[1], device="cpu")
    predictor.model = threshold_network()
    return predictor.predict_array(image, affine, probabilities=False)[0]


def sphere(shape, centre, radius_mm, spacing) -> np.ndarray:
    grid = np.indices(shape, dtype=np.float64)
    d2 = sum(((grid[a] - centre[a]) * spacing[a]) ** 2 for a in range(3))
    return d2 <= radius_mm**2


def far_apart_scan(spacing=FINE_SPACING, flip=False):
    """(image (X, Y, Z, 1), affine, truth): two organs (value 1) at opposite ends of a 160x96x64 scan and a small
    lesion (value 2, radius 4 mm, under 1 % of the foreground) between them, away from both."""
    shape = (160, 96, 64)
    truth = np.zeros(shape, np.uint8)
    truth[sphere(shape, (25, 48, 14), 22, spacing)] = 1
    truth[sphere(shape, (135, 48, 50), 22, spacing)] = 1
    truth[sphere(shape, (80, 16, 32), 4, spacing)] = 2
    affine = np.diag([*spacing, 1.0])
    if flip:  # LPS voxel order, as DICOM converters write
        affine = np.diag([-spacing[0], -spacing[1], spacing[2], 1.0])
        affine[:3, 3] = (shape[0] * spacing[0], shape[1] * spacing[1], -40.0)
    return truth.astype(np.float32)[..., None], affine, truth


def inside_any(boxes, shape) -> np.ndarray:
    mask = np.zeros(shape, bool)
    for box in boxes:
        mask[box] = True
    return mask


@pytest.mark.parametrize("flip", [False, True], ids=["ras", "lps"])
def test_far_structures_and_a_small_lesion_each_get_a_region_and_the_cascade_equals_full_resolution(runs, flip):
    """Two organs at opposite ends and a small lesion apart from both: the coarse stage's pieces give three
    disjoint regions (each around its structure, under half the scan together, not one box over the whole span),
    and the cascade's label map equals the fine network over the whole scan everywhere, the lesion included (a
    single box without the pieces under 1 % of the foreground, as before, loses it). Holds for RAS and for
    flipped (LPS) anisotropic affines."""
    image, affine, truth = far_apart_scan(flip=flip)
    predictor = cascade(runs)
    labels = predictor.predict_array(image, affine, probabilities=False)[0]
    boxes = predictor.last_boxes
    assert len(boxes) == 3, boxes
    assert merge_boxes(boxes) == boxes  # disjoint
    covered = inside_any(boxes, truth.shape)
    assert covered[truth > 0].all()
    assert covered.mean() < 0.5
    assert predictor.last_region.startswith("3 regions = ")
    np.testing.assert_array_equal(labels, reference(runs, image, affine))
    assert (labels == 2).sum() == (truth == 2).sum()


def test_the_old_single_box_loses_the_small_lesion(runs):
    """The premise of the test above: one box around the coarse foreground without its pieces under 1 % (the code
    before regions) does not hold the lesion, so a label map made from it would have no lesion."""
    image, affine, truth = far_apart_scan()
    predictor = cascade(runs)
    grid = predictor.coarse.grid_prediction(image, affine)
    from scipy import ndimage

    foreground = grid.grid_labels() > 0
    pieces, count = ndimage.label(foreground)
    sizes = np.bincount(pieces.ravel())[1:]
    kept = np.isin(pieces, 1 + np.flatnonzero(sizes >= 0.01 * sizes.sum()))
    assert count == 3 and kept.sum() < foreground.sum()
    lesion_piece = pieces == pieces[tuple(np.argwhere(grid.grid_labels() == 2)[0])]
    assert not (kept & lesion_piece).any()


def test_fine_classes_are_replaced_only_inside_the_regions(runs):
    """With `cascade.fine_classes` [2], the label map is the coarse stage's outside the regions (bit for bit) and,
    inside them, the coarse stage's with class 2 taken from the fine stage."""
    image, affine, truth = far_apart_scan()
    predictor = cascade(runs, fine_classes=[2])
    labels = predictor.predict_array(image, affine, probabilities=False)[0]
    coarse = predictor.coarse.predict_array(image, affine, probabilities=False)[0]
    fine = reference(runs, image, affine)
    covered = inside_any(predictor.last_boxes, truth.shape)
    np.testing.assert_array_equal(labels[~covered], coarse[~covered])
    expected = np.where(fine == 2, 2, np.where(coarse == 2, 0, coarse))
    np.testing.assert_array_equal(labels[covered], expected[covered])
    assert (labels == 2).sum() == (truth == 2).sum()


def test_a_structure_at_the_scan_border_gets_a_clipped_region(runs):
    """An organ cut by the scan's first and last slices: its region is clipped to the scan and the cascade equals
    the fine network over the whole scan there."""
    shape = (80, 80, 40)
    truth = np.zeros(shape, np.uint8)
    truth[sphere(shape, (2, 40, 20), 15, FINE_SPACING)] = 1
    truth[70:80, 70:80, 30:40] = 1  # a block in the far corner, touching three faces
    image, affine = truth.astype(np.float32)[..., None], np.diag([*FINE_SPACING, 1.0])
    predictor = cascade(runs)
    labels = predictor.predict_array(image, affine, probabilities=False)[0]
    assert len(predictor.last_boxes) == 2
    assert any(b[0].start == 0 for b in predictor.last_boxes)
    assert any(b[2].stop == shape[2] and b[0].stop == shape[0] for b in predictor.last_boxes)
    np.testing.assert_array_equal(labels, reference(runs, image, affine))


def lesion_only_scan():
    """(image, affine, truth): `far_apart_scan`'s small lesion alone, at the same place, without the organs."""
    image, affine, truth = far_apart_scan()
    truth = np.where(truth == 2, truth, 0).astype(np.uint8)
    return truth.astype(np.float32)[..., None], affine, truth


LESION_UNDER_MM3 = 2000.0  # above the lesion's volume (about 270 mm3), far under an organ's (about 44,600 mm3)


@pytest.mark.parametrize("fine_classes", [None, [2]], ids=["all_classes", "fine_classes"])
def test_a_small_piece_keeps_the_coarse_label_alone_or_beside_a_big_one(runs, fine_classes):
    """The one rule for a piece under `cascade.min_region_mm3`: it keeps the coarse stage's label, never dropped,
    whether it is alone in the scan (no region at all, the fine stage does not run) or beside organs that get
    regions; with and without `fine_classes`. Outside the regions (the lesion included) the label map is the coarse
    stage's bit for bit, and inside them the fine stage's."""
    for make_scan, regions in ((far_apart_scan, 2), (lesion_only_scan, 0)):
        image, affine, truth = make_scan()
        predictor = cascade(runs, min_region_mm3=LESION_UNDER_MM3, fine_classes=fine_classes)
        labels = predictor.predict_array(image, affine, probabilities=False)[0]
        coarse = predictor.coarse.predict_array(image, affine, probabilities=False)[0]
        assert len(predictor.last_boxes) == regions, predictor.last_boxes
        assert "1 piece under cascade.min_region_mm3 keeps the coarse label" in predictor.last_region
        covered = inside_any(predictor.last_boxes, truth.shape)
        assert not covered[truth == 2].any()  # the lesion has no region
        np.testing.assert_array_equal(labels[~covered], coarse[~covered])
        found = labels[truth == 2]  # at the coarse resolution: 2 at its core, 1 where it blurs into the background
        assert (found == 2).any() and (found > 0).mean() > 0.8, np.bincount(found)
        if fine_classes is None:
            np.testing.assert_array_equal(labels[covered], reference(runs, image, affine)[covered])


def test_a_small_piece_over_the_minimum_gets_a_region_of_at_least_the_fine_patch_alone_or_beside_others(runs):
    """With `cascade.min_region_mm3` 0 (the plan's) the lesion is a region alone and beside the organs: its box is
    grown to at least the fine stage's patch (24x24x12 voxels of 1x1x2 mm, from its 6 mm margin around 8 mm), and
    the cascade equals the fine network over the whole scan."""
    for make_scan, regions in ((far_apart_scan, 3), (lesion_only_scan, 1)):
        image, affine, truth = make_scan()
        predictor = cascade(runs)
        labels = predictor.predict_array(image, affine, probabilities=False)[0]
        assert len(predictor.last_boxes) == regions
        (box,) = [b for b in predictor.last_boxes if inside_any([b], truth.shape)[truth == 2].all()]
        assert [s.stop - s.start for s in box] >= [24, 24, 12], box
        np.testing.assert_array_equal(labels, reference(runs, image, affine))


def far_apart_and_speck_scan():
    """`far_apart_scan` with a speck (2x2x1 voxels of the lesion's value) in a corner, away from everything."""
    image, affine, truth = far_apart_scan()
    truth[150:152, 4:6, 60] = 2
    return truth.astype(np.float32)[..., None], affine, truth


@pytest.mark.parametrize(
    "settings, coarse_never_finds",
    [
        ({}, False),
        ({"fine_classes": [2]}, False),
        ({"fine_classes": [1]}, False),
        ({"min_region_mm3": LESION_UNDER_MM3}, False),
        ({"min_region_mm3": LESION_UNDER_MM3, "fine_classes": [2]}, False),
        ({"fine_classes": [2]}, True),
    ],
    ids=["all_classes", "fine_lesion", "fine_organ", "small_pieces_coarse", "small_pieces_fine_lesion", "fallback"],
)
def test_the_label_map_is_the_argmax_of_the_returned_probabilities_in_every_mode(runs, settings, coarse_never_finds):
    """The returned probabilities describe the returned label map: a distribution per voxel whose argmax is the label,
    in every mode (every class from the fine stage, `fine_classes`, small pieces at the coarse resolution, the
    whole-scan fallback), and the label map is the one returned without probabilities."""
    image, affine, _ = far_apart_and_speck_scan()
    predictor = cascade(runs, coarse_never_finds=coarse_never_finds, **settings)
    labels, probabilities, _ = predictor.predict_array(image, affine, probabilities=True)
    assert probabilities.shape == (*labels.shape, len(CLASSES))
    np.testing.assert_allclose(probabilities.sum(axis=-1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(np.argmax(probabilities, axis=-1), labels)
    np.testing.assert_array_equal(predictor.predict_array(image, affine, probabilities=False)[0], labels)
    assert (labels == 1).any() and (labels == 2).any()


def test_fine_classes_compose_the_fine_stages_probabilities_with_the_coarse_stages(runs, monkeypatch):
    """With `fine_classes` [2], a region's probability of class 2 is the fine stage's, and the fine stage's
    probability of the other classes is shared between them as the coarse stage shares it; outside the regions the
    probabilities are the coarse stage's. Composed a few slices at a time (a region of hundreds of chunks here), the
    results are the same."""
    image, affine, truth = far_apart_scan()
    predictor = cascade(runs, fine_classes=[2])
    labels, probabilities, _ = predictor.predict_array(image, affine, probabilities=True)
    monkeypatch.setattr(cascade_module, "REGION_CHUNK_VOXELS", 300)
    for asked in (True, False):
        chunked = predictor.predict_array(image, affine, probabilities=asked)
        np.testing.assert_array_equal(chunked[0], labels)
        if asked:
            np.testing.assert_array_equal(chunked[1], probabilities)
    coarse = predictor.coarse.predict_array(image, affine, probabilities=True)[1]
    fine = reference_probabilities(runs, image, affine)
    covered = inside_any(predictor.last_boxes, truth.shape)
    np.testing.assert_array_equal(probabilities[~covered], coarse[~covered])
    inside = covered & (truth > 0)  # the fine stage's foreground crop in each region: the labelled voxels
    np.testing.assert_allclose(probabilities[inside][:, 2], fine[inside][:, 2], atol=1e-6)
    rest = (fine[inside][:, 0] + fine[inside][:, 1])[:, None]
    share = coarse[inside][:, :2] / coarse[inside][:, :2].sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(probabilities[inside][:, :2], rest * share, atol=1e-6)


def reference_probabilities(runs, image, affine) -> np.ndarray:
    """The fine network's probabilities over the whole scan."""
    predictor = Predictor(load_config(runs[1] / "config.yaml"), runs[1], device="cpu")
    predictor.model = threshold_network()
    return predictor.predict_array(image, affine, probabilities=True)[1]


def test_when_the_coarse_stage_finds_nothing_the_fine_stage_decides_every_class_over_the_whole_scan(runs, tmp_path):
    """The coarse network says background everywhere: the fine stage runs over the whole scan and decides every
    class, also with `cascade.fine_classes` (there is no coarse label to keep), so the result is the full-resolution
    reference; predictions.csv's `region` column says the coarse stage found nothing."""
    image, affine, truth = far_apart_scan()
    path = tmp_path / "case.nii.gz"
    nib.save(nib.Nifti1Image(image[..., 0], affine), str(path))
    predictor = cascade(runs, coarse_never_finds=True, fine_classes=[2])
    result = predictor.predict_file(InputCase("case", str(path)), tmp_path / "out")
    assert result.status == "ok", result.reason
    written = np.asarray(nib.load(result.output).dataobj)
    np.testing.assert_array_equal(written, reference(runs, image, affine))
    assert (written == 1).any() and (written == 2).any()
    write_csv([result], tmp_path / "out" / "predictions.csv", CLASSES)
    text = (tmp_path / "out" / "predictions.csv").read_text()
    assert "whole scan (the coarse stage found nothing)" in text


def test_coarse_regions_map_a_coarse_piece_onto_the_scan_through_a_flipped_anisotropic_affine(runs):
    """The box of a coarse piece, mapped through an LPS affine with 0.8x0.8x3 mm voxels, lies on the structure in
    the scan's own voxel order: it holds the structure's voxels, and per side the margin give or take one coarse
    voxel (the coarse stage sees the structure's edge on its own grid)."""
    spacing = (0.8, 0.8, 3.0)
    shape = (100, 90, 30)
    truth = np.zeros(shape, np.uint8)
    truth[sphere(shape, (70, 30, 10), 8, spacing)] = 1
    affine = np.diag([-spacing[0], -spacing[1], spacing[2], 1.0])
    predictor = cascade(runs)
    grid = predictor.coarse.grid_prediction(truth.astype(np.float32)[..., None], affine)
    (box,), small = coarse_regions(grid, affine, margin_mm=6.0)
    assert small == 0
    where = np.argwhere(truth > 0)
    first, last = where.min(axis=0), where.max(axis=0) + 1
    margin = np.ceil(6.0 / np.asarray(spacing))
    coarse_voxel = np.ceil(np.asarray(COARSE_SPACING) / np.asarray(spacing))
    for axis, s in enumerate(box):
        low = max(first[axis] - margin[axis], 0)
        high = min(last[axis] + margin[axis], shape[axis])
        assert s.start <= first[axis] and s.stop >= last[axis], (axis, s, first, last)
        assert abs(s.start - low) <= coarse_voxel[axis] + 1 and abs(s.stop - high) <= coarse_voxel[axis] + 1, (
            axis,
            s,
            low,
            high,
        )


def test_the_plan_records_the_regions_the_training_labels_give(tmp_path):
    """The fingerprint's first pass records each case's label pieces (found on ~4 mm cells, boxed on its voxels) and
    the cascade's fine stage plan sets `cascade.min_region_mm3` to 0 with the measured regions in its reason and
    summary. With a 5 mm margin two far organs and a small lesion make three regions per case, their volume and
    share that of the three grown boxes clipped to the foreground crop (recomputed here from the label by hand)."""
    from tfmis.hardware import Hardware
    from tfmis.planning.fingerprint import fingerprint_msd
    from tfmis.planning.planner import ExperimentPlanner
    from tfmis.planning.stages import CASCADE_MARGIN_MM, StagePlanner, measure_regions

    root = tmp_path / "far"
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    cases = []
    for i in range(3):
        image, affine, truth = far_apart_scan()
        nib.save(nib.Nifti1Image(image[..., 0] * 100 + 10, affine), str(root / "imagesTr" / f"c_{i}.nii.gz"))
        nib.save(nib.Nifti1Image(truth, affine), str(root / "labelsTr" / f"c_{i}.nii.gz"))
        cases.append({"image": f"./imagesTr/c_{i}.nii.gz", "label": f"./labelsTr/c_{i}.nii.gz"})
    (root / "dataset.json").write_text(
        json.dumps(
            {
                "name": "far",
                "modality": {"0": "MR"},
                "labels": {"0": "background", "1": "organ", "2": "lesion"},
                "training": cases,
                "test": [],
                "numTraining": 3,
            }
        )
    )
    fingerprint = fingerprint_msd(root, workers=1, progress=False)
    counts, volumes, shares = measure_regions(fingerprint, CASCADE_MARGIN_MM / 4)
    assert counts == [3, 3, 3]
    _, _, truth = far_apart_scan()
    labelled = np.argwhere(truth > 0)  # the foreground crop: the image is 10 (background) outside the labels
    crop_first, crop_last = labelled.min(axis=0), labelled.max(axis=0) + 1
    expected = 0.0
    for centre, radius in (((25, 48, 14), 22), ((135, 48, 50), 22), ((80, 16, 32), 4)):
        where = np.argwhere(sphere(truth.shape, centre, radius, FINE_SPACING))
        first, last = where.min(axis=0), where.max(axis=0) + 1
        margin = np.array([5, 5, 3])  # 5 mm = ceil(5 / 1, 5 / 1, 5 / 2) voxels of 1x1x2 mm
        first, last = np.maximum(first - margin, 0), np.minimum(last + margin, truth.shape)  # within the scan
        first, last = np.maximum(first, crop_first), np.minimum(last, crop_last)  # within the foreground crop
        expected += float(np.prod(last - first)) * 2.0
    np.testing.assert_allclose(volumes, [expected] * 3)
    np.testing.assert_allclose(shares, [expected / 2.0 / np.prod(crop_last - crop_first)] * 3)
    assert all(0 < s < 1 for s in shares)
    hardware = Hardware(cpu_name="test cpu", cpu_count=2, host_memory_mb=24_000, host_available_mb=20_000)
    # this small phantom's low-resolution stage would save under 2x, so no cascade is a candidate: its fine stage's
    # regions step is applied to a full-resolution plan
    fine = ExperimentPlanner(fingerprint, hardware, output_dir=str(tmp_path / "run")).plan()
    StagePlanner(fingerprint, hardware).determine_regions(fine)
    assert fine.values["cascade.min_region_mm3"] == 0.0
    at_plan_margin = measure_regions(fingerprint, CASCADE_MARGIN_MM)  # 20 mm: this small phantom's boxes merge
    assert fine.summary["regions"]["per_case"] == at_plan_margin[0]
    median = np.median(at_plan_margin[0])
    assert f"the training labels give {median:g} region(s) per case" in fine.reasons["cascade.min_region_mm3"]
