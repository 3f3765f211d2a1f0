"""DICOM series in: a folder of single-frame CT or MR slices read as the volume and affine tfmis uses for NIfTI.

`read_series(folder)` returns a `DicomVolume`: a float32 array (X, Y, Z) in voxel order (x = column index, y = row
index, z = slice index, slices sorted by their position along the slice normal) with RescaleSlope/Intercept
applied, and the 4x4 voxel-to-world affine in RAS mm, as nibabel gives for a NIfTI of the same scan (DICOM's patient
coordinates are LPS: the first two rows change sign). The slice normal is the cross product of
ImageOrientationPatient's row and column cosines, a slice's position is dot(ImagePositionPatient, normal), and the
slice spacing comes from the positions (never SliceThickness). The sorted headers are kept (`datasets`): a DICOM
SEG written for the volume references them (`tfmis.inference.dicom_seg`).

A series that would give a wrong volume is refused in one line naming its folder and the fix, never read silently:
missing slices (a gap in the positions), uneven spacing (steps more than `SPACING_TOLERANCE` apart, or slices
`DRIFT_TOLERANCE` of a spacing off the even grid of the affine), gantry tilt (the positions move across the normal
by `DRIFT_TOLERANCE` of a pixel), mixed orientations or slice sizes, two slices at one position, multi-frame
files (`CaseError`: the case fails, the others go on). A folder of several series is a usage error
listing them (UID, description, slices): `choose_series` takes the one named by `--series UID`.

pydicom is an optional dependency (`pip install 'tfmis[dicom]'`); without it `require` says so in one line (exit 2).
Telling a DICOM folder from others (`is_dicom_folder`) needs no pydicom: a DICOM file has `DICM` at byte 128.

Example:
```python
volume = read_series("scans/patient_01")            # the folder's one series
volume.image.shape, volume.affine                   # (512, 512, 120) float32, 4x4 RAS
volume = read_series("scans/patient_02", "1.2.826.0.1.3680043.8.498.1")   # one of several series
```
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np

from tfmis.data.msd import CaseError
from tfmis.errors import DataError, UsageError

INSTALL = "install tfmis[dicom] (pip install 'tfmis[dicom]')"
SPACING_TOLERANCE = 0.01  # slice gaps may differ from their mean by this fraction of it (1%)
DRIFT_TOLERANCE = 0.1  # a slice may sit this fraction of a voxel off the grid of the affine (along or across)
ORIENTATION_TOLERANCE = 1e-4  # direction cosines of two slices that differ by more are two orientations
# SOP classes of CT, MR and PET images (single- and multi-frame): a file of one of them is a slice, and one without a
# position is a broken slice, never left out
VOLUME_CLASSES = {
    "1.2.840.10008.5.1.4.1.1.2",  # CT Image Storage
    "1.2.840.10008.5.1.4.1.1.2.1",  # Enhanced CT
    "1.2.840.10008.5.1.4.1.1.2.2",  # Legacy Converted Enhanced CT
    "1.2.840.10008.5.1.4.1.1.4",  # MR Image Storage
    "1.2.840.10008.5.1.4.1.1.4.1",  # Enhanced MR
    "1.2.840.10008.5.1.4.1.1.4.4",  # Legacy Converted Enhanced MR
    "1.2.840.10008.5.1.4.1.1.128",  # PET Image Storage
    "1.2.840.10008.5.1.4.1.1.128.1",  # Legacy Converted Enhanced PET
    "1.2.840.10008.5.1.4.1.1.130",  # Enhanced PET
}
GEOMETRY_TAGS = (
    "ImageType",
    "SeriesInstanceUID",
    "SeriesDescription",
    "Modality",
    "ImagePositionPatient",
    "NumberOfFrames",
)


def require(what: str, *packages: str) -> None:
    """Raises a `UsageError` (exit 2) of one line when a package of the `dicom` extra is not installed.

    Example:
    ```python
    require("--output-format dicom-seg", "pydicom", "highdicom")
    ```
    """
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        raise UsageError(f"{what} needs {' and '.join(missing)}, which is not installed: {INSTALL}")


def looks_like_dicom(path: Path) -> bool:
    """True for a file with DICOM's preamble (`DICM` at byte 128: every DICOM Part 10 file); reads 132 bytes."""
    try:
        with open(path, "rb") as f:
            head = f.read(132)
    except OSError:
        return False
    return len(head) == 132 and head[128:132] == b"DICM"


