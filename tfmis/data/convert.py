"""MSD folder → preprocessed TFRecord shards + index.json + fingerprint.json.

The conversion is planned up front (seeded split, or K folds stratified by the classes each case holds or read
from a splits_final.json; shards per split), then cases are
preprocessed in parallel worker processes (numpy/scipy/nibabel only) and written by the main
process, shard by shard, in plan order. Each shard is written under a temporary name and renamed
when complete, and a small progress file records what it holds; a rerun with the same parameters
skips finished shards, a rerun with other parameters is refused (or rebuilt with `overwrite`).

Bad cases never stop the others: each is recorded in `index.json` under `skipped` with its reason.

Example:
```python
report = convert(ConversionConfig(source_dir="Task09_Spleen", target_dir="spleen_tfr",
                                  spacing=(1.5, 1.5, 2.0), ct_window=(-57, 164)))
print(report["skipped"])
```
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import hashlib
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Literal

import nibabel as nib
import numpy as np

from tfmis.data import fingerprint as fp
from tfmis.data.msd import CT_MODALITIES, Case, CaseError, DatasetError, MSDDataset, load_case
from tfmis.data.preprocess import PreprocessConfig, preprocess, ras_spacing
from tfmis.data.records import (
    COMPRESSIONS,
    FINGERPRINT_FILE,
    INDEX_FILE,
    SCHEMA_VERSION,
    encode_example,
    fold_name,
    framed_size,
    shard_name,
)
from tfmis.errors import ConfigError, DataError, MissingInput, RunStateError
from tfmis.hardware import case_workers
from tfmis.utils.io import atomic_path, atomic_write_json, parse_temp_name
from tfmis.utils.lock import folder_lock
from tfmis.utils.parallel import map_ordered

PLAN_FILE = "conversion.json"
PROGRESS_DIR = ".progress"
SPLITS_FILE = "splits_final.json"  # a fold conversion's folds, in nnU-Net v2's format
EXIT_SKIPPED = 3  # conversion finished, but some cases were skipped


class ParametersChanged(RunStateError):
    """The target folder holds a conversion made with other parameters."""


class NothingConverted(DatasetError):
    """Every case was skipped: no record was written (the outputs are removed so a rerun starts afresh)."""


DEFAULT_SPLIT = (0.7, 0.15, 0.15)


def _option(
    default, help: str, flag: str | None = None, lengths: tuple[int, ...] | None = None, group: str | None = None
):
    """A conversion option: its default and how `tfmis-convert` offers it (help, flag, value count)."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "lengths": lengths, "group": group})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConversionOptions:
    """How a dataset is converted: the one definition behind the `data.conversion` config section, the
    `tfmis-convert` flags and `ConversionConfig`.

    Args:
        split: fractions for train/val/test (1 to 3 values); the default 0.7,0.15,0.15 unless `folds` is set.
        folds: K for K-fold splits `fold0..fold{K-1}` instead of `split`, stratified by the classes each case
            holds (`assign_splits`).
        spacing: target spacing (mm, RAS order); None = the dataset's median spacing.
        reshape: fixed output shape instead of resampling to a spacing.
        shards: shards per split (at most one per case).
        compression: GZIP, ZLIB or NONE.
        workers: parallel preprocessing processes (1 = in this process; None = `hardware.case_workers()`: the
            usable CPUs, at most 8).
        seed: seed of the split.
        image_dtype: float16 or float32.
        ct_window: (low, high) HU window for CT channels; None = the 0.5/99.5 percentiles of the
            labelled foreground, measured in a first pass (as nnU-Net does).
        ct_normalization: CT channels after clipping to `ct_window`: "scale" to [0, 1], or "zscore": minus
            the mean, over the standard deviation, of the labelled foreground intensities of all training
            cases (nnU-Net's CTNormalization; measured in the same first pass).
        crop_foreground, crop_margin: crop to the non-background bounding box (+ margin voxels).
        crop_to_label_mm: crop to the labelled voxels' box + this many mm instead (a cascade's fine stage).
    """

    split: tuple[float, ...] | None = _option(
        None,
        "fractions of the labelled cases for train,val,test (default 0.7,0.15,0.15); normalised to sum 1",
        lengths=(1, 2, 3),
        group="split",
    )
    folds: int | None = _option(
        None, "K: write K folds (splits fold0..foldK-1) instead of train/val/test", group="split"
    )
    spacing: tuple[float, float, float] | None = _option(
        None,
        "target voxel spacing in mm along R,A,S, e.g. 1.5,1.5,2.0 (default: the dataset's median spacing)",
        group="grid",
    )
    reshape: tuple[int, int, int] | None = _option(
        None, "fixed output shape X,Y,Z after cropping, e.g. 120,120,96 (instead of resampling)", group="grid"
    )
    shards: int = _option(4, "shards per split (at most one per case; default 4)")
    compression: Literal["GZIP", "ZLIB", "NONE"] = _option("GZIP", "TFRecord compression (default GZIP)")
    workers: int | None = _option(
        None, "parallel preprocessing processes (default: the usable CPUs, at most 8; 1 = no subprocess)"
    )
    seed: int = _option(0, "seed of the split (default 0)")
    image_dtype: Literal["float16", "float32"] = _option(
        "float16", "storage dtype of the normalised images (default float16, half the bytes)"
    )
    ct_window: tuple[float, float] | None = _option(
        None,
        "LOW,HIGH Hounsfield window for CT channels, e.g. -57,164 (default: 0.5/99.5 percentiles of the "
        "labelled foreground)",
    )
    ct_normalization: Literal["scale", "zscore"] = _option(
        "scale",
        "CT channels after clipping to the window: scale to [0, 1] (default) or zscore with the mean and "
        "std of the labelled foreground over the training cases (nnU-Net)",
    )
    crop_foreground: bool = _option(True, "do not crop to the foreground bounding box", flag="--no-crop")
    crop_margin: int = _option(0, "voxels kept around the foreground box (default 0)")
    crop_to_label_mm: float | None = _option(
        None,
        "crop each case to its labelled voxels' box grown by MM millimetres instead of the foreground box (the "
        "region a cascade's fine stage sees; cases without labelled voxels keep the foreground crop)",
    )

    def __post_init__(self):
        if self.split is not None and self.folds is not None:
            raise ConfigError(f"set only one of split {list(self.split)} and folds {self.folds}")
        if self.split is None and self.folds is None:
            object.__setattr__(self, "split", DEFAULT_SPLIT)
        for name in ("split", "spacing", "reshape", "ct_window"):  # YAML and JSON give lists
            value = getattr(self, name)
            object.__setattr__(self, name, tuple(value) if value is not None else None)
        if self.split is not None:
            if not 1 <= len(self.split) <= 3 or min(self.split) < 0 or sum(self.split) <= 0:
                raise ConfigError(f"split must be 1 to 3 non-negative fractions (train,val,test), got {self.split}")
        if self.folds is not None and self.folds < 2:
            raise ConfigError(f"folds must be at least 2, got {self.folds}")
        if self.ct_normalization not in ("scale", "zscore"):
            raise ConfigError(f"ct_normalization must be scale or zscore, got {self.ct_normalization!r}")
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"compression must be one of {sorted(COMPRESSIONS)}, got {self.compression!r}")
        if self.shards < 1 or (self.workers is not None and self.workers < 1):
            raise ConfigError("shards and workers must be at least 1")
        if self.crop_margin < 0:
            raise ConfigError(f"crop_margin must be >= 0, got {self.crop_margin}")
        if self.crop_to_label_mm is not None and self.crop_to_label_mm < 0:
            raise ConfigError(f"crop_to_label_mm must be >= 0 mm (or null), got {self.crop_to_label_mm}")

    @property
    def num_workers(self) -> int:
        return self.workers or case_workers()


