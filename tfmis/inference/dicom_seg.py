"""DICOM SEG out: a predicted label map written as a DICOM Segmentation object (`tfmis-predict --output-format
dicom-seg`) that references the series it was predicted from.

`write_segmentation` writes a BINARY `highdicom.seg.Segmentation` with one segment per foreground class **present in
the label map**, numbered 1..N in the classes' order and labelled with the class's name in the run's dataset labels
(a region dataset's names included), coded with the generic SCT "Tissue" as category and type (the label names are
free text: tfmis knows no code for them), algorithm type AUTOMATIC and an algorithm identification naming tfmis and
its version. Classes absent from the prediction are not declared: a segment without frames is valid DICOM, but
some viewers reject it, so a reader maps segments to classes by their labels (`read_segmentation(...,
class_names)`). Its source images are the series' slices (`tfmis.data.sources.dicom_series.DicomVolume.datasets`, in the
volume's slice order), or the one enhanced multi-frame image the volume was read from (frame for frame), so frame
k of the label map (its (rows, columns) = (y, x) plane z = k) is the segmentation of source slice k; empty frames
are left out. An empty prediction is one segment (the first foreground class) with one empty frame on the first
slice (a SEG must hold a segment and a frame): a few kB, where every empty frame of every class took 39 MB for
512x512x600.

A series without StudyInstanceUID (some anonymisers remove it) cannot be referenced as DICOM asks; with
`new_study_uid=True` (`tfmis-predict --new-study-uid`) its SEG gets a new study UID, and a warning says that a
viewer will file the SEG as a study of its own.

`read_segmentation` reads such a file back into the (X, Y, Z) label map of the source volume (highdicom's
`get_pixels_by_source_instance`, or by source frame for a multi-frame source).

highdicom (and pydicom) are the optional `dicom` extra: `pip install 'tfmis[dicom]'`.

Example:
```python
volume = read_series("scans/patient_01")
write_segmentation(labels, volume, ["background", "liver", "tumour"], Path("out/patient_01.seg.dcm"))
np.array_equal(read_segmentation("out/patient_01.seg.dcm", volume, ["background", "liver", "tumour"]), labels)
```
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import numpy as np

from tfmis.data.sources.dicom_series import DicomVolume, read_series, require
from tfmis.data.sources.errors import CaseError
from tfmis.errors import DataError, UsageError
from tfmis.utils.io import atomic_path

OUTPUT_FORMATS = ("nifti", "dicom-seg")
SEG_SUFFIX = ".seg.dcm"
SEG_SERIES_NUMBER = 900
SEG_SERIES_DESCRIPTION = "tfmis segmentation"


def tfmis_version() -> str:
    """The installed tfmis distribution's version, else the package's `__version__` (a source checkout)."""
    try:
        return importlib.metadata.version("tfmis")
    except importlib.metadata.PackageNotFoundError:
        import tfmis

        return tfmis.__version__


def read_dicom_case(case, num_channels: int) -> tuple[np.ndarray, np.ndarray, object, DicomVolume]:
    """A DICOM series case (`InputCase` with `series`) as the predictor reads a NIfTI: (float32 image (X, Y, Z, 1),
    RAS affine, a NIfTI header for outputs written as NIfTI (scanner coordinates, mm), the `DicomVolume`).

    Raises:
        CaseError: the series cannot form a volume (`read_series`), or the model needs more than one channel.
    """
    import nibabel as nib

    if num_channels != 1:
        raise CaseError(
            case.case_id,
            f"DICOM series {case.image} is one channel, the model needs {num_channels} (one per modality): predict "
            "multi-channel cases from NIfTI files",
        )
    volume = read_series(case.image, case.series, case.case_id)
    header = nib.Nifti1Header()
    header.set_qform(volume.affine, code=1)
    header.set_sform(volume.affine, code=1)
    header.set_xyzt_units("mm")
    image, volume.image = volume.image, None  # the predictor frees the image once it is preprocessed
    return image[..., np.newaxis], volume.affine, header, volume


def segment_descriptions(class_names: list[str], present=None) -> list:
    """highdicom `SegmentDescription`s of the foreground classes (`class_names[1:]`), or only of the label values in
    `present`, numbered 1..N in the classes' order and labelled with their names."""
    import highdicom as hd
    from pydicom.sr.codedict import codes

    algorithm = hd.AlgorithmIdentificationSequence(
        name="tfmis", family=codes.cid7162.ArtificialIntelligence, version=tfmis_version()
    )
    values = [v for v in range(1, len(class_names)) if present is None or v in present]
    return [
        hd.seg.SegmentDescription(
            segment_number=number,
            segment_label=class_names[value],
            segmented_property_category=codes.SCT.Tissue,
            segmented_property_type=codes.SCT.Tissue,
            algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
            algorithm_identification=algorithm,
        )
        for number, value in enumerate(values, start=1)
    ]


