"""DICOM as PACS and other tools export it, written by other writers than tfmis's tests' own (GDCM through
SimpleITK, pydicom's encoders, highdicom's legacy converters), read as SimpleITK reads them; and DICOM SEG as
viewers expect it (segments named, absent classes not declared, an empty prediction small, a series without a
study UID)."""

from __future__ import annotations

import subprocess
import sys

import highdicom as hd
import numpy as np
import pydicom
import pytest
from dicom_files import coronal_affine, ct_slices, oblique_affine, save_slices, sitk_series
from pydicom.uid import (
    JPEG2000Lossless,
    JPEGLosslessSV1,
    JPEGLSLossless,
    MRImageStorage,
    RLELossless,
)
from test_dicom import sitk_ras_affine

from tfmis.data.sources.dicom_series import position_rounding, read_series
from tfmis.data.sources.errors import CaseError
from tfmis.errors import DataError
from tfmis.inference.dicom_seg import read_segmentation, write_segmentation

CLASSES = ["background", "liver", "spleen", "kidney"]


@pytest.fixture(scope="module")
def volume():
    """(X, Y, Z) int16 HU values: noise over the whole range, so that a decoder that rounds or clips shows."""
    return np.random.default_rng(0).integers(-1024, 3000, (24, 20, 10)).astype(np.int16)


def pydicom_compressed(volume, affine, folder, syntax):
    """Our slices compressed by pydicom's own encoders (RLE: pydicom's; JPEG-LS: pyjpegls)."""
    slices = ct_slices(volume, affine)
    for ds in slices:
        ds.compress(syntax, encoding_plugin="pyjpegls" if syntax == JPEGLSLossless else "")
    return save_slices(slices, folder)


@pytest.mark.parametrize(
    "syntax",
    [JPEGLosslessSV1, JPEG2000Lossless, JPEGLSLossless, RLELossless],
    ids=["jpeg-lossless-sitk", "jpeg2000-sitk", "jpeg-ls-pydicom", "rle-pydicom"],
)
def test_a_compressed_series_from_another_writer_reads_its_voxels_and_simpleitks_geometry(volume, tmp_path, syntax):
    """JPEG Lossless (process 14, SV1: the commonest lossless PACS syntax) and JPEG 2000 written by GDCM through
    SimpleITK, JPEG-LS and RLE by pydicom's encoders: the file carries that transfer syntax, the voxels read back
    exactly (the dicom extra's decoders), and the affine is SimpleITK's."""
    affine = oblique_affine()
    if syntax in (JPEGLosslessSV1, JPEG2000Lossless):
        folder = sitk_series(tmp_path / "s", volume, affine, "JPEG" if syntax == JPEGLosslessSV1 else "JPEG2000")
    else:
        folder = pydicom_compressed(volume, affine, tmp_path / "s", syntax)
    assert {str(pydicom.dcmread(p).file_meta.TransferSyntaxUID) for p in folder.iterdir()} == {str(syntax)}
    read = read_series(folder)
    np.testing.assert_array_equal(read.image, volume)
    sitk_affine, sitk_array = sitk_ras_affine(folder)
    np.testing.assert_allclose(read.affine, sitk_affine, atol=1e-6)
    np.testing.assert_array_equal(sitk_array, volume)


