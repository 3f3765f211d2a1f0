"""Real DICOM series for the tests: CT Image Storage slices written with pydicom from a volume and its RAS affine.

`ct_slices(volume, affine)` gives one pydicom Dataset per slice (z) of an (X, Y, Z) volume of integer HU values:
int16 pixels stored as HU + 1024 with RescaleSlope 1 and RescaleIntercept -1024, ImagePositionPatient and
ImageOrientationPatient from the affine (RAS to DICOM's LPS), PixelSpacing, fresh UIDs. A test edits them (drops a
slice, moves one) and `save_slices` writes them under shuffled file names.
"""

from __future__ import annotations

import locale
from pathlib import Path

import numpy as np
import pydicom
from pydicom.dataset import FileMetaDataset
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid

INTERCEPT = -1024.0


def ct_slices(volume: np.ndarray, affine: np.ndarray, description: str = "test CT", series_uid=None, study=None):
    """One CT slice Dataset per z of `volume` (X, Y, Z integer HU values) with `affine` (voxel to RAS mm; its third
    column must point along the cross product of the first two, as DICOM's slice normal)."""
    lps = np.diag([-1.0, -1.0, 1.0, 1.0]) @ np.asarray(affine, np.float64)
    dx, dy = np.linalg.norm(lps[:3, 0]), np.linalg.norm(lps[:3, 1])
    row, column = lps[:3, 0] / dx, lps[:3, 1] / dy
    study = study or {"StudyInstanceUID": generate_uid(), "FrameOfReferenceUID": generate_uid()}
    series_uid = series_uid or generate_uid()
    slices = []
    for z in range(volume.shape[2]):
        ds = pydicom.Dataset()
        ds.file_meta = FileMetaDataset()
        ds.file_meta.MediaStorageSOPClassUID = CTImageStorage
        ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
        ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds.SOPClassUID, ds.SOPInstanceUID = CTImageStorage, ds.file_meta.MediaStorageSOPInstanceUID
        ds.PatientName, ds.PatientID, ds.PatientBirthDate, ds.PatientSex = "Test^Patient", "TEST01", "19700101", "O"
        ds.StudyInstanceUID, ds.FrameOfReferenceUID = study["StudyInstanceUID"], study["FrameOfReferenceUID"]
        ds.StudyID, ds.StudyDate, ds.StudyTime, ds.AccessionNumber, ds.ReferringPhysicianName = (
            "1",
            "20260101",
            "",
            "",
            "",
        )
        ds.SeriesInstanceUID, ds.SeriesNumber, ds.SeriesDescription = series_uid, 1, description
        ds.Modality, ds.Manufacturer, ds.InstanceNumber = "CT", "tests", z + 1
        ds.ImageType = ["ORIGINAL", "PRIMARY", "AXIAL"]
        ds.PositionReferenceIndicator = ""
        ds.ImageOrientationPatient = [f"{v:.10g}" for v in (*row, *column)]
        ds.ImagePositionPatient = [f"{v:.10g}" for v in lps[:3] @ np.array([0.0, 0.0, z, 1.0])]
        ds.PixelSpacing = [f"{dy:.10g}", f"{dx:.10g}"]  # between rows, between columns
        ds.SliceThickness = f"{np.linalg.norm(lps[:3, 2]):.10g}"
        ds.Rows, ds.Columns = volume.shape[1], volume.shape[0]
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 1
        ds.RescaleSlope, ds.RescaleIntercept, ds.RescaleType = "1", f"{INTERCEPT:g}", "HU"
        pixels = np.rint(volume[:, :, z].T - INTERCEPT).astype("<i2")  # (rows, columns) = (y, x)
        ds.PixelData = pixels.tobytes()
        slices.append(ds)
    return slices


def save_slices(slices, folder: Path, seed: int = 0) -> Path:
    """Writes `slices` into `folder` as IM<random number>.dcm in a shuffled order (the file names say nothing of a
    slice's place)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = np.random.default_rng(seed).permutation(len(slices) * 7)[: len(slices)]
    for ds, n in zip(slices, names):
        ds.save_as(folder / f"IM{n:05d}.dcm", enforce_file_format=True)
    return folder


def write_series(folder: Path, volume: np.ndarray, affine: np.ndarray, seed: int = 0, **kwargs) -> Path:
    """`ct_slices` of `volume` and `affine` saved into `folder` in a shuffled order."""
    return save_slices(ct_slices(volume, affine, **kwargs), folder, seed)


def oblique_affine(spacing=(0.8, 0.9, 2.5), origin=(-30.0, 12.5, 40.0), degrees=(20.0, -15.0, 10.0)) -> np.ndarray:
    """A right-handed voxel-to-RAS affine rotated about the three axes (an oblique acquisition)."""
    a, b, c = np.radians(degrees)
    rx = np.array([[1, 0, 0], [0, np.cos(a), -np.sin(a)], [0, np.sin(a), np.cos(a)]])
    ry = np.array([[np.cos(b), 0, np.sin(b)], [0, 1, 0], [-np.sin(b), 0, np.cos(b)]])
    rz = np.array([[np.cos(c), -np.sin(c), 0], [np.sin(c), np.cos(c), 0], [0, 0, 1]])
    affine = np.eye(4)
    affine[:3, :3] = np.diag([-1.0, -1.0, 1.0]) @ rz @ ry @ rx @ np.diag(spacing)  # LPS-like storage, rotated
    affine[:3, 3] = origin
    return affine


def coronal_affine(spacing=(1.5, 1.5, 2.0), origin=(20.0, -10.0, 35.0)) -> np.ndarray:
    """Coronal slices (ImageOrientationPatient 1,0,0 / 0,0,-1): x to the patient's left, y down, z to the back."""
    lps = np.zeros((4, 4))
    lps[:3, 0] = (spacing[0], 0.0, 0.0)
    lps[:3, 1] = (0.0, 0.0, -spacing[1])
    lps[:3, 2] = (0.0, spacing[2], 0.0)
    lps[:3, 3] = origin
    lps[3, 3] = 1.0
    return np.diag([-1.0, -1.0, 1.0, 1.0]) @ lps


