"""Reading nnU-Net v2 raw datasets (`DatasetNNN_Name/`) as they are, with no conversion to MSD first.

```
Dataset003_Liver/
  dataset.json   {"channel_names": {"0": "CT"}, "labels": {"background": 0, "liver": 1, "tumour": 2},
                  "numTraining": 131, "file_ending": ".nii.gz"}
  imagesTr/      liver_000_0000.nii.gz ...   one file per channel: <case>_<4-digit channel><file_ending>
  labelsTr/      liver_000.nii.gz ...        <case><file_ending>
  imagesTs/      (optional) liver_200_0000.nii.gz ...
```

The cases are those of the files in `imagesTr` (nnU-Net v2 has no list of them), found by nnU-Net's own rule
(`nnunetv2.utilities.utils.get_filenames_of_train_images_and_targets`): a file ending with `file_ending` is channel
`XXXX` of case `<name>` when it is named `<name>_XXXX<file_ending>`, and the case's label is
`labelsTr/<name><file_ending>`. A `dataset` key in dataset.json ({case: {"images": [...], "label": ...}}) lists the
files instead, as nnU-Net allows.

What differs from MSD's dataset.json:

* `channel_names` instead of `modality`; a channel named "CT" (any case) gets the CT normalisation, any other
  z-score, as for MSD's modalities (nnU-Net's `map_channel_name_to_normalization`; its "noNorm" and "rescale_to_0_1"
  have no tfmis counterpart and are z-scored).
* `labels` maps name → value (inverted): {"background": 0, "liver": 1}. The values must be 0..N-1.
* region labels: {"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing tumor": 3} with
  `regions_class_order` [1, 2, 3] become `regions` in tfmis's form (`validation.regions`: names made identifiers,
  {"whole_tumor": [1, 2, 3], ...}); the classes are the label values 0..max, named `label_<value>`.
* `file_ending`: the format of every image and label (`.nii.gz`, `.nii`, `.nrrd`, `.mha`, `.mhd`).

A case that breaks the layout (a channel file missing, a label without its image, files with another ending than
`file_ending`, a file without a channel index) is still listed, with its `problem`: reading it raises that problem
as its `CaseError`, so a conversion reports one line per bad case and converts the others, as for MSD.

Example:
```python
dataset = NnUNetDataset("Dataset003_Liver")      # or tfmis.data.sources.layouts.open_dataset(folder)
dataset.modalities, dataset.labels, dataset.training[0].image
# (['CT'], ['background', 'liver', 'tumour'], ('imagesTr/liver_000_0000.nii.gz',))
```
"""

from __future__ import annotations

import re
from pathlib import Path

from tfmis.data.sources.cases import Case, SegmentationDataset, read_dataset_json
from tfmis.data.sources.errors import DatasetError
from tfmis.data.sources.image_io import IMAGE_SUFFIXES, image_suffix, strip_image_suffix

CHANNEL_INDEX = re.compile(r"(.+)_(\d{4})")


def is_nnunet_v2(meta: dict) -> bool:
    """Whether a dataset.json is nnU-Net v2's (it has `channel_names` or `file_ending`) rather than MSD's."""
    return "channel_names" in meta or "file_ending" in meta


