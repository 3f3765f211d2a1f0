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
import os
import sys
from pathlib import Path

import numpy as np

from tfmis.data.sources.errors import CaseError
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
    "SOPClassUID",
    "SOPInstanceUID",
)
ENHANCED_CLASSES = {  # multi-frame images whose frames carry their geometry in functional groups
    "1.2.840.10008.5.1.4.1.1.2.1",  # Enhanced CT
    "1.2.840.10008.5.1.4.1.1.2.2",  # Legacy Converted Enhanced CT
    "1.2.840.10008.5.1.4.1.1.4.1",  # Enhanced MR
    "1.2.840.10008.5.1.4.1.1.4.4",  # Legacy Converted Enhanced MR
    "1.2.840.10008.5.1.4.1.1.128.1",  # Legacy Converted Enhanced PET
    "1.2.840.10008.5.1.4.1.1.130",  # Enhanced PET
}


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
    """True for a DICOM file: `DICM` at byte 128 (every DICOM Part 10 file), or, without that preamble (as some
    PACS exports and older scanners write), a data set that starts with a group 0002 or 0008 element (little endian,
    explicit VR letters or an implicit length). Reads 132 bytes."""
    try:
        with open(path, "rb") as f:
            head = f.read(132)
    except OSError:
        return False
    if len(head) == 132 and head[128:132] == b"DICM":
        return True
    return (
        len(head) >= 8
        and head[:2] in (b"\x02\x00", b"\x08\x00")
        and (head[4:6].isalpha() and head[4:6].isupper() or int.from_bytes(head[4:8], "little") < 1 << 16)
    )


def _visible_files(folder: Path):
    return (p for p in Path(folder).iterdir() if p.is_file() and not p.name.startswith("."))


def dicom_files(folder: Path) -> list[Path]:
    """The DICOM files of a case folder, sorted: those directly in `folder`, or, when it holds none, those anywhere
    below it (a series exported one or more folders deeper: patient/study/series). Hidden files and folders are
    left out."""
    folder = Path(folder)
    direct = sorted(p for p in _visible_files(folder) if looks_like_dicom(p))
    if direct:
        return direct
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(root) / f for f in files if not f.startswith(".") and looks_like_dicom(Path(root) / f)]
    return sorted(found)


def holds_dicom_files(folder: Path) -> bool:
    """True when `folder` directly holds at least one DICOM file (stops at the first)."""
    return any(looks_like_dicom(p) for p in _visible_files(folder))


def is_dicom_folder(folder: Path) -> bool:
    """True when `folder` or a folder below it holds at least one DICOM file (stops at the first)."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if any(not f.startswith(".") and looks_like_dicom(Path(root) / f) for f in files):
            return True
    return False


@dataclasses.dataclass
class SeriesInfo:
    """One series of a folder: its SeriesInstanceUID, SeriesDescription, Modality, image files (one per
    SOPInstanceUID) and slices (a multi-frame file's frames each count)."""

    uid: str
    description: str
    modality: str
    files: list
    slices: int = 0
    duplicates: int = 0  # files dropped: a SOPInstanceUID already read from another file

    def describe(self) -> str:
        return f"{self.uid} ({self.modality or '?'} '{self.description}', {self.slices} slices)"


def _frames(ds) -> int:
    return int(ds.get("NumberOfFrames", 1) or 1)


def _sop_class(ds) -> str:
    meta = getattr(ds, "file_meta", None)
    return str(ds.get("SOPClassUID", "") or (meta.get("MediaStorageSOPClassUID", "") if meta else ""))


def list_series(folder: Path) -> list[SeriesInfo]:
    """The image series of a case folder (`dicom_files`): its DICOM files with an ImagePositionPatient, or enhanced
    multi-frame images, grouped by SeriesInstanceUID (a DICOMDIR, a SEG or a report in the folder is not a slice and
    is left out, nor is a localizer (scout) image, by its ImageType, which some scanners put in the series), in
    order of their first file. A file whose SOPInstanceUID another file of the series already has (a slice exported
    twice) is dropped and counted in `duplicates`.

    Raises:
        DataError: a file pydicom cannot parse, or a CT, MR or PET slice without a position (a truncated file: left
            out, it would be a missing first or last slice that no check sees).
    """
    import pydicom

    found: dict[str, SeriesInfo] = {}
    seen: dict[str, set] = {}
    for path in dicom_files(folder):
        try:
            ds = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=list(GEOMETRY_TAGS), force=True)
        except Exception as e:  # pydicom raises many types for a broken file
            raise DataError(
                f"DICOM file {path} cannot be read (truncated or corrupt?): {_one_line(e)}; replace it with a "
                "complete copy, or export the series again"
            ) from None
        sop = _sop_class(ds)
        if "ImagePositionPatient" not in ds and sop not in ENHANCED_CLASSES:
            if sop and sop not in VOLUME_CLASSES:  # a DICOMDIR, a SEG, a report: not a slice
                continue
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
        instance = str(ds.get("SOPInstanceUID", "")) or str(path)
        if instance in seen.setdefault(uid, set()):
            info.duplicates += 1
            continue
        seen[uid].add(instance)
        info.files.append(path)
        info.slices += _frames(ds)
    return list(found.values())


