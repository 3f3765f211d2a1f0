"""Which cases go where: seeded train/val/test fractions, K folds stratified by the classes each case holds, and
the folds of an nnU-Net v2 splits_final.json (read, checked against the dataset, and written for a fold conversion).

Numpy only (no TensorFlow): the planner assigns its split preview here too.

Example:
```python
from tfmis.data.folds import assign_splits
assign_splits(["a", "b", "c", "d"], (0.5, 0.5), None, seed=0)   # {"train": [2 cases], "val": [2 cases]}
```
"""

from __future__ import annotations

import collections
import hashlib
import json
from pathlib import Path

import numpy as np

from tfmis.data.records import fold_name
from tfmis.data.sources.cases import SegmentationDataset
from tfmis.errors import DataError, MissingInput

SPLITS_FILE = "splits_final.json"  # a fold conversion's folds, in nnU-Net v2's format
DEFAULT_SPLIT = (0.7, 0.15, 0.15)


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


def folds_from_file(
    folds: list[dict[str, list[str]]], dataset: SegmentationDataset, path: str | Path
) -> dict[str, list[str]]:
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
