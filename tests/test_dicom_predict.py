"""`tfmis-predict` on DICOM series with a real (tiny) trained CT run: a series predicts the labels of its NIfTI, its
DICOM SEG reads back as that label map, and each bad series folder fails its case in one line (exit 3) or, several
series in one folder, stops the command (exit 2)."""

from __future__ import annotations

import csv

import nibabel as nib
import numpy as np
import pydicom
import pytest
from conftest import make_msd_dataset, tiny_config, write_nifti
from dicom_files import BAD_SERIES, coronal_affine, ct_slices, save_slices, write_series

from tfmis.config import load_config
from tfmis.data.records import load_index
from tfmis.data.sources.dicom_series import read_series
from tfmis.inference.dicom_seg import read_segmentation
from tfmis.predict import main as predict_main

pytestmark = pytest.mark.slow  # trains a run (about 20 s on 2 cores)


@pytest.fixture(scope="module")
def ct_run(tmp_path_factory):
    """A tiny run trained on a one-channel CT dataset, and one of its scans (float32 HU, X x Y x Z)."""
    from tfmis.config import save_config
    from tfmis.data.conversion_options import ConversionConfig
    from tfmis.data.convert import convert
    from tfmis.engine.trainer import Trainer

    root = tmp_path_factory.mktemp("ct")
    source = make_msd_dataset(root / "Task98_CT", num_cases=4, channels=1, modalities={"0": "CT"})
    convert(ConversionConfig(str(source), str(root / "tfrecords"), split=(0.75, 0.25), workers=1, progress=False))
    config = tiny_config(root / "tfrecords", root / "run", "training.epochs=3", "training.steps_per_epoch=4")
    Trainer(config).fit()
    save_config(config, root / "run" / "config.yaml")
    image = np.asanyarray(nib.load(str(source / "imagesTr" / "case_000.nii.gz")).dataobj).astype(np.float32)
    return root / "run", image


def predict(run, inputs, output, *more) -> int:
    return predict_main(["--checkpoint", str(run), "--input", str(inputs), "--output", str(output), "--quiet", *more])


def test_a_coronal_series_predicts_the_labels_of_its_nifti_and_its_seg_reads_back_as_them(ct_run, tmp_path):
    run, image = ct_run
    affine = coronal_affine()
    write_nifti(tmp_path / "nifti" / "case.nii.gz", image, affine)
    series = write_series(tmp_path / "dicom" / "case", image, affine, seed=5)  # shuffled file names
    assert predict(run, tmp_path / "nifti", tmp_path / "from_nifti") == 0
    assert predict(run, tmp_path / "dicom", tmp_path / "from_dicom") == 0
    assert predict(run, series, tmp_path / "seg", "--output-format", "dicom-seg") == 0
    expected = nib.load(str(tmp_path / "from_nifti" / "case.nii.gz"))
    labels = np.asanyarray(expected.dataobj)
    assert set(np.unique(labels)) >= {0, 1}  # the SEG holds a segment
    from_dicom = nib.load(str(tmp_path / "from_dicom" / "case.nii.gz"))
    np.testing.assert_array_equal(np.asanyarray(from_dicom.dataobj), labels)
    np.testing.assert_allclose(from_dicom.affine, expected.affine, atol=1e-6)
    seg = tmp_path / "seg" / "case.seg.dcm"
    names = load_index(load_config(run / "config.yaml").data.dataset_dir)["source"]["labels"]
    np.testing.assert_array_equal(read_segmentation(seg, read_series(series), names), labels)
    assert not (tmp_path / "seg" / "case.nii.gz").exists()
    with open(tmp_path / "seg" / "predictions.csv") as f:
        row = next(csv.DictReader(f))
    assert row["status"] == "ok" and row["output"] == str(seg)
    assert int(row["foreground_voxels"]) == np.count_nonzero(labels)


def test_each_bad_series_fails_its_case_in_one_line_and_several_series_stop_the_command(ct_run, tmp_path, capsys):
    run, image = ct_run
    scans = tmp_path / "scans"
    write_series(scans / "good", image, coronal_affine())
    for problem, (edit, _) in BAD_SERIES.items():
        save_slices(edit(ct_slices(image, coronal_affine())), scans / problem.replace(" ", "_"))
    assert predict(run, scans, tmp_path / "out") == 3
    with open(tmp_path / "out" / "predictions.csv") as f:
        rows = {r["case"]: r for r in csv.DictReader(f)}
    assert rows["good"]["status"] == "ok"
    for problem, (_, words) in BAD_SERIES.items():
        row = rows[problem.replace(" ", "_")]
        assert row["status"] == "failed" and words in row["reason"], row["reason"]
        assert str(scans / problem.replace(" ", "_")) in row["reason"]
    assert "4 of 5 case(s) failed" in capsys.readouterr().err
    study = tmp_path / "study"
    save_slices(ct_slices(image, coronal_affine(), description="a") + ct_slices(image, coronal_affine()), study)
    assert predict(run, study, tmp_path / "out2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {study} holds 2 DICOM series, 2 of them with ") and err[-1].endswith(
        "--series UID"
    )


def test_an_anonymised_series_without_study_uid_gets_a_seg_only_with_new_study_uid(ct_run, tmp_path, capsys):
    """`--output-format dicom-seg` on a series without StudyInstanceUID: the case fails (exit 3) with the reason
    naming `--new-study-uid` in predictions.csv; with the flag it is written, under a new study UID that the one
    warning line gives."""
    run, image = ct_run
    slices = ct_slices(image, coronal_affine())
    for ds in slices:
        del ds.StudyInstanceUID
    series = save_slices(slices, tmp_path / "anonymous")
    assert predict(run, series, tmp_path / "refused", "--output-format", "dicom-seg") == 3
    with open(tmp_path / "refused" / "predictions.csv") as f:
        row = next(csv.DictReader(f))
    assert row["status"] == "failed" and "--new-study-uid" in row["reason"], row
    capsys.readouterr()
    assert predict(run, series, tmp_path / "new", "--output-format", "dicom-seg", "--new-study-uid") == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: DICOM series")]
    study = str(pydicom.dcmread(tmp_path / "new" / "anonymous.seg.dcm").StudyInstanceUID)
    assert len(warnings) == 1 and study in warnings[0] and "no StudyInstanceUID" in warnings[0]
