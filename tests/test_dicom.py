"""DICOM in and out without a model: real series written with pydicom read back as their NIfTI (nibabel) and as
SimpleITK reads them; DICOM SEG written with highdicom read back as the label map; each bad folder one line.

The predictions through `tfmis-predict` on a trained run are in test_dicom_predict.py (slow)."""

from __future__ import annotations

import subprocess
import sys

import nibabel as nib
import numpy as np
import pydicom
import pytest
from conftest import write_nifti
from dicom_files import BAD_SERIES, coronal_affine, ct_slices, oblique_affine, save_slices, write_series

from tfmis.data.demos.ct import generate_case
from tfmis.data.sources.dicom_series import read_series, series_geometry
from tfmis.data.sources.errors import CaseError
from tfmis.errors import DataError, UsageError
from tfmis.inference.dicom_seg import read_segmentation, write_segmentation
from tfmis.inference.inputs import collect_inputs
from tfmis.predict import main as predict_main

CLASSES = ["background", "spleen", "lesion"]


@pytest.fixture(scope="module")
def ct_case():
    """A small demo CT volume (int16 HU, X x Y x Z) and its label map."""
    image, label, _ = generate_case(0, shape=(30, 26, 14))
    return image.astype(np.float32), label


def sitk_ras_affine(folder):
    """The voxel-to-RAS affine of the series as SimpleITK's ImageSeriesReader reads it (its direction, origin and
    spacing are LPS), and its array in (x, y, z) order."""
    import SimpleITK as sitk

    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(reader.GetGDCMSeriesFileNames(str(folder)))
    image = reader.Execute()
    lps = np.eye(4)
    lps[:3, :3] = np.array(image.GetDirection()).reshape(3, 3) * np.array(image.GetSpacing())
    lps[:3, 3] = image.GetOrigin()
    return np.diag([-1.0, -1.0, 1.0, 1.0]) @ lps, sitk.GetArrayFromImage(image).transpose(2, 1, 0)


@pytest.mark.parametrize("orientation", ["oblique", "coronal"])
def test_shuffled_series_reads_as_the_nifti_of_its_volume_and_as_simpleitk_reads_it(ct_case, tmp_path, orientation):
    image, _ = ct_case
    affine = oblique_affine() if orientation == "oblique" else coronal_affine()
    folder = write_series(tmp_path / "series", image, affine, seed=3)
    nifti = nib.load(write_nifti(tmp_path / "case.nii.gz", image, affine))
    volume = read_series(folder)
    assert volume.image.dtype == np.float32 and volume.image.shape == image.shape
    np.testing.assert_array_equal(volume.image, np.asanyarray(nifti.dataobj))  # HU: int16 pixels rescaled
    np.testing.assert_allclose(volume.affine, nifti.affine, atol=1e-5)  # the NIfTI stores its affine as float32
    np.testing.assert_allclose(volume.affine, affine, atol=1e-8)
    sitk_affine, sitk_array = sitk_ras_affine(folder)
    np.testing.assert_allclose(volume.affine, sitk_affine, atol=1e-6)
    np.testing.assert_array_equal(volume.image, sitk_array)
    positions = [
        float(np.dot(ds.ImagePositionPatient, np.cross(*np.reshape(ds.ImageOrientationPatient, (2, 3)))))
        for ds in volume.datasets
    ]
    assert positions == sorted(positions)  # the headers in the volume's slice order