def dicom_files(folder: Path) -> list[Path]:
    """The DICOM files directly in `folder` (hidden files left out), sorted by name."""
    return sorted(
        p for p in Path(folder).iterdir() if p.is_file() and not p.name.startswith(".") and looks_like_dicom(p)
    )


def is_dicom_folder(folder: Path) -> bool:
    """True when `folder` directly holds at least one DICOM file (stops at the first)."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    return any(p.is_file() and not p.name.startswith(".") and looks_like_dicom(p) for p in folder.iterdir())


@dataclasses.dataclass
class SeriesInfo:
    """One series of a folder: its SeriesInstanceUID, SeriesDescription, Modality and slice files."""

    uid: str
    description: str
    modality: str
    files: list

    def describe(self) -> str:
        return f"{self.uid} ({self.modality or '?'} '{self.description}', {len(self.files)} slices)"


def list_series(folder: Path) -> list[SeriesInfo]:
    """The image series in `folder`: its DICOM files with an ImagePositionPatient, grouped by SeriesInstanceUID (a
    DICOMDIR, a SEG or a report in the folder is not a slice and is left out, nor is a localizer (scout) image, by its
    ImageType, which some scanners put in the series), in order of their first file.

    Raises:
        DataError: a file pydicom cannot parse, or a CT, MR or PET slice without a position (a truncated file: left
            out, it would be a missing first or last slice that no check sees).
    """
    import pydicom

    found: dict[str, SeriesInfo] = {}
    for path in dicom_files(folder):
        try:
            ds = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=list(GEOMETRY_TAGS))
        except Exception as e:  # pydicom raises many types for a broken file
            raise DataError(
                f"DICOM file {path} cannot be read (truncated or corrupt?): {type(e).__name__}: {e}"
            ) from None
        if "ImagePositionPatient" not in ds:
            sop = str(ds.file_meta.get("MediaStorageSOPClassUID", "") if hasattr(ds, "file_meta") else "")
            if sop and sop not in VOLUME_CLASSES:  # a DICOMDIR, a SEG, a report: not a slice
                continue
            if int(ds.get("NumberOfFrames", 1) or 1) == 1:  # (a multi-frame image: read_series says it is not read)
                raise DataError(
                    f"DICOM file {path} is an image slice without ImagePositionPatient, or has no SOP class "
                    "(truncated or corrupt?): replace it with a complete copy, or export the series again"
                )
        if "LOCALIZER" in [str(v).upper() for v in (ds.get("ImageType") or [])]:  # a scout view: not a slice
            continue
        uid = str(ds.get("SeriesInstanceUID", ""))
        info = found.setdefault(
            uid, SeriesInfo(uid, str(ds.get("SeriesDescription", "")), str(ds.get("Modality", "")), [])
        )
        info.files.append(path)
    return list(found.values())


def choose_series(folder: Path, uid: str | None = None) -> SeriesInfo:
    """The series of `folder` to read: the one named `uid`, or the folder's only one.

    Raises:
        UsageError: several series and no `uid` (they are listed: UID, description, slices; exit 2), or `uid` is
            not one of them.
        DataError: no DICOM image slices in the folder.
    """
    series = list_series(folder)
    if not series:
        raise DataError(
            f"{folder} holds no DICOM image slices (files with an ImagePositionPatient): give the folder of a CT or MR "
            "series"
        )
    listing = "; ".join(s.describe() for s in series)
    if uid is not None:
        for s in series:
            if s.uid == uid:
                return s
        raise UsageError(f"--series {uid} is not in {folder}, which holds: {listing}")
    if len(series) > 1:
        raise UsageError(f"{folder} holds {len(series)} DICOM series: {listing}; choose one with --series UID")
    return series[0]


def series_folders(path: Path, uid: str | None = None) -> list[tuple[str, Path, str]]:
    """The DICOM cases under `path`: (case id = folder name, folder, SeriesInstanceUID) for `path` itself when it
    holds DICOM files, else for each of its subfolders that does (a folder of series folders, one case each).

    With `uid` (`--series`): a folder holding that series reads it; any other folder its only series. A folder of
    several series and no `uid` for it is a `UsageError` listing them; so is a `uid` that no folder holds. A folder
    whose files cannot be listed (a corrupt file, no image slices) gets the UID "": its case fails when
    `read_series` reads it, with the reason.
    """
    path = Path(path)
    folders = [path] if is_dicom_folder(path) else sorted(p for p in path.iterdir() if is_dicom_folder(p))
    if folders:
        require(f"--input {path} (DICOM)", "pydicom")
    cases = []
    for folder in folders:
        try:
            series = list_series(folder)
            if not series and folder != path:  # a subfolder of SEGs or reports only (an earlier output): no case
                continue
            chosen = [s for s in series if s.uid == uid]
            # the folder's only series; several (listed), or a --series the one folder lacks: a UsageError
            pick = chosen[0] if chosen else choose_series(folder, uid if len(folders) == 1 else None)
        except DataError:  # an unreadable file, no image slices: the case fails when it is read, not the command
            cases.append((folder.name, folder, ""))
            continue
        cases.append((folder.name, folder, pick.uid))
    if uid is not None and folders and not any(c[2] == uid for c in cases):
        raise UsageError(f"--series {uid} is in none of the {len(folders)} DICOM folders of {path}")
    return cases


@dataclasses.dataclass
class DicomVolume:
    """A series read by `read_series`: `image` float32 (X, Y, Z) (None once a caller took it, so that it can be
    freed), `affine` 4x4 voxel to RAS mm, `datasets` the slices' headers (pydicom Datasets, no pixel data) in the
    volume's slice order (z), `folder`, `uid`, and `shape` (X, Y, Z)."""

    image: np.ndarray | None
    affine: np.ndarray
    datasets: list
    folder: Path
    uid: str

    def __post_init__(self):
        self.shape = tuple(self.image.shape[:3])


