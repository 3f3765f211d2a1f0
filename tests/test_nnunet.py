"""nnU-Net v2 raw datasets read as they are (tfmis.data.sources.nnunet, picked by dataset.json): the same records as
the MSD layout of the same cases, region labels as tfmis's regions config, and a layout broken case by case
converting its good cases with one line per bad one."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import make_msd_dataset
from nnunet_layout import msd_in_format, msd_to_nnunet

from tfmis.config import load_config
from tfmis.config.checks import region_paint_labels
from tfmis.convert import main as convert_main
from tfmis.data.conversion_options import ConversionConfig
from tfmis.data.convert import convert
from tfmis.data.records import load_index, read_record, split_cases
from tfmis.data.sources.errors import DatasetError
from tfmis.data.sources.layouts import open_dataset
from tfmis.data.sources.msd import MSDDataset
from tfmis.data.sources.nnunet import NnUNetDataset


def all_records(target) -> dict:
    """{case id: (image, label, geometry)} of every record of every split, decoded by the repo's record reader."""
    index = load_index(target)
    out = {}
    for split in index["splits"]:
        for sample in range(len(split_cases(index, split))):
            record = read_record(target, split, sample)
            out[record["case_id"]] = (record["image"], record["label"], record["metadata"]["geometry"])
    return out


@pytest.mark.parametrize("file_ending", [".nii.gz", ".mha"])
def test_nnunet_layout_converts_to_the_same_records_as_its_msd_layout(tmp_path, file_ending):
    if file_ending != ".nii.gz":
        pytest.importorskip("SimpleITK")
    msd = make_msd_dataset(tmp_path / "Task99_Test", num_cases=4)
    nnunet = msd_to_nnunet(msd, tmp_path / "Dataset099_Test", file_ending)
    assert isinstance(open_dataset(msd), MSDDataset) and isinstance(open_dataset(nnunet), NnUNetDataset)
    for source, target in ((msd, "msd_tfr"), (nnunet, "nnunet_tfr")):
        convert(ConversionConfig(str(source), str(tmp_path / target), split=(0.5, 0.5), workers=1, progress=False))
    expected, got = all_records(tmp_path / "msd_tfr"), all_records(tmp_path / "nnunet_tfr")
    assert sorted(got) == sorted(expected) == [f"case_{i:03d}" for i in range(4)]
    for case_id, (image, label, geometry) in expected.items():
        np.testing.assert_array_equal(got[case_id][0], image)
        np.testing.assert_array_equal(got[case_id][1], label)
        assert got[case_id][2] == geometry
    index = load_index(tmp_path / "nnunet_tfr")
    assert index["source"]["layout"] == "nnunetv2" and index["source"]["labels"] == ["background", "organ", "core"]
    assert index["cases"]["case_000"]["image"] == [f"imagesTr/case_000_000{c}{file_ending}" for c in range(2)]
    assert load_index(tmp_path / "msd_tfr")["preprocessing"] == index["preprocessing"]


def test_msd_dataset_of_nrrd_files_converts_to_the_records_of_its_nifti_files(tmp_path):
    """An MSD dataset.json listing NRRD files (two channels as vector pixels) gives the records of the same scans
    as NIfTI."""
    pytest.importorskip("SimpleITK")
    msd = make_msd_dataset(tmp_path / "Task99_Test", num_cases=2)
    nrrd = msd_in_format(msd, tmp_path / "Task98_Nrrd", ".nrrd")
    for source, target in ((msd, "nifti_tfr"), (nrrd, "nrrd_tfr")):
        convert(ConversionConfig(str(source), str(tmp_path / target), split=(0.5, 0.5), workers=1, progress=False))
    expected, got = all_records(tmp_path / "nifti_tfr"), all_records(tmp_path / "nrrd_tfr")
    assert sorted(got) == sorted(expected) == ["case_000", "case_001"]
    for case_id, (image, label, geometry) in expected.items():
        np.testing.assert_array_equal(got[case_id][0], image)
        np.testing.assert_array_equal(got[case_id][1], label)
        assert got[case_id][2] == geometry


def test_channel_named_ct_in_any_case_gets_ct_normalisation_as_an_msd_ct_modality(tmp_path):
    """nnU-Net's rule (channel name "CT", any case) is tfmis's MSD rule: the conversion clips and scales it as CT, with
    the window the MSD layout of the same scans gets."""
    msd = make_msd_dataset(tmp_path / "msd", num_cases=2, channels=1, modalities={"0": "CT"})
    nnunet = msd_to_nnunet(msd, tmp_path / "nn", channel_names={"0": "ct"})
    dataset = open_dataset(nnunet)
    assert dataset.modalities == ["ct"] and dataset.is_ct and dataset.num_channels == 1
    assert [c.image for c in dataset.test] == [("imagesTs/case_900_0000.nii.gz",)]
    for source, target in ((msd, "msd_tfr"), (nnunet, "nn_tfr")):
        convert(ConversionConfig(str(source), str(tmp_path / target), split=(0.5, 0.5), workers=1, progress=False))
    prep = load_index(tmp_path / "nn_tfr")["preprocessing"]
    assert prep["normalization"] == ["ct"] and prep["ct_window"] is not None
    assert prep == load_index(tmp_path / "msd_tfr")["preprocessing"]


