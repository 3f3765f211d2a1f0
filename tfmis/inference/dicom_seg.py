"""DICOM SEG out: a predicted label map written as a DICOM Segmentation object (`tfmis-predict --output-format
dicom-seg`) that references the series it was predicted from.

`write_segmentation` writes a BINARY `highdicom.seg.Segmentation`: one segment per foreground class (segment number =
the class's label value, segment label = its name in the run's dataset labels), coded with the generic SCT "Tissue"
as category and type (the label names are free text: tfmis knows no code for them), algorithm type AUTOMATIC and
an algorithm identification naming tfmis and its version. Its source images are the series' slices
(`tfmis.data.dicom_series.DicomVolume.datasets`, in the volume's slice order), so frame k of the label map (its
(rows, columns) = (y, x) plane z = k) is the segmentation of source slice k; empty frames are left out.

`read_segmentation` reads such a file back into the (X, Y, Z) label map of the source volume (highdicom's
`get_pixels_by_source_instance`).

highdicom (and pydicom) are the optional `dicom` extra: `pip install 'tfmis[dicom]'`.

Example:
```python
volume = read_series("scans/patient_01")
write_segmentation(labels, volume, ["background", "liver", "tumour"], Path("out/patient_01.seg.dcm"))
np.array_equal(read_segmentation("out/patient_01.seg.dcm", volume), labels)   # True
```
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import numpy as np

from tfmis.data.dicom_series import DicomVolume, read_series, require
from tfmis.data.msd import CaseError
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
    """highdicom `SegmentDescription`s of the foreground classes (`class_names[1:]`, segment number = label value),
    or only of the label values in `present`."""
    import highdicom as hd
    from pydicom.sr.codedict import codes

    algorithm = hd.AlgorithmIdentificationSequence(
        name="tfmis", family=codes.cid7162.ArtificialIntelligence, version=tfmis_version()
    )
    return [
        hd.seg.SegmentDescription(
            segment_number=number,
            segment_label=name,
            segmented_property_category=codes.SCT.Tissue,
            segmented_property_type=codes.SCT.Tissue,
            algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
            algorithm_identification=algorithm,
        )
        for number, name in enumerate(class_names)
        if number > 0 and (present is None or number in present)
    ]


def write_segmentation(labels: np.ndarray, volume: DicomVolume | None, class_names: list[str], path: Path) -> Path:
    """Writes the (X, Y, Z) label map `labels` of `volume` as a DICOM SEG at `path`, atomically (see the module).

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
    _complete_headers(volume)
    frames = np.ascontiguousarray(labels.transpose(2, 1, 0))  # (slices, rows, columns): frame k on source slice k
    try:
        seg = _segmentation(volume, frames.astype(np.uint8 if len(class_names) <= 256 else np.uint16), class_names)
    except (AttributeError, ValueError, TypeError, KeyError) as e:  # what highdicom finds missing or wrong
        raise DataError(
            f"DICOM series in {volume.folder}: a DICOM SEG cannot reference it ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); predict it with --output-format nifti"
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


def _complete_headers(volume: DicomVolume) -> None:
    """Fills the source headers' missing type-2 attributes (empty, and SliceThickness: the measured spacing) so that
    highdicom can copy them; a missing type-1 attribute is a `DataError` naming the folder."""
    spacing = float(np.linalg.norm(volume.affine[:3, 2]))
    for ds in volume.datasets:
        missing = [k for k in REQUIRED if not ds.get(k)]
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


def _segmentation(volume: DicomVolume, frames: np.ndarray, class_names: list[str]):
    """The highdicom `Segmentation` of `frames` (slices, rows, columns) over `volume`'s slices."""
    import highdicom as hd

    return hd.seg.Segmentation(
        source_images=volume.datasets,
        pixel_array=frames,
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
        segment_descriptions=segment_descriptions(class_names),
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


def read_segmentation(path: str | Path, volume: DicomVolume) -> np.ndarray:
    """The uint8 (X, Y, Z) label map of a SEG written by `write_segmentation` for `volume`: each voxel the number of
    the segment that holds it, 0 where none does (slices with no frame are background)."""
    import highdicom as hd

    seg = hd.seg.segread(str(path))
    uids = [str(ds.SOPInstanceUID) for ds in volume.datasets]
    referenced = {str(uid) for _, _, uid in seg.get_source_image_uids()}
    frames = np.zeros((len(uids), volume.shape[1], volume.shape[0]), np.uint8)
    present = [k for k, uid in enumerate(uids) if uid in referenced]
    if present and seg.get_segment_numbers():
        pixels = seg.get_pixels_by_source_instance(
            [uids[k] for k in present], combine_segments=True, assert_missing_frames_are_empty=True
        )
        frames[present] = pixels
    return frames.transpose(2, 1, 0)