def _vector(ds, keyword: str, path: Path, size: int) -> np.ndarray:
    value = ds.get(keyword)
    if value is None or len(value) != size:
        raise DataError(f"DICOM file {path} has no valid {keyword} (got {value!r}): it is not a slice of a volume")
    return np.array([float(v) for v in value], np.float64)


def series_geometry(headers: list, paths: list, folder: Path) -> tuple[list[int], np.ndarray]:
    """The slices' order (sorted by position along the normal) and the RAS affine of the volume they form.

    Raises:
        DataError: mixed orientations, pixel spacings or slice sizes; fewer than two slices; two slices at one
            position; gantry tilt; missing slices; uneven spacing. Each one line naming `folder` and the fix.
    """
    where = f"DICOM series in {folder}"
    orientations = [_vector(ds, "ImageOrientationPatient", p, 6) for ds, p in zip(headers, paths)]
    for o, p in zip(orientations, paths):
        if np.abs(o - orientations[0]).max() > ORIENTATION_TOLERANCE:
            raise DataError(
                f"{where} mixes slice orientations (ImageOrientationPatient {_fmt(orientations[0])} in "
                f"{paths[0].name}, "
                f"{_fmt(o)} in {p.name}): give a series of one orientation (export each orientation as its own series)"
            )
    pixel = [_vector(ds, "PixelSpacing", p, 2) for ds, p in zip(headers, paths)]
    sizes = [(int(ds.Rows), int(ds.Columns)) for ds in headers]
    for s, ps, p in zip(sizes, pixel, paths):
        if s != sizes[0] or np.abs(ps - pixel[0]).max() > 1e-6 * max(1.0, float(pixel[0].max())):
            raise DataError(
                f"{where} mixes slice sizes ({sizes[0]} rows x columns at {_fmt(pixel[0])} mm in {paths[0].name}, "
                f"{s} at {_fmt(ps)} mm in {p.name}): give a series whose slices share one grid"
            )
    if len(headers) < 2:
        raise DataError(f"{where} has one slice: a volume needs at least two (give the whole series)")
    row, column = orientations[0][:3], orientations[0][3:]
    normal = np.cross(row, column)
    normal /= np.linalg.norm(normal)
    positions = np.stack([_vector(ds, "ImagePositionPatient", p, 3) for ds, p in zip(headers, paths)])
    along = positions @ normal
    order = [int(i) for i in np.argsort(along, kind="stable")]
    along, positions = along[order], positions[order]
    steps = np.diff(along)
    spacing = float(along[-1] - along[0]) / (len(order) - 1)
    if steps.min() <= 1e-3 * max(spacing, 1e-3):
        i = int(np.argmin(steps))
        names = f"{paths[order[i]].name} and {paths[order[i + 1]].name}"
        raise DataError(
            f"{where} has two slices at one position ({names}, {along[i]:.3f} mm along the normal): several "
            "acquisitions, echoes or phases in one series; export them as separate series"
        )
    _check_tilt(positions, along, normal, float(pixel[0].min()), where)
    _check_spacing(steps, along, where)
    affine = np.eye(4)
    affine[:3, 0] = row * pixel[0][1]  # x = column index: along the row cosine, by the spacing between columns
    affine[:3, 1] = column * pixel[0][0]  # y = row index: along the column cosine, by the spacing between rows
    affine[:3, 2] = normal * spacing
    affine[:3, 3] = positions[0]
    return order, np.diag([-1.0, -1.0, 1.0, 1.0]) @ affine  # LPS -> RAS