@dataclasses.dataclass(frozen=True)
class ConversionConfig(ConversionOptions):
    """What `convert` does: the options plus where from and to. See `tfmis-convert --help`.

    Args:
        source_dir: MSD dataset folder (with dataset.json).
        target_dir: output folder for shards, index.json and fingerprint.json.
        overwrite: rebuild when the target holds a conversion with other parameters.
        progress: show a progress bar.
        splits_file: a splits_final.json (nnU-Net v2's format, `read_splits_file`) whose val lists are the folds;
            sets `folds` to its number of folds. Its content, not its path, is a parameter of the conversion.
        **options: the `ConversionOptions`.
    """

    source_dir: str
    target_dir: str
    overwrite: bool = False
    progress: bool = True
    splits_file: str | None = None

    def __post_init__(self):
        if self.splits_file is not None:
            if self.split is not None:
                raise ConfigError(f"set only one of split {list(self.split)} and splits_file {self.splits_file}")
            folds = len(read_splits_file(self.splits_file))
            if self.folds is not None and self.folds != folds:
                raise ConfigError(
                    f"folds is {self.folds} but splits_file {self.splits_file} holds {folds} folds: leave folds "
                    "unset (the file sets it)"
                )
            object.__setattr__(self, "folds", folds)
        super().__post_init__()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ConversionConfig:
        """From `build_parser()`'s arguments."""
        options = {f.name: getattr(args, f.name) for f in dataclasses.fields(ConversionOptions)}
        return cls(
            source_dir=args.source_dir,
            target_dir=args.target_dir,
            overwrite=args.overwrite,
            progress=not args.quiet,
            splits_file=args.splits_file,
            **options,
        )

    def requested(self, dataset_json_sha256: str, splits_sha256: str | None = None) -> dict:
        """The parameters that decide the output (not workers/progress/overwrite, nor where a splits file is).

        Args:
            splits_sha256: `splits_sha256` of the splits file's folds, when folds come from one.
        """
        keep = {f.name for f in dataclasses.fields(ConversionOptions)} - {"workers"}
        d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items() if k in keep}
        d["dataset_json_sha256"] = dataset_json_sha256
        d["schema_version"] = SCHEMA_VERSION
        if self.folds is not None:  # how the folds were made (absent for fractions: older conversions stay valid)
            d["fold_assignment"] = "splits_file" if splits_sha256 else "stratified"
            if splits_sha256:
                d["splits_file_sha256"] = splits_sha256
        return d


