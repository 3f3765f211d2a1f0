"""Stages (fullres / lowres / cascade) in the plan, the fine stage's label-box conversion, training every stage in
order with --resume per stage, and prediction through the cascade."""

from __future__ import annotations

import csv
import dataclasses
import math
import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest

from tfmis.config import ConfigError, load_config, load_stages, write_stages
from tfmis.data.preprocess import PreprocessConfig, preprocess
from tfmis.hardware import Hardware
from tfmis.planning.fingerprint import DatasetFingerprint
from tfmis.planning.rules import lowres_spacing, patch_coverage
from tfmis.planning.stages import CASCADE_MARGIN_MM, MIN_VOXELS_ACROSS, plan_stages

CPU = Hardware(cpu_name="test cpu", cpu_count=2, host_memory_mb=24_000, host_available_mb=20_000)


def fingerprint(spacing, crop_shape, class_volumes_mm3, label_extent_mm, n=8, labels=None, modality="MRI"):
    """A fingerprint of `n` identical cases (the planner reads medians, so one case's numbers decide)."""
    k = len(class_volumes_mm3)
    return DatasetFingerprint(
        name="synthetic",
        modalities=[modality],
        labels=labels or ["background"] + [f"class{i}" for i in range(1, k)],
        case_ids=[f"case_{i:03d}" for i in range(n)],
        spacings=np.array([spacing] * n, dtype=np.float64),
        crop_shapes=np.array([crop_shape] * n, dtype=np.float64),
        class_voxels=[int(v / np.prod(spacing)) * n for v in class_volumes_mm3],
        ct_window=None,
        intensity=[],
        cases_without_foreground=[],
        skipped={},
        source="synthetic",
        source_dir="/data/synthetic",
        class_volumes_mm3=np.array([class_volumes_mm3] * n, dtype=np.float64),
        label_extents_mm=np.array([label_extent_mm] * n, dtype=np.float64),
    )


def nnunet_lowres_loop(spacing, median_shape, patch_at, threshold=0.25, factor=1.03):
    """nnU-Net v2's ExperimentPlanner.plan_experiment loop for 3d_lowres, written out as it reads there."""
    fullres = np.array(spacing, dtype=np.float64)
    lowres = fullres.copy()
    median = np.array(median_shape, dtype=np.float64)
    num_voxels_in_patch = np.prod(patch_at(fullres, median))
    median_num_voxels = np.prod(median)
    while num_voxels_in_patch / median_num_voxels < threshold:
        max_spacing = max(lowres)
        if np.any((max_spacing / lowres) > 2):
            lowres[(max_spacing / lowres) > 2] *= factor
        else:
            lowres *= factor
        median_num_voxels = np.prod(fullres / lowres * median)
        num_voxels_in_patch = np.prod(patch_at(lowres, fullres / lowres * median))
    return lowres


@pytest.mark.parametrize(
    "spacing, shape", [([1.0, 1.0, 1.0], [140, 170, 140]), ([0.8, 0.8, 3.0], [420, 330, 120]), ([2, 2, 2], [40] * 3)]
)
def test_lowres_spacing_is_nnunets_loop(spacing, shape):
    """rules.lowres_spacing raises the spacing exactly as nnU-Net v2's loop (finer axes first, 3% a step, until
    the patch covers 25% of the median image), for a patch that is clipped to the median image."""

    def patch_at(s, m):
        return [min(48.0, float(x)) for x in m]

    ours, median, patch, _ = lowres_spacing(spacing, shape, patch_at)
    np.testing.assert_allclose(ours, nnunet_lowres_loop(spacing, shape, patch_at), rtol=1e-12)
    assert patch_coverage(patch, median) >= 0.25


def test_demo_sized_data_stays_one_full_resolution_stage():
    """A small image (the demo brain at 2.5 mm) is covered by the CPU patch: fullres, one stage, the reason says
    how much of the median image the patch covers."""
    staged = plan_stages(fingerprint([2.5] * 3, [58, 74, 62], [9e6, 1.2e6, 6.6e5, 4.6e3], [135, 190, 165]), CPU)
    assert staged.configuration == "fullres" and [n for n, _ in staged.stages] == ["fullres"]
    assert "covers 41.6% of the median image 58x74x62" in staged.decision[0]
    assert staged.final.values["data.conversion.spacing"] == [2.5, 2.5, 2.5]


