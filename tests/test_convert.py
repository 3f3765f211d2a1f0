import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from conftest import brain_like_case, lps_affine, make_msd_dataset, update_dataset_json, write_nifti

from tfmis.convert import build_parser
from tfmis.data.conversion_options import ConversionConfig
from tfmis.data.convert import PLAN_FILE, ParametersChanged, convert
from tfmis.data.folds import assign_splits
from tfmis.data.preprocess import PreprocessConfig, preprocess
from tfmis.data.records import load_index, read_record, record_dataset, split_cases
from tfmis.data.sources.cases import load_case
from tfmis.data.sources.msd import MSDDataset
from tfmis.utils.io import host_name

REPO = Path(__file__).resolve().parents[1]


def run_tool(*args, timeout=300):
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "tfrecord.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def records_by_case(target, split):
    out = {}
    for image, label, meta in record_dataset(target, split):
        out[meta["case_id"].numpy().decode()] = (image.numpy(), label.numpy(), json.loads(meta["metadata"].numpy()))
    return out


@pytest.mark.parametrize("compression, image_dtype", [("NONE", "float32"), ("GZIP", "float16"), ("ZLIB", "float32")])
def test_round_trip_is_bit_exact(msd_dataset, tmp_path, compression, image_dtype):
    target = tmp_path / "out"
    index = convert(
        ConversionConfig(
            str(msd_dataset),
            str(target),
            split=(1.0,),
            shards=2,
            compression=compression,
            image_dtype=image_dtype,
            spacing=(1.5, 1.5, 2.0),
            workers=1,
            progress=False,
        )
    )
    assert index["stats"]["records"] == 6 and not index["skipped"]
    ds = MSDDataset(msd_dataset)
    config = PreprocessConfig(spacing=(1.5, 1.5, 2.0), normalization=("zscore", "zscore"), image_dtype=image_dtype)
    records = records_by_case(target, "train")
    assert sorted(records) == [c.case_id for c in ds.training]
    for case in ds.training:
        loaded = load_case(case, ds)
        image, label, geometry = preprocess(loaded.image, loaded.label, loaded.affine, config)
        got_image, got_label, meta = records[case.case_id]
        assert got_image.dtype == np.dtype(image_dtype)
        assert got_image.tobytes() == image.tobytes() and got_label.tobytes() == label.tobytes()
        assert meta["geometry"] == json.loads(json.dumps(geometry.to_dict()))
    # a single record read by its byte offset is the same record
    for i, entry in enumerate(split_cases(load_index(target), "train")):
        one = read_record(target, "train", i)
        assert one["case_id"] == entry["case_id"]
        assert one["image"].tobytes() == records[one["case_id"]][0].tobytes()
        assert one["label"].tobytes() == records[one["case_id"]][1].tobytes()


def test_index_and_fingerprint_describe_the_shards(msd_dataset, tmp_path):
    target = tmp_path / "out"
    index = convert(
        ConversionConfig(str(msd_dataset), str(target), split=(0.5, 0.25, 0.25), shards=2, workers=2, progress=False)
    )
    on_disk = load_index(target)
    assert on_disk["schema_version"] == 1 and on_disk["splits"].keys() == {"train", "val", "test"}
    assert [s["num_records"] for s in on_disk["splits"].values()] == [3, 2, 1]
    assert on_disk["preprocessing"]["spacing"] == [1.5, 1.5, 2.0]  # the median spacing, RAS order
    for name, split in on_disk["splits"].items():
        assert sum(s["records"] for s in split["shards"]) == split["num_records"]
        for shard in split["shards"]:
            assert (target / shard["file"]).stat().st_size == shard["bytes"]
            assert len(list(record_dataset(target, name).as_numpy_iterator())) == split["num_records"]
    fingerprint = json.loads((target / "fingerprint.json").read_text())
    for split in on_disk["splits"]:
        for _image, label, meta in record_dataset(target, split):
            cid = meta["case_id"].numpy().decode()
            counts = np.bincount(label.numpy().ravel(), minlength=3).tolist()
            assert fingerprint["cases"][cid]["class_voxels"] == counts
            assert fingerprint["cases"][cid]["shape"] == list(label.shape)
            assert fingerprint["cases"][cid]["original_shape"] == [20, 22, 18]
    summary = fingerprint["dataset"]
    assert summary["num_cases"] == 6 and len(summary["shape_p99_5"]) == 3
    assert summary["intensity"][0]["p00_5"] < summary["intensity"][0]["p99_5"]
    assert index["stats"]["bytes_per_case"] > 0