def choose_series(folder: Path, uid: str | None = None, say=None) -> SeriesInfo:
    """The series of `folder` to read: the one named `uid`, else the one with the most slices (a study folder as a
    PACS exports it: the localizer, the thin and thick reconstructions, ...), said in one line through `say`
    (default: standard error) naming it, the others and `--series`.

    Raises:
        UsageError: `uid` is not one of the series, or two series share the most slices (they are listed: UID,
            description, slices; exit 2).
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
    if len(series) == 1:
        return series[0]
    largest = max(s.slices for s in series)
    ties = [s for s in series if s.slices == largest]
    if len(ties) > 1:
        raise UsageError(
            f"{folder} holds {len(series)} DICOM series, {len(ties)} of them with {largest} slices: {listing}; choose "
            "one with --series UID"
        )
    others = "; ".join(s.describe() for s in series if s is not ties[0])
    (say or _stderr)(
        f"{folder} holds {len(series)} DICOM series: reading the largest, {ties[0].describe()}; not read: {others}; "
        "choose another with --series UID"
    )
    return ties[0]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _one_line(error: Exception) -> str:
    """An exception as one line: its type and its whole message, lines joined (pydicom's list their causes)."""
    text = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def series_folders(path: Path, uid: str | None = None, say=None) -> list[tuple[str, Path, str]]:
    """The DICOM cases under `path`: (case id = folder name, folder, SeriesInstanceUID) for `path` itself when it
    directly holds DICOM files, else for each of its subfolders with DICOM files in it or below it (a folder of
    series folders, one case each; a series exported deeper, patient/study/series, is its top folder's case).

    With `uid` (`--series`): a folder holding that series reads it; any other folder its largest series
    (`choose_series`, said through `say`). A `uid` that no folder holds is a `UsageError`. A folder whose files
    cannot be listed (a corrupt file, no image slices) gets the UID "": its case fails when `read_series` reads it,
    with the reason.
    """
    path = Path(path)
    if holds_dicom_files(path):
        folders = [path]
    else:
        folders = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".") and is_dicom_folder(p))
    if folders:
        require(f"--input {path} (DICOM)", "pydicom")
    cases = []
    for folder in folders:
        try:
            series = list_series(folder)
            if not series and folder != path:  # a subfolder of SEGs or reports only (an earlier output): no case
                continue
            chosen = [s for s in series if s.uid == uid]
            # the named series; the folder's only or largest one (said); a --series the one folder lacks: UsageError
            pick = chosen[0] if chosen else choose_series(folder, uid if len(folders) == 1 else None, say)
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
    freed), `affine` 4x4 voxel to RAS mm, `datasets` the slices' headers (pydicom Datasets, no pixel data; a frame
    of a multi-frame image gets one made from its functional groups) in the volume's slice order (z), `folder`,
    `uid`, `slices` (file, frame index or None for a single-frame file) in the same order, and `shape` (X, Y, Z)."""

    image: np.ndarray | None
    affine: np.ndarray
    datasets: list
    folder: Path
    uid: str
    slices: list = dataclasses.field(default_factory=list)  # (file, frame index or None) per z

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
    rounding = position_rounding(headers) * float(np.abs(normal).sum())  # of a position along the normal
    _check_tilt(positions, along, normal, float(pixel[0].min()), where, position_rounding(headers) * np.sqrt(3))
    _check_spacing(steps, along, where, rounding)
    affine = np.eye(4)
    affine[:3, 0] = row * pixel[0][1]  # x = column index: along the row cosine, by the spacing between columns
    affine[:3, 1] = column * pixel[0][0]  # y = row index: along the column cosine, by the spacing between rows
    affine[:3, 2] = normal * spacing
    affine[:3, 3] = positions[0]
    return order, np.diag([-1.0, -1.0, 1.0, 1.0]) @ affine  # LPS -> RAS


def position_rounding(headers: list) -> float:
    """How far a written ImagePositionPatient coordinate may be from the true one: half a unit of its last decimal,
    for the most decimals any coordinate of the series was written with (0 when they were written as integers or
    in exponent form: nothing is assumed). Anonymisers that shorten decimal strings leave 2 decimals: 0.005 mm."""
    most = 0
    for ds in headers:
        for value in ds.get("ImagePositionPatient") or ():
            text = str(getattr(value, "original_string", None) or value).strip()
            if "e" in text.lower():
                return 0.0
            most = max(most, len(text.partition(".")[2]))
    return 0.5 * 10.0**-most if most else 0.0


def _check_tilt(
    positions: np.ndarray, along: np.ndarray, normal: np.ndarray, pixel: float, where: str, rounding: float = 0.0
) -> None:
    """Gantry tilt: the slices' positions move across the normal (by more than `DRIFT_TOLERANCE` of the smallest
    pixel spacing `pixel`, anywhere in the series, plus twice `rounding`, how far a written position may be off),
    so the slices are sheared."""
    offsets = positions - positions[0]
    across = np.linalg.norm(offsets - np.outer(offsets @ normal, normal), axis=1)
    if across.max() > DRIFT_TOLERANCE * pixel + 2 * rounding:
        i = int(np.argmax(across))
        degrees = float(np.degrees(np.arctan2(across[i], along[i] - along[0])))
        raise DataError(
            f"{where} is tilted: the slice positions do not follow the slice normal (gantry tilt of {degrees:.1f} "
            "degrees); resample it to an orthogonal grid first (e.g. dcm2niix corrects gantry tilt)"
        )


def _check_spacing(steps: np.ndarray, along: np.ndarray, where: str, rounding: float = 0.0) -> None:
    """Missing slices (a gap of about two or more median steps) and uneven spacing: steps more than
    `SPACING_TOLERANCE` from their mean (the affine's spacing), or a slice more than `DRIFT_TOLERANCE` of the
    spacing off the even grid the affine describes (steps each within 1% can still add up). `rounding` is how far a
    position along the normal may be off as written (`position_rounding`): a step may be off by twice that more,
    as SimpleITK and dcm2niix read positions written to 2 decimals; a missing slice is a whole step and still is
    one."""
    step = float(np.median(steps))
    ratio = steps / step
    whole = np.rint(ratio)
    gap = np.abs(steps - whole * step) <= SPACING_TOLERANCE * whole * step + 2 * rounding
    missing = gap & (whole >= 2)
    if np.any(missing):
        i = int(np.argmax(missing))
        n = int(whole[i]) - 1
        raise DataError(
            f"{where} misses {n} slice(s): a gap of {steps[i]:.3f} mm between the slices at {along[i]:.3f} and "
            f"{along[i + 1]:.3f} mm along the normal, where the others are {step:.3f} mm apart; export the complete "
            "series"
        )
    spacing = float(along[-1] - along[0]) / len(steps)
    drift = np.abs(along - along[0] - spacing * np.arange(len(along))).max()  # off the even grid of the affine
    uneven = np.abs(steps - spacing).max() > SPACING_TOLERANCE * spacing + 2 * rounding  # the affine's: their mean
    if uneven or drift > DRIFT_TOLERANCE * spacing + 2 * rounding:
        what = (
            f"more than {SPACING_TOLERANCE:.0%} off their mean {spacing:.3f} mm"
            if uneven
            else f"slices up to {drift:.3f} mm off an even grid"
        )
        if rounding >= 5e-4:
            what += f", beyond the {rounding:.3f} mm the written positions' decimals allow"
        raise DataError(
            f"{where} has uneven slice spacing: from {steps.min():.3f} to {steps.max():.3f} mm ({what}); resample it "
            "to even spacing first, or export it again"
        )


def _fmt(values) -> str:
    return "[" + ", ".join(f"{float(v):g}" for v in values) + "]"


def _functional(ds, frame: int, sequence: str, keyword: str):
    """`keyword` of the frame's functional group `sequence` (per-frame first, then shared), else of the data set."""
    per, shared = ds.get("PerFrameFunctionalGroupsSequence"), ds.get("SharedFunctionalGroupsSequence")
    for item in (per[frame] if per and frame < len(per) else None, shared[0] if shared else None):
        inner = item.get(sequence) if item is not None else None
        if inner and keyword in inner[0]:
            return inner[0].get(keyword)
    return ds.get(keyword)


def _frame_headers(ds, path: Path) -> list:
    """One header per frame of an enhanced multi-frame image: its position, orientation, pixel spacing and rescale
    from the functional groups, with the file's Rows, Columns and identity; single-frame slices are themselves."""
    import pydicom

    if _sop_class(ds) not in ENHANCED_CLASSES:
        return [ds]
    frames = []
    for k in range(_frames(ds)):
        frame = pydicom.Dataset()
        for sequence, keyword in (
            ("PlanePositionSequence", "ImagePositionPatient"),
            ("PlaneOrientationSequence", "ImageOrientationPatient"),
            ("PixelMeasuresSequence", "PixelSpacing"),
            ("PixelValueTransformationSequence", "RescaleSlope"),
            ("PixelValueTransformationSequence", "RescaleIntercept"),
        ):
            value = _functional(ds, k, sequence, keyword)
            if value is not None:
                setattr(frame, keyword, value)
        for keyword in (
            "Rows",
            "Columns",
            "SamplesPerPixel",
            "SOPClassUID",
            "SOPInstanceUID",
            "SeriesInstanceUID",
            "StudyInstanceUID",
            "FrameOfReferenceUID",
            "Modality",
        ):
            if keyword in ds:
                setattr(frame, keyword, ds.get(keyword))
        if "ImagePositionPatient" not in frame:
            raise DataError(
                f"DICOM file {path}: frame {k + 1} of its {_frames(ds)} has no position (PlanePositionSequence): "
                "truncated or corrupt? export the series again"
            )
        frames.append(frame)
    return frames


def read_series(folder: str | Path, uid: str | None = None, case_id: str = "", say=None) -> DicomVolume:
    """Reads one series of `folder` (`choose_series`: the one named `uid`, else the largest, said through `say`) as
    a `DicomVolume` (see the module's docstring). Single-frame slices and enhanced multi-frame images (Enhanced and
    Legacy Converted Enhanced CT, MR and PET: each frame a slice, its geometry and rescale from the functional
    groups) are read; a slice exported twice (one SOPInstanceUID) is read once.

    Raises:
        CaseError: the series cannot form a volume (`series_geometry`'s checks, pixel data that cannot be decoded:
            the transfer syntax and the fix named), naming `case_id` and the folder.
        UsageError: a `uid` the folder lacks, two largest series and no `uid`, or pydicom is not installed.
    """
    require(f"--input {folder} (DICOM)", "pydicom")
    import pydicom

    folder = Path(folder)
    try:
        info = choose_series(folder, uid or None, say)
        headers, slices = [], []  # a header per slice (a frame of a multi-frame file is one), and (file, frame)
        for p in info.files:
            ds = pydicom.dcmread(p, stop_before_pixels=True, force=True)
            if int(ds.get("SamplesPerPixel", 1) or 1) != 1:
                raise DataError(
                    f"DICOM file {p} in {folder} has {ds.SamplesPerPixel} samples per pixel (colour): a CT or MR "
                    "series is grayscale; give the original series, not a rendered one"
                )
            frames = _frame_headers(ds, p)
            if len(frames) == 1 and _frames(ds) > 1:
                raise DataError(
                    f"DICOM file {p} in {folder} holds {ds.NumberOfFrames} frames of SOP class {_sop_class(ds)}, not "
                    "an enhanced CT, MR or PET image: export the series as single-frame slices"
                )
            headers += frames
            slices += [(p, k if _sop_class(ds) in ENHANCED_CLASSES else None) for k in range(len(frames))]
        names = [Path(f"{p.name}[frame {k + 1}]") if k is not None else p for p, k in slices]
        order, affine = series_geometry(headers, names, folder)
    except UsageError:  # a --series the folder lacks, two largest series: the command line needs fixing
        raise
    except DataError as e:
        raise CaseError(case_id or folder.name, str(e)) from None
    except Exception as e:  # pydicom raises many types for a broken file
        raise CaseError(case_id or folder.name, f"DICOM series in {folder} cannot be read: {_one_line(e)}") from None
    rows, columns = int(headers[0].Rows), int(headers[0].Columns)
    image = np.empty((columns, rows, len(order)), np.float32)
    pixels = _Pixels(case_id or folder.name)
    for z, i in enumerate(order):
        path, frame = slices[i]
        values = pixels.frame(path, frame)
        slope = float(headers[i].get("RescaleSlope", 1) or 1)
        intercept = float(headers[i].get("RescaleIntercept", 0) or 0)
        image[:, :, z] = (values.astype(np.float64) * slope + intercept).T  # (rows, columns) -> (x, y)
    return DicomVolume(image, affine, [headers[i] for i in order], folder, info.uid, [slices[i] for i in order])


class _Pixels:
    """Decoded pixels of a series' files, one file held at a time (a multi-frame file is decoded once)."""

    def __init__(self, case_id: str):
        self.case_id, self.path, self.array = case_id, None, None

    def frame(self, path: Path, frame: int | None) -> np.ndarray:
        """The (rows, columns) pixels of `path` (its frame `frame` of a multi-frame file)."""
        if path != self.path:
            self.path, self.array = path, self._decode(path)
        array = self.array if frame is None else self.array.reshape(-1, *self.array.shape[-2:])[frame]
        return array

    def _decode(self, path: Path) -> np.ndarray:
        import pydicom

        ds = None
        try:
            ds = pydicom.dcmread(path, force=True)
            syntax = ds.file_meta.get("TransferSyntaxUID") if hasattr(ds, "file_meta") else None
            if syntax is None:  # no file meta (no preamble): DICOM's default, implicit VR little endian
                ds.file_meta = pydicom.dataset.FileMetaDataset()
                ds.file_meta.TransferSyntaxUID = pydicom.uid.ImplicitVRLittleEndian
            pixels = ds.pixel_array
        except Exception as e:  # an unsupported compression, truncated pixel data
            raise CaseError(
                self.case_id, f"DICOM file {path}: its pixels cannot be read: {_decode_error(ds, e)}"
            ) from None
        expected = (int(ds.Rows), int(ds.Columns))
        if pixels.shape[-2:] != expected or (pixels.ndim == 3) != (_frames(ds) > 1):
            raise CaseError(self.case_id, f"DICOM file {path}: its pixels are {pixels.shape}, not Rows x Columns")
        return pixels


def _decode_error(ds, error: Exception) -> str:
    """Why pixels could not be decoded, in one line: the transfer syntax and what to install, or pydicom's cause."""
    syntax = getattr(getattr(ds, "file_meta", None), "TransferSyntaxUID", None) if ds is not None else None
    text = _one_line(error)
    if syntax is not None and syntax.is_compressed and "missing dependencies" in text:
        return (
            f"they are compressed as {syntax.name} ({syntax}), which no installed decoder reads ({text}); install "
            "the decoders of the dicom extra: pip install 'tfmis[dicom]' (python-gdcm, pyjpegls)"
        )
    return text