def test_brats_sized_large_structures_get_one_low_resolution_stage():
    """BraTS at 1 mm: the 48^3 CPU patch covers ~3% of the brain; the tumour classes are tens of mm across, so
    one low-resolution stage at nnU-Net's lowres spacing (~2 mm) gets the whole budget."""
    fp = fingerprint([1.0] * 3, [140, 172, 140], [3e6, 6e4, 2.5e4, 1.5e4], [70, 80, 60])
    staged = plan_stages(fp, CPU)
    assert staged.configuration == "lowres" and [n for n, _ in staged.stages] == ["lowres"]
    spacing = staged.final.values["data.conversion.spacing"]
    assert 1.8 < spacing[0] < 2.6 and spacing[0] == spacing[1] == spacing[2]
    smallest = 2 * (3 * 1.5e4 / (4 * math.pi)) ** (1 / 3) / spacing[0]
    assert smallest >= MIN_VOXELS_ACROSS
    assert any("low-resolution voxels" in line for line in staged.decision)
    assert staged.final.values["data.dataset_dir"].endswith("_lowres")


def test_ct_sized_small_organ_gets_a_cascade():
    """Abdominal CT at 0.8 mm: a large organ and a small one (2 cm^3) in a box a fraction of the scan: a coarse stage
    on the whole scan and a fine full-resolution stage on the labels' box + margin, sharing the time budget; the
    small class is the fine stage's, the large one the coarse stage's."""
    fp = fingerprint([0.8, 0.8, 2.5], [480, 360, 240], [5e7, 3e6, 2e3], [120, 90, 80], labels=None, modality="MRI")
    staged = plan_stages(fp, CPU, output_dir="runs/ct", dataset_dir="data/ct_tfrecords", max_minutes=10)
    assert staged.configuration == "cascade"
    (coarse_name, coarse), (fine_name, fine) = staged.stages
    assert (coarse_name, fine_name) == ("lowres", "cascade")
    assert coarse.values["output.dir"] == "runs/ct/lowres" and fine.values["output.dir"] == "runs/ct/cascade"
    assert fine.values["cascade.coarse_run"] == "runs/ct/lowres"
    assert fine.values["data.conversion.crop_to_label_mm"] == CASCADE_MARGIN_MM
    assert fine.values["data.conversion.spacing"] == [0.8, 0.8, 2.5]
    assert min(coarse.values["data.conversion.spacing"]) > 2.0
    assert coarse.values["training.max_minutes"] + fine.values["training.max_minutes"] == pytest.approx(10)
    assert coarse.values["training.epochs"] < fine.values["training.epochs"] * 2  # the budget is shared
    header = "\n".join(fine.header)
    assert "cascade" in header and "covers" in header
    # the classes under 10 low-resolution voxels across are the fine stage's; the large ones stay the coarse one's
    coarsest = max(coarse.values["data.conversion.spacing"])
    across = [(6 * v / math.pi) ** (1 / 3) / coarsest for v in (3e6, 2e3)]  # the foreground classes
    assert across[0] >= MIN_VOXELS_ACROSS > across[1]
    assert fine.values["cascade.fine_classes"] == [2]


def test_labels_filling_the_image_keep_full_resolution():
    """Small structures everywhere (the labels' box is the whole image): a coarse stage cannot narrow the region,
    so full resolution stays, and the decision says so."""
    fp = fingerprint([0.8, 0.8, 2.5], [480, 360, 240], [5e7, 2e5, 2e3], [384, 288, 600])
    staged = plan_stages(fp, CPU)
    assert staged.configuration == "fullres"
    assert "a coarse stage cannot narrow them" in staged.decision[-1]