class NnUNetDataset(SegmentationDataset):
    """The dataset.json and files of an nnU-Net v2 raw dataset folder, as `SegmentationDataset`.

    Args:
        root: the dataset folder (holding dataset.json, imagesTr, labelsTr).
        meta: its parsed dataset.json (read when None).

    Raises:
        DatasetError: dataset.json lacks or mis-declares `channel_names`, `labels`, `file_ending`,
            `regions_class_order`; or imagesTr holds no case (one line naming the key or folder and the fix).
    """

    layout = "nnunetv2"

    def __init__(self, root: str | Path, meta: dict | None = None):
        self.root = Path(root).resolve()
        self.meta = read_dataset_json(self.root) if meta is None else meta
        path = self.root / "dataset.json"
        self.name = str(self.meta.get("name", self.root.name))
        self.description = str(self.meta.get("description", ""))
        self.modalities = _channel_names(self.meta, path)
        self.file_ending = _file_ending(self.meta, path)
        self.labels, self.regions = _labels(self.meta, path)
        if isinstance(self.meta.get("dataset"), dict):
            self.training = _listed_cases(self.meta["dataset"], self.root, path)
        else:
            self.training = self._discover("imagesTr", "labelsTr")
        self.test = self._discover("imagesTs", None) if (self.root / "imagesTs").is_dir() else []
        if not self.training:
            raise DatasetError(
                f"{self.root / 'imagesTr'}: no case found (files named <case>_0000{self.file_ending}, as "
                "dataset.json's file_ending says): add the images or fix file_ending"
            )

    def _discover(self, image_dir: str, label_dir: str | None) -> list[Case]:
        """The cases of `image_dir` by nnU-Net's naming rule, each with its label in `label_dir` (when given);
        a case breaking the rule carries its `problem`."""
        ending, n = self.file_ending, self.num_channels
        channels: dict[str, dict[int, str]] = {}
        strays: dict[str, str] = {}  # case id -> why its files are not usable
        for name in _image_files(self.root / image_dir):
            match = CHANNEL_INDEX.fullmatch(name[: -len(ending)]) if name.endswith(ending) else None
            if match:
                channels.setdefault(match[1], {})[int(match[2])] = name
                continue
            stem = strip_image_suffix(name)
            indexed = CHANNEL_INDEX.fullmatch(stem)
            case_id = indexed[1] if indexed else stem
            if not name.endswith(ending):
                strays.setdefault(
                    case_id,
                    f"{image_dir}/{name} ends with {image_suffix(name)}, not dataset.json's file_ending {ending!r}: "
                    f"convert it to {ending} or fix file_ending",
                )
            else:
                strays.setdefault(
                    case_id,
                    f"{image_dir}/{name} has no 4-digit channel index: name it {case_id}_0000{ending} (one file per "
                    "channel)",
                )
        labels = {}
        if label_dir is not None:
            labels = {strip_image_suffix(name): name for name in _image_files(self.root / label_dir)}
        cases = []
        for case_id in sorted(set(channels) | set(strays) | set(labels)):
            files = tuple(f"{image_dir}/{case_id}_{c:04d}{ending}" for c in range(n))
            label = None if label_dir is None else f"{label_dir}/{case_id}{ending}"
            problem = None
            if case_id in channels:
                problem = self._channel_problem(case_id, channels[case_id], image_dir)
            elif case_id in strays:
                problem = strays[case_id]
            else:
                problem = (
                    f"label {label_dir}/{labels[case_id]} has no image {files[0]}: add the image (one file per "
                    "channel) or remove the label"
                )
            if problem is None and label is not None and labels.get(case_id) != Path(label).name:
                problem = f"label {label} does not exist" + (
                    f" ({label_dir}/{labels[case_id]} has another ending than file_ending {ending!r}: convert it)"
                    if case_id in labels
                    else f": add {label_dir}/{case_id}{ending}"
                )
            cases.append(Case(case_id, files, label, problem))
        return cases

    def _channel_problem(self, case_id: str, found: dict[int, str], image_dir: str) -> str | None:
        n = self.num_channels
        missing = [c for c in range(n) if c not in found]
        if missing:
            c = missing[0]
            return (
                f"channel {c} ({self.modalities[c]}) file {image_dir}/{case_id}_{c:04d}{self.file_ending} is "
                f"missing: dataset.json's channel_names declares {n} channel(s), one file each"
            )
        extra = sorted(c for c in found if c >= n)
        if extra:
            return (
                f"{image_dir}/{found[extra[0]]} is channel {extra[0]}, but dataset.json's channel_names declares "
                f"{n} channel(s) (0..{n - 1}): add the channel to channel_names or remove the file"
            )
        return None


def _image_files(folder: Path) -> list[str]:
    """The image files in `folder` (any suffix tfmis reads; no macOS `._*` files), sorted; [] without it."""
    if not folder.is_dir():
        return []
    return sorted(
        p.name for p in folder.iterdir() if image_suffix(p.name) and not p.name.startswith("._") and p.is_file()
    )