def write_segmentation(
    labels: np.ndarray,
    volume: DicomVolume | None,
    class_names: list[str],
    path: Path,
    new_study_uid: bool = False,
    say=None,
) -> Path:
    """Writes the (X, Y, Z) label map `labels` of `volume` as a DICOM SEG at `path`, atomically (see the module).

    Args:
        new_study_uid: a series without StudyInstanceUID gets a new one for its SEG (said through `say`, default
            standard error) instead of failing.

    Raises:
        UsageError: `volume` is None (the input was not a DICOM series), or highdicom is not installed.
        DataError: the series lacks what a SEG must reference (a Frame of Reference UID, ...): the case fails.
        ValueError: `labels` is not on the volume's grid, or holds a value that is not a class.
    """
    require("--output-format dicom-seg", "pydicom", "highdicom")
    if volume is None:
        raise UsageError(
            "--output-format dicom-seg references the DICOM series a label map was predicted from: give a DICOM "
            "series folder as --input, or --output-format nifti"
        )
    if labels.shape != volume.shape:
        raise ValueError(f"label map of shape {labels.shape} for a DICOM volume of shape {volume.shape}")
    if labels.size and int(labels.max()) >= len(class_names):
        raise ValueError(f"label map holds {int(labels.max())}, beyond the classes {class_names}")
    present = [int(v) for v in np.unique(labels) if v > 0]
    segments = present or [1]  # an empty prediction: one segment and one empty frame (a SEG needs both)
    numbers = np.zeros(len(class_names), np.uint16)
    numbers[segments] = np.arange(1, len(segments) + 1)
    frames = numbers[labels.transpose(2, 1, 0)]  # (slices, rows, columns): frame k on source slice k
    sources = volume.datasets
    files = {f for f, _ in volume.slices}
    if any(k is not None for _, k in volume.slices):  # one enhanced image: the SEG's frames are its frames, in order
        if len(files) > 1:
            raise DataError(
                f"DICOM series in {volume.folder}: a DICOM SEG over {len(files)} multi-frame files is not written "
                "(one multi-frame image, or single-frame slices, are); predict it with --output-format nifti"
            )
        import pydicom

        sources = [pydicom.dcmread(next(iter(files)), stop_before_pixels=True, force=True)]
        ordered = np.empty_like(frames)
        ordered[[k for _, k in volume.slices]] = frames
        frames = ordered
    elif not present:
        sources, frames = sources[:1], frames[:1]
    _complete_headers(sources, volume, new_study_uid, say)
    try:
        seg = _segmentation(
            sources, frames.astype(np.uint8 if len(segments) < 256 else np.uint16), class_names, segments
        )
    except (AttributeError, ValueError, TypeError, KeyError) as e:  # what highdicom finds missing or wrong
        raise DataError(
            f"DICOM series in {volume.folder}: a DICOM SEG cannot reference it ({type(e).__name__}: "
            f"{' '.join(str(e).split()) if str(e) else ''}); predict it with --output-format nifti"
        ) from None
    path = Path(path)
    with atomic_path(path, suffix=SEG_SUFFIX) as tmp:
        seg.save_as(tmp)
    return path


# the patient and study attributes a SEG copies from its source images that DICOM lets a series leave empty (type 2),
# which highdicom reads as attributes: a series without them gets them empty
EMPTY_IF_MISSING = (
    "PatientName",
    "PatientID",
    "PatientBirthDate",
    "PatientSex",
    "StudyID",
    "StudyDate",
    "StudyTime",
    "AccessionNumber",
    "ReferringPhysicianName",
)
# what a SEG must reference (type 1): a series without one cannot have a SEG
REQUIRED = ("StudyInstanceUID", "SeriesInstanceUID", "SOPInstanceUID", "SOPClassUID", "FrameOfReferenceUID", "Modality")