def test_far_apart_structures_get_a_cascade_when_their_regions_are_small_though_their_box_is_large():
    """Two small structures at opposite ends of the scan: the labels' single box + 20 mm fills the image (full
    resolution without label pieces, as before), but a box per piece is a few percent of it, so with the
    fingerprint's label pieces the plan is a cascade and says why."""
    one_box = fingerprint([0.8, 0.8, 2.5], [480, 360, 240], [5e7, 2e5, 2e3], [384, 288, 600])
    assert plan_stages(one_box, CPU).configuration == "fullres"
    cell = [4.0, 4.0, 5.0]
    pieces = {
        "cell_mm": cell,
        "shape": [96, 72, 120],
        "pieces": [[[5, 5, 2], [15, 15, 10]], [[80, 60, 110], [90, 70, 118]]],
    }
    far = dataclasses.replace(one_box, label_pieces=[pieces] * one_box.num_cases)
    staged = plan_stages(far, CPU, output_dir="runs/far")
    assert staged.configuration == "cascade"
    assert any("regions (a box per connected piece" in line and "median 2 per case" in line for line in staged.decision)
    fine = staged.stages[-1][1]
    assert fine.summary["regions"]["per_case"] == [2] * one_box.num_cases


def test_stages_file_round_trip_and_clear_errors(tmp_path):
    """A stages file names stage configs in order; load_config on it says how to train it; a missing stage
    config is named."""
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("training:\n  epochs: 1\n")
    b.write_text("training:\n  epochs: 2\n")
    path = write_stages(tmp_path / "plan.yaml", [("lowres", a), ("fullres", b)], ["why: numbers"])
    assert load_stages(path) == [("lowres", a), ("fullres", b)]
    assert load_stages(a) is None
    with pytest.raises(ConfigError, match="plan of several stages .*python -m tfmis.train --config"):
        load_config(path)
    b.unlink()
    with pytest.raises(ConfigError, match=f"stage fullres: config file {b} does not exist"):
        load_stages(path)


def test_crop_to_label_keeps_the_labels_box_plus_margin():
    """crop_to_label_mm cuts the labels' box grown by the margin (ceil(mm / spacing) voxels per side) instead of
    the foreground box; without labelled voxels the foreground crop stays."""
    image = np.random.default_rng(0).normal(size=(60, 50, 30, 1)).astype(np.float32) + 5
    label = np.zeros((60, 50, 30), np.uint8)
    label[20:30, 10:20, 12:15] = 1
    affine = np.diag([1.0, 2.0, 3.0, 1.0])
    config = PreprocessConfig(spacing=(1.0, 2.0, 3.0), crop_to_label_mm=6.0)
    out, out_label, geometry = preprocess(image, label, affine, config)
    assert geometry.crop_start == [14, 7, 10] and geometry.crop_stop == [36, 23, 17]
    assert out.shape[:3] == (22, 16, 7) and out_label.sum() == label.sum()
    _, _, whole = preprocess(image, np.zeros_like(label), affine, config)
    assert whole.crop_start == [0, 0, 0] and whole.crop_stop == [60, 50, 30]


def _run(args, cwd):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def cascade_run(tmp_path_factory):
    """A cascade trained for two epochs per stage on the small CT demo, by `train --source-dir`."""
    from tfmis.data.demos.ct import make_ct_dataset

    root = tmp_path_factory.mktemp("cascade")
    # large enough that the CPU patch (at most 48^3 voxels) covers under 25% of the median image, so the forced
    # cascade has a real low-resolution stage (a smaller image is refused: its coarse stage would be full resolution)
    make_ct_dataset(root / "ct", num_cases=6, num_test=1, shape=(192, 192, 64))
    args = [
        "-m",
        "tfmis.train",
        "--source-dir",
        str(root / "ct"),
        "--configuration",
        "cascade",
        "--set",
        f"output.dir={root / 'run'}",
        "--set",
        f"data.dataset_dir={root / 'tfrecords'}",
        "--set",
        "training.epochs=2",
        "--set",
        "output.progress=false",
    ]
    done = _run(args, root)
    assert done.returncode == 0, done.stderr[-3000:]
    return root, args, done