BRATS_LABELS = {"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing tumor": 3}


def regions_dataset(root, labels=BRATS_LABELS, order=(1, 2, 3)):
    msd = make_msd_dataset(root / "msd", num_cases=1, labels={"0": "background", "1": "a", "2": "b", "3": "c"})
    nnunet = msd_to_nnunet(msd, root / "nn")
    meta = json.loads((nnunet / "dataset.json").read_text())
    meta.update(labels=labels, regions_class_order=list(order))
    (nnunet / "dataset.json").write_text(json.dumps(meta))
    return nnunet


def test_region_labels_map_onto_tfmis_regions_config_painted_in_regions_class_order(tmp_path):
    dataset = open_dataset(regions_dataset(tmp_path))
    assert dataset.regions == {"whole_tumor": [1, 2, 3], "tumor_core": [2, 3], "enhancing_tumor": [3]}
    assert dataset.labels == ["background", "whole tumor", "tumor core", "enhancing tumor"]  # who paints each label
    regions = "{" + ", ".join(f"{k}: {v}" for k, v in dataset.regions.items()) + "}"
    config = load_config(None, ["model.output=regions", "loss.activation=sigmoid", f"validation.regions={regions}"])
    assert config.validation.regions == dataset.regions
    assert region_paint_labels(config.validation.regions) == [1, 2, 3]  # nnU-Net's regions_class_order


def test_regions_class_order_that_tfmis_would_paint_otherwise_is_one_line_naming_the_key(tmp_path):
    root = regions_dataset(tmp_path, order=(3, 2, 1))
    with pytest.raises(DatasetError, match=r"regions_class_order .* expected \[1, 2, 3\], got \[3, 2, 1\]") as raised:
        open_dataset(root)
    assert "\n" not in str(raised.value)


def break_layout(root) -> dict[str, str]:
    """Breaks cases of an nnU-Net dataset of case_000..case_005 one way each; {case: words of its line}."""
    (root / "imagesTr" / "case_001_0001.nii.gz").unlink()
    for c in range(2):
        (root / "imagesTr" / f"case_002_000{c}.nii.gz").unlink()
    for c in range(2):
        source = root / "imagesTr" / f"case_003_000{c}.nii.gz"
        shutil.copyfile(source, source.with_name(f"case_003_000{c}.nii"))
        source.unlink()
    (root / "labelsTr" / "case_004.nii.gz").unlink()
    return {
        "case_001": "channel 1 (MR1) file imagesTr/case_001_0001.nii.gz is missing",
        "case_002": "label labelsTr/case_002.nii.gz has no image imagesTr/case_002_0000.nii.gz",
        "case_003": "imagesTr/case_003_0000.nii ends with .nii, not dataset.json's file_ending '.nii.gz'",
        "case_004": "label labelsTr/case_004.nii.gz does not exist",
    }


def test_broken_nnunet_layout_names_each_bad_case_in_one_line_and_converts_the_good_ones(tmp_path, capsys):
    """An nnU-Net v2 folder broken case by case (a missing channel file, a missing label, another file ending...):
    exit 3, each bad case's reason printed once (when it is met; the summary names the case), the good cases
    converted, and the summary counts only shards that hold records."""
    root = msd_to_nnunet(make_msd_dataset(tmp_path / "msd", num_cases=6), tmp_path / "Dataset001_Broken")
    expected = break_layout(root)
    code = convert_main(
        ["--source-dir", str(root), "--target-dir", str(tmp_path / "out"), "--split", "0.5,0.5", "--workers", "1"]
    )
    out, err = capsys.readouterr()
    assert code == 3, err  # docs/exit-codes.md: converted, but some cases were skipped
    skipped = {s["case_id"]: s["reason"] for s in load_index(tmp_path / "out")["skipped"]}
    assert sorted(skipped) == sorted(expected)
    for case_id, words in expected.items():  # each reason printed once, when the case is met; its id in the summary
        assert words in skipped[case_id]
        lines = [line for line in (out + err).splitlines() if words in line]
        assert len(lines) == 1 and lines[0].strip().startswith(f"{case_id}: "), lines
        assert case_id in next(line for line in out.splitlines() if line.strip().startswith("skipped: "))
    assert sorted(load_index(tmp_path / "out")["cases"]) == ["case_000", "case_005"]
    assert "Traceback" not in err
    for name, split in load_index(tmp_path / "out")["splits"].items():  # a shard of skipped cases only is no shard
        line = next(line for line in out.splitlines() if line.strip().startswith(f"{name} "))
        written = sum(1 for shard in split["shards"] if shard["records"])
        assert f"{split['num_records']} records in {written} shard(s)" in line, line