def test_rescale_slope_and_intercept_of_each_slice_are_applied(ct_case, tmp_path):
    image, _ = ct_case
    slices = ct_slices(image, coronal_affine())
    ds = slices[4]  # stored as (HU + 1024) / 2 with slope 2: the same HU
    pixels = np.frombuffer(ds.PixelData, "<i2").reshape(ds.Rows, ds.Columns).astype(np.int32)
    ds.PixelData = ((pixels // 2).astype("<i2")).tobytes()
    ds.RescaleSlope = "2"
    volume = read_series(save_slices(slices, tmp_path / "s"))
    expected = image.copy()
    expected[:, :, 4] = (np.rint(image[:, :, 4] + 1024) // 2) * 2 - 1024
    np.testing.assert_array_equal(volume.image, expected)


def test_an_mr_series_without_rescale_reads_its_unsigned_pixels_as_they_are(tmp_path):
    volume = np.random.default_rng(0).integers(0, 4000, (12, 10, 6)).astype(np.float32)
    slices = ct_slices(volume, oblique_affine())
    for ds, z in zip(slices, range(volume.shape[2])):
        ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = pydicom.uid.MRImageStorage
        ds.Modality, ds.PixelRepresentation = "MR", 0
        del ds.RescaleSlope, ds.RescaleIntercept, ds.RescaleType
        ds.PixelData = volume[:, :, z].T.astype("<u2").tobytes()
    read = read_series(save_slices(slices, tmp_path / "mr"))
    np.testing.assert_array_equal(read.image, volume)
    np.testing.assert_allclose(read.affine, sitk_ras_affine(tmp_path / "mr")[0], atol=1e-6)


def test_a_segmentation_reads_back_as_the_label_map_with_highdicom_and_references_the_series(ct_case, tmp_path):
    image, label = ct_case
    folder = write_series(tmp_path / "series", image, oblique_affine(), seed=1)
    volume = read_series(folder)
    path = write_segmentation(label, volume, CLASSES, tmp_path / "case.seg.dcm")
    np.testing.assert_array_equal(read_segmentation(path, volume), label)
    seg = pydicom.dcmread(path)
    assert seg.SOPClassUID == pydicom.uid.SegmentationStorage and seg.SegmentationType == "BINARY"
    assert [s.SegmentLabel for s in seg.SegmentSequence] == ["spleen", "lesion"]
    assert [s.SegmentNumber for s in seg.SegmentSequence] == [1, 2]
    for s in seg.SegmentSequence:
        assert s.SegmentAlgorithmType == "AUTOMATIC" and s.SegmentAlgorithmName == "tfmis"
        assert s.SegmentedPropertyCategoryCodeSequence[0].CodeMeaning == "Tissue"
    assert seg.ReferencedSeriesSequence[0].SeriesInstanceUID == volume.uid
    referenced = {r.ReferencedSOPInstanceUID for r in seg.ReferencedSeriesSequence[0].ReferencedInstanceSequence}
    assert referenced == {ds.SOPInstanceUID for ds in volume.datasets}
    assert seg.StudyInstanceUID == volume.datasets[0].StudyInstanceUID
    (folder / "seg.dcm").write_bytes(path.read_bytes())  # a SEG beside the slices is not a slice (nor a series)
    assert read_series(folder).uid == volume.uid


@pytest.mark.parametrize("problem", list(BAD_SERIES))
def test_a_series_that_would_give_a_wrong_volume_is_refused_in_one_line_naming_its_folder(ct_case, tmp_path, problem):
    image, _ = ct_case
    edit, words = BAD_SERIES[problem]
    folder = save_slices(edit(ct_slices(image, coronal_affine())), tmp_path / problem.replace(" ", "_"))
    with pytest.raises(CaseError) as caught:
        read_series(folder, case_id="c1")
    line = str(caught.value)
    assert words in line and str(folder) in line and len(line.splitlines()) == 1, line


def test_a_localizer_in_the_series_is_left_out(ct_case, tmp_path):
    image, _ = ct_case
    slices = ct_slices(image, coronal_affine())
    scout = ct_slices(image[:, :, :1], oblique_affine(), series_uid=slices[0].SeriesInstanceUID)[0]
    scout.ImageType = ["ORIGINAL", "PRIMARY", "LOCALIZER"]
    volume = read_series(save_slices([*slices, scout], tmp_path / "series"))
    np.testing.assert_array_equal(volume.image, image)
    assert scout.SOPInstanceUID not in {ds.SOPInstanceUID for ds in volume.datasets}


def geometry_headers(along, across=None):
    """Headers of axial slices at `along` mm (z), each shifted by `across` mm in x: geometry tags only."""
    headers = []
    for k, z in enumerate(along):
        ds = pydicom.Dataset()
        ds.ImageOrientationPatient = ["1", "0", "0", "0", "1", "0"]
        ds.ImagePositionPatient = [f"{0.0 if across is None else across[k]:.6f}", "0", f"{z:.6f}"]
        ds.PixelSpacing, ds.Rows, ds.Columns = ["0.8", "0.8"], 4, 4
        headers.append(ds)
    return headers


def test_steps_each_within_one_percent_that_add_up_off_the_even_grid_are_uneven_spacing(tmp_path):
    n = 200  # 1 mm slices, the first half 0.9% further apart, the second half 0.9% closer: 0.9 mm off at the middle
    along = np.concatenate([[0.0], np.cumsum(np.r_[np.full(n // 2, 1.009), np.full(n // 2 - 1, 0.991)])])
    with pytest.raises(
        DataError, match=r"uneven slice spacing: from 0\.991 to 1\.009 mm \(slices up to 0\.89. mm off an even grid\)"
    ):
        series_geometry(geometry_headers(along), [tmp_path / f"{k}.dcm" for k in range(n)], tmp_path)
    order, affine = series_geometry(geometry_headers(np.arange(n) * 1.0), [tmp_path] * n, tmp_path)
    assert order == list(range(n)) and affine[2, 2] == pytest.approx(1.0)


def test_a_small_tilt_that_adds_up_to_a_tenth_of_a_pixel_is_refused(tmp_path):
    n = 100  # 0.002 mm across per 1 mm slice (0.1 degrees): 0.2 mm at the last slice, a quarter of a pixel
    headers = geometry_headers(np.arange(n) * 1.0, np.arange(n) * 0.002)
    with pytest.raises(DataError, match=r"gantry tilt of 0\.1 degrees"):
        series_geometry(headers, [tmp_path] * n, tmp_path)


def test_a_study_folder_reads_its_largest_series_saying_so_the_named_one_with_series_and_a_tie_is_refused(
    ct_case, tmp_path, capsys
):
    """A study folder as a PACS exports it (a thin series, a 6-slice one, a duplicated slice file): without
    `--series` the series with the most slices is read and one line on standard error names it, the other and
    `--series`; `--series UID` reads the named one; two series of the most slices are a UsageError listing them."""
    image, _ = ct_case
    folder = tmp_path / "study"
    first = ct_slices(image, coronal_affine(), description="soft tissue")
    second = ct_slices(image[:, :, :6], coronal_affine(), description="bone", series_uid="1.2.3.4.5")
    save_slices(first + second, folder)
    first[2].save_as(folder / "copy_of_a_slice.dcm", enforce_file_format=True)  # one SOPInstanceUID twice
    (case,) = collect_inputs(folder)
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1 and case.series == first[0].SeriesInstanceUID, line
    assert line == (
        f"{folder} holds 2 DICOM series: reading the largest, {first[0].SeriesInstanceUID} (CT 'soft tissue', "
        f"{image.shape[2]} slices); not read: 1.2.3.4.5 (CT 'bone', 6 slices); choose another with --series UID"
    )
    np.testing.assert_array_equal(read_series(case.image, case.series).image, image)
    (case,) = collect_inputs(folder, series="1.2.3.4.5")
    assert case.series == "1.2.3.4.5" and case.case_id == "study"
    assert read_series(case.image, case.series).image.shape == (*image.shape[:2], 6)
    with pytest.raises(UsageError, match="--series 9.9 is not in"):
        collect_inputs(folder, series="9.9")
    tie = ct_slices(image, coronal_affine(), description="bone", series_uid="1.2.3.4.6")
    save_slices(tie, tmp_path / "tie")
    save_slices(first, tmp_path / "tie", seed=1)
    with pytest.raises(UsageError) as caught:
        collect_inputs(tmp_path / "tie")
    line = str(caught.value)
    assert f"{tmp_path / 'tie'} holds 2 DICOM series, 2 of them with {image.shape[2]} slices" in line
    assert "1.2.3.4.6 (CT 'bone'" in line and line.endswith("choose one with --series UID")


def test_a_folder_of_series_folders_is_one_case_each_next_to_nifti_files(ct_case, tmp_path):
    image, label = ct_case
    write_series(tmp_path / "scans" / "patient_b", image, coronal_affine())
    write_series(tmp_path / "scans" / "patient_a", image, oblique_affine())
    write_nifti(tmp_path / "scans" / "patient_c.nii.gz", image, coronal_affine())
    write_nifti(tmp_path / "labels" / "patient_a.nii.gz", label, oblique_affine())
    volume = read_series(tmp_path / "scans" / "patient_b")  # an earlier prediction's SEG folder: no case
    write_segmentation(label, volume, CLASSES, tmp_path / "scans" / "predictions" / "patient_b.seg.dcm")
    cases = collect_inputs(tmp_path / "scans", label_dir=tmp_path / "labels")
    assert [(c.case_id, c.series is not None) for c in cases] == [
        ("patient_c", False),
        ("patient_a", True),
        ("patient_b", True),
    ]
    assert [c.label for c in cases] == [None, str(tmp_path / "labels" / "patient_a.nii.gz"), None]
    with pytest.raises(UsageError, match="is one DICOM slice: give the folder"):
        collect_inputs(next((tmp_path / "scans" / "patient_a").iterdir()))


def test_a_series_without_patient_and_study_details_gets_a_seg_and_one_without_frame_of_reference_fails(
    ct_case, tmp_path
):
    image, label = ct_case
    slices = ct_slices(image, coronal_affine())
    for ds in slices:  # type-2 attributes a series may leave out; highdicom reads them
        for keyword in (
            "PatientName",
            "PatientID",
            "PatientBirthDate",
            "StudyDate",
            "AccessionNumber",
            "SliceThickness",
        ):
            delattr(ds, keyword)
    volume = read_series(save_slices(slices, tmp_path / "anonymous"))
    path = write_segmentation(label, volume, CLASSES, tmp_path / "anonymous.seg.dcm")
    np.testing.assert_array_equal(read_segmentation(path, volume), label)
    for ds in volume.datasets:
        del ds.FrameOfReferenceUID
    with pytest.raises(DataError, match="its slices have no FrameOfReferenceUID, which a DICOM SEG must reference"):
        write_segmentation(label, volume, CLASSES, tmp_path / "no_frame.seg.dcm")
    assert not (tmp_path / "no_frame.seg.dcm").exists()


def test_a_corrupt_slice_fails_its_case_when_read_not_the_collection_of_the_others(ct_case, tmp_path):
    image, _ = ct_case
    write_series(tmp_path / "scans" / "good", image, coronal_affine())
    broken = write_series(tmp_path / "scans" / "broken", image, coronal_affine())
    victim = sorted(broken.iterdir())[2]
    victim.write_bytes(victim.read_bytes()[:200])  # the preamble and a truncated header
    cases = collect_inputs(tmp_path / "scans")
    assert [(c.case_id, c.series != "") for c in cases] == [("broken", False), ("good", True)]
    with pytest.raises(CaseError, match=f"case broken: DICOM file {victim} is an image slice without ImagePosition"):
        read_series(cases[0].image, cases[0].series, cases[0].case_id)


def test_dicom_seg_output_needs_a_dicom_input_and_the_dicom_extra_exit_2(ct_case, tmp_path, capsys):
    image, _ = ct_case
    nifti = write_nifti(tmp_path / "case.nii.gz", image, coronal_affine())
    args = ["--checkpoint", str(tmp_path), "--input", str(nifti), "--output", str(tmp_path / "out")]
    assert predict_main([*args, "--output-format", "dicom-seg"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --output-format dicom-seg: --input") and "--output-format nifti" in err
    assert len(err.splitlines()) == 1
    # highdicom not importable: one line saying what to install (a real import failure in a fresh process)
    code = (
        "import sys; sys.modules['highdicom'] = None; from tfmis.predict import main; "
        f"sys.exit(main({[*args, '--output-format', 'dicom-seg']!r}))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "error: --output-format dicom-seg needs highdicom, which is not installed: install tfmis[dicom] "
        "(pip install 'tfmis[dicom]')"
    )
    # pydicom not importable, a DICOM series as --input
    series = write_series(tmp_path / "series", image, coronal_affine())
    args[3] = str(series)
    code = f"import sys; sys.modules['pydicom'] = None; from tfmis.predict import main; sys.exit(main({args!r}))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        f"error: --input {series} (DICOM) needs pydicom, which is not installed: install tfmis[dicom] "
        "(pip install 'tfmis[dicom]')"
    )