@pytest.mark.slow
def test_train_source_dir_trains_each_stage_into_its_run_folder_and_resume_skips_finished_ones(cascade_run):
    """`train --source-dir` on a cascade plan converts and trains the coarse then the fine stage, each a normal
    run folder with its own converted data (the fine one cropped to the labels); --resume keeps the plan and skips
    finished stages."""
    root, args, done = cascade_run
    assert "Stage 1/2 (lowres)" in done.stderr and "Stage 2/2 (cascade)" in done.stderr
    for stage in ("lowres", "cascade"):
        assert (root / "run" / stage / "best.weights.h5").is_file()
        assert (root / "run" / stage / "summary.json").is_file()
    assert load_stages(root / "run" / "plan.yaml")[1][1] == root / "run" / "cascade" / "plan.yaml"
    assert not (root / "run" / "fullres" / "config.yaml").exists()  # the fullres candidate is planned, not trained
    fine = load_config(root / "run" / "cascade" / "config.yaml")
    assert fine.cascade.coarse_run == str(root / "run" / "lowres")
    assert fine.data.conversion.crop_to_label_mm == CASCADE_MARGIN_MM
    import json

    roi_shapes = [
        c["shape"] for c in json.loads((root / "tfrecords_roi" / "fingerprint.json").read_text())["cases"].values()
    ]
    assert roi_shapes  # the fine stage's own conversion
    resumed = _run([*args, "--resume"], root)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming with the plan in" in resumed.stderr
    assert "Stage 1/2 (lowres): finished earlier" in resumed.stderr
    assert "Stage 2/2 (cascade): finished earlier" in resumed.stderr


@pytest.mark.slow
def test_predict_through_the_cascade_writes_the_input_geometry_and_reports_the_regions(cascade_run):
    """`predict --checkpoint <cascade folder>` runs the coarse stage on the whole scan and the fine stage on the
    regions it finds: the label map has the input's geometry and each case's regions (or the whole-scan fallback)
    are in predictions.csv. What lies inside and outside the regions is checked in test_cascade_regions.py, with
    stages whose output is known."""
    root, _, _ = cascade_run
    out = root / "pred"
    done = _run(
        [
            "-m",
            "tfmis.predict",
            "--checkpoint",
            str(root / "run"),
            "--input",
            str(root / "ct" / "dataset.json"),
            "--subset",
            "training",
            "--output",
            str(out),
            "--quiet",
        ],
        root,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fine stage on" in done.stdout
    rows = list(csv.DictReader((out / "predictions.csv").open()))
    assert len(rows) == 6
    for row in rows:
        assert " region" in row["region"] or row["region"] == "whole scan (the coarse stage found nothing)", row
        image = nib.load(str(root / "ct" / "imagesTr" / f"{row['case']}.nii.gz"))
        labels = nib.load(str(out / f"{row['case']}.nii.gz"))
        assert labels.shape == image.shape
        np.testing.assert_allclose(labels.affine, image.affine)


@pytest.mark.slow
def test_fine_classes_come_from_the_fine_stage_and_the_rest_from_the_coarse_stage(cascade_run):
    """With `cascade.fine_classes`, the cascade's label map is the coarse stage's wherever neither stage says a
    fine class, and a fine class appears only inside the fine stage's box, which holds the coarse stage's
    foreground (found on its own grid) and the margin."""
    from tfmis.inference.cascade import make_predictor, regions_of_interest

    root, _, _ = cascade_run
    config = load_config(root / "run" / "cascade" / "config.yaml")
    config.cascade.fine_classes = [2]
    predictor = make_predictor(config, root / "run" / "cascade")
    img = nib.load(str(root / "ct" / "imagesTr" / "ct_000.nii.gz"))
    image = np.asarray(img.dataobj, dtype=np.float32)[..., None]
    labels = predictor.predict_array(image, img.affine, probabilities=False)[0]
    coarse = predictor.coarse.predict_array(image, img.affine, probabilities=False)[0]
    keep = (labels != 2) & (coarse != 2)
    np.testing.assert_array_equal(labels[keep], coarse[keep])
    boxes = predictor.last_boxes
    assert boxes, "the coarse stage found nothing on a training case"
    outside = np.ones(labels.shape, bool)
    for box in boxes:
        outside[box] = False
    assert not (labels[outside] == 2).any()
    for tight in regions_of_interest(coarse > 0, img.affine, config.cascade.margin_mm / 2):
        assert any(all(b.start <= t.start and t.stop <= b.stop for b, t in zip(box, tight)) for box in boxes), tight