def assign_splits(
    case_ids: list[str], split, folds, seed: int, case_classes: dict[str, set[int]] | None = None
) -> dict[str, list[str]]:
    """Seeded assignment of cases to `train/val/test` fractions or to `fold0..foldK-1` (`stratified_folds`).

    Args:
        case_ids: the cases to assign.
        split: fractions for train/val/test (with `folds` None).
        folds: K, or None for `split`.
        seed: seeds the order (the same arguments always give the same assignment).
        case_classes: with `folds`: case id -> the foreground labels its label map holds (missing = none).
    """
    rng = np.random.default_rng(seed)
    order = [case_ids[i] for i in rng.permutation(len(case_ids))]
    if folds is not None:
        return stratified_folds(order, folds, case_classes or {}, rng)
    names = ("train", "val", "test")[: len(split)]
    fractions = np.array(split, dtype=float) / sum(split)
    exact = fractions * len(order)
    counts = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - counts), kind="stable")[: len(order) - counts.sum()]:
        counts[i] += 1  # largest remainders get the leftover cases
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return {name: order[bounds[i] : bounds[i + 1]] for i, name in enumerate(names)}


def stratified_folds(
    order: list[str], folds: int, case_classes: dict[str, set[int]], rng: np.random.Generator
) -> dict[str, list[str]]:
    """K folds of equal size (differing by at most one case), stratified by the classes the cases hold.

    Only classes held by at least 2 cases count (a class of one case is missing from its fold's training part
    whatever the split). The cases are taken rarest class first (a case's key: how many cases hold its rarest class,
    then its next rarest, ...; at an equal start, more classes first; cases without such classes last; `order`, a
    seeded shuffle, among equal keys). Each goes to the fold with room whose validation part holds the fewest cases
    of its classes (its rarest class first), then the smallest fold, then a seeded draw. Then, while a class has
    all its cases in one fold, a case of it is swapped with one of another fold where that leaves fewer such
    classes. So the rare classes are spread over the validation folds and every fold's training part sees every
    class of at least 2 cases wherever equal fold sizes allow it (and the swaps find it). Each fold's cases are
    returned sorted.
    """
    if not 2 <= folds <= len(order):
        raise DataError(f"{folds} folds need at least {folds} cases (one per fold), and there are {len(order)}")
    holders = collections.Counter(int(c) for case in order for c in set(case_classes.get(case, ())))
    present = {case: sorted({int(c) for c in case_classes.get(case, ()) if holders[int(c)] >= 2}) for case in order}
    rarity = {case: sorted(present[case], key=lambda c: (holders[c], c)) for case in order}
    last = (float("inf"), float("inf"))  # ends each key: of two keys alike so far, the case of more classes first
    keys = {case: (not present[case], [(holders[c], c) for c in rarity[case]] + [last]) for case in order}
    ranked = sorted(order, key=keys.__getitem__)  # stable: the seeded order among equal keys
    low, extra = divmod(len(order), folds)  # sizes: `extra` folds of low + 1 cases, the others of low
    val: list[list[str]] = [[] for _ in range(folds)]
    counts = [collections.Counter() for _ in range(folds)]  # fold -> class -> its cases in the fold
    for case in ranked:
        full = sum(len(v) > low for v in val)
        room = [k for k in range(folds) if len(val[k]) < low or (len(val[k]) == low and full < extra)]
        score = {k: ([counts[k][c] for c in rarity[case]], len(val[k])) for k in room}
        best = min(score.values())
        tied = [k for k in room if score[k] == best]
        k = tied[int(rng.integers(len(tied)))]
        val[k].append(case)
        counts[k].update(present[case])
    _spread_lone_classes(val, counts, present)
    return {fold_name(k): sorted(cases) for k, cases in enumerate(val)}


def _spread_lone_classes(val: list[list[str]], counts: list[collections.Counter], present: dict) -> None:
    """Swaps cases between folds (sizes kept) while a swap lowers the number of lone classes, those whose cases all
    share one fold (whose training part then lacks them): the first such swap in fold and case order, so the result
    is deterministic. Each swap lowers the number, so this ends."""

    def homes(c: int) -> int:
        return sum(1 for fold in counts if fold[c] > 0)

    def move(case: str, source: int, target: int) -> None:
        val[source].remove(case)
        val[target].append(case)
        counts[source].subtract(present[case])
        counts[target].update(present[case])

    def improving_swap() -> bool:
        lone = sorted({c for fold in counts for c, n in fold.items() if n > 0 and homes(c) == 1})
        for c in lone:
            k = next(i for i, fold in enumerate(counts) if fold[c] > 0)
            for case in [case for case in val[k] if c in present[case]]:
                for j in range(len(val)):
                    for other in list(val[j]) if j != k else []:
                        affected = set(present[case]) | set(present[other])
                        before = sum(homes(a) == 1 for a in affected)
                        move(case, k, j)
                        move(other, j, k)
                        if sum(homes(a) == 1 for a in affected) < before:
                            return True
                        move(other, k, j)  # undo
                        move(case, j, k)
        return False

    while improving_swap():
        pass


