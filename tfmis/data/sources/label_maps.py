"""The image files of a prediction: a label map read as small integers (`read_label_map`; a NIfTI slab by slab), and
an array written with the input's affine and header in the format its name gives (`save_like`), both through
`tfmis.data.sources.image_io` (NIfTI, and NRRD / MetaImage with the `formats` extra).

Below the predictor (`tfmis.inference`), the postprocessing (`tfmis.postprocessing`) and cross-validation's
out-of-fold maps, which read and write label maps alike.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from tfmis.data.sources.errors import CaseError, UnreadableImage
from tfmis.data.sources.image_io import READ_ERRORS, open_lazily, write_image
from tfmis.errors import DataError

LABEL_SLAB_SLICES = 32  # slices (the file's last axis) of a label NIfTI read and cast at a time


def read_label_map(path: str | Path, num_classes: int, case_id: str = "", shape=None) -> np.ndarray:
    """A label map file as an unsigned integer array (uint8; uint16 beyond 256 classes) in the file's voxel order.

    An NRRD or MetaImage file is read whole (`tfmis.data.sources.image_io.read_image`) and cast slab by slab. A NIfTI is
    read `LABEL_SLAB_SLICES` slices along the file's last axis at a time from nibabel's array proxy (the file kept
    open, so a .nii.gz is decompressed once, front to back), each slab cast to the small type: no float64 (or
    int64) copy of the volume. Labels stored as floats (or scaled integers) are rounded to the nearest integer
    first, as nibabel's floats near an integer deserve.

    Raises:
        CaseError: the label's shape is not `shape` (when given), or the file is corrupt or truncated.
        DataError: a value that is not one of the classes 0..num_classes-1.

    Example:
    ```python
    label = read_label_map("labelsTr/liver_3.nii.gz", num_classes=3)   # uint8 (X, Y, Z)
    ```
    """
    try:
        return _cast_label_map(open_lazily(path), num_classes, case_id, shape, path)
    except UnreadableImage as e:
        raise CaseError(case_id, f"label file {e}") from e
    except READ_ERRORS as e:
        if isinstance(e, DataError):
            raise
        raise CaseError(
            case_id, f"label file {path} cannot be read (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from e
    except OSError as e:  # a file that is not there or not readable stays an OS error; gzip's is a corrupt file
        if not isinstance(e, gzip.BadGzipFile):
            raise
        raise CaseError(case_id, f"label file {path} cannot be read (truncated or corrupt?): {e}") from e


def _cast_label_map(img, num_classes: int, case_id: str, shape, path) -> np.ndarray:
    """The label map of `img` (`tfmis.data.sources.image_io.open_lazily`) cast slab by slab; CaseError / DataError."""
    if shape is not None and tuple(img.shape) != tuple(shape):
        raise CaseError(case_id, f"label {path} has shape {tuple(img.shape)}, the image {tuple(shape)}")
    out = np.empty(img.shape, np.uint8 if num_classes <= 2**8 else np.uint16)
    outside = _read_slabs(img, out, num_classes)
    if outside:
        low, high = min(low for low, _ in outside), max(high for _, high in outside)
        raise DataError(
            f"label {path} holds values outside the classes 0..{num_classes - 1} (in [{low}, {high}] where it does)"
        )
    return out


def _read_slabs(img, out: np.ndarray, num_classes: int) -> list:
    """Fills `out` from `img` slab by slab; (min, max) of the slabs holding a value that is not a class (NaN too)."""
    outside = []
    for start in range(0, img.shape[-1], LABEL_SLAB_SLICES):
        part = (..., slice(start, start + LABEL_SLAB_SLICES))
        slab = np.asanyarray(img.dataobj[part])
        if slab.dtype.kind == "f":
            slab = np.rint(slab)
        if slab.size:
            low, high = slab.min(), slab.max()
            if low >= 0 and high < num_classes:  # False for NaN
                out[part] = slab
            else:
                outside.append((low, high))
    return outside


def save_like(data: np.ndarray, affine: np.ndarray, header, path: Path, dtype) -> None:
    """Writes `data` with the input's affine, atomically, in the format of `path`'s suffix
    (`tfmis.data.sources.image_io.write_image`): a NIfTI keeps the input's NIfTI `header` (orientation codes,
    units...) when there is one; an NRRD / MetaImage gets the affine's direction, origin and spacing.

    Float data with an integer `dtype` is stored scaled in a NIfTI (nibabel sets scl_slope; readers get floats).
    """
    write_image(data, affine, path, dtype, header)
