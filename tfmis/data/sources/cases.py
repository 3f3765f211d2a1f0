"""What every dataset layout shares: a `Case` (its id, image and label files), a `SegmentationDataset` (the folder,
channel and class names, its cases), `read_dataset_json`, and `load_case`, which reads and validates one case as
it is stored on disk. The layouts: `tfmis.data.sources.msd` (Medical Segmentation Decathlon) and
`tfmis.data.sources.nnunet` (nnU-Net v2 raw), picked by `tfmis.data.sources.layouts.open_dataset`; images are read
by `tfmis.data.sources.image_io`.

Example:
```python
dataset = open_dataset("Task09_Spleen")
volume = load_case(dataset.training[0], dataset)   # image (X, Y, Z, C) float32, label (X, Y, Z) uint8
```
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from tfmis.data.sources.errors import CaseError, DatasetError, DatasetNotFound
from tfmis.data.sources.image_io import load_image, read_case_file, strip_image_suffix

CT_MODALITIES = {"CT"}


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
    """What every dataset layout gives (`tfmis.data.sources.layouts.open_dataset` picks the layout): the dataset folder
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
        raw_label, label_affine, _ = read_case_file(case.case_id, dataset.resolve(case, case.label), "label")
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