def read_splits_file(path: str | Path) -> list[dict[str, list[str]]]:
    """The folds of a splits_final.json in nnU-Net v2's format: a list of K >= 2 `{"train": [case ids], "val":
    [case ids]}`. Checked: the val lists are disjoint and not empty, and each fold's train list is exactly the
    other folds' val cases (as nnU-Net's generated splits are). Case ids are the image file names without
    `.nii.gz` (`hippocampus_001`), in tfmis (`Case.case_id`) and in nnU-Net alike.

    Raises:
        ValueError: one line naming the file (missing, not JSON, not this format), and the fold and case at fault.
    """
    path = Path(path)
    if not path.is_file():  # a ValueError, as a missing dataset.json (DatasetError): commands print it as one line
        raise MissingInput(
            f"splits file {path} does not exist: give a splits_final.json (nnU-Net v2's format: a list of "
            '{"train": [case ids], "val": [case ids]}, one per fold)'
        )
    try:
        folds = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    shape = '{"train": [case ids], "val": [case ids]}'
    if not isinstance(folds, list) or len(folds) < 2:
        raise DataError(f"{path}: expected a list of at least 2 folds, each {shape} (nnU-Net v2's splits_final.json)")
    for k, fold in enumerate(folds):
        lists = [fold.get(key) for key in ("train", "val")] if isinstance(fold, dict) else [None]
        if not all(isinstance(v, list) and all(isinstance(c, str) for c in v) for v in lists):
            raise DataError(f"{path}: fold {k} is not {shape}")
        if not fold["val"]:
            raise DataError(f"{path}: fold {k}'s val list is empty: each fold validates on at least one case")
    home = {}  # case -> the fold it validates in
    for k, fold in enumerate(folds):
        for case in fold["val"]:
            if case in home:
                where = "twice in its val list" if home[case] == k else f"also in fold {home[case]}'s val list"
                raise DataError(f"{path}: fold {k}'s val list holds case {case!r} {where}: each case validates once")
            home[case] = k
    for k, fold in enumerate(folds):
        train = fold["train"]
        for case in train:
            if case not in home:
                raise DataError(
                    f"{path}: fold {k}'s train list holds case {case!r}, which is in no fold's val list: each fold "
                    "trains on exactly the other folds' val cases"
                )
            if home[case] == k:
                raise DataError(f"{path}: fold {k}'s train list holds case {case!r} of its own val list")
        missing = sorted(set(home) - set(train) - set(fold["val"]), key=lambda c: (home[c], c))
        if missing:
            raise DataError(
                f"{path}: fold {k}'s train list lacks case {missing[0]!r} (in fold {home[missing[0]]}'s val list"
                f"{f', and {len(missing) - 1} more' if len(missing) > 1 else ''}): each fold trains on exactly the "
                "other folds' val cases"
            )
        if len(set(train)) != len(train):
            raise DataError(f"{path}: fold {k}'s train list names a case twice")
    return [{"train": list(fold["train"]), "val": list(fold["val"])} for fold in folds]