def _channel_names(meta: dict, path: Path) -> list[str]:
    entry = meta.get("channel_names", meta.get("modality"))
    if not isinstance(entry, dict) or not entry:
        raise DatasetError(f'{path}: key "channel_names" must be a non-empty object like {{"0": "CT"}}')
    try:
        indexed = {int(k): str(v) for k, v in entry.items()}
    except ValueError as e:
        raise DatasetError(f"{path}: key 'channel_names' has a non-integer index ({e})") from e
    if sorted(indexed) != list(range(len(indexed))):
        raise DatasetError(f"{path}: key 'channel_names' must use indices 0..{len(indexed) - 1}, got {sorted(indexed)}")
    return [indexed[i] for i in range(len(indexed))]


def _file_ending(meta: dict, path: Path) -> str:
    ending = meta.get("file_ending")
    if ending not in IMAGE_SUFFIXES:
        raise DatasetError(
            f"{path}: key 'file_ending' must be one of {', '.join(IMAGE_SUFFIXES)} (the format of every image and "
            f"label), got {ending!r}"
        )
    return ending


def _labels(meta: dict, path: Path) -> tuple[list[str], dict[str, list[int]] | None]:
    """(class names indexed by value, regions or None) from nnU-Net's `labels` (name → value or [values])."""
    entry = meta.get("labels")
    if not isinstance(entry, dict) or not entry:
        raise DatasetError(f'{path}: key "labels" must be a non-empty object like {{"background": 0, "liver": 1}}')
    if "ignore" in entry:
        raise DatasetError(
            f"{path}: labels declares an 'ignore' label, which tfmis does not train with: relabel those voxels "
            "and remove it"
        )
    values = {}
    for name, value in entry.items():
        members = value if isinstance(value, list) else [value]
        if not members or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in members):
            raise DatasetError(
                f"{path}: labels[{name!r}] must be a label value >= 0 or a list of them (a region), got {value!r}"
            )
        values[name] = members
    if values.get("background") != [0] and [0] not in values.values():
        raise DatasetError(f'{path}: labels must declare the background as 0, e.g. {{"background": 0, ...}}')
    if not any(isinstance(v, list) for v in entry.values()) and "regions_class_order" not in meta:
        by_value = {v[0]: name for name, v in values.items()}
        if sorted(by_value) != list(range(len(values))):
            raise DatasetError(
                f"{path}: labels must give the values 0..{len(values) - 1}, each once, got {sorted(by_value)}"
            )
        return [by_value[v] for v in range(len(values))], None
    return _regions(meta, values, path)


def _regions(meta: dict, values: dict[str, list[int]], path: Path) -> tuple[list[str], dict[str, list[int]]]:
    """Region labels as tfmis's `validation.regions`, checked against `regions_class_order`."""
    regions: dict[str, list[int]] = {}
    for name, members in values.items():
        if members == [0]:
            continue
        key = re.sub(r"\W+", "_", name.strip()).strip("_") or "region"
        key = key if key[0].isalpha() else f"region_{key}"
        regions[key] = sorted(set(members))
    paint = []
    for i, key in enumerate(regions):  # the one label each region adds to the regions after it
        own = sorted(set(regions[key]) - {v for later in list(regions.values())[i + 1 :] for v in later})
        paint.append(own[0] if len(own) == 1 else None)
    order = meta.get("regions_class_order")
    if order != paint:
        raise DatasetError(
            f"{path}: regions_class_order must list, for each region of labels in order, the one label it adds to "
            f"the regions after it (tfmis paints region outputs that way), expected {paint}, got {order!r}: list the "
            "regions from largest to smallest, each adding exactly one label"
        )
    top = max(v for members in regions.values() for v in members)
    # label v of the painted map is the region that paints it, named as dataset.json names it
    names = {v: name.strip() for (name, members), v in zip(((n, m) for n, m in values.items() if m != [0]), paint)}
    return ["background"] + [names.get(v) or f"label_{v}" for v in range(1, top + 1)], regions


def _listed_cases(entries: dict, root: Path, path: Path) -> list[Case]:
    """The cases of dataset.json's `dataset` key ({case: {"images": [...], "label": "..."}})."""
    cases = []
    for case_id, entry in entries.items():
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("images"), list)
            or not all(isinstance(p, str) for p in entry["images"])
            or not isinstance(entry.get("label"), str)
        ):
            raise DatasetError(f'{path}: dataset[{case_id!r}] must be {{"images": ["..."], "label": "..."}}')
        cases.append(Case(str(case_id), tuple(entry["images"]), entry["label"]))
    return cases