def test_splits_are_seeded_and_folds_partition():
    ids = [f"c{i}" for i in range(20)]
    a = assign_splits(ids, (0.7, 0.15, 0.15), None, seed=3)
    assert a == assign_splits(ids, (0.7, 0.15, 0.15), None, seed=3)
    assert a != assign_splits(ids, (0.7, 0.15, 0.15), None, seed=4)
    assert [len(v) for v in a.values()] == [14, 3, 3]
    assert sorted(sum(a.values(), [])) == sorted(ids)
    folds = assign_splits(ids, None, 5, seed=0)
    assert list(folds) == [f"fold{k}" for k in range(5)] and all(len(v) == 4 for v in folds.values())
    assert sorted(sum(folds.values(), [])) == sorted(ids)


def test_folds_conversion(msd_dataset, tmp_path):
    index = convert(
        ConversionConfig(
            str(msd_dataset), str(tmp_path / "out"), split=None, folds=3, shards=1, workers=1, progress=False
        )
    )
    assert {k: v["num_records"] for k, v in index["splits"].items()} == {"fold0": 2, "fold1": 2, "fold2": 2}


def test_resume_rebuilds_only_unfinished_shards(msd_dataset, tmp_path):
    target = tmp_path / "out"
    config = ConversionConfig(str(msd_dataset), str(target), split=(1.0,), shards=3, workers=1, progress=False)
    convert(config)
    shards = sorted(target.glob("train-*.tfrecord.gz"))
    original = {p.name: p.read_bytes() for p in shards}
    # the state an interrupted run leaves: one shard missing, its temporary half-written
    victim = shards[1]
    victim.unlink()
    (target / ".progress" / (victim.name + ".json")).unlink()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    half = target / f"{victim.name}.{host_name()}.{dead.pid}.0a1b2c3d.tmp"  # its writer's temporary, the writer dead
    half.write_bytes(b"half a shard")
    (target / "index.json").unlink()
    mtimes = {p.name: p.stat().st_mtime_ns for p in shards if p != victim}
    time.sleep(0.01)
    index = convert(config)
    assert {p.name: p.read_bytes() for p in sorted(target.glob("train-*.tfrecord.gz"))} == original
    assert {p.name: p.stat().st_mtime_ns for p in shards if p != victim} == mtimes
    assert not half.exists() and not list(target.glob("*.tmp")) and index["stats"]["records"] == 6