def test_without_a_decoder_a_compressed_series_fails_in_one_line_naming_its_syntax_and_the_install(volume, tmp_path):
    """GDCM and pylibjpeg made unimportable in a fresh process (as without the dicom extra's decoders): the JPEG
    Lossless series' case fails in one line that names the transfer syntax, pydicom's whole cause (not cut at its
    first line) and the command that installs the decoders."""
    folder = sitk_series(tmp_path / "s", volume, coronal_affine(), "JPEG")
    code = (
        "import sys; sys.modules['gdcm'] = None; sys.modules['pylibjpeg'] = None\n"
        "from tfmis.data.sources.dicom_series import read_series\n"
        "from tfmis.data.sources.errors import CaseError\n"
        f"try:\n    read_series({str(folder)!r}, case_id='c1')\n"
        "except CaseError as e:\n    print(e)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    line = run.stdout.strip()
    assert run.returncode == 0 and len(line.splitlines()) == 1, run.stdout + run.stderr
    assert line.startswith("case c1: DICOM file ") and "its pixels cannot be read" in line
    assert "compressed as JPEG Lossless, Non-Hierarchical, First-Order Prediction" in line
    assert "gdcm - requires gdcm" in line and line.endswith("pip install 'tfmis[dicom]' (python-gdcm, pyjpegls)")


def test_a_thin_oblique_series_with_positions_written_to_2_decimals_reads_as_simpleitk_reads_it(tmp_path):
    """0.6 mm slices tilted 12 degrees, ImagePositionPatient written to 2 decimals (by SimpleITK/GDCM, as
    anonymisers leave them): steps from 0.592 to 0.604 mm, which the 1 % spacing check alone refused. Read with
    the rounding of 2 decimals allowed (0.005 mm a coordinate): the voxels exactly, the affine within that rounding
    of the true one and of SimpleITK's; the same series less one slice is still refused as a missing slice."""
    volume = np.random.default_rng(1).integers(-1000, 1000, (24, 20, 60)).astype(np.int16)
    affine = oblique_affine(spacing=(0.7, 0.7, 0.6), origin=(-31.234567, 12.345678, 40.98765), degrees=(12, 0, 0))
    folder = sitk_series(tmp_path / "thin", volume, affine, decimals=2)
    headers = [pydicom.dcmread(p, stop_before_pixels=True) for p in sorted(folder.iterdir())]
    assert position_rounding(headers) == 0.005
    read = read_series(folder)
    np.testing.assert_array_equal(read.image, volume)
    np.testing.assert_allclose(read.affine, affine, atol=0.01)
    np.testing.assert_allclose(read.affine, sitk_ras_affine(folder)[0], atol=0.01)
    by_z = sorted(folder.iterdir(), key=lambda p: int(pydicom.dcmread(p).InstanceNumber))
    by_z[30].unlink()
    with pytest.raises(CaseError, match=r"misses 1 slice\(s\): a gap of 1\.19. mm"):
        read_series(folder, case_id="thin")


def test_the_rounding_allowance_does_not_let_uneven_spacing_through(tmp_path, volume):
    """Positions written to 2 decimals with every other slice 0.05 mm further on (steps of 0.65 and 0.55 mm, 8 %
    off, ten times the rounding): refused as uneven spacing, the allowance named."""
    affine = oblique_affine(spacing=(0.7, 0.7, 0.6), degrees=(12, 0, 0))
    slices = ct_slices(volume, affine)
    normal = np.cross(
        [float(v) for v in slices[0].ImageOrientationPatient[:3]],
        [float(v) for v in slices[0].ImageOrientationPatient[3:]],
    )
    for z, ds in enumerate(slices):
        position = np.array([float(v) for v in ds.ImagePositionPatient]) + (0.05 * normal if z % 2 else 0)
        ds.ImagePositionPatient = [f"{v:.2f}" for v in position]
    with pytest.raises(CaseError, match=r"uneven slice spacing: .*beyond the 0\.006 mm the written positions'"):
        read_series(save_slices(slices, tmp_path / "uneven"), case_id="u")


def test_files_without_preamble_a_series_two_folders_deeper_and_a_slice_exported_twice_read_as_the_volume(
    volume, tmp_path
):
    """A PACS export as it arrives: slices written without the 128-byte preamble and `DICM` (a bare data set,
    implicit VR), in case/STUDY/SERIES, one of them twice under another name: `--input case` is one case of the
    whole volume (the duplicate's SOPInstanceUID read once)."""
    from tfmis.inference.inputs import collect_inputs

    slices = ct_slices(volume, coronal_affine())
    series = tmp_path / "scans" / "case01" / "STUDY1" / "SERIES1"
    series.mkdir(parents=True)
    for z, ds in enumerate(slices):
        del ds.file_meta
        ds.save_as(series / f"{z:04d}", implicit_vr=True, little_endian=True)
    (series / "copy").write_bytes((series / "0003").read_bytes())
    assert (series / "0003").read_bytes()[:2] == b"\x08\x00"  # no preamble: the data set's first tag
    cases = collect_inputs(tmp_path / "scans")
    assert [(c.case_id, c.series) for c in cases] == [("case01", slices[0].SeriesInstanceUID)]
    read = read_series(cases[0].image, cases[0].series)
    np.testing.assert_array_equal(read.image, volume)
    assert len(read.datasets) == volume.shape[2]


@pytest.mark.parametrize("modality", ["CT", "MR"])
def test_an_enhanced_multi_frame_image_reads_frame_for_frame_and_its_seg_reads_back(volume, tmp_path, modality):
    """A legacy converted enhanced CT or MR image (highdicom's converter, frames in reverse slice order): the
    volume and affine of the single-frame series it came from, each frame's position and rescale from its
    functional groups; a SEG written over it references its frames and reads back as the label map. One frame of
    it alone is refused as one slice."""
    affine = oblique_affine()
    slices = ct_slices(volume, affine)
    if modality == "MR":
        for ds in slices:
            ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = MRImageStorage
            ds.Modality, ds.ImageType = "MR", ["ORIGINAL", "PRIMARY", "OTHER"]
            ds.ScanningSequence, ds.SequenceVariant, ds.ScanOptions, ds.MRAcquisitionType = "GR", "SP", "", "3D"
            ds.EchoTrainLength, ds.ImagingFrequency, ds.MagneticFieldStrength = 1, "63.9", "1.5"
    for ds in slices:
        ds.PatientSex = "O"
    convert = hd.legacy.LegacyConvertedEnhancedCTImage if modality == "CT" else hd.legacy.LegacyConvertedEnhancedMRImage
    image = convert(
        slices[::-1], series_instance_uid=hd.UID(), series_number=2, sop_instance_uid=hd.UID(), instance_number=1
    )
    folder = tmp_path / "enhanced"
    folder.mkdir()
    image.save_as(folder / "image.dcm")
    read = read_series(folder)
    np.testing.assert_array_equal(read.image, volume)
    np.testing.assert_allclose(read.affine, affine, atol=1e-6)
    assert [k for _, k in read.slices] == list(range(volume.shape[2]))[::-1]
    labels = np.zeros(volume.shape, np.uint8)
    labels[2:9, 3:8, 1:4], labels[12:20, 5:15, 5:9] = 1, 3
    seg = write_segmentation(labels, read, CLASSES, tmp_path / "enhanced.seg.dcm")
    np.testing.assert_array_equal(read_segmentation(seg, read, CLASSES), labels)
    one = convert(
        slices[:1], series_instance_uid=hd.UID(), series_number=3, sop_instance_uid=hd.UID(), instance_number=1
    )
    (tmp_path / "one").mkdir()
    one.save_as(tmp_path / "one" / "one.dcm")
    with pytest.raises(CaseError, match="has one slice: a volume needs at least two"):
        read_series(tmp_path / "one", case_id="one")


def test_a_seg_declares_only_the_classes_present_named_and_an_empty_prediction_is_one_frame(volume, tmp_path):
    """Liver and kidney predicted, spleen absent: 2 segments, numbered 1-2 and labelled 'liver' and 'kidney' (no
    segment without frames), read back as labels 1 and 3 by their names; an all-background prediction of 10 slices
    is one segment with one frame (a few kB), read back as all background."""
    read = read_series(save_slices(ct_slices(volume, coronal_affine()), tmp_path / "series"))
    labels = np.zeros(volume.shape, np.uint8)
    labels[2:9, 3:8, 1:4], labels[12:20, 5:15, 5:9] = 1, 3
    path = write_segmentation(labels, read, CLASSES, tmp_path / "two.seg.dcm")
    seg = pydicom.dcmread(path)
    assert [(int(s.SegmentNumber), s.SegmentLabel) for s in seg.SegmentSequence] == [(1, "liver"), (2, "kidney")]
    np.testing.assert_array_equal(read_segmentation(path, read, CLASSES), labels)
    np.testing.assert_array_equal(read_segmentation(path, read), np.where(labels == 3, 2, labels))  # by number
    with pytest.raises(DataError, match="segment 2 is labelled 'kidney', not one of the classes"):
        read_segmentation(path, read, ["background", "liver"])
    empty = write_segmentation(np.zeros_like(labels), read, CLASSES, tmp_path / "empty.seg.dcm")
    seg = pydicom.dcmread(empty)
    assert int(seg.NumberOfFrames) == 1 and len(seg.SegmentSequence) == 1 and empty.stat().st_size < 20_000
    np.testing.assert_array_equal(read_segmentation(empty, read, CLASSES), np.zeros_like(labels))


def test_a_series_without_study_uid_fails_naming_the_flag_and_with_it_gets_a_seg_under_a_new_study(volume, tmp_path):
    """An anonymised series without StudyInstanceUID: the SEG is refused in one line naming --new-study-uid; with
    `new_study_uid` one warning line gives the new UID, the SEG carries it and reads back as the label map."""
    slices = ct_slices(volume, coronal_affine())
    for ds in slices:
        del ds.StudyInstanceUID
    read = read_series(save_slices(slices, tmp_path / "anonymous"))
    labels = np.zeros(volume.shape, np.uint8)
    labels[2:9, 3:8, 1:4] = 2
    with pytest.raises(DataError) as caught:
        write_segmentation(labels, read, CLASSES, tmp_path / "refused.seg.dcm")
    assert "no StudyInstanceUID (anonymised?)" in str(caught.value) and "--new-study-uid" in str(caught.value)
    assert not (tmp_path / "refused.seg.dcm").exists()
    said = []
    path = write_segmentation(labels, read, CLASSES, tmp_path / "new.seg.dcm", new_study_uid=True, say=said.append)
    study = str(pydicom.dcmread(path).StudyInstanceUID)
    assert len(said) == 1 and said[0].startswith("warning: DICOM series in") and study in said[0]
    np.testing.assert_array_equal(read_segmentation(path, read, CLASSES), labels)
