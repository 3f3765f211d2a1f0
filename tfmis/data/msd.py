"""Reading Medical Segmentation Decathlon (MSD) style datasets, and what every dataset layout shares (`Case`,
`SegmentationDataset`, `load_case`; nnU-Net v2 raw datasets: `tfmis.data.nnunet`, either picked by
`tfmis.data.datasets.open_dataset`).

An MSD dataset folder holds a `dataset.json` and the image files it references (NIfTI, or any format
`tfmis.data.image_io` reads):

```
Task09_Spleen/
  dataset.json          {"modality": {"0": "CT"}, "labels": {"0": "background", "1": "spleen"},
                         "training": [{"image": "./imagesTr/spleen_2.nii.gz",
                                       "label": "./labelsTr/spleen_2.nii.gz"}, ...],
                         "test": ["./imagesTs/spleen_1.nii.gz", ...]}
  imagesTr/ labelsTr/ imagesTs/
```

Only files referenced by `dataset.json` are ever opened: the real MSD tarballs carry macOS `._*`
files next to the images, and a path that leads outside the dataset folder (`..`, an absolute path) is
refused. The check is lexical: `imagesTr` or `labelsTr` as symlinks to another disk (a common cluster
layout) are inside the folder.

Example:
```python
dataset = MSDDataset("Task09_Spleen")
case = dataset.training[0]
volume = load_case(case, dataset)   # image (X, Y, Z, C) float32, label (X, Y, Z) uint8
```
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from tfmis.data.image_io import UnreadableImage, read_image, strip_image_suffix
from tfmis.errors import DataError, UsageError

CT_MODALITIES = {"CT"}


class DatasetError(DataError):
    """The dataset as a whole is unusable (dataset.json missing or malformed)."""


class DatasetNotFound(UsageError, DatasetError):
    """The folder given as a dataset holds no dataset.json: the argument or `data.source_dir` needs fixing
    (exit 2, as any usage error; still a DatasetError for library callers)."""


class CaseError(DataError):
    """One case is unusable; the message says why. Conversion records it and goes on."""

    def __init__(self, case_id: str, reason: str):
        super().__init__(f"case {case_id}: {reason}")
        self.case_id = case_id
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Case:
    """One case of a dataset.

    Args:
        case_id: file name of the image without its suffix (e.g. `spleen_2`); nnU-Net's case identifier.
        image: path of the image relative to the dataset folder (one file holding every channel: MSD), or the
            paths of its channel files in channel order (nnU-Net v2's `<case>_0000.nii.gz`, `<case>_0001...`).
        label: path of the label, or None for unlabelled (test) cases.
        problem: why the case cannot be used, found while listing the dataset (a channel file missing, a label
            without its image...); `load_case` raises it as the case's `CaseError`.
    """

    case_id: str
    image: str | tuple[str, ...]
    label: str | None = None
    problem: str | None = None

    @property
    def image_files(self) -> tuple[str, ...]:
        """The image's file(s), in channel order."""
        return (self.image,) if isinstance(self.image, str) else tuple(self.image)


def case_id_from_path(path: str) -> str:
    """The file name without its folder and image suffix (`.nii.gz`, `.nii`, `.nrrd`, `.mha`, `.mhd`)."""
    return strip_image_suffix(path)


class SegmentationDataset:
    """What every dataset layout gives (`tfmis.data.datasets.open_dataset` picks the layout): the dataset folder
    `root`, `name`, `description`, `modalities` (channel names, index = channel), `labels` (class names, index =
    label value), `regions` (nnU-Net region labels as `validation.regions`, {name: [labels]}, or None), the
    `training` cases (with labels) and the `test` cases, `layout` ("msd" or "nnunetv2")."""

    layout = ""
    regions: dict[str, list[int]] | None = None

    root: Path
    name: str
    modalities: list
    labels: list
    training: list[Case]
    test: list[Case]

    @property
    def num_channels(self) -> int:
        return len(self.modalities)

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    @property
    def is_ct(self) -> bool:
        return any(str(m).upper() in CT_MODALITIES for m in self.modalities)

    def resolve(self, case: Case, relpath: str) -> Path:
        """The absolute path of a file of `case`; refuses paths that leave the dataset folder.

        The containment check is lexical (`..` and `.` normalised, symlinks not followed): `imagesTr` as a
        symlink to another disk stays inside the folder, `../other/x.nii.gz` or an absolute path elsewhere
        does not.
        """
        path = Path(os.path.normpath(self.root / relpath))
        if path != self.root and self.root not in path.parents:
            raise CaseError(case.case_id, f"path {relpath!r} leads outside the dataset folder {self.root}")
        return path

    def resolve_image(self, case: Case) -> str | tuple[str, ...]:
        """The absolute path of the case's image (a tuple of its channel files when it has several)."""
        paths = tuple(str(self.resolve(case, p)) for p in case.image_files)
        return paths[0] if isinstance(case.image, str) else paths

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.name!r}, modalities={self.modalities}, labels={self.labels}, "
            f"training={len(self.training)}, test={len(self.test)})"
        )


