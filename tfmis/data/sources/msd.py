"""Reading Medical Segmentation Decathlon (MSD) style datasets (what every layout shares: `tfmis.data.sources.cases`;
nnU-Net v2 raw datasets: `tfmis.data.sources.nnunet`, either picked by `tfmis.data.sources.layouts.open_dataset`).

An MSD dataset folder holds a `dataset.json` and the image files it references (NIfTI, or any format
`tfmis.data.sources.image_io` reads):

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

from pathlib import Path

from tfmis.data.sources.cases import Case, SegmentationDataset, case_id_from_path, read_dataset_json
from tfmis.data.sources.errors import DatasetError


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