def planned(source, out, *extra):
    from tfmis.plan import main as plan_main

    args = ["--source-dir", str(source), "--output", str(out / "plan.yaml"), "--output-dir", str(out / "run")]
    assert plan_main([*args, "--target-dir", str(out / "tfr"), "--workers", "1", "--quiet", *extra]) == 0
    return load_config(out / "plan.yaml")


def test_plan_of_an_nnunet_dataset_equals_the_plan_of_its_msd_layout(tmp_path):
    """The same scans as MSD, as nnU-Net v2 NIfTI and (with SimpleITK) as nnU-Net v2 MetaImage and MSD NRRD plan
    alike."""
    msd = make_msd_dataset(tmp_path / "Task99_Test", num_cases=4)
    sources = [msd, msd_to_nnunet(msd, tmp_path / "Dataset099_Test")]
    try:
        import SimpleITK  # noqa: F401

        sources.append(msd_to_nnunet(msd, tmp_path / "Dataset098_Mha", ".mha"))
        sources.append(msd_in_format(msd, tmp_path / "Task97_Nrrd", ".nrrd"))
    except ImportError:
        pass
    configs = [dataclasses.asdict(planned(source, tmp_path / f"plan{i}")) for i, source in enumerate(sources)]
    for config in configs:
        config["output"].pop("dir")
        config["data"].pop("source_dir"), config["data"].pop("dataset_dir")
    assert all(config == configs[0] for config in configs[1:])


def test_plan_of_an_nnunet_regions_dataset_trains_its_regions(tmp_path):
    dataset = open_dataset(regions_dataset(tmp_path))
    config = planned(dataset.root, tmp_path / "plan")
    assert config.validation.regions == dataset.regions
    assert config.model.output == "regions" and config.loss.activation == "sigmoid"


SOURCES = [("nnunetv2", ".nii.gz"), ("nnunetv2", ".mha"), ("msd", ".nrrd")]


def source_dataset(tmp_path, layout: str, suffix: str):
    """Four cases of `make_msd_dataset` in `layout` with images and labels as `suffix` files."""
    if suffix != ".nii.gz":
        pytest.importorskip("SimpleITK")
    msd = make_msd_dataset(tmp_path / "msd", num_cases=4)
    if layout == "msd":
        return msd_in_format(msd, tmp_path / "Task99_Source", suffix)
    return msd_to_nnunet(msd, tmp_path / "Task99_Source", suffix)


@pytest.mark.slow
@pytest.mark.parametrize("layout, suffix", SOURCES)
def test_train_source_dir_plans_converts_and_trains_each_layout_and_format(tmp_path, layout, suffix):
    """`python -m tfmis.train --source-dir` on an nnU-Net v2 dataset (NIfTI, MetaImage) and an MSD one of NRRD files:
    planned, converted, trained."""
    import os
    import subprocess
    import sys

    source = source_dataset(tmp_path, layout, suffix)
    settings = ["training.epochs=1", "training.steps_per_epoch=1", "output.progress=false", "output.tensorboard=false"]
    result = subprocess.run(
        [sys.executable, "-m", "tfmis.train", "--source-dir", str(source), "--set", f"output.dir={tmp_path / 'run'}"]
        + [arg for setting in settings for arg in ("--set", setting)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    index = load_index(tmp_path / "Task99_Source_tfrecords")
    assert index["source"]["layout"] == layout and len(index["cases"]) == 4
    assert (tmp_path / "run" / "summary.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("layout, suffix", SOURCES[1:])
def test_crossval_predicts_and_scores_out_of_fold_in_the_format_of_each_layout(tmp_path, capsys, layout, suffix):
    """tfmis-crossval with data.source_dir an nnU-Net v2 dataset of MetaImage files or an MSD one of NRRD files: two
    folds trained, every case predicted out of fold from its files into a label map of their format, scored, and a
    configuration chosen. (NIfTI out of fold, nnU-Net v2's default, is every other cross-validation test's case.)"""
    from conftest import tiny_config

    from tfmis.config import save_config
    from tfmis.crossval import main as crossval_main

    source = source_dataset(tmp_path, layout, suffix)
    config = tiny_config(
        tmp_path / "tfrecords",
        tmp_path / "runs",
        f"data.source_dir={source}",
        "data.conversion.shards=1",
        "training.epochs=1",
        "training.steps_per_epoch=1",
    )
    save_config(config, tmp_path / "a.yaml")
    code = crossval_main(["--config", str(tmp_path / "a.yaml"), "--folds", "2", "--output", str(tmp_path / "cv")])
    assert code == 0, capsys.readouterr().err[-3000:]
    assert json.loads((tmp_path / "cv" / "crossval.json").read_text())["chosen"]["configurations"] == ["a"]
    predictions = sorted(p.name for p in (tmp_path / "cv").rglob("validation/case_*"))
    assert predictions == [f"case_{i:03d}{suffix}" for i in range(4)]