def _check_tilt(positions: np.ndarray, along: np.ndarray, normal: np.ndarray, pixel: float, where: str) -> None:
    """Gantry tilt: the slices' positions move across the normal (by more than `DRIFT_TOLERANCE` of the smallest
    pixel spacing `pixel`, anywhere in the series), so the slices are sheared."""
    offsets = positions - positions[0]
    across = np.linalg.norm(offsets - np.outer(offsets @ normal, normal), axis=1)
    if across.max() > DRIFT_TOLERANCE * pixel:
        i = int(np.argmax(across))
        degrees = float(np.degrees(np.arctan2(across[i], along[i] - along[0])))
        raise DataError(
            f"{where} is tilted: the slice positions do not follow the slice normal (gantry tilt of {degrees:.1f} "
            "degrees); resample it to an orthogonal grid first (e.g. dcm2niix corrects gantry tilt)"
        )


def _check_spacing(steps: np.ndarray, along: np.ndarray, where: str) -> None:
    """Missing slices (a gap of about two or more median steps) and uneven spacing: steps more than
    `SPACING_TOLERANCE` from their mean (the affine's spacing), or a slice more than `DRIFT_TOLERANCE` of the
    spacing off the even grid the affine describes (steps each within 1% can still add up)."""
    step = float(np.median(steps))
    ratio = steps / step
    gap = np.abs(ratio - np.rint(ratio)) <= SPACING_TOLERANCE * np.rint(ratio)
    missing = gap & (np.rint(ratio) >= 2)
    if np.any(missing):
        i = int(np.argmax(missing))
        n = int(np.rint(ratio[i])) - 1
        raise DataError(
            f"{where} misses {n} slice(s): a gap of {steps[i]:.3f} mm between the slices at {along[i]:.3f} and "
            f"{along[i + 1]:.3f} mm along the normal, where the others are {step:.3f} mm apart; export the complete "
            "series"
        )
    spacing = float(along[-1] - along[0]) / len(steps)
    drift = np.abs(along - along[0] - spacing * np.arange(len(along))).max()  # off the even grid of the affine
    uneven = np.abs(steps / spacing - 1).max() > SPACING_TOLERANCE  # the affine's spacing: their mean
    if uneven or drift > DRIFT_TOLERANCE * spacing:
        what = (
            f"more than {SPACING_TOLERANCE:.0%} off their mean {spacing:.3f} mm"
            if uneven
            else f"slices up to {drift:.3f} mm off an even grid"
        )
        raise DataError(
            f"{where} has uneven slice spacing: from {steps.min():.3f} to {steps.max():.3f} mm ({what}); resample it "
            "to even spacing first, or export it again"
        )