def test_resume_rewrites_a_recorded_shard_whose_size_or_checksum_does_not_match(msd_dataset, tmp_path, capsys):
    """Each shard's size and sha256 are in its progress record and in index.json. A recorded shard truncated to
    half (conversion finished: the size check) or with one byte flipped (an interrupted conversion, no
    index.json: the checksum check) is named on stderr and written again, the others are kept, and the records
    (and bytes) equal a clean conversion's."""
    import hashlib

    target = tmp_path / "out"
    config = ConversionConfig(str(msd_dataset), str(target), split=(1.0,), shards=3, workers=1, progress=False)
    index = convert(config)
    shards = sorted(target.glob("train-*.tfrecord.gz"))
    for entry in index["splits"]["train"]["shards"]:
        data = (target / entry["file"]).read_bytes()
        assert entry["bytes"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()
        progress = json.loads((target / ".progress" / (entry["file"] + ".json")).read_text())
        assert (progress["bytes"], progress["sha256"]) == (entry["bytes"], entry["sha256"])
    clean = records_by_case(target, "train")
    original = {p.name: p.read_bytes() for p in shards}
    capsys.readouterr()

    truncated = shards[1]
    truncated.write_bytes(original[truncated.name][: len(original[truncated.name]) // 2])
    kept = {p.name: p.stat().st_mtime_ns for p in shards if p != truncated}
    convert(config)
    err = capsys.readouterr().err
    half = len(original[truncated.name]) // 2
    assert f"{truncated.name}: {half} bytes on disk, {len(original[truncated.name])} recorded: writing it again" in err
    assert {p.name: p.stat().st_mtime_ns for p in shards if p != truncated} == kept, "only the bad shard rewritten"

    flipped = shards[2]
    data = bytearray(original[flipped.name])
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    (target / "index.json").unlink()  # an interrupted conversion: resuming checks the checksums
    convert(config)
    err = capsys.readouterr().err
    assert f"{flipped.name}: sha256 " in err and "differs from the recorded" in err and shards[0].name not in err
    assert {p.name: p.read_bytes() for p in shards} == original
    assert records_by_case(target, "train").keys() == clean.keys()
    for cid, (image, label, meta) in records_by_case(target, "train").items():
        assert np.array_equal(image, clean[cid][0]) and np.array_equal(label, clean[cid][1]) and meta == clean[cid][2]


@pytest.mark.slow
def test_resume_after_kill(tmp_path):
    """A real conversion process killed after its first shard resumes to the same bytes."""
    source = make_msd_dataset(tmp_path / "ds", num_cases=10, shape=(48, 48, 40))
    args = ["--source-dir", source, "--split", "1", "--shards", "10", "--workers", "1", "--compression", "NONE"]
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tools" / "tfrecord.py"), *map(str, args), "--target-dir", tmp_path / "out"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    progress = tmp_path / "out" / ".progress"
    deadline = time.time() + 120
    while time.time() < deadline and not list(progress.glob("*.json")) and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(list(progress.glob("*.json")))
    assert 1 <= done_before < 10, "the process was not interrupted mid-way"
    assert not (tmp_path / "out" / "index.json").exists()
    resumed = run_tool(*args, "--target-dir", tmp_path / "out")
    assert resumed.returncode == 0, resumed.stderr
    assert f"Resuming: {done_before} of 10 shards already complete" in resumed.stderr
    fresh = run_tool(*args, "--target-dir", tmp_path / "fresh")
    assert fresh.returncode == 0, fresh.stderr
    for shard in sorted((tmp_path / "fresh").glob("*.tfrecord")):
        assert (tmp_path / "out" / shard.name).read_bytes() == shard.read_bytes()


def test_changed_parameters_are_refused_or_rebuilt(msd_dataset, tmp_path):
    target = tmp_path / "out"
    convert(ConversionConfig(str(msd_dataset), str(target), split=(1.0,), shards=2, workers=1, progress=False))
    with pytest.raises(ParametersChanged, match=r"shards: 2 -> 3"):
        convert(ConversionConfig(str(msd_dataset), str(target), split=(1.0,), shards=3, workers=1, progress=False))
    update_dataset_json(msd_dataset, description="edited")
    with pytest.raises(ParametersChanged, match="dataset_json_sha256"):
        convert(ConversionConfig(str(msd_dataset), str(target), split=(1.0,), shards=2, workers=1, progress=False))
    index = convert(
        ConversionConfig(
            str(msd_dataset), str(target), split=(1.0,), shards=3, workers=1, progress=False, overwrite=True
        )
    )
    assert len(index["splits"]["train"]["shards"]) == 3
    assert sorted(p.name for p in target.glob("*.tfrecord*")) == [f"train-00{i}-of-003.tfrecord.gz" for i in range(3)]


def test_explicit_values_equal_to_what_a_default_resolved_to_reuse_the_conversion(msd_dataset, tmp_path):
    """A conversion made with the default spacing (the median) is the conversion asked for with that median
    written out (as `python -m tfmis.plan` writes it), and the other way round: it is reused, not refused, as is
    one made before an option existed when that option is asked for with its default; another spacing is
    refused."""
    target = tmp_path / "out"
    first = convert(ConversionConfig(str(msd_dataset), str(target), split=(1.0,), shards=2, workers=1, progress=False))
    resolved = json.loads((target / PLAN_FILE).read_text())["resolved"]["spacing"]  # the median spacing
    stamps = {p.name: p.stat().st_mtime_ns for p in target.glob("*.tfrecord*")}
    again = convert(
        ConversionConfig(
            str(msd_dataset), str(target), split=(1.0,), shards=2, workers=1, progress=False, spacing=tuple(resolved)
        )
    )
    assert again["splits"] == first["splits"]
    assert {p.name: p.stat().st_mtime_ns for p in target.glob("*.tfrecord*")} == stamps, "no shard rewritten"
    back = convert(ConversionConfig(str(msd_dataset), str(target), split=(1.0,), shards=2, workers=1, progress=False))
    assert back["splits"] == first["splits"], "and the default again, after the explicit median"
    # a conversion made before an option existed, asked for with that option's default, is the same conversion
    plan = json.loads((target / PLAN_FILE).read_text())
    del plan["requested"]["ct_normalization"]
    (target / PLAN_FILE).write_text(json.dumps(plan))
    convert(ConversionConfig(str(msd_dataset), str(target), split=(1.0,), shards=2, workers=1, progress=False))
    assert {p.name: p.stat().st_mtime_ns for p in target.glob("*.tfrecord*")} == stamps, "no shard rewritten"
    other = tuple(2 * s for s in resolved)
    with pytest.raises(ParametersChanged, match=r"spacing: "):
        convert(
            ConversionConfig(
                str(msd_dataset), str(target), split=(1.0,), shards=2, workers=1, progress=False, spacing=other
            )
        )


def test_ct_zscore_conversion_measures_the_labelled_foreground_of_every_training_case(tmp_path):
    """ct_normalization=zscore on a CT-like dataset: the resolved mean/std are those of the raw HU under every
    training case's label (read here with nibabel; the cases are small enough that no voxel is subsampled), the
    window their 0.5/99.5 percentiles; the index says ct_zscore and holds them (prediction reads them there);
    every converted voxel lies between the window's ends mapped by that z-score."""
    from tfmis.data.demos.ct import make_ct_dataset

    source = make_ct_dataset(tmp_path / "Task91_CT", num_cases=4, shape=(40, 40, 12))
    foreground = []
    for path in sorted((source / "labelsTr").glob("*.nii.gz")):
        label = np.asarray(nib.load(path).dataobj) > 0
        image = nib.load(source / "imagesTr" / path.name).get_fdata()
        assert 0 < label.sum() < 10_000
        foreground.append(image[label])
    values = np.concatenate(foreground)
    target = tmp_path / "out"
    index = convert(
        ConversionConfig(
            str(source),
            str(target),
            split=(1.0,),
            shards=1,
            workers=1,
            progress=False,
            ct_normalization="zscore",
            image_dtype="float32",
        )
    )
    resolved = json.loads((target / PLAN_FILE).read_text())["resolved"]
    mean, std = resolved["ct_mean_std"]
    assert mean == pytest.approx(values.mean(), rel=1e-6) and std == pytest.approx(values.std(), rel=1e-6)
    lo, hi = resolved["ct_window"]
    assert [lo, hi] == pytest.approx(np.percentile(values, [0.5, 99.5]), abs=0.051)
    prep = index["preprocessing"]
    assert prep["normalization"] == ["ct_zscore"] and prep["ct_mean_std"] == pytest.approx([mean, std])
    assert PreprocessConfig.from_dict(prep).ct_mean_std == (mean, std)
    for image, _, _ in record_dataset(target, "train"):
        x = image.numpy()
        assert x.min() >= (lo - mean) / std - 1e-5 and x.max() <= (hi - mean) / std + 1e-5
        assert x.max() > 0 > x.min()


def make_broken_dataset(root: Path) -> dict:
    """Good cases plus one bad case of each kind; returns {case_id: expected words in its reason}."""
    make_msd_dataset(root, num_cases=11)
    rng = np.random.default_rng(7)
    img, lab = brain_like_case(rng)
    images, labels = root / "imagesTr", root / "labelsTr"
    (images / "case_001.nii.gz").unlink()  # missing file
    data = (images / "case_002.nii.gz").read_bytes()
    (images / "case_002.nii.gz").write_bytes(data[: len(data) // 2])  # truncated .nii.gz
    write_nifti(labels / "case_003.nii.gz", lab[:-2], lps_affine(), np.uint8)  # shape mismatch
    write_nifti(labels / "case_004.nii.gz", lab, lps_affine(origin=(0, 0, 0)), np.uint8)  # affine mismatch
    bad_label = lab.copy()
    bad_label[0, 0, 0] = 7
    write_nifti(labels / "case_005.nii.gz", bad_label, lps_affine(), np.uint8)  # undeclared label value
    nan_image = img.copy()
    nan_image[5, 5, 5, 1] = np.nan
    write_nifti(images / "case_006.nii.gz", nan_image, lps_affine(), np.float32)  # NaN in the image
    inf_image = img.copy()
    inf_image[6, 6, 6, 0] = -np.inf
    write_nifti(images / "case_010.nii.gz", inf_image, lps_affine(), np.float32)  # Inf in the image
    write_nifti(labels / "case_007.nii.gz", np.zeros_like(lab), lps_affine(), np.uint8)  # no foreground: warning
    (images / "case_008.nii.gz").write_bytes(b"this is not a nifti file at all")  # corrupt header
    meta = json.loads((root / "dataset.json").read_text())
    meta["training"][9]["label"] = "../../etc/passwd"  # path outside the dataset
    (root / "dataset.json").write_text(json.dumps(meta))
    return {
        "case_001": "does not exist",
        "case_002": "cannot be read",
        "case_003": "does not match image shape",
        "case_004": "affine does not match",
        "case_005": "not declared",
        "case_006": "NaN",
        "case_008": "cannot be read",
        "case_009": "outside the dataset folder",
        "case_010": "NaN/Inf",
    }


def test_bad_cases_are_named_and_the_rest_convert(tmp_path):
    expected = make_broken_dataset(tmp_path / "broken")
    result = run_tool(
        "--source-dir",
        tmp_path / "broken",
        "--target-dir",
        tmp_path / "out",
        "--split",
        "0.5,0.5",
        "--shards",
        "2",
        "--workers",
        "2",
    )
    assert result.returncode == 3, result.stderr
    index = load_index(tmp_path / "out")
    skipped = {s["case_id"]: s["reason"] for s in index["skipped"]}
    assert sorted(skipped) == sorted(expected)
    for case_id, words in expected.items():
        assert words in skipped[case_id], (case_id, skipped[case_id])
        assert f"{case_id}: skipped: " in result.stderr  # shown as it happens, above the progress bar, once
        assert skipped[case_id] not in result.stdout and case_id in result.stdout  # the summary names it only
    assert sorted(index["cases"]) == ["case_000", "case_007"]
    assert index["warnings"] == [{"case_id": "case_007", "message": "label has no foreground voxels"}]
    assert "warning case_007: label has no foreground voxels" in result.stdout
    fingerprint = json.loads((tmp_path / "out" / "fingerprint.json").read_text())
    assert fingerprint["dataset"]["cases_without_foreground"] == ["case_007"]


def test_cli_parses_tuples_and_explains_flags(msd_dataset, tmp_path):
    args = build_parser().parse_args(
        [
            "--source-dir",
            "a",
            "--target-dir",
            "b",
            "--split",
            "0.8, 0.2",
            "--spacing",
            "1.5,1.5,2.0",
            "--compression",
            "ZLIB",
        ]
    )
    assert args.split == (0.8, 0.2) and args.spacing == (1.5, 1.5, 2.0) and args.compression == "ZLIB"
    assert build_parser().parse_args(["--source-dir", "a", "--target-dir", "b", "--reshape", "120,120,96"]).reshape == (
        120,
        120,
        96,
    )
    help_text = run_tool("--help").stdout
    for flag in (
        "--source-dir",
        "--target-dir",
        "--split",
        "--folds",
        "--spacing",
        "--reshape",
        "--shards",
        "--compression",
        "--workers",
        "--seed",
        "--ct-window",
        "--overwrite",
    ):
        assert flag in help_text
    bad = run_tool("--source-dir", msd_dataset, "--target-dir", tmp_path / "o", "--spacing", "1.5,2")
    assert bad.returncode == 2 and "--spacing: expected 3 comma-separated values" in bad.stderr
    both = run_tool("--source-dir", msd_dataset, "--target-dir", tmp_path / "o", "--split", "1", "--folds", "3")
    assert both.returncode == 2 and "not allowed with" in both.stderr
    missing = run_tool("--source-dir", tmp_path / "nowhere", "--target-dir", tmp_path / "o")
    assert missing.returncode == 2 and "dataset.json" in missing.stderr  # as in every command


def test_ct_window_is_measured_when_not_given(tmp_path):
    root = make_msd_dataset(tmp_path / "ct", num_cases=3, channels=1, modalities={"0": "CT"})
    index = convert(ConversionConfig(str(root), str(tmp_path / "out"), split=(1.0,), workers=1, progress=False))
    lo, hi = index["preprocessing"]["ct_window"]
    assert 40 < lo < hi < 200  # the labelled foreground of the synthetic data sits around 100-160
    for image, _, _ in record_dataset(tmp_path / "out", "train"):
        assert float(image.numpy().min()) >= 0 and float(image.numpy().max()) <= 1


def test_resume_reuses_measured_spacing_and_ct_window(tmp_path):
    """A finished conversion reruns without touching the images (no second measuring pass)."""
    root = make_msd_dataset(tmp_path / "ct", num_cases=3, channels=1, modalities={"0": "CT"})
    config = ConversionConfig(str(root), str(tmp_path / "out"), split=(1.0,), workers=1, progress=False)
    first = convert(config)
    for image in (root / "imagesTr").glob("*.nii.gz"):
        image.unlink()
    again = convert(config)
    assert again["preprocessing"] == first["preprocessing"] and again["stats"]["records"] == 3


@pytest.mark.slow
def test_conversion_progress_to_a_log_file_is_plain_lines_without_bar_frames(msd_dataset, tmp_path):
    """tools/tfrecord.py with standard error captured (not a terminal, as in a SLURM log) reports progress as
    plain lines without carriage-return bar frames, ending with the count of all converted cases."""
    result = run_tool("--source-dir", msd_dataset, "--target-dir", tmp_path / "out", "--split", "1", "--workers", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "\r" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("Converting ")]
    assert lines and lines[-1].split("  ")[0].endswith(": 6/6 cases (100%)")


def test_a_fine_stage_conversion_normalised_by_its_own_box_is_refused_and_one_by_the_whole_image_reused(
    msd_dataset, tmp_path
):
    """A `crop_to_label_mm` conversion (a cascade's fine stage) records that its normalisation statistics are the
    whole image's: a rerun reuses it, while one made before that rule (its plan without the key, normalised by the
    label box) is refused as a conversion with other parameters instead of training on other intensities than
    cascade prediction gives; a plain conversion carries no such key (older ones stay valid)."""
    target = tmp_path / "roi"

    def roi(**extra):
        options = dict(split=(1.0,), shards=1, workers=1, progress=False, crop_to_label_mm=4.0)
        return convert(ConversionConfig(str(msd_dataset), str(target), **options, **extra))

    roi()
    plan = json.loads((target / PLAN_FILE).read_text())
    assert plan["requested"]["label_crop_statistics"] == "whole_image"
    stamps = {p.name: p.stat().st_mtime_ns for p in target.glob("*.tfrecord*")}
    roi()
    assert {p.name: p.stat().st_mtime_ns for p in target.glob("*.tfrecord*")} == stamps, "reused"
    del plan["requested"]["label_crop_statistics"]
    (target / PLAN_FILE).write_text(json.dumps(plan))
    with pytest.raises(ParametersChanged, match=r"label_crop_statistics: None -> 'whole_image'.*--overwrite"):
        roi()
    plain = tmp_path / "plain"
    convert(ConversionConfig(str(msd_dataset), str(plain), split=(1.0,), shards=1, workers=1, progress=False))
    assert "label_crop_statistics" not in json.loads((plain / PLAN_FILE).read_text())["requested"]


@pytest.mark.parametrize(
    "shape, dtype, labelled",
    [((5, 6, 7, 2), np.float16, True), ((200, 3, 1, 1), np.float32, False), ((130, 129, 1, 1), np.float16, True)],
)
def test_a_record_is_the_bytes_protobuf_writes_for_the_same_example(shape, dtype, labelled):
    """`encode_example` writes the protocol buffer itself (one copy of the image): its bytes equal those of
    `tf.train.Example(...).SerializeToString(deterministic=True)` built from the same fields as the format describes
    them (multi-channel, unlabelled with an empty label and shape (0, 0, 0), sides over 127 and records over 16 KB,
    whose varints take several bytes; a non-ASCII case id), and `parse_example` reads them back."""
    import json

    import tensorflow as tf

    from tfmis.data.records import encode_example, parse_example

    rng = np.random.default_rng(0)
    image = rng.normal(size=shape).astype(dtype)
    label = rng.integers(0, 5, shape[:3]).astype(np.uint8) if labelled else None
    metadata = {"case_id": "case_é1", "geometry": {"spacing": [1.5, 2.0, 3.0]}}

    def feature(value):
        if isinstance(value, bytes):
            return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))
        return tf.train.Feature(int64_list=tf.train.Int64List(value=list(value)))

    fields = {
        "case_id": "case_é1".encode(),
        "image": image.astype(image.dtype.newbyteorder("<")).tobytes(),
        "image_shape": shape,
        "label": label.tobytes() if labelled else b"",
        "label_shape": label.shape if labelled else (0, 0, 0),
        "metadata": json.dumps(metadata, sort_keys=True).encode(),
    }
    example = tf.train.Example(features=tf.train.Features(feature={k: feature(v) for k, v in fields.items()}))
    written = encode_example("case_é1", image, label, metadata)
    assert written == example.SerializeToString(deterministic=True)
    parsed_image, parsed_label, meta = parse_example(tf.constant(written), np.dtype(dtype).name)
    np.testing.assert_array_equal(parsed_image.numpy(), image)
    assert parsed_label.shape == (label.shape if labelled else (0, 0, 0))
    assert json.loads(meta["metadata"].numpy()) == metadata


@pytest.mark.parametrize(
    "shape, dtype, labelled", [((5, 6, 7, 2), np.float16, True), ((130, 129, 1, 1), np.float32, False)]
)
def test_decode_example_reads_without_copies_what_parse_example_reads(shape, dtype, labelled):
    """`decode_example` (the wire format read in numpy, the patch-read writer's reader) gives the arrays, case id and
    metadata TensorFlow's `parse_example` gives, for `encode_example`'s bytes, for protobuf's own serialisation
    (map order not fixed) and for a record whose shapes are written unpacked (each integer its own field, as protocol
    buffers may); its arrays are views of the payload, not copies; a payload that is not a record is a ValueError."""
    import json

    import tensorflow as tf

    from tfmis.data.records import decode_example, encode_example, parse_example

    rng = np.random.default_rng(1)
    image = rng.normal(size=shape).astype(dtype)
    label = rng.integers(0, 5, shape[:3]).astype(np.uint8) if labelled else None
    metadata = {"case_id": "case_7", "geometry": {"spacing": [1.5, 2.0, 3.0]}}
    written = bytearray(encode_example("case_7", image, label, metadata))
    example = tf.train.Example.FromString(bytes(written))

    # the same example written out by hand from the encoding's definition, the shapes as unpacked varints (one field
    # each, wire type 0), the map's entries in reverse order
    def field(number: int, body: bytes) -> bytes:  # a length-delimited field
        return _varint_bytes(number << 3 | 2) + _varint_bytes(len(body)) + body

    entries = b""
    for key in reversed(list(example.features.feature)):
        feature = example.features.feature[key]
        if feature.HasField("int64_list"):
            body = field(3, b"".join(bytes([0x08]) + _varint_bytes(v) for v in feature.int64_list.value))
        else:
            body = field(1, b"".join(field(1, v) for v in feature.bytes_list.value))
        entries += field(1, field(1, key.encode()) + field(2, body))
    unpacked = bytearray(field(1, entries))
    for payload in (written, bytearray(example.SerializeToString()), unpacked):
        got = decode_example(payload, np.dtype(dtype).name)
        want_image, want_label, want_meta = parse_example(tf.constant(bytes(payload)), np.dtype(dtype).name)
        np.testing.assert_array_equal(got["image"], want_image.numpy())
        np.testing.assert_array_equal(got["label"], want_label.numpy())
        assert got["image"].dtype == dtype and got["label"].shape == (label.shape if labelled else (0, 0, 0))
        assert got["case_id"] == "case_7" and got["metadata"] == json.loads(want_meta["metadata"].numpy())
        assert np.shares_memory(got["image"], np.frombuffer(payload, np.uint8))
    with pytest.raises(ValueError, match="no feature 'image_shape'"):
        decode_example(bytearray(b"\x0a\x00"), "float16")  # an Example with no features
    with pytest.raises(ValueError, match="runs past"):
        decode_example(written[:-7], np.dtype(dtype).name)  # a truncated record


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB", "NONE"])
def test_a_shards_records_are_read_once_each_into_one_buffer(tmp_path, compression):
    """`read_record_payloads` over a shard TensorFlow's own `TFRecordWriter` wrote (three 8 MB records, every
    compression): each requested record's bytes come back exact, in offset order, a record not asked for skipped;
    Python's allocations (tracemalloc: the payload buffers, gzip's and zlib's chunks) peak under 1.3x one record,
    so a record is never held twice (reading a whole copy first, as `GzipFile.readinto` does, would be 2x)."""
    import hashlib
    import tracemalloc

    import tensorflow as tf

    from tfmis.data.records import COMPRESSIONS, framed_size, read_record_payloads

    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 4, 8 << 20, dtype=np.uint8).tobytes() for _ in range(3)]  # compressible, 2 bits a byte
    path = tmp_path / f"train-000-of-001.tfrecord{COMPRESSIONS[compression]}"
    with tf.io.TFRecordWriter(str(path), tf.io.TFRecordOptions(compression_type=compression.replace("NONE", ""))) as w:
        for payload in payloads:
            w.write(payload)
    offsets = np.cumsum([0] + [framed_size(len(p)) for p in payloads])[:-1]
    entries = [
        {"case_id": f"c{i}", "offset": int(o), "length": len(p), "sha256": hashlib.sha256(p).hexdigest()}
        for i, (o, p) in enumerate(zip(offsets, payloads))
    ]
    tracemalloc.start()
    try:
        read = []
        for entry, payload in read_record_payloads(path, [entries[2], entries[0]], compression):
            read.append((entry["case_id"], payload == payloads[int(entry["case_id"][1:])]))
            del payload
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert read == [("c0", True), ("c2", True)]
    assert peak < 1.3 * len(payloads[0]), f"{peak / len(payloads[0]):.2f} records held at once"


def _varint_bytes(value: int) -> bytes:
    """A protocol buffer varint, written out from the encoding's definition (7 bits a byte, low first)."""
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)