def shifted(slices, i, by):
    """Moves slice i's ImagePositionPatient by `by` (LPS mm)."""
    slices[i].ImagePositionPatient = [f"{float(v) + d:.10g}" for v, d in zip(slices[i].ImagePositionPatient, by)]


def missing_slice(slices):
    return slices[:3] + slices[4:]


def uneven_spacing(slices):  # every other coronal slice 0.3 mm further back: steps of 2.3 and 1.7 mm
    for i in range(1, len(slices), 2):
        shifted(slices, i, (0.0, 0.3, 0.0))
    return slices


def gantry_tilt(slices):  # each slice 2 * tan(10 degrees) mm lower than the one before: sheared by 10 degrees
    for i in range(len(slices)):
        shifted(slices, i, (0.0, 0.0, -0.3527 * i))
    return slices


def mixed_orientations(slices):  # one slice turned by about 6 degrees
    slices[3].ImageOrientationPatient = ["1", "0", "0", "0", "0.1", "-0.99498744"]
    return slices


BAD_SERIES = {  # what is wrong -> (edit of the slices of a coronal series, the words of its one line)
    "missing slice": (missing_slice, "misses 1 slice(s)"),
    "uneven spacing": (uneven_spacing, "uneven slice spacing"),
    "gantry tilt": (gantry_tilt, "gantry tilt of 10.0 degrees"),
    "mixed orientations": (mixed_orientations, "mixes slice orientations"),
}


def sitk_series(folder: Path, volume: np.ndarray, affine: np.ndarray, compressor: str | None = None, decimals=None):
    """The (X, Y, Z) int16 `volume` with its voxel-to-RAS `affine` written as a CT series by another writer than
    ours: GDCM through SimpleITK's ImageFileWriter, one file per slice (SimpleITK's own series example), compressed
    with `compressor` ("JPEG": JPEG Lossless process 14 SV1, "JPEG2000": lossless JPEG 2000) or not, and each
    ImagePositionPatient written with `decimals` decimals (as anonymisers that shorten decimal strings leave them)
    or GDCM's full precision."""
    import SimpleITK as sitk

    lps = np.diag([-1.0, -1.0, 1.0, 1.0]) @ np.asarray(affine, np.float64)
    spacing = np.linalg.norm(lps[:3, :3], axis=0)
    direction = lps[:3, :3] / spacing
    image = sitk.GetImageFromArray(np.asarray(volume).transpose(2, 1, 0).astype(np.int16))
    image.SetSpacing([float(v) for v in spacing])
    image.SetDirection([float(v) for v in direction.ravel()])
    image.SetOrigin([float(v) for v in lps[:3, 3]])
    writer = sitk.ImageFileWriter()
    writer.KeepOriginalImageUIDOn()
    if compressor:
        writer.SetUseCompression(True)
        writer.SetCompressor(compressor)
    study, series, frame = generate_uid(), generate_uid(), generate_uid()
    orientation = "\\".join(f"{v:.10g}" for v in (*direction[:, 0], *direction[:, 1]))
    folder.mkdir(parents=True, exist_ok=True)
    # GDCM's JPEG writer sets the process's C locale (and leaves it): later file reads in this test process would
    # decode as ASCII, so the locale is put back
    saved = locale.setlocale(locale.LC_ALL)
    try:
        _write_planes(writer, image, volume.shape[2], folder, study, series, frame, orientation, decimals)
    finally:
        locale.setlocale(locale.LC_ALL, saved)
    return folder


def _write_planes(writer, image, slices: int, folder: Path, study, series, frame, orientation, decimals) -> None:
    for z in range(slices):
        plane = image[:, :, z]
        point = image.TransformIndexToPhysicalPoint((0, 0, z))
        position = "\\".join(f"{v:.{decimals}f}" if decimals is not None else f"{v:.10g}" for v in point)
        for tag, value in {
            "0008|0060": "CT",
            "0008|0016": CTImageStorage,
            "0008|0018": generate_uid(),
            "0020|000d": study,
            "0020|000e": series,
            "0020|0052": frame,
            "0020|0037": orientation,
            "0020|0032": position,
            "0020|0013": str(z + 1),
            "0028|1052": "0",
            "0028|1053": "1",
        }.items():
            plane.SetMetaData(tag, value)
        writer.SetFileName(str(folder / f"slice{(z * 7919) % 10007:05d}.dcm"))
        writer.Execute(plane)