def _fmt(values) -> str:
    return "[" + ", ".join(f"{float(v):g}" for v in values) + "]"


def read_series(folder: str | Path, uid: str | None = None, case_id: str = "") -> DicomVolume:
    """Reads one series of `folder` (`choose_series`) as a `DicomVolume` (see the module's docstring).

    Raises:
        CaseError: the series cannot form a volume (`series_geometry`'s checks, a multi-frame file, pixel data that
            cannot be decoded), naming `case_id` and the folder.
        UsageError: several series and no `uid`, or pydicom is not installed.
    """
    require(f"--input {folder} (DICOM)", "pydicom")
    import pydicom

    folder = Path(folder)
    try:
        info = choose_series(folder, uid or None)
        headers = [pydicom.dcmread(p, stop_before_pixels=True) for p in info.files]
        for ds, p in zip(headers, info.files):
            if int(ds.get("NumberOfFrames", 1) or 1) > 1:
                raise DataError(
                    f"DICOM file {p} in {folder} holds {ds.NumberOfFrames} frames: multi-frame (enhanced) series are "
                    "not read; export the series as single-frame slices"
                )
            if int(ds.get("SamplesPerPixel", 1) or 1) != 1:
                raise DataError(
                    f"DICOM file {p} in {folder} has {ds.SamplesPerPixel} samples per pixel (colour): a CT or MR "
                    "series is grayscale; give the original series, not a rendered one"
                )
        order, affine = series_geometry(headers, info.files, folder)
    except UsageError:  # several series and no --series: the command line needs fixing
        raise
    except DataError as e:
        raise CaseError(case_id or folder.name, str(e)) from None
    except Exception as e:  # pydicom raises many types for a broken file
        raise CaseError(
            case_id or folder.name, f"DICOM series in {folder} cannot be read: {type(e).__name__}: {e}"
        ) from None
    rows, columns = int(headers[0].Rows), int(headers[0].Columns)
    image = np.empty((columns, rows, len(order)), np.float32)
    for z, i in enumerate(order):
        image[:, :, z] = _slice_values(info.files[i], case_id or folder.name).T  # (rows, columns) -> (x, y)
    return DicomVolume(image, affine, [headers[i] for i in order], folder, info.uid)


def _slice_values(path: Path, case_id: str) -> np.ndarray:
    """One slice's pixels (rows, columns) with its RescaleSlope and RescaleIntercept applied (float64)."""
    import pydicom

    try:
        ds = pydicom.dcmread(path)
        pixels = ds.pixel_array
    except Exception as e:  # an unsupported compression, truncated pixel data
        raise CaseError(case_id, f"DICOM file {path}: its pixels cannot be read: {type(e).__name__}: {e}") from None
    if pixels.shape != (ds.Rows, ds.Columns):
        raise CaseError(case_id, f"DICOM file {path}: its pixels are {pixels.shape}, not Rows x Columns")
    slope = float(ds.get("RescaleSlope", 1) or 1)
    intercept = float(ds.get("RescaleIntercept", 0) or 0)
    return pixels.astype(np.float64) * slope + intercept