def _complete_headers(sources: list, volume: DicomVolume, new_study_uid: bool = False, say=None) -> None:
    """Fills the missing type-2 attributes of the headers `sources` (of `volume`; empty, and SliceThickness: the
    measured spacing) so that highdicom can copy them; a missing type-1 attribute is a `DataError` naming the
    folder, except a missing StudyInstanceUID with `new_study_uid`: a new one, said through `say`."""
    spacing = float(np.linalg.norm(volume.affine[:3, 2]))
    if new_study_uid and any(not ds.get("StudyInstanceUID") for ds in sources):
        import highdicom as hd

        study = str(hd.UID())
        for ds in sources:
            ds.StudyInstanceUID = study
        (say or _stderr)(
            f"warning: DICOM series in {volume.folder} has no StudyInstanceUID: its SEG gets a new one, {study} "
            "(--new-study-uid); a viewer files it as a study of its own, not beside the series"
        )
    for ds in sources:
        missing = [k for k in REQUIRED if not ds.get(k)]
        if missing == ["StudyInstanceUID"]:
            raise DataError(
                f"DICOM series in {volume.folder}: its slices have no StudyInstanceUID (anonymised?), which a DICOM "
                "SEG must reference; predict it with --new-study-uid (the SEG gets a new study UID) or "
                "--output-format nifti"
            )
        if missing:
            raise DataError(
                f"DICOM series in {volume.folder}: its slices have no {missing[0]}, which a DICOM SEG must reference; "
                "predict it with --output-format nifti"
            )
        for keyword in EMPTY_IF_MISSING:
            if keyword not in ds:
                setattr(ds, keyword, "")
        if "SliceThickness" not in ds or ds.SliceThickness in (None, ""):
            ds.SliceThickness = f"{spacing:.6g}"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _segmentation(sources: list, frames: np.ndarray, class_names: list[str], present: list[int]):
    """The highdicom `Segmentation` of `frames` (frames, rows, columns; values: segment numbers) over `sources`."""
    import highdicom as hd

    return hd.seg.Segmentation(
        source_images=sources,
        pixel_array=frames,
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
        segment_descriptions=segment_descriptions(class_names, present),
        series_instance_uid=hd.UID(),
        series_number=SEG_SERIES_NUMBER,
        sop_instance_uid=hd.UID(),
        instance_number=1,
        manufacturer="tfmis",
        manufacturer_model_name="tfmis",
        software_versions=tfmis_version(),
        device_serial_number="none",
        series_description=SEG_SERIES_DESCRIPTION,
    )


def read_segmentation(path: str | Path, volume: DicomVolume, class_names: list[str] | None = None) -> np.ndarray:
    """The uint8 (X, Y, Z) label map of a SEG written by `write_segmentation` for `volume`: each voxel the label
    value of the class whose name labels the segment that holds it (with `class_names`; else the segment's
    number), 0 where none does (slices with no frame are background).

    Raises:
        DataError: a segment whose label is not one of `class_names`.
    """
    import highdicom as hd

    seg = hd.seg.segread(str(path))
    numbers = seg.get_segment_numbers()
    lut = np.arange(max(numbers, default=0) + 1, dtype=np.uint8)
    if class_names is not None:
        for number in numbers:
            label = seg.get_segment_description(number).segment_label
            if label not in class_names:
                raise DataError(f"{path}: segment {number} is labelled {label!r}, not one of the classes {class_names}")
            lut[number] = class_names.index(label)
    frames = np.zeros((len(volume.datasets), volume.shape[1], volume.shape[0]), np.uint8)
    if not numbers:
        return frames.transpose(2, 1, 0)
    if any(k is not None for _, k in volume.slices):  # one multi-frame source: by its frame numbers
        uid = str(volume.datasets[0].SOPInstanceUID)
        pixels = seg.get_pixels_by_source_frame(
            uid,
            source_frame_numbers=[k + 1 for _, k in volume.slices],
            combine_segments=True,
            assert_missing_frames_are_empty=True,
        )
        frames[:] = pixels
    else:
        uids = [str(ds.SOPInstanceUID) for ds in volume.datasets]
        referenced = {str(uid) for _, _, uid in seg.get_source_image_uids()}
        present = [k for k, uid in enumerate(uids) if uid in referenced]
        if present:
            frames[present] = seg.get_pixels_by_source_instance(
                [uids[k] for k in present], combine_segments=True, assert_missing_frames_are_empty=True
            )
    return lut[frames].transpose(2, 1, 0)