class MSDDataset(SegmentationDataset):
    """The parsed `dataset.json` of an MSD-style dataset folder.

    Args:
        root: the dataset folder (the one holding dataset.json).

    Attributes:
        name, description, modalities (list of names, index = channel), labels (list of names,
        index = label value), training (list of `Case` with labels), test (list of `Case`).
    """

    layout = "msd"

    def __init__(self, root: str | Path, meta: dict | None = None):
        self.root = Path(root).resolve()
        path = self.root / "dataset.json"
        meta = read_dataset_json(self.root) if meta is None else meta
        self.meta = meta
        self.name = str(meta.get("name", self.root.name))
        self.description = str(meta.get("description", ""))
        self.modalities = _indexed_names(meta, "modality", path)
        self.labels = _indexed_names(meta, "labels", path)
        if self.labels[0] is None:
            raise DatasetError(f"{path}: key 'labels' must declare label 0 (background)")
        self.training = [_training_case(entry, i, path) for i, entry in enumerate(meta.get("training", []))]
        self.test = [_test_case(entry, i, path) for i, entry in enumerate(meta.get("test", []))]
        ids = [c.case_id for c in self.training]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise DatasetError(f"{path}: 'training' lists case ids more than once: {duplicates}")
        if not self.training:
            raise DatasetError(f"{path}: key 'training' lists no cases")


def read_dataset_json(root: Path) -> dict:
    """The parsed `dataset.json` of the folder `root`.

    Raises:
        DatasetNotFound: there is none (exit 2: the argument needs fixing).
        DatasetError: it is not a JSON object.
    """
    path = Path(root) / "dataset.json"
    if not path.is_file():
        raise DatasetNotFound(f"{path}: not found; a dataset folder (MSD or nnU-Net v2 raw) must contain dataset.json")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(meta, dict):
        raise DatasetError(f"{path}: top level must be an object")
    return meta


def _indexed_names(meta: dict, key: str, path: Path) -> list:
    """`{"0": "T1", "1": "T2"}` → `["T1", "T2"]`; keys must be 0..N-1."""
    entry = meta.get(key)
    if not isinstance(entry, dict) or not entry:
        raise DatasetError(f'{path}: key {key!r} must be a non-empty object like {{"0": "name"}}')
    try:
        indexed = {int(k): str(v) for k, v in entry.items()}
    except ValueError as e:
        raise DatasetError(f"{path}: key {key!r} has a non-integer index ({e})") from e
    if sorted(indexed) != list(range(len(indexed))):
        raise DatasetError(f"{path}: key {key!r} must use indices 0..{len(indexed) - 1}, got {sorted(indexed)}")
    return [indexed[i] for i in range(len(indexed))]


def _training_case(entry, i: int, path: Path) -> Case:
    if (
        not isinstance(entry, dict)
        or not isinstance(entry.get("image"), str)
        or not isinstance(entry.get("label"), str)
    ):
        raise DatasetError(f'{path}: training[{i}] must be {{"image": "...", "label": "..."}}, got {entry!r}')
    return Case(case_id_from_path(entry["image"]), entry["image"], entry["label"])


def _test_case(entry, i: int, path: Path) -> Case:
    image = entry.get("image") if isinstance(entry, dict) else entry
    if not isinstance(image, str):
        raise DatasetError(f"{path}: test[{i}] must be a path string, got {entry!r}")
    return Case(case_id_from_path(image), image)


