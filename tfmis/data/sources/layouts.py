"""A dataset folder opened in its own layout, told apart by what its `dataset.json` holds (no flag): an nnU-Net v2
raw dataset (`channel_names`, `file_ending`: `tfmis.data.sources.nnunet.NnUNetDataset`) or a Medical Segmentation
Decathlon one (`modality`, `training`: `tfmis.data.sources.msd.MSDDataset`). Both give the same `SegmentationDataset`:
cases, channel names, class names, regions.

Example:
```python
dataset = open_dataset("Dataset003_Liver")   # or "Task03_Liver"
dataset.layout, dataset.modalities, len(dataset.training)
```
"""

from __future__ import annotations

from pathlib import Path

from tfmis.data.sources.cases import SegmentationDataset, read_dataset_json
from tfmis.data.sources.msd import MSDDataset
from tfmis.data.sources.nnunet import NnUNetDataset, is_nnunet_v2


def open_dataset(root: str | Path) -> SegmentationDataset:
    """The dataset in folder `root` (the one holding dataset.json), read in the layout its dataset.json declares.

    Raises:
        DatasetNotFound: `root` holds no dataset.json (exit 2).
        DatasetError: dataset.json is unusable (one line naming the key and the fix).
    """
    meta = read_dataset_json(Path(root).resolve())
    if is_nnunet_v2(meta):
        return NnUNetDataset(root, meta)
    return MSDDataset(root, meta)
