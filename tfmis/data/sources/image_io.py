"""The one reader and writer of image files in tfmis: NIfTI (`.nii.gz`, `.nii`, through nibabel) and, with the
`formats` extra (SimpleITK), NRRD (`.nrrd`), MetaImage (`.mha`, `.mhd` + `.raw`).

Whatever the format, an image comes back in tfmis's convention, the one nibabel gives for NIfTI:

* the array in (X, Y, Z[, C]) voxel order (SimpleITK's arrays are (Z, Y, X[, C]): reversed here);
* a 4x4 voxel-to-world affine in RAS+ millimetres. SimpleITK's geometry is LPS (origin, direction, spacing):
  `affine[:3, :3] = F @ direction @ diag(spacing)`, `affine[:3, 3] = F @ origin` with `F = diag(-1, -1, 1)`, and
  back the same way when writing, so a file read and written again keeps its direction, origin and spacing.

The on-disk value type is kept (an int16 CT stays int16: `load_image(integers=True)` relies on it).

Example:
```python
image = read_image("imagesTr/ct_001_0000.mha")        # image.array (X, Y, Z), image.affine (4x4 RAS)
write_image(labels, image.affine, "pred/ct_001.mha", np.uint8)   # same direction, origin, spacing
```
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import nibabel as nib
import numpy as np

from tfmis.data.sources.errors import CaseError, UnreadableImage
from tfmis.utils.io import atomic_path, atomic_save_nifti, fsync_dir

NIFTI_SUFFIXES = (".nii.gz", ".nii")
ITK_SUFFIXES = (".nrrd", ".mha", ".mhd")
IMAGE_SUFFIXES = NIFTI_SUFFIXES + ITK_SUFFIXES
LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0])
INSTALL_FORMATS = "pip install 'tfmis[formats]' (SimpleITK)"


@dataclasses.dataclass
class ImageFile:
    """An image as read.

    Attributes:
        array: (X, Y, Z[, C]) in the file's value type (NIfTI: nibabel's, scaled data as floats).
        affine: 4x4 float64 voxel-to-world, RAS+ mm.
        disk_dtype: the stored value type with byte order (e.g. `>i2`, `<f4`).
        header: the NIfTI header (kept for writing alike), None for other formats.
    """

    array: np.ndarray
    affine: np.ndarray
    disk_dtype: str
    header: object = None


def image_suffix(name: str | Path) -> str | None:
    """The image format suffix `name` ends with (`.nii.gz`, `.nii`, `.nrrd`, `.mha`, `.mhd`), or None.

    >>> image_suffix("imagesTr/ct_001_0000.nii.gz"), image_suffix("a.MHA"), image_suffix("notes.txt")
    ('.nii.gz', '.mha', None)
    """
    lower = str(name).lower()
    return next((s for s in IMAGE_SUFFIXES if lower.endswith(s)), None)


def strip_image_suffix(name: str | Path) -> str:
    """The file name without its directory and image suffix (a case id for MSD files).

    >>> strip_image_suffix("imagesTr/spleen_2.nii.gz"), strip_image_suffix("x.mha"), strip_image_suffix("y.txt")
    ('spleen_2', 'x', 'y.txt')
    """
    base = Path(name).name
    suffix = image_suffix(base)
    return base[: -len(suffix)] if suffix else base


def is_nifti(path: str | Path) -> bool:
    return image_suffix(path) in NIFTI_SUFFIXES


def output_suffix(input_path: str | Path) -> str:
    """The suffix of a file written for the input `input_path`: its own format (`.nii.gz` when it has none).

    >>> output_suffix("scans/ct_001.mha"), output_suffix("ct_002.nii")
    ('.mha', '.nii')
    """
    return image_suffix(input_path) or ".nii.gz"


def _sitk():
    try:
        import SimpleITK
    except ImportError as e:
        raise ImportError(f"NRRD and MetaImage files need SimpleITK: {INSTALL_FORMATS}") from e
    return SimpleITK


def _check_format(path: Path) -> str:
    suffix = image_suffix(path)
    if suffix is None:
        raise UnreadableImage(f"{path}: not an image file tfmis reads (it reads {', '.join(IMAGE_SUFFIXES)})")
    if not path.is_file():
        raise UnreadableImage(f"{path}: file does not exist")
    return suffix


def read_image(path: str | Path) -> ImageFile:
    """Reads an image file (array, RAS affine, stored dtype).

    Raises:
        UnreadableImage: the file is missing, corrupt or truncated, not an image format tfmis reads, or an NRRD /
            MetaImage file without SimpleITK installed; one line naming the file (and `tfmis[formats]`).
    """
    path = Path(path)
    suffix = _check_format(path)
    try:
        if suffix in NIFTI_SUFFIXES:
            img = nib.load(str(path))
            data = np.asanyarray(img.dataobj)
            return ImageFile(data, np.asarray(img.affine, dtype=np.float64), img.get_data_dtype().str, img.header)
        sitk = _sitk()
        img = sitk.ReadImage(str(path))
        data = sitk.GetArrayFromImage(img)  # (Z, Y, X) or (Z, Y, X, C) for vector pixels; (T, Z, Y, X) for 4D
        axes = (*range(img.GetDimension() - 1, -1, -1), *range(img.GetDimension(), data.ndim))
        data = np.ascontiguousarray(np.transpose(data, axes))
        return ImageFile(data, _itk_affine(img), data.dtype.str, None)
    except ImportError as e:
        raise UnreadableImage(f"{path}: {e}") from None
    except (OSError, EOFError, zlib.error, ValueError, RuntimeError, nib.filebasedimages.ImageFileError) as e:
        raise UnreadableImage(f"{path} cannot be read (truncated or corrupt?): {type(e).__name__}: {_first(e)}") from e


class _InMemory:
    """An array with the two attributes of a nibabel image that a slab reader uses (`shape`, `dataobj`)."""

    def __init__(self, array: np.ndarray):
        self.shape, self.dataobj = array.shape, array


def open_lazily(path: str | Path):
    """An object with `shape` and `dataobj` (sliceable) for reading an image slab by slab: a NIfTI's nibabel proxy
    (the file kept open, so a .nii.gz is decompressed once, front to back), other formats read whole.

    Slicing `dataobj` of a corrupt NIfTI raises one of `READ_ERRORS` (or gzip's `BadGzipFile`, an OSError).

    Raises:
        UnreadableImage: an NRRD / MetaImage file that cannot be read (as `read_image`).
    """
    if is_nifti(path):
        return nib.load(str(path), keep_file_open=True)
    return _InMemory(read_image(path).array)


READ_ERRORS = (EOFError, zlib.error, ValueError, nib.filebasedimages.ImageFileError)


def read_affine(path: str | Path) -> np.ndarray:
    """The 4x4 RAS voxel-to-world affine from the file's header alone (no voxel data read).

    Raises:
        UnreadableImage: as `read_image`.
    """
    return read_geometry(path)[0]


def read_geometry(path: str | Path) -> tuple[np.ndarray, object]:
    """(4x4 RAS affine, NIfTI header or None) from the file's header alone (no voxel data read): what
    `write_image` needs to write another array alike.

    Raises:
        UnreadableImage: as `read_image`.
    """
    path = Path(path)
    suffix = _check_format(path)
    try:
        if suffix in NIFTI_SUFFIXES:
            img = nib.load(str(path))
            return np.asarray(img.affine, dtype=np.float64), img.header
        sitk = _sitk()
        reader = sitk.ImageFileReader()
        reader.SetFileName(str(path))
        reader.ReadImageInformation()
        return _itk_affine(reader), None
    except ImportError as e:
        raise UnreadableImage(f"{path}: {e}") from None
    except (OSError, EOFError, zlib.error, ValueError, RuntimeError, nib.filebasedimages.ImageFileError) as e:
        raise UnreadableImage(f"{path}: cannot read its header: {type(e).__name__}: {_first(e)}") from e


def read_shape(path: str | Path) -> tuple[int, ...]:
    """The array shape an image file decodes to (X, Y, Z[, C]), from its header alone (no voxel data read).

    Raises:
        UnreadableImage: as `read_image`.
    """
    path = Path(path)
    suffix = _check_format(path)
    try:
        if suffix in NIFTI_SUFFIXES:
            return tuple(int(n) for n in nib.load(str(path)).shape)
        reader = _sitk().ImageFileReader()
        reader.SetFileName(str(path))
        reader.ReadImageInformation()
        components = reader.GetNumberOfComponents()
        return tuple(int(n) for n in reader.GetSize()) + ((components,) if components > 1 else ())
    except ImportError as e:
        raise UnreadableImage(f"{path}: {e}") from None
    except (OSError, EOFError, zlib.error, ValueError, RuntimeError, nib.filebasedimages.ImageFileError) as e:
        raise UnreadableImage(f"{path}: cannot read its header: {type(e).__name__}: {_first(e)}") from e


def _first(error: BaseException) -> str:
    """The first non-empty line of an error (ITK's messages run over several lines)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines and lines[0].startswith("Exception thrown") else (lines[0] if lines else "")


def _itk_affine(img) -> np.ndarray:
    """The RAS affine of a SimpleITK image or reader (the first three axes of a 4D image)."""
    dim = img.GetDimension()
    direction = np.asarray(img.GetDirection(), dtype=np.float64).reshape(dim, dim)[:3, :3]
    spacing = np.asarray(img.GetSpacing(), dtype=np.float64)[:3]
    origin = np.asarray(img.GetOrigin(), dtype=np.float64)[:3]
    if dim < 3:
        raise ValueError(f"a {dim}D image; tfmis reads 3D volumes")
    affine = np.eye(4)
    affine[:3, :3] = LPS_TO_RAS @ direction @ np.diag(spacing)
    affine[:3, 3] = LPS_TO_RAS @ origin
    return affine


def itk_geometry(affine: np.ndarray) -> tuple[tuple, tuple, tuple]:
    """(spacing, origin, direction) in SimpleITK's LPS terms for a RAS `affine`: the inverse of the reader's.

    >>> affine = np.diag([2.0, 3.0, 4.0, 1.0])
    >>> affine[:3, 3] = [10.0, 20.0, 30.0]
    >>> spacing, origin, direction = itk_geometry(affine)
    >>> spacing, origin
    ((2.0, 3.0, 4.0), (-10.0, -20.0, 30.0))
    >>> np.reshape(direction, (3, 3)).diagonal().tolist()
    [-1.0, -1.0, 1.0]
    """
    affine = np.asarray(affine, dtype=np.float64)
    lps = LPS_TO_RAS @ affine[:3, :3]
    spacing = np.linalg.norm(lps, axis=0)
    direction = lps / spacing
    origin = LPS_TO_RAS @ affine[:3, 3]
    return tuple(map(float, spacing)), tuple(map(float, origin)), tuple(map(float, direction.ravel()))


def write_image(data: np.ndarray, affine: np.ndarray, path: str | Path, dtype, header=None) -> None:
    """Writes `data` (X, Y, Z[, C]) with `affine` (RAS) to `path`, in the format its suffix names, atomically
    (`path` holds the old or the new image, whole; a `.mhd` and its `.raw` are each replaced whole).

    NIfTI keeps `header` (orientation codes, units ...) when given; float data with an integer `dtype` is then
    stored scaled (nibabel sets scl_slope). Other formats store `data` cast to `dtype`, with the direction, origin
    and spacing of `affine` (channels as vector pixels).

    Raises:
        UnreadableImage: an NRRD / MetaImage path without SimpleITK installed (one line naming `tfmis[formats]`).
        ValueError: `path` has no image suffix.
    """
    path = Path(path)
    suffix = image_suffix(path)
    if suffix is None:
        raise ValueError(f"{path}: not an image file name (it must end with one of {', '.join(IMAGE_SUFFIXES)})")
    if suffix in NIFTI_SUFFIXES:
        new_header = header.copy() if isinstance(header, nib.Nifti1Header) else nib.Nifti1Header()
        new_header.set_data_dtype(dtype)
        atomic_save_nifti(nib.Nifti1Image(data, affine, new_header), path)
        return
    try:
        sitk = _sitk()
    except ImportError as e:
        raise UnreadableImage(f"{path}: {e}") from None
    array = np.asarray(data).astype(dtype, copy=False)
    vector = array.ndim == 4
    axes = (2, 1, 0, 3) if vector else (2, 1, 0)  # (X, Y, Z[, C]) to SimpleITK's (Z, Y, X[, C])
    img = sitk.GetImageFromArray(np.ascontiguousarray(np.transpose(array, axes)), isVector=vector)
    spacing, origin, direction = itk_geometry(affine)
    img.SetSpacing(spacing)
    img.SetOrigin(origin)
    img.SetDirection(direction)
    if suffix == ".mhd":
        _write_mhd(sitk, img, path)
        return
    with atomic_path(path, suffix=suffix) as tmp:
        sitk.WriteImage(img, str(tmp), useCompression=True)


def _write_mhd(sitk, img, path: Path) -> None:
    """A `.mhd` header and its `.raw` data written under their own names in a temporary folder beside `path`, then
    moved into place (data first, so the header never names a missing file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=".tmp-", dir=path.parent))
    try:
        sitk.WriteImage(img, str(folder / path.name))
        for written in sorted(folder.iterdir(), key=lambda p: p.suffix == ".mhd"):
            os.replace(written, path.parent / written.name)
        fsync_dir(path.parent)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def read_case_file(case_id: str, path: Path, what: str) -> tuple[np.ndarray, np.ndarray, str]:
    """(array, affine, on-disk dtype) of one file (`what`: "image", "label"...) of case `case_id`
    (`read_image`); a missing or unreadable file is a `CaseError` naming the case."""
    if not path.is_file():
        raise CaseError(case_id, f"{what} file {path} does not exist")
    try:
        image = read_image(path)
    except UnreadableImage as e:
        raise CaseError(case_id, f"{what} file {e}") from e
    return image.array, image.affine, image.disk_dtype


def read_channels(paths: list[Path], case_id: str) -> tuple[np.ndarray, np.ndarray, str]:
    """The channel files of one image (nnU-Net v2: one 3D file each) stacked on a last axis; they must share
    shape and affine. One file is returned as it is (3D, or 4D with channels last)."""
    if len(paths) == 1:
        return read_case_file(case_id, paths[0], "image")
    arrays, affine, disk_dtype = [], None, None
    for c, path in enumerate(paths):
        raw, file_affine, file_dtype = read_case_file(case_id, path, f"channel {c} image")
        if raw.ndim == 4 and raw.shape[3] == 1:
            raw = raw[..., 0]
        if raw.ndim != 3:
            raise CaseError(case_id, f"channel file {path} has shape {raw.shape}; a channel file holds one 3D volume")
        if arrays and raw.shape != arrays[0].shape:
            raise CaseError(case_id, f"channel file {path} has shape {raw.shape}, channel 0 {arrays[0].shape}")
        if affine is not None and not np.allclose(file_affine, affine, atol=1e-3, rtol=0):
            raise CaseError(
                case_id,
                f"channel file {path} has another affine than channel 0 (max difference "
                f"{np.abs(file_affine - affine).max():.4g}): the channels must be on one grid",
            )
        arrays.append(raw)
        affine, disk_dtype = (file_affine, file_dtype) if affine is None else (affine, disk_dtype)
    dtype = np.result_type(*arrays)
    return np.stack([a.astype(dtype, copy=False) for a in arrays], axis=-1), affine, disk_dtype


def load_image(
    path: str | Path | tuple | list, num_channels: int, case_id: str, integers: bool = False
) -> tuple[np.ndarray, np.ndarray, str]:
    """Reads one image as float32 (X, Y, Z, C); raises `CaseError` naming the case.

    `path` is one file (3D, or 4D with channels last: MSD) or the image's channel files in order (nnU-Net v2, one
    3D file each, sharing shape and affine), in any format `read_image` reads.

    With `integers`, an image stored as integers of up to 16 bits without a scale factor (a CT's int16) keeps
    that type: every value is exact in float32, `preprocess` turns slabs of it into float32 as it goes, and a
    512x512x600 CT then takes 300 MB instead of 600 MB.

    Returns:
        (image, 4x4 RAS affine, on-disk dtype string with byte order of the (first) file, e.g. `>i2`).
    """
    paths = [Path(p) for p in path] if isinstance(path, (tuple, list)) else [Path(path)]
    raw, affine, disk_dtype = read_channels(paths, case_id)
    if not np.all(np.isfinite(affine)) or abs(np.linalg.det(affine[:3, :3])) < 1e-12:
        raise CaseError(
            case_id,
            f"image affine {affine[:3, :3].round(4).tolist()} (voxel to world) is singular or not finite: give the "
            "file a valid qform/sform (voxel sizes > 0)",
        )
    if raw.ndim == 3:
        raw = raw[..., np.newaxis]
    elif raw.ndim == 5 and raw.shape[3] == 1:  # some writers put channels on the 5th axis
        raw = raw[:, :, :, 0, :]
    if raw.ndim != 4:
        raise CaseError(case_id, f"image has {raw.ndim} dimensions (shape {raw.shape}); expected 3D or 4D")
    if raw.shape[-1] != num_channels:
        raise CaseError(
            case_id,
            f"image has {raw.shape[-1]} channel(s) (shape {raw.shape}) but "
            f"{num_channels} are expected (one per modality)",
        )
    # also converts big-endian to native order; C order (NIfTI data is Fortran-ordered) so that the
    # crop, normalisation and resampling downstream read memory in the order they loop
    if integers and raw.dtype.kind in "iu" and raw.dtype.itemsize <= 2:  # no scale factor: the reader kept the ints
        return raw.astype(raw.dtype.newbyteorder("="), order="C"), affine, disk_dtype
    image = raw.astype(np.float32, order="C")
    if not np.all(np.isfinite(image)):
        bad = int(np.size(image) - np.count_nonzero(np.isfinite(image)))
        raise CaseError(case_id, f"image contains {bad} NaN/Inf voxel(s)")
    return image, affine, disk_dtype