@dataclasses.dataclass
class LoadedCase:
    """A case as stored on disk, before any preprocessing.

    Attributes:
        image: float32 array (X, Y, Z, C) in the file's voxel order (native byte order).
        label: uint8 array (X, Y, Z) or None.
        affine: the image's 4x4 voxel-to-world (RAS mm) affine.
        header_dtype: the image's on-disk dtype, byte order included (e.g. `>i2`).
    """

    case_id: str
    image: np.ndarray
    label: np.ndarray | None
    affine: np.ndarray
    header_dtype: str


def _read_file(case_id: str, path: Path, what: str) -> tuple[np.ndarray, np.ndarray, str]:
    """(array, affine, on-disk dtype) of one file of a case (`tfmis.data.image_io.read_image`); `CaseError`."""
    if not path.is_file():
        raise CaseError(case_id, f"{what} file {path} does not exist")
    try:
        image = read_image(path)
    except UnreadableImage as e:
        raise CaseError(case_id, f"{what} file {e}") from e
    return image.array, image.affine, image.disk_dtype


def _read_channels(paths: list[Path], case_id: str) -> tuple[np.ndarray, np.ndarray, str]:
    """The channel files of one image (nnU-Net v2: one 3D file each) stacked on a last axis; they must share
    shape and affine. One file is returned as it is (3D, or 4D with channels last)."""
    if len(paths) == 1:
        return _read_file(case_id, paths[0], "image")
    arrays, affine, disk_dtype = [], None, None
    for c, path in enumerate(paths):
        raw, file_affine, file_dtype = _read_file(case_id, path, f"channel {c} image")
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
    3D file each, sharing shape and affine), in any format `tfmis.data.image_io` reads.

    With `integers`, an image stored as integers of up to 16 bits without a scale factor (a CT's int16) keeps
    that type: every value is exact in float32, `preprocess` turns slabs of it into float32 as it goes, and a
    512x512x600 CT then takes 300 MB instead of 600 MB.

    Returns:
        (image, 4x4 RAS affine, on-disk dtype string with byte order of the (first) file, e.g. `>i2`).
    """
    paths = [Path(p) for p in path] if isinstance(path, (tuple, list)) else [Path(path)]
    raw, affine, disk_dtype = _read_channels(paths, case_id)
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


def load_case(case: Case, dataset: SegmentationDataset, affine_tolerance: float = 1e-3) -> LoadedCase:
    """Reads and validates one case. Raises `CaseError` naming the case and what is wrong.

    Checks: the case had no problem when the dataset was listed (`Case.problem`); files exist and decode; channel
    count matches `modality`; no NaN/Inf in the image; label spatial shape and affine match the image; label values
    are integers declared in `labels`.
    """
    if case.problem:
        raise CaseError(case.case_id, case.problem)
    paths = [dataset.resolve(case, p) for p in case.image_files]
    image, affine, disk_dtype = load_image(paths, dataset.num_channels, case.case_id)
    label = None
    if case.label is not None:
        raw_label, label_affine, _ = _read_file(case.case_id, dataset.resolve(case, case.label), "label")
        if raw_label.ndim == 4 and raw_label.shape[3] == 1:
            raw_label = raw_label[..., 0]
        if raw_label.shape != image.shape[:3]:
            raise CaseError(case.case_id, f"label shape {raw_label.shape} does not match image shape {image.shape[:3]}")
        if not np.allclose(label_affine, affine, atol=affine_tolerance, rtol=0):
            raise CaseError(
                case.case_id,
                "label affine does not match image affine (max difference "
                f"{np.abs(label_affine - affine).max():.4g}):\nimage={affine.round(4).tolist()}\n"
                f"label={label_affine.round(4).tolist()}",
            )
        label = _validate_label(case, np.asarray(raw_label), dataset.num_classes)
    return LoadedCase(case.case_id, image, label, affine, disk_dtype)


def _validate_label(case: Case, raw: np.ndarray, num_classes: int) -> np.ndarray:
    values = np.unique(raw)
    if not np.all(np.isfinite(values)) or not np.all(values == np.round(values)):
        raise CaseError(
            case.case_id, f"label contains non-integer values, e.g. {values[values != np.round(values)][:5]}"
        )
    undeclared = [int(v) for v in values if v < 0 or v >= num_classes]
    if undeclared:
        raise CaseError(
            case.case_id,
            f"label contains value(s) {undeclared} not declared in dataset.json 'labels' "
            f"(declared: 0..{num_classes - 1})",
        )
    return raw.astype(np.uint8, order="C")
