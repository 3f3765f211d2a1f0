"""The built-in demo dataset: real files on disk, read back with nibabel and the MSD reader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from tfmis.data.demos import brain as demo
from tfmis.data.sources.cases import load_case
from tfmis.data.sources.msd import MSDDataset
from tfmis.utils.io import parse_temp_name

NUM_TRAINING, NUM_TEST = 3, 1


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory) -> Path:
    return demo.make_demo_dataset(
        tmp_path_factory.mktemp("demo") / "Task00_DemoBrain", num_training=NUM_TRAINING, num_test=NUM_TEST, seed=0
    )


def _all_image_paths(root: Path) -> list[Path]:
    return sorted((root / "imagesTr").glob("demo_*.nii.gz")) + sorted((root / "imagesTs").glob("demo_*.nii.gz"))


def _arrays(root: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    image = np.asanyarray(nib.load(str(root / "imagesTr" / f"{name}.nii.gz")).dataobj)
    label = np.asanyarray(nib.load(str(root / "labelsTr" / f"{name}.nii.gz")).dataobj)
    return image, label


def test_template_asset_is_small_and_2mm():
    import tfmis.data

    assets = Path(tfmis.data.__file__).parent / "assets"  # beside the data package, shipped with it
    asset = assets / demo.TEMPLATE_ASSET
    assert asset.stat().st_size < 1.5e6
    assert (assets / "MNI152_LICENSE.txt").is_file()
    template = demo.load_template()
    assert template.t1.shape == template.gm.shape == template.wm.shape == template.brain.shape
    assert np.allclose(nib.affines.voxel_sizes(template.affine), 2.0)
    assert nib.aff2axcodes(template.affine) == ("R", "A", "S")


def test_dataset_json_matches_files(demo_root):
    meta = json.loads((demo_root / "dataset.json").read_text())
    assert meta["name"] == "Task00_DemoBrain"
    assert meta["tensorImageSize"] == "4D"
    assert meta["modality"] == {"0": "T1w", "1": "T2w"}
    assert meta["labels"] == {"0": "background", "1": "grey matter", "2": "white matter", "3": "lesion"}
    assert "ICBM152" in meta["description"] and meta["licence"] and meta["reference"]
    assert meta["numTraining"] == NUM_TRAINING and meta["numTest"] == NUM_TEST
    assert meta["training"][0] == {"image": "./imagesTr/demo_000.nii.gz", "label": "./labelsTr/demo_000.nii.gz"}
    assert meta["test"] == ["./imagesTs/demo_100.nii.gz"]
    referenced = [e["image"] for e in meta["training"]] + [e["label"] for e in meta["training"]] + meta["test"]
    assert all((demo_root / p).is_file() for p in referenced)
    assert not list((demo_root / "labelsTr").glob("demo_1*")), "test cases must have no label"
    assert not [p for p in demo_root.rglob("*") if parse_temp_name(p.name)], "temporary files must be renamed away"


def test_images_and_labels_are_consistent(demo_root):
    for path in _all_image_paths(demo_root):
        img = nib.load(str(path))
        assert img.ndim == 4 and img.shape[-1] == 2, path
        assert 50 <= min(img.shape[:3]) and max(img.shape[:3]) <= 130, img.shape
        if path.parent.name == "imagesTs":
            continue
        label = nib.load(str(demo_root / "labelsTr" / path.name))
        assert label.shape == img.shape[:3]
        assert label.get_data_dtype() == np.uint8
        assert np.array_equal(label.affine, img.affine)
        values = np.unique(np.asanyarray(label.dataobj))
        assert values.tolist() == [0, 1, 2, 3], f"{path.name}: every class present, nothing else"


def test_orientation_dtype_and_spacing_variety(demo_root):
    images = [nib.load(str(p)) for p in _all_image_paths(demo_root)]
    axcodes = {nib.aff2axcodes(img.affine) for img in images}
    assert {("R", "A", "S"), ("L", "P", "S")} <= axcodes
    dtypes = {img.get_data_dtype().str for img in images}  # ".str" spells the byte order
    assert ">i2" in dtypes and "<i2" in dtypes
    spacings = {tuple(np.round(img.header.get_zooms()[:3], 3)) for img in images}
    assert (2.5, 2.5, 2.5) in spacings and any(len(set(s)) > 1 for s in spacings), spacings


def test_stored_orientation_only_changes_voxel_order(monkeypatch):
    """The LPS case, stored as RAS instead, must show the same world: affines are physically right."""
    stored = demo.generate_case(1)
    lps_style = demo.storage_style(1)
    monkeypatch.setattr(demo, "storage_style", lambda n: demo.StorageStyle(("R", "A", "S"), "<i2", lps_style.spacing))
    as_ras = demo.generate_case(1)
    canonical = nib.as_closest_canonical(nib.Nifti1Image(stored.label, stored.affine))
    assert np.allclose(canonical.affine, as_ras.affine)
    assert np.array_equal(np.asanyarray(canonical.dataobj), as_ras.label)


def test_big_endian_image_reads_back_identically():
    case = demo.generate_case(1)  # schedule: LPS, big-endian
    assert case.image.dtype == np.dtype(">i2")
    img = demo.nifti_image(case.image, case.affine)
    reread = nib.Nifti1Image.from_bytes(img.to_bytes())
    assert reread.get_data_dtype() == np.dtype(">i2")
    assert np.array_equal(np.asanyarray(reread.dataobj), case.image)


def test_msd_reader_loads_every_case(demo_root):
    dataset = MSDDataset(demo_root)
    assert dataset.num_channels == 2 and dataset.num_classes == 4
    assert len(dataset.training) == NUM_TRAINING and len(dataset.test) == NUM_TEST
    for case in dataset.training + dataset.test:
        loaded = load_case(case, dataset)
        assert loaded.image.dtype == np.float32 and loaded.image.shape[-1] == 2
        assert (loaded.label is None) == (case in dataset.test)


def test_background_is_zero_and_tissues_are_visible(demo_root):
    for name in ("demo_000", "demo_001", "demo_002"):
        image, label = _arrays(demo_root, name)
        image = image.astype(np.float32)
        brain = image[..., 0] > 0
        assert np.array_equal(brain, image[..., 1] > 0), "both channels share one skull-stripped mask"
        assert np.all(brain[label > 0]), "every labelled voxel is inside the brain"
        assert 0.5 < 1 - brain.mean() < 0.95, "the field of view is larger than the brain"
        t1, t2 = (image[..., c] for c in range(2))
        mean = {c: (t1[label == c].mean(), t2[label == c].mean()) for c in (1, 2, 3)}
        assert mean[2][0] > mean[1][0] > mean[3][0], "T1w: white > grey > lesion"
        assert mean[3][1] > mean[1][1] > mean[2][1], "T2w: lesion > grey > white"


def test_same_seed_same_data_other_seed_other_data(demo_root, tmp_path):
    again = demo.make_demo_dataset(tmp_path / "again", num_training=1, num_test=0, seed=0)
    other = demo.make_demo_dataset(tmp_path / "other", num_training=1, num_test=0, seed=1)
    reference = _arrays(demo_root, "demo_000")
    for mine, theirs in zip(_arrays(again, "demo_000"), reference):
        assert np.array_equal(mine, theirs)
    other_image, other_label = _arrays(other, "demo_000")
    assert other_image.shape != reference[0].shape or not np.array_equal(other_image, reference[0])
    assert other_label.shape != reference[1].shape or not np.array_equal(other_label, reference[1])


def test_second_call_does_nothing_unless_overwrite(tmp_path):
    root = demo.make_demo_dataset(tmp_path / "ds", num_training=1, num_test=0)
    files = sorted(root.rglob("*.*"))
    before = {p: p.stat().st_mtime_ns for p in files}
    # Age the files so a rewrite would be visible even on coarse-mtime filesystems.
    for p in files:
        os.utime(p, ns=(before[p] - 10**9, before[p] - 10**9))
    aged = {p: p.stat().st_mtime_ns for p in files}
    assert demo.make_demo_dataset(root, num_training=1, num_test=0) == root
    assert {p: p.stat().st_mtime_ns for p in files} == aged
    demo.make_demo_dataset(root, num_training=1, num_test=0, overwrite=True)
    assert all(p.stat().st_mtime_ns > aged[p] for p in files)


def test_rejects_empty_training_set(tmp_path):
    with pytest.raises(ValueError, match="num_training"):
        demo.make_demo_dataset(tmp_path / "ds", num_training=0)


def test_command_line(tmp_path):
    out = tmp_path / "cli"
    command = [
        sys.executable,
        "-m",
        "tfmis.data.demos.brain",
        "--output",
        str(out),
        "--cases",
        "1",
        "--test-cases",
        "1",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "1 training + 1 test" in result.stdout and str(out.resolve()) in result.stdout
    assert MSDDataset(out).test[0].case_id == "demo_100"
    again = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "nothing to do" in again.stdout


# ------------------------------------------------------------------ real-size variants (small versions here)


def test_brats_size_dataset_through_nibabel(tmp_path):
    root = demo.make_demo_dataset(tmp_path / "brats", num_training=2, num_test=1, size="brats", channels=3, spacing=4.0)
    meta = json.loads((root / "dataset.json").read_text())
    assert meta["name"] == "Task01_DemoBraTS"
    assert meta["modality"] == {"0": "FLAIR", "1": "T1w", "2": "t1gd"}
    assert meta["labels"] == {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"}
    for name in ("demo_000", "demo_001"):
        img = nib.load(str(root / "imagesTr" / f"{name}.nii.gz"))
        label = nib.load(str(root / "labelsTr" / f"{name}.nii.gz"))
        assert img.shape == (60, 60, 39, 3) and label.shape == img.shape[:3]  # 240 x 240 x 155 mm at 4 mm
        assert np.allclose(img.header.get_zooms()[:3], 4.0) and np.array_equal(img.affine, label.affine)
        assert nib.aff2axcodes(img.affine) == ("L", "P", "S")
        assert img.get_data_dtype() == np.int16 and label.get_data_dtype() == np.uint8
        image, labels = np.asanyarray(img.dataobj), np.asanyarray(label.dataobj)
        assert np.unique(labels).tolist() == [0, 1, 2, 3], name
        brain = image[..., 0] > 0
        assert np.all(brain[labels > 0]) and all(np.array_equal(brain, image[..., c] > 0) for c in range(3))
        flair = image[..., 0].astype(np.float32)
        assert flair[labels == 1].mean() > flair[brain & (labels == 0)].mean(), "oedema is bright on FLAIR"
    dataset = MSDDataset(root)
    assert dataset.num_channels == 3 and dataset.num_classes == 4 and len(dataset.test) == 1
    # deterministic per (seed, case); another seed gives another case
    again = demo.generate_brats_case(1, seed=0, spacing=4.0, channels=3)
    assert np.array_equal(again.image, np.asanyarray(nib.load(str(root / "imagesTr" / "demo_001.nii.gz")).dataobj))
    other = demo.generate_brats_case(1, seed=1, spacing=4.0, channels=3)
    assert not np.array_equal(other.label, again.label)


def test_brats_size_grid_is_the_brats_box_and_tumour_sizes_vary():
    template = demo.load_template()
    rng = np.random.default_rng(0)
    shape, affine = demo.brats_grid(rng, template, demo.brats_pose(rng, template), 1.0)
    assert shape == (240, 240, 155) and np.allclose(nib.affines.voxel_sizes(affine), 1.0)
    tumour_mm3 = [np.count_nonzero(demo.generate_brats_case(n, spacing=3.0).label) * 27 for n in range(6)]
    assert min(tumour_mm3) < 0.25 * max(tumour_mm3), tumour_mm3
    with pytest.raises(ValueError, match="channels"):
        demo.make_demo_dataset("/nonexistent/never", size="brats", channels=5)


def test_ct_full_size_dataset_through_nibabel(tmp_path):
    from tfmis.data.demos import ct as demo_ct

    root = demo_ct.make_ct_dataset(
        tmp_path / "ct", num_cases=2, num_test=0, size="full", slices=(20, 30), in_plane=64, seed=3
    )
    meta = json.loads((root / "dataset.json").read_text())
    assert meta["labels"] == demo_ct.FULL_LABELS and meta["modality"] == {"0": "CT"}
    for i in range(2):
        img = nib.load(str(root / "imagesTr" / f"ct_{i:03d}.nii.gz"))
        label = nib.load(str(root / "labelsTr" / f"ct_{i:03d}.nii.gz"))
        assert img.shape[:2] == (64, 64) and 20 <= img.shape[2] <= 30 and label.shape == img.shape
        sx, sy, sz = img.header.get_zooms()
        assert sx == sy and 0.7 * 8 <= sx <= 0.9 * 8 and sz in demo_ct.FULL_SLICE_MM  # 512 / 64 = 8
        assert img.get_data_dtype() == np.int16 and label.get_data_dtype() == np.uint8
        assert nib.aff2axcodes(img.affine) == ("L", "P", "S")
        image, labels = np.asanyarray(img.dataobj), np.asanyarray(label.dataobj)
        assert set(np.unique(labels).tolist()) <= set(range(6)) and {1, 2, 3} <= set(labels.ravel().tolist())
        assert image.min() == -1024 and abs(np.median(image[labels == 1]) - demo_ct.HU["liver"]) < 20
        again_image, again_label, again_affine = demo_ct.generate_full_case(i, 3, (20, 30), 64)
        assert np.array_equal(again_image, image) and np.array_equal(again_label, labels)
        assert np.allclose(again_affine, img.affine)
    other = demo_ct.generate_full_case(0, 4, (20, 30), 64)[0]
    assert other.shape != image.shape or not np.array_equal(other, image)


def test_ct_full_size_case_is_real_size_and_built_slab_by_slab():
    import tracemalloc

    from tfmis.data.demos import ct as demo_ct

    tracemalloc.start()
    try:
        image, label, affine = demo_ct.generate_full_case(0, slices=(100, 100))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert image.shape == (512, 512, 100) and image.dtype == np.int16 and label.dtype == np.uint8
    sizes = nib.affines.voxel_sizes(affine)
    assert 0.7 <= sizes[0] == sizes[1] <= 0.9 and 1.5 <= sizes[2] <= 5.0
    counts = np.bincount(label.ravel(), minlength=6)
    assert np.all(counts > 0), counts
    assert counts[1] > 20 * counts[4] and counts[1] > 50 * counts[5], "organs of very different sizes"
    # the returned arrays plus a few 32-slice slabs, whatever the number of slices
    overhead = peak - image.nbytes - label.nbytes
    assert overhead < 250e6, f"{overhead / 1e6:.0f} MB traced beyond the {image.nbytes / 1e6:.0f} MB case"
    # a slab boundary (slice 32) is invisible: same noise-free statistics either side
    assert abs(float(image[:, :, 31].mean()) - float(image[:, :, 32].mean())) < 30


def test_ct_command_line_full_size(tmp_path):
    out = tmp_path / "ctcli"
    command = [sys.executable, "-m", "tfmis.data.demos.ct", "--size", "full", "--output", str(out)]
    command += ["--cases", "1", "--test-cases", "0", "--slices", "12,16", "--in-plane", "48"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "1 CT-like training cases" in result.stdout
    assert nib.load(str(out / "imagesTr" / "ct_000.nii.gz")).shape[:2] == (48, 48)


def _world_centroid_mm(mask: np.ndarray, affine: np.ndarray) -> np.ndarray:
    """The centroid of `mask` in world (RAS+) millimetres."""
    return nib.affines.apply_affine(affine, np.argwhere(mask).mean(axis=0))


def test_ct_far_anatomy_puts_the_bladder_far_below_the_liver_and_the_lesion_inside_the_left_kidney(tmp_path):
    """anatomy="far" (read back through nibabel): labels 0-6 all present (6 bladder, in dataset.json too); the
    bladder's centroid >= 200 world mm below the liver's; the lesion is one piece whose every face neighbour
    is the left kidney (the kidney piece on the patient's left); lung HU in the top slice; and the foreground's
    z extent spans most (> 60 %) of the scan. World mm come from the affine, so the check holds at any
    `in_plane` (128 here: ~3 mm pixels, 5 mm slices for the ~560 mm scan)."""
    from scipy import ndimage

    from tfmis.data.demos import ct as demo_ct

    root = demo_ct.make_ct_dataset(
        tmp_path / "far", num_cases=2, num_test=0, size="full", slices=(112, 124), in_plane=128, anatomy="far"
    )
    meta = json.loads((root / "dataset.json").read_text())
    assert meta["labels"] == demo_ct.FAR_LABELS and meta["labels"]["6"] == "bladder"
    assert meta["description"] == demo_ct.FAR_DESCRIPTION
    for i in range(2):
        img = nib.load(str(root / "imagesTr" / f"ct_{i:03d}.nii.gz"))
        label = np.asanyarray(nib.load(str(root / "labelsTr" / f"ct_{i:03d}.nii.gz")).dataobj)
        image, affine = np.asanyarray(img.dataobj), img.affine
        assert image.dtype == np.int16 and nib.aff2axcodes(affine) == ("L", "P", "S")
        assert set(np.unique(label).tolist()) == set(range(7))
        assert 0 <= np.median(image[label == 6]) <= 30, "fluid-filled bladder"
        # far apart along z (S is the third world axis; the voxel z axis runs inferior to superior)
        liver_z, bladder_z = _world_centroid_mm(label == 1, affine)[2], _world_centroid_mm(label == 6, affine)[2]
        assert liver_z - bladder_z >= 200, (liver_z, bladder_z)
        assert np.count_nonzero(np.abs(image[:, :, -1] - demo_ct.FULL_HU["lung"]) < 50) > 500, "lung bases on top"
        slices_with_foreground = np.flatnonzero(label.any(axis=(0, 1)))
        assert slices_with_foreground[-1] - slices_with_foreground[0] + 1 > 0.6 * label.shape[2]
        # the lesion: one small piece, every face neighbour in the left kidney
        lesion = label == 5
        assert ndimage.label(lesion)[1] == 1
        kidneys, count = ndimage.label(label == 3)
        assert count == 2
        left = 1 + int(np.argmin([_world_centroid_mm(kidneys == k, affine)[0] for k in (1, 2)]))  # RAS x < 0: left
        ring = ndimage.binary_dilation(lesion) & ~lesion
        assert np.all(kidneys[ring] == left)
        assert np.count_nonzero(lesion) < 0.2 * np.count_nonzero(kidneys == left)


def test_ct_far_anatomy_option_leaves_the_default_cases_bit_identical():
    """Omitting `anatomy` gives the same arrays as anatomy="abdomen", and those match sha256 digests recorded
    before the option existed; no label above 5 (lesion) in them, and anatomy="far" does change the case."""
    import hashlib

    from tfmis.data.demos import ct as demo_ct

    image, label, affine = demo_ct.generate_full_case(1, 3, (20, 30), 64)
    explicit = demo_ct.generate_full_case(1, 3, (20, 30), 64, anatomy="abdomen")
    assert all(np.array_equal(a, b) for a, b in zip((image, label, affine), explicit))
    assert hashlib.sha256(image.tobytes()).hexdigest() == (
        "93d3ceb2ccef38dbd16c5e4e53c961578c68a8214c8c41c40281b6638d14e78c"
    )
    assert hashlib.sha256(label.tobytes()).hexdigest() == (
        "86b0e7fe44ca8c4bb22f103158868a9907c182f24c779ad1f09841b881dbff73"
    )
    assert label.max() <= 5
    far_image = demo_ct.generate_full_case(1, 3, (20, 30), 64, anatomy="far")[0]
    assert far_image.shape != image.shape or not np.array_equal(far_image, image)


def test_ct_command_line_far_anatomy(tmp_path, monkeypatch, capsys):
    """`--anatomy far` writes data/Task92_DemoCTFar (the default name) with the bladder label; `--help` lists the
    option; `--anatomy far` without `--size full` and an unknown anatomy are refused (CLI and Python API)."""
    from tfmis.data.demos import ct as demo_ct

    with pytest.raises(SystemExit) as exit_help:
        demo_ct.main(["--help"])
    assert exit_help.value.code == 0 and "--anatomy {abdomen,far}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_small:
        demo_ct.main(["--anatomy", "far"])
    assert exit_small.value.code == 2 and "--anatomy far needs --size full" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs size='full'"):
        demo_ct.make_ct_dataset(tmp_path / "never", anatomy="far")
    with pytest.raises(ValueError, match="anatomy must be one of"):
        demo_ct.generate_full_case(0, anatomy="pelvis")
    monkeypatch.chdir(tmp_path)
    argv = ["--size", "full", "--anatomy", "far", "--cases", "1", "--test-cases", "0", "--slices", "112,112"]
    assert demo_ct.main([*argv, "--in-plane", "48"]) == 0
    root = tmp_path / "data" / demo_ct.FAR_DATASET_NAME
    assert json.loads((root / "dataset.json").read_text())["labels"]["6"] == "bladder"
    assert 6 in np.unique(np.asanyarray(nib.load(str(root / "labelsTr" / "ct_000.nii.gz")).dataobj))


# ------------------------------------------------------------------ the demo recipe and the MONAI comparison

REPO = Path(__file__).resolve().parents[1]
MONAI_PYTHON = REPO / ".venv-monai" / "bin" / "python"
_no_monai = pytest.mark.skipif(
    not MONAI_PYTHON.is_file(),
    reason="no MONAI environment at .venv-monai (see benchmarks/monai_demo.py for the command that creates it)",
)


def needs_monai(test):
    """MONAI's torch is GBs of wheels: CI never installs it, so these comparisons may skip there too."""
    return pytest.mark.ci_may_skip("CI does not install MONAI (torch)")(_no_monai(test))


def test_demo_config_model_gives_logits_at_patch_resolution():
    """The demo recipe's U-Net (whatever its first stride) maps a training patch to logits of the same size."""
    import dataclasses

    from tfmis.config import load_config
    from tfmis.networks import UNetConfig, check_patch_size

    config = load_config(REPO / "configs" / "demo.yaml")
    patch = tuple(config.pipeline.patch_size)
    check_patch_size(patch, config.model.strides)
    check_patch_size(config.validation.roi_size or patch, config.model.strides)
    model = UNetConfig(2, 4, **dataclasses.asdict(config.model)).build()
    logits = model(np.zeros((1, *patch, 2), np.float32))
    assert tuple(logits.shape) == (1, *patch, 4)
    assert config.training.max_minutes is None, "the README's main job trains the whole schedule"


def _load_export_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("export_demo_npy", REPO / "benchmarks" / "export_demo_npy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_export_npy_holds_exactly_the_voxels_of_the_records(converted_dataset, tmp_path):
    from tfmis.data.records import load_index, record_dataset

    export = _load_export_module()
    out = tmp_path / "npy"
    manifest = export.export_npy(converted_dataset, out)
    index = load_index(converted_dataset)
    for split in ("train", "val"):
        assert sorted(e["case_id"] for e in manifest["splits"][split]) == sorted(index["splits"][split]["cases"])
        by_id = {e["case_id"]: e for e in manifest["splits"][split]}
        for image, label, meta in record_dataset(converted_dataset, split):
            entry = by_id[meta["case_id"].numpy().decode()]
            exported_image, exported_label = np.load(out / entry["image"]), np.load(out / entry["label"])
            assert exported_image.dtype == np.float32 and exported_label.dtype == np.uint8
            np.testing.assert_array_equal(exported_image, np.moveaxis(image.numpy().astype(np.float32), -1, 0))
            np.testing.assert_array_equal(exported_label, label.numpy())
    assert manifest["classes"] == index["source"]["labels"] and manifest["channels"] == index["source"]["modalities"]
    first = out / manifest["splits"]["train"][0]["image"]
    stamp = first.stat().st_mtime_ns
    os.utime(first, ns=(stamp - 10**9, stamp - 10**9))
    assert export.export_npy(converted_dataset, out) == manifest
    assert first.stat().st_mtime_ns == stamp - 10**9, "an up-to-date export is not rewritten"
    export.export_npy(converted_dataset, out, force=True)
    assert first.stat().st_mtime_ns > stamp - 10**9
    with pytest.raises(KeyError, match="no split"):
        export.export_npy(converted_dataset, tmp_path / "other", splits=("train", "fold7"))


@needs_monai
def test_monai_recipe_trains_on_the_export_and_logs_each_validation(converted_dataset, tmp_path):
    export = _load_export_module()
    export.export_npy(converted_dataset, tmp_path / "npy")
    out = tmp_path / "monai"
    command = [
        str(MONAI_PYTHON),
        str(REPO / "benchmarks" / "monai_demo.py"),
        "--data",
        str(tmp_path / "npy"),
        "--output",
        str(out),
        "--epochs",
        "3",
        "--val-interval",
        "2",
        "--patch",
        "16",
        "16",
        "16",
        "--class-ratios",
        "1",
        "1",
        "1",
        "--crops-per-volume",
        "2",
        "--batch",
        "2",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3]
    validated = [r for r in records if "val_mean_dice" in r]
    assert [r["epoch"] for r in validated] == [2, 3], "every val_interval epochs and the last"
    for r in validated:
        assert 0.0 <= r["val_mean_dice"] <= 1.0 and len(r["val_dice"]) == 2 and r["val_seconds"] > 0
    elapsed = [r["elapsed_seconds"] for r in records]
    assert elapsed == sorted(elapsed) and all(
        r["data_wait_seconds"] + r["compute_seconds"] <= r["epoch_seconds"] for r in records
    )
    settings = json.loads((out / "settings.json").read_text())
    assert settings["threads"] == 2 and settings["steps_per_epoch"] == 6  # 6 train cases x 2 crops / 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_mean_dice"] == max(r["val_mean_dice"] for r in validated)


@needs_monai
def test_time_to_dice_runs_monai_and_tfmis_arms_and_reports(converted_dataset, tmp_path):
    """The whole benchmark command on a tiny config: both arms in real subprocesses, then the report."""
    from conftest import tiny_config

    from tfmis.config import save_config

    config_path = tmp_path / "tiny.yaml"
    save_config(
        tiny_config(converted_dataset, tmp_path / "unused", "training.epochs=2", "pipeline.class_ratios=[1,1,1]"),
        config_path,
    )
    out = tmp_path / "ttd"
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "time_to_dice.py"),
        "--config",
        str(config_path),
        "--max-minutes",
        "5",
        "--levels",
        "0.0",
        "0.999",
        "--output",
        str(out),
        "--quiet",
        "--monai-arg=--epochs=2",
        "--monai-arg=--strides",
        "--monai-arg=2",
        "--monai-arg=2",
        "--monai-arg=--channels",
        "--monai-arg=4",
        "--monai-arg=8",
        "--monai-arg=16",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "time_to_dice.json").read_text())
    assert list(report["runs"]) == ["monai", "tiny"]
    for name, (run,) in report["runs"].items():
        assert run["epochs"] == 2, name
        assert run["time_to_dice"]["0.00"] == run["curve"][0][0] > 0, "the first validation reaches Dice 0"
        assert run["time_to_dice"]["0.00"] <= run["elapsed_seconds"] < run["process_seconds"]
    monai_arm = report["arms"][0]
    assert monai_arm["name"] == "monai" and "--patch" in monai_arm["overrides"]
    assert monai_arm["overrides"][monai_arm["overrides"].index("--patch") + 1] == "16", "the config's patch"
    ratio = report["ratios"]["tiny"]["0.00"]
    assert ratio == pytest.approx(
        report["summaries"]["monai"]["time_to_dice"]["0.00"] / report["summaries"]["tiny"]["time_to_dice"]["0.00"]
    )
    markdown = (out / "time_to_dice.md").read_text()
    assert "| monai |" in markdown and "| tiny |" in markdown and "time to 0.00, s" in markdown
    assert (out / "time_to_dice.png").stat().st_size > 10_000
    assert (out / "monai" / "run1" / "history.jsonl").is_file() and (out / "tiny" / "run1.log").is_file()