def splits_sha256(folds: list[dict[str, list[str]]]) -> str:
    """The identity of a splits file's folds: the sha256 of each fold's sorted val list, in fold order (the same
    folds written with other spacing or list order are the same conversion)."""
    canonical = json.dumps([sorted(fold["val"]) for fold in folds], separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def folds_from_file(folds: list[dict[str, list[str]]], dataset: MSDDataset, path: str | Path) -> dict[str, list[str]]:
    """`fold0..foldK-1` from a splits file's val lists (`read_splits_file`), checked against dataset.json: every
    case named must be a training case, and every training case in a fold.

    Raises:
        ValueError: one line naming the file, the fold and the case.
    """
    known = {c.case_id for c in dataset.training}
    for k, fold in enumerate(folds):
        unknown = [c for c in fold["val"] if c not in known]
        if unknown:
            raise DataError(
                f"{path}: fold {k}'s val list names case {unknown[0]!r}, which {dataset.root / 'dataset.json'} does "
                f"not list for training (case ids are the image file names without .nii.gz, e.g. "
                f"{dataset.training[0].case_id!r}): fix the file or the dataset"
            )
    placed = {c for fold in folds for c in fold["val"]}
    left_out = [c.case_id for c in dataset.training if c.case_id not in placed]
    if left_out:
        raise DataError(
            f"{path}: case {left_out[0]!r} of {dataset.root / 'dataset.json'} is in no fold's val list"
            f"{f' (and {len(left_out) - 1} more)' if len(left_out) > 1 else ''}: add it to one fold (or remove it "
            "from the dataset's training list)"
        )
    return {fold_name(k): sorted(fold["val"]) for k, fold in enumerate(folds)}


def nnunet_splits(splits: dict[str, list[str]]) -> list[dict[str, list[str]]]:
    """A fold conversion's folds as nnU-Net v2's splits_final.json: per fold, the sorted cases of the other folds
    (train) and its own (val)."""
    folds = list(splits.values())
    return [
        {"train": sorted(c for j, other in enumerate(folds) if j != k for c in other), "val": sorted(own)}
        for k, own in enumerate(folds)
    ]


def plan_shards(splits: dict[str, list[str]], shards: int, compression: str) -> list[dict]:
    plan = []
    for split, cases in splits.items():
        n = min(shards, len(cases))
        for k, chunk in enumerate(np.array_split(np.array(cases, dtype=object), n) if n else []):
            plan.append(
                {
                    "split": split,
                    "shard": k,
                    "file": shard_name(split, k, n, compression),
                    "cases": [str(c) for c in chunk],
                }
            )
    return plan


def header_spacing(case: Case, dataset: MSDDataset) -> np.ndarray:
    """RAS voxel spacing from the image header alone (no voxel data read)."""
    path = dataset.resolve(case, case.image)
    if not Path(path).is_file():
        raise CaseError(case.case_id, f"image file {path} does not exist")
    try:
        return ras_spacing(nib.load(str(path)).affine)
    except Exception as e:  # any header problem: the worker reports it with the full reason
        raise CaseError(case.case_id, f"cannot read header of {path}: {e}") from e


# ---------------------------------------------------------------- worker side (no TensorFlow here)


def _process_case(task: tuple) -> dict:
    case, source_dir, prep = task
    try:
        dataset = MSDDataset(source_dir)
        loaded = load_case(case, dataset)
        # the raw intensities are sampled first: preprocess then normalises in the loaded image's own memory
        ct = _ct_channels(dataset)
        intensity = fp.case_intensity(loaded.image, loaded.label, ct)
        background = fp.case_background(loaded.image, ct)  # what preprocess's foreground_mask finds (6 faces read)
        image, label, geometry = preprocess(loaded.image, loaded.label, loaded.affine, prep, overwrite_image=True)
        warnings = []
        if label is not None and not (label > 0).any():
            warnings.append("label has no foreground voxels")
        return {
            "case_id": case.case_id,
            "status": "ok",
            "image": image,
            "label": label,
            "geometry": geometry.to_dict(),
            "warnings": warnings,
            "disk_dtype": loaded.header_dtype,
            "fingerprint": fp.case_fingerprint(
                None,
                loaded.label,
                ras_spacing(loaded.affine),
                geometry,
                label,
                dataset.num_classes,
                intensity,
                background,
            ),
        }
    except CaseError as e:
        return {"case_id": case.case_id, "status": "skipped", "reason": e.reason}
    except Exception as e:  # never let one case stop the others
        return {"case_id": case.case_id, "status": "skipped", "reason": f"unexpected {type(e).__name__}: {e}"}


def _label_classes(task: tuple) -> list[int]:
    """The foreground label values a case's label file holds (read once, nothing else); [] if it cannot be read
    (the main pass reports the case)."""
    case, source_dir = task
    try:
        dataset = MSDDataset(source_dir)
        label = np.asanyarray(nib.load(str(dataset.resolve(case, case.label))).dataobj)
        if label.dtype == np.uint8:
            values = np.flatnonzero(np.bincount(label.ravel(), minlength=1))
        else:
            values = np.unique(label)
        return sorted({int(v) for v in values if 0 < v < dataset.num_classes and float(v).is_integer()})
    except Exception:
        return []


def _foreground_sample(task: tuple) -> np.ndarray | None:
    case, source_dir = task
    try:
        dataset = MSDDataset(source_dir)
        loaded = load_case(case, dataset)
        return fp.foreground_sample(loaded.image, loaded.label, _ct_channels(dataset))
    except Exception:
        return None  # reported by the main pass


def _ct_channels(dataset: MSDDataset) -> list[int]:
    return [i for i, m in enumerate(dataset.modalities) if str(m).upper() in CT_MODALITIES]


# ---------------------------------------------------------------- main side


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _prepare_target(target: Path, requested: dict, overwrite: bool, dataset: MSDDataset | None = None) -> None:
    plan_path = target / PLAN_FILE
    if plan_path.is_file():
        plan = json.loads(plan_path.read_text())
        previous = dict(plan.get("requested", {}))
        resolved = plan.get("resolved", {})
        defaults = {f.name: f.default for f in dataclasses.fields(ConversionOptions)}
        for k, new in requested.items():
            if k not in previous and k in defaults and new == defaults[k]:
                previous[k] = new  # an option added since that conversion, asked for with its default
            old = previous.get(k)
            if old == new or resolved.get(k) is None:
                continue
            if old is None and new == resolved[k]:
                previous[k] = new  # the default it resolved, now asked for by its value (as a plan writes it)
            elif (
                new is None
                and old == resolved[k]
                and k == "spacing"
                and dataset is not None
                and list(_median_spacing(dataset) or []) == resolved[k]
            ):
                previous[k] = None  # the value asked for then is what the default (the median) resolves to
        if previous != requested:
            changed = sorted(k for k in set(previous) | set(requested) if previous.get(k) != requested.get(k))
            details = "; ".join(f"{k}: {previous.get(k)!r} -> {requested.get(k)!r}" for k in changed)
            if not overwrite:
                raise ParametersChanged(
                    f"{target} holds a conversion made with other parameters ({details}); "
                    "use another --target-dir, or --overwrite to rebuild it"
                )
            _remove_outputs(target)
    elif _shard_files(target) and not overwrite:
        raise ParametersChanged(
            f"{target} holds TFRecord files that this tool did not plan; use an empty --target-dir, or --overwrite"
        )
    elif overwrite:
        _remove_outputs(target)


def _remove_outputs(target: Path) -> None:
    for path in [
        *_shard_files(target),
        *(target / PROGRESS_DIR).glob("*"),
        target / INDEX_FILE,
        target / FINGERPRINT_FILE,
        target / PLAN_FILE,
        target / SPLITS_FILE,
    ]:
        if path.is_file():
            path.unlink()


def _shard_files(target: Path) -> list[Path]:
    """The TFRecord files in `target` (not a writer's temporaries)."""
    return [p for p in target.glob("*.tfrecord*") if parse_temp_name(p.name) is None]


def _median_spacing(dataset: MSDDataset) -> tuple[float, float, float] | None:
    spacings = []
    for case in dataset.training:
        try:
            spacings.append(header_spacing(case, dataset))
        except CaseError:
            pass  # the worker reports this case with its reason
    return tuple(float(s) for s in np.round(np.median(spacings, axis=0), 4)) if spacings else None


def _first_unreadable(dataset: MSDDataset) -> str:
    """The first training case whose image header cannot be read, with the reason (`case_id: why`)."""
    for case in dataset.training:
        try:
            header_spacing(case, dataset)
        except CaseError as e:
            return f"{case.case_id}: {e.reason}"
    return "none"


def _ct_foreground_statistics(dataset: MSDDataset, workers: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """((0.5, 99.5) percentiles, (mean, std)) of the CT channels' labelled foreground intensities, sampled from
    every training case (nnU-Net's foreground intensity properties)."""
    tasks = [(c, str(dataset.root)) for c in dataset.training]
    samples = [s for s in map_ordered(_foreground_sample, tasks, workers) if s is not None]
    if not samples:
        raise DatasetError(f"{dataset.root}: no readable case to measure the CT window from; pass --ct-window")
    ct_channels = [i for i, m in enumerate(dataset.modalities) if m.upper() == "CT"]
    values = np.concatenate([s[:, ct_channels].ravel() for s in samples]).astype(np.float64)
    return fp.ct_window(values), (float(values.mean()), float(values.std()))


def _write_shard(target: Path, shard: dict, results, index_meta: dict, on_case) -> dict:
    """Writes one shard from its cases' worker results; returns its progress record."""
    import tensorflow as tf

    final = target / shard["file"]
    options = tf.io.TFRecordOptions(
        compression_type="" if index_meta["compression"] == "NONE" else index_meta["compression"]
    )
    record = {
        "file": shard["file"],
        "split": shard["split"],
        "shard": shard["shard"],
        "cases": {},
        "skipped": {},
        "warnings": {},
        "fingerprints": {},
    }
    offset = 0
    # durable before the progress file says it is done: atomic_path fsyncs the shard, renames it, fsyncs the folder
    with atomic_path(final) as tmp, tf.io.TFRecordWriter(str(tmp), options) as writer:
        for result in results:
            cid = result["case_id"]
            if result["status"] != "ok":
                record["skipped"][cid] = result["reason"]
                on_case(cid, f"skipped: {result['reason']}")
                continue
            metadata = {
                "case_id": cid,
                "geometry": result["geometry"],
                "modalities": index_meta["modalities"],
                "labels": index_meta["labels"],
                "image_disk_dtype": result["disk_dtype"],
            }
            payload = encode_example(cid, result["image"], result["label"], metadata)
            writer.write(payload)
            record["cases"][cid] = {
                "case_id": cid,
                "split": shard["split"],
                "shard": shard["shard"],
                "file": shard["file"],
                "position": len(record["cases"]),
                "offset": offset,
                "length": len(payload),
                "image_shape": list(result["image"].shape),
                "geometry": result["geometry"],
            }
            offset += framed_size(len(payload))
            record["fingerprints"][cid] = result["fingerprint"]
            if result["warnings"]:
                record["warnings"][cid] = result["warnings"]
                on_case(cid, "warning: " + "; ".join(result["warnings"]))
            else:
                on_case(cid, None)
            # let this case's arrays go before the next one is read: with workers=1 the next case is
            # preprocessed in this process while `result` and `payload` would still hold this one
            del result, payload
    record["bytes"], record["sha256"] = _file_digest(final)
    record["records"] = len(record["cases"])
    atomic_write_json(target / PROGRESS_DIR / (shard["file"] + ".json"), record)
    return record


def _file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file, read in 4 MiB blocks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


def _finished_shards(target: Path, plan: list[dict], checksums: bool, say) -> set[str]:
    """The planned shards whose file and progress record exist and agree: the size always, the sha256 too with
    `checksums`. A shard that disagrees is reported through `say` and left out (so it is written again)."""
    done = set()
    for shard in plan:
        path, progress = target / shard["file"], target / PROGRESS_DIR / (shard["file"] + ".json")
        if not (path.is_file() and progress.is_file()):
            continue
        record = json.loads(progress.read_text())
        size = path.stat().st_size
        if "bytes" in record and size != record["bytes"]:
            say(f"{shard['file']}: {size} bytes on disk, {record['bytes']} recorded: writing it again")
            continue
        if checksums and "sha256" in record:
            _, sha256 = _file_digest(path)
            if sha256 != record["sha256"]:
                say(
                    f"{shard['file']}: sha256 {sha256[:12]}... differs from the recorded {record['sha256'][:12]}...: "
                    "writing it again"
                )
                continue
        done.add(shard["file"])
    return done


def convert(config: ConversionConfig, wait: bool = False) -> dict:
    """Runs (or resumes) a conversion; returns the written index (plus `run_seconds`).

    The conversion holds the target's lock (`tfmis.utils.lock.folder_lock`) from start to end. With `wait`, a
    conversion of the same target by another live process is waited for (one line names it), then this one
    checks its result (a no-op when it finished with the same parameters).

    Raises:
        FolderLocked: another live conversion holds the target (the message names it; not with `wait`).
    """
    start = time.time()
    dataset = MSDDataset(config.source_dir)
    target = Path(config.target_dir)
    with folder_lock(target, "tfmis-convert", wait=wait):  # taking it removes the temporaries of dead writers
        return _convert(config, dataset, target, start)


def _convert(config: ConversionConfig, dataset: MSDDataset, target: Path, start: float) -> dict:
    from tfmis.utils.progress import progress_bar

    # read before the target is touched: a splits file inside it (an earlier conversion's) is removed by overwrite
    file_folds = read_splits_file(config.splits_file) if config.splits_file is not None else None
    (target / PROGRESS_DIR).mkdir(parents=True, exist_ok=True)
    requested = config.requested(
        _sha256(dataset.root / "dataset.json"), splits_sha256(file_folds) if file_folds is not None else None
    )
    _prepare_target(target, requested, config.overwrite, dataset)
    previous = json.loads((target / PLAN_FILE).read_text()) if (target / PLAN_FILE).is_file() else {}
    ct_norm = "ct_zscore" if config.ct_normalization == "zscore" else "ct"
    modal_norm = tuple(ct_norm if m.upper() == "CT" else "zscore" for m in dataset.modalities)
    splits = None
    if previous.get("requested") == requested and "resolved" in previous:  # resuming
        spacing, ct_window = previous["resolved"]["spacing"], previous["resolved"]["ct_window"]
        ct_mean_std = previous["resolved"].get("ct_mean_std")
        splits = previous["resolved"].get("splits")  # planned once: stratified folds read every label
    else:
        spacing = config.spacing or _median_spacing(dataset)
        ct_window, ct_mean_std = config.ct_window, None
        if ct_norm in modal_norm and (ct_window is None or ct_norm == "ct_zscore"):
            window, mean_std = _ct_foreground_statistics(dataset, config.num_workers)
            ct_window = ct_window if ct_window is not None else window
            ct_mean_std = mean_std if ct_norm == "ct_zscore" else None
    if spacing is None and config.reshape is None:  # not one header could be read: nothing can be converted
        raise NothingConverted(
            f"{dataset.root}: 0 of {len(dataset.training)} cases readable, so nothing to convert "
            f"(first: {_first_unreadable(dataset)}); fix the files dataset.json lists and rerun"
        )
    if splits is None:
        splits = _plan_splits(config, dataset, file_folds)
    atomic_write_json(
        target / PLAN_FILE,
        {
            "requested": requested,
            "resolved": {"spacing": spacing, "ct_window": ct_window, "ct_mean_std": ct_mean_std, "splits": splits},
        },
    )
    spacing = tuple(spacing) if spacing is not None else None
    ct_window = tuple(ct_window) if ct_window is not None else None
    prep = PreprocessConfig(
        spacing=spacing,
        reshape=config.reshape,
        normalization=modal_norm,
        ct_window=ct_window,
        ct_mean_std=tuple(ct_mean_std) if ct_mean_std is not None else None,
        crop_foreground=config.crop_foreground,
        crop_margin=config.crop_margin,
        crop_to_label_mm=config.crop_to_label_mm,
        image_dtype=config.image_dtype,
    )

    plan = plan_shards(splits, config.shards, config.compression)
    # a finished conversion (index.json, written after every shard was synced) checks sizes only, which is cheap
    # at every training start; resuming an unfinished one checks the checksums of the shards it keeps too
    done = _finished_shards(
        target, plan, not (target / INDEX_FILE).is_file(), lambda line: print(line, file=sys.stderr)
    )
    pending = [s for s in plan if s["file"] not in done]
    by_id = {c.case_id: c for c in dataset.training}
    tasks = [(by_id[cid], str(dataset.root), prep) for s in pending for cid in s["cases"]]
    index_meta = {"compression": config.compression, "modalities": dataset.modalities, "labels": dataset.labels}

    bar = progress_bar(len(tasks), f"Converting {dataset.name}", "case", disable=not config.progress)
    if done:
        bar.write(
            f"Resuming: {len(done)} of {len(plan)} shards already complete, {len(tasks)} cases to go", file=sys.stderr
        )

    def on_case(case_id: str, message: str | None):
        if message:
            bar.write(f"  {case_id}: {message}", file=sys.stderr)
        bar.update(1)

    results = map_ordered(_process_case, tasks, config.num_workers)
    for shard in pending:
        _write_shard(target, shard, itertools.islice(results, len(shard["cases"])), index_meta, on_case)
    bar.close()

    index = _build_index(target, dataset, config, requested, prep, splits, plan)
    if not index["cases"]:  # an index of 0 records is no conversion: say why, and do not resume from it
        _remove_outputs(target)
        first = index["skipped"][0] if index["skipped"] else {"case_id": "-", "reason": "no case listed"}
        raise NothingConverted(
            f"{dataset.root}: 0 of {len(dataset.training)} cases converted, all skipped (first: "
            f"{first['case_id']}: {first['reason']}); fix the files dataset.json lists and rerun"
        )
    index["run_seconds"] = round(time.time() - start, 2)
    if config.folds is not None:  # before index.json, whose presence says the conversion is complete
        atomic_write_json(target / SPLITS_FILE, nnunet_splits(splits))
    atomic_write_json(target / INDEX_FILE, index)
    return index


def _plan_splits(config: ConversionConfig, dataset: MSDDataset, file_folds: list[dict] | None) -> dict:
    """The cases of each split: the splits file's folds, stratified folds (every training label read once, in
    parallel), or seeded fractions."""
    if file_folds is not None:
        return folds_from_file(file_folds, dataset, config.splits_file)
    ids = [c.case_id for c in dataset.training]
    classes = None
    if config.folds is not None:
        tasks = [(c, str(dataset.root)) for c in dataset.training]
        classes = dict(zip(ids, map_ordered(_label_classes, tasks, config.num_workers)))
    return assign_splits(ids, config.split, config.folds, config.seed, classes)


def _build_index(
    target: Path,
    dataset: MSDDataset,
    config: ConversionConfig,
    requested: dict,
    prep: PreprocessConfig,
    splits: dict,
    plan: list,
) -> dict:
    progress = [json.loads((target / PROGRESS_DIR / (s["file"] + ".json")).read_text()) for s in plan]
    cases, skipped, warnings, fingerprints = {}, [], [], {}
    for record in progress:
        cases.update(record["cases"])
        fingerprints.update(record["fingerprints"])
        skipped += [{"case_id": k, "reason": v} for k, v in record["skipped"].items()]
        warnings += [{"case_id": k, "message": m} for k, ms in record["warnings"].items() for m in ms]
    for case in dataset.training:  # where each record came from: predict maps results back onto these files
        if case.case_id in cases:
            cases[case.case_id].update(image=case.image, label=case.label)
    total_bytes = sum(r["bytes"] for r in progress)
    summary = fp.summarize(fingerprints, dataset.labels, dataset.modalities)
    atomic_write_json(target / FINGERPRINT_FILE, {"dataset": summary, "cases": fingerprints})
    return {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": {
            "dir": str(dataset.root),
            "name": dataset.name,
            "modalities": dataset.modalities,
            "labels": dataset.labels,
            "num_training": len(dataset.training),
            "num_test": len(dataset.test),
            "dataset_json_sha256": requested["dataset_json_sha256"],
        },
        "requested": requested,
        "preprocessing": {**prep.to_dict(), "compression": config.compression},
        "split": {
            "fractions": list(config.split) if config.split else None,
            "folds": config.folds,
            "seed": config.seed,
            "fold_assignment": requested.get("fold_assignment"),  # stratified or splits_file (folds only)
            "splits_file": config.splits_file,
        },
        "splits": {
            name: {
                "cases": ids,
                "num_records": sum(r["records"] for r in progress if r["split"] == name),
                "shards": [
                    {"file": r["file"], "records": r["records"], "bytes": r["bytes"], "sha256": r.get("sha256")}
                    for r in progress
                    if r["split"] == name
                ],
            }
            for name, ids in splits.items()
        },
        "cases": cases,
        # per channel: the cases whose background is a non-zero border constant (z-scored), cropped against it
        "background": summary.get("background"),
        "skipped": sorted(skipped, key=lambda s: s["case_id"]),
        "warnings": sorted(warnings, key=lambda w: w["case_id"]),
        "stats": {
            "records": len(cases),
            "bytes": total_bytes,
            "bytes_per_case": round(total_bytes / len(cases)) if cases else 0,
        },
    }


def summary_text(index: dict) -> str:
    """A short human-readable account of a conversion."""
    prep = index["preprocessing"]
    grid = f"reshape {prep['reshape']}" if prep["reshape"] else f"spacing {prep['spacing']} mm"
    lines = [
        f"{index['source']['name']}: {index['stats']['records']} cases converted, "
        f"{len(index['skipped'])} skipped, {len(index['warnings'])} warnings "
        f"({grid}, {prep['image_dtype']}, {prep['compression']}, "
        f"{index['stats']['bytes_per_case'] / 1e6:.2f} MB/case, {index['run_seconds']:.1f} s)"
    ]
    for name, split in index["splits"].items():
        lines.append(f"  {name:<6} {split['num_records']:>4} records in {len(split['shards'])} shard(s)")
    lines += [f"  {line}" for line in fp.background_lines(index.get("background"))]
    for s in index["skipped"]:
        lines.append(f"  SKIPPED {s['case_id']}: {s['reason']}")
    for w in index["warnings"]:
        lines.append(f"  warning {w['case_id']}: {w['message']}")
    return "\n".join(lines)
