"""Postprocessing chosen by evidence, as nnU-Net v2: keep only the largest connected piece of a structure, and keep
that step only where it raised the out-of-fold Dice.

- `keep_largest_component`: all voxels of a structure (a class, or a region: several labels as one) outside its
  largest 26-connected piece become background 0, in place, working inside the structure's bounding box;
- `apply_postprocessing`: a `tfmis.config.PostprocessingConfig` applied to one label map (the whole foreground
  first, then each listed structure in order, as nnU-Net applies its list of functions);
- `case_dice`: nnU-Net's Dice of a case's prediction file against its reference, per structure
  (`tfmis.metrics.nnunet_scores`: Dice NaN when prediction and reference are both empty, the mean over cases
  leaving NaN out, the foreground mean an ordinary mean of those means);
- `choose_postprocessing`: nnU-Net v2's `determine_postprocessing` decision procedure on out-of-fold predictions.

Following nnU-Net v2 (`nnunetv2/postprocessing/remove_connected_components.py`, `nnunetv2/evaluation/
evaluate_predictions.py`, `acvl_utils/morphology/morphology_helper.py`):

- connectivity: nnU-Net labels components with `skimage.measure.label(mask, connectivity=None)`, full
  connectivity (26 neighbours in 3-D); here `scipy.ndimage.label` with a full 3x3x3 structure, the same pieces;
- ties: nnU-Net keeps every piece whose size equals the largest (`j == max(y)`), so two equal largest pieces both
  stay; so here;
- a piece removed becomes background 0, whatever other structures lie around it.

Memory: `keep_largest_component` finds the structure's bounding box `SLAB_SLICES` slices at a time (a slab's boolean
mask), then works inside the box only: at most about 4 bytes per voxel of the box (the uint16 piece numbers, the
mask of removed voxels and a comparison's temporary; 6 beyond 65535 pieces) plus a slab's temporaries; a small
structure in a large map never costs a map-sized array. `choose_postprocessing` holds one case at a time: its
prediction and reference (uint8, 2 bytes per voxel), a step's box as above and the slab-wise confusion counts'
temporaries (`tfmis.metrics.segmentation`), plus one K x K confusion matrix per case (measured peaks:
docs/crossval.md, "Postprocessing").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
from scipy import ndimage

from tfmis.config import PostprocessingConfig
from tfmis.data.sources.label_maps import read_label_map, save_like
from tfmis.errors import DataError, MissingInput
from tfmis.metrics.boxes import slab_box
from tfmis.metrics.nnunet_scores import dice_from_confusion, dice_summary
from tfmis.metrics.segmentation import SLAB_SLICES, confusion_matrix, region_masks

# a step: the labels of one structure, or None for the whole foreground (every label but 0)
Step = tuple[int, ...] | None
FOREGROUND = "foreground"  # the report's name for the whole-foreground step


# ---------------------------------------------------------------- largest connected component


def _structure_mask(array: np.ndarray, structure: Step) -> np.ndarray:
    """The voxels of `array` in the structure: labelled with one of its labels, or any foreground label (None)."""
    return array != 0 if structure is None else region_masks(array, structure)


def _bounding_box(labels: np.ndarray, structure: Step) -> tuple[slice, ...] | None:
    """The bounding box of the structure's voxels, found `SLAB_SLICES` slices (first axis) at a time; None when the
    structure has no voxel."""
    return slab_box(labels, lambda slab: _structure_mask(slab, structure), SLAB_SLICES)


def _label_pieces(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """(pieces, count): full-connectivity components of `mask` numbered 1..count, as uint16 when they fit (half the
    memory of int32; scipy refuses an output too small for the count, and then int32 is used)."""
    full = np.ones((3,) * mask.ndim, bool)
    try:
        return ndimage.label(mask, structure=full, output=np.uint16)
    except RuntimeError:  # more than 65535 pieces
        return ndimage.label(mask, structure=full, output=np.int32)


def _removal(labels: np.ndarray, structure: Step) -> tuple[tuple[slice, ...], np.ndarray] | None:
    """(box, removed): the voxels of `labels[box]` that nnU-Net's step would set to background (the structure's
    voxels outside its largest full-connectivity pieces); None when it removes nothing.

    Inside the box: the structure's mask (1 byte per voxel), its pieces (2, or 4 beyond 65535 pieces) and the
    removed voxels' mask with one comparison's temporary (2); piece sizes are counted a slab at a time, since
    `np.bincount` on the whole box would take an int64 copy of it."""
    box = _bounding_box(labels, structure)
    if box is None:
        return None
    pieces, count = _label_pieces(_structure_mask(labels[box], structure))
    if count < 2:
        return None
    sizes = np.zeros(count + 1, np.int64)
    for start in range(0, pieces.shape[0], SLAB_SLICES):
        sizes += np.bincount(pieces[start : start + SLAB_SLICES].ravel(), minlength=count + 1)
    sizes[0] = 0  # background is no piece
    removed = pieces != 0
    for piece in np.flatnonzero(sizes == sizes.max()):  # nnU-Net keeps every piece as large as the largest
        removed &= pieces != piece
    return box, removed


def keep_largest_component(labels: np.ndarray, structure_labels: Sequence[int]) -> int:
    """In place: the voxels of the structure (labelled with any of `structure_labels`) outside its largest
    26-connected piece become background 0; returns the number of voxels removed.

    nnU-Net v2's `remove_all_but_largest_component_from_segmentation`: pieces are full-connectivity components (26
    neighbours in 3-D, every neighbour sharing a face, edge or corner; `skimage.measure.label(connectivity=None)` in
    nnU-Net, `scipy.ndimage.label` with a 3x3x3 structure here), and every piece as large as the largest stays
    (a tie keeps them all). Any number of dimensions (full connectivity in each).

    Memory: the structure's bounding box is found `SLAB_SLICES` slices at a time, then only the box is labelled:
    at most about 4 bytes per voxel of the box (uint16 piece numbers, the removed voxels' mask, a comparison's
    temporary) plus a slab's temporaries; a map-sized allocation only when the structure spans the map.

    Example:
    ```python
    removed = keep_largest_component(label_map, [2])        # class 2 only
    removed = keep_largest_component(label_map, [1, 2, 3])  # a region: labels 1-3 as one structure
    ```
    """
    structure = tuple(int(label) for label in structure_labels)
    if not structure or min(structure) < 1:
        raise ValueError(f"keep_largest_component: structure_labels must be foreground labels (>= 1), got {structure}")
    return _keep_largest(labels, structure)


def _keep_largest(labels: np.ndarray, structure: Step) -> int:
    found = _removal(labels, structure)
    if found is None:
        return 0
    box, removed = found
    labels[box][removed] = 0  # labels[box] is a view: basic slicing
    return int(np.count_nonzero(removed))


def _steps(spec: PostprocessingConfig) -> list[Step]:
    """The spec's steps in the order they apply: the whole foreground first, then each listed structure."""
    steps: list[Step] = [None] if spec.largest_foreground_component else []
    return steps + [tuple(int(label) for label in labels) for labels in spec.largest_component_labels]


def postprocessing_enabled(spec) -> bool:
    """Whether a `PostprocessingConfig` (or None) changes anything."""
    return spec is not None and bool(spec.largest_foreground_component or spec.largest_component_labels)


def describe_postprocessing(spec) -> str:
    """What a `PostprocessingConfig` does, in a few words ("none" when nothing).

    Example:
        >>> from tfmis.config import PostprocessingConfig
        >>> describe_postprocessing(PostprocessingConfig(True, [[2], [1, 2]]))
        'largest foreground component, largest component of 2, of 1+2'
    """
    if not postprocessing_enabled(spec):
        return "none"
    steps = ["largest foreground component"] if spec.largest_foreground_component else []
    if spec.largest_component_labels:
        pieces = ", of ".join("+".join(map(str, labels)) for labels in spec.largest_component_labels)
        steps.append(f"largest component of {pieces}")
    return ", ".join(steps)


def apply_postprocessing(labels: np.ndarray, spec: PostprocessingConfig) -> np.ndarray:
    """`spec` applied to one label map, in place (the same array is returned): first, when
    `largest_foreground_component`, all foreground labels (every label but 0) as one structure keep only their
    largest piece; then each entry of `largest_component_labels` in order, as nnU-Net's `apply_postprocessing`
    runs its list of functions. Removed voxels become 0.

    Example:
    ```python
    spec = PostprocessingConfig(largest_foreground_component=True, largest_component_labels=[[2]])
    apply_postprocessing(label_map, spec)
    ```
    """
    for step in _steps(spec):
        _keep_largest(labels, step)
    return labels


# ---------------------------------------------------------------- nnU-Net's scores


def case_dice(
    prediction_path: str | Path,
    reference_path: str | Path,
    class_labels: Sequence[int],
    regions: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, float]:
    """nnU-Net's Dice of one case's prediction NIfTI against its reference, per structure as `choose_postprocessing`
    scores them: {"1": ..., "2": ...} per class, or {region name: ...} when `regions` are given. NaN when both maps
    lack the structure.

    Raises:
        FileNotFoundError: a file is missing. ValueError: shapes differ, or a label above max(class_labels).
    """
    _, structures = _check_structures(class_labels, regions)
    prediction_path, reference_path = _check_cases([(prediction_path, reference_path)], None)[0]
    num_classes = max(int(c) for c in class_labels) + 1
    prediction = _read_labels(prediction_path, num_classes)
    reference = _read_reference(reference_path, num_classes, prediction.shape)
    return dice_from_confusion(confusion_matrix(prediction, reference, num_classes), structures)


# ---------------------------------------------------------------- choosing by out-of-fold Dice


def _json_number(value: float) -> float | None:
    """A float for JSON: NaN (no Dice to measure) as null."""
    return None if value is None or math.isnan(value) else float(value)


def _json_scores(summary: dict) -> dict:
    return {
        "dice": {name: _json_number(value) for name, value in summary["mean"].items()},
        "foreground_mean": _json_number(summary["foreground_mean"]),
    }


def _check_structures(class_labels, regions) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(classes, scored structures): {str(label): (label,)} and, with regions, {name: labels} (what nnU-Net scores
    and decides on: its foreground regions for region-based training, else its foreground labels)."""
    labels = list(class_labels)
    bad = [v for v in labels if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1]
    if not labels or bad or len(set(labels)) != len(labels):
        raise ValueError(f"class_labels: expected distinct foreground labels (>= 1), got {labels}")
    classes = {str(int(c)): (int(c),) for c in labels}
    if regions is None:
        return classes, classes
    checked = {}
    for name, members in dict(regions).items():
        members = list(members)
        if not members or len(set(members)) != len(members) or not set(members) <= set(labels):
            raise ValueError(f"regions.{name}: expected distinct labels among class_labels {labels}, got {members}")
        checked[str(name)] = tuple(int(m) for m in members)
    if not checked:
        raise ValueError("regions: give at least one region, or None to decide per class")
    return classes, checked


def _check_cases(cases, output_folder) -> list[tuple[Path, Path]]:
    pairs = [(Path(prediction), Path(reference)) for prediction, reference in cases]
    if not pairs:
        raise DataError("choose_postprocessing: no cases; give (prediction, reference) NIfTI paths of out-of-fold maps")
    for prediction, reference in pairs:
        for path, what in ((prediction, "prediction"), (reference, "reference")):
            if not path.is_file():
                raise MissingInput(f"{what} {path} not found: every case needs its prediction and reference")
    if output_folder is not None:
        names = [prediction.name for prediction, _ in pairs]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise DataError(f"output_folder: predictions share file names {twice[:3]}; give each case its own name")
    return pairs


def _read_labels(path: Path, num_classes: int) -> np.ndarray:
    """A label NIfTI as uint8 (uint16 beyond 256 classes), read slab-wise; ValueError for a label >= num_classes."""
    return read_label_map(path, num_classes)


def _read_reference(path: Path, num_classes: int, shape) -> np.ndarray:
    """The reference label map of a prediction of `shape`; ValueError naming it when its shape differs."""
    reference = _read_labels(path, num_classes)
    if reference.shape != tuple(shape):
        raise DataError(
            f"reference {path} has shape {reference.shape}, its prediction {tuple(shape)}: out-of-fold predictions "
            "must lie on their reference's grid"
        )
    return reference


def _case_id(path: Path) -> str:
    from tfmis.data.sources.image_io import strip_image_suffix

    return strip_image_suffix(path)


def choose_postprocessing(
    cases: Iterable[tuple[str | Path, str | Path]],
    class_labels: Sequence[int],
    regions: Mapping[str, Sequence[int]] | None = None,
    output_folder: str | Path | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[PostprocessingConfig, dict]:
    """nnU-Net v2's `determine_postprocessing` on out-of-fold predictions: which largest-component steps raise Dice.

    The scored structures are the classes (`class_labels`), or the regions {name: labels} when given (as nnU-Net
    scores its foreground regions for region-based training). In order, each on the predictions with the steps
    kept so far applied:

    1. the whole foreground (every label but 0, nnU-Net's foreground labels as one structure): kept when the
       foreground mean Dice rises strictly and no structure's mean Dice falls (nnU-Net's defensive check);
    2. only when there is more than one structure, each structure in order: kept when its mean Dice rises strictly.

    Means are nnU-Net's (`dice_summary`): per structure over cases leaving NaN out; a NaN mean fails every
    comparison, as in nnU-Net. Exactly what `apply_postprocessing` does with the returned spec is what was scored.

    One case at a time: each step reads every prediction again (and a reference only when the step removes voxels
    from that case), applies the kept steps and the tried one, and updates that case's confusion counts from the
    removed voxels; nothing but a K x K matrix per case is held across cases.

    Args:
        cases: (prediction, reference) NIfTI paths on one grid per case, read as uint8 labels 0..max(class_labels).
        output_folder: when given, each prediction with the chosen steps applied is written there under its own
            file name (the prediction's affine and header), as nnU-Net's `postprocessed` folder.
        log: called with one line per step tried (e.g. `print`).

    Returns:
        (spec, report): the `PostprocessingConfig` of the kept steps, and a JSON-serialisable report (NaN as null):
        "structures", "cases", one "steps" entry per step tried (structure, labels, voxels removed, cases changed,
        Dice before/after per structure and foreground mean, kept), and "final" (per class, and per region when
        given, Dice means before and after the chosen steps, and per case).

    Raises:
        FileNotFoundError: a case's prediction or reference is missing.
        ValueError: no cases; bad class_labels/regions; a map whose shape differs from its pair's or that holds a
            label above max(class_labels).
    """
    classes, structures = _check_structures(class_labels, regions)
    pairs = _check_cases(cases, output_folder)
    say = log or (lambda line: None)
    oof = _OutOfFoldCases(pairs, [int(c) for c in class_labels], structures)
    steps_report = [_decide_foreground(oof, say)]
    if len(structures) > 1:  # each structure, only when there are several (nnU-Net: `if len(labels_or_regions) > 1`)
        steps_report += _decide_structures(oof, say)
    spec = PostprocessingConfig(
        largest_foreground_component=None in oof.kept,
        largest_component_labels=[list(step) for step in oof.kept if step is not None],
    )
    report = {
        "structures": {name: list(labels) for name, labels in structures.items()},
        "cases": len(pairs),
        "steps": steps_report,
        "postprocessing": dataclasses.asdict(spec),
        "final": _final_scores(oof, {"classes": classes} | ({"regions": structures} if regions is not None else {})),
    }
    if output_folder is not None:
        _write_postprocessed(pairs, spec, Path(output_folder), oof.read)
    return spec, report


class _OutOfFoldCases:
    """The out-of-fold cases `choose_postprocessing` decides on, read one case at a time: each case's confusion
    counts confusion[reference, prediction] as predicted (`baseline`) and with the steps kept so far applied
    (`current`), and the steps kept (`kept`: None for the whole foreground, else a structure's labels).

    Args:
        pairs: the (prediction, reference) paths, checked (`_check_cases`).
        foreground_labels: the class labels (>= 1); the maps hold labels 0..max of them.
        structures: the scored structures {name: labels} (`_check_structures`).
    """

    def __init__(self, pairs: list[tuple[Path, Path]], foreground_labels: list[int], structures: dict):
        self.pairs, self.foreground_labels, self.structures = pairs, foreground_labels, structures
        self.num_classes = max(foreground_labels) + 1
        self.kept: list[Step] = []
        self.baseline: list[np.ndarray] = []  # each case's confusion as predicted
        self.current: list[np.ndarray] = []  # each case's confusion with the kept steps applied

    def read(self, path: Path) -> np.ndarray:
        """A prediction's label map."""
        return _read_labels(path, self.num_classes)

    def read_reference(self, path: Path, shape) -> np.ndarray:
        """A reference label map, on the grid of a prediction of `shape`."""
        return _read_reference(path, self.num_classes, shape)

    def confusion_change(self, prediction: np.ndarray, reference, reference_path: Path, step: Step):
        """Applies `step` to `prediction` in place; returns the change of the case's confusion counts
        (confusion[reference, prediction]) and the voxels removed. The reference is read only when needed (None:
        not read yet)."""
        num_classes = self.num_classes
        change = np.zeros((num_classes, num_classes), np.int64)
        found = _removal(prediction, step)
        if found is None:
            return change, 0
        box, removed = found
        if reference is None:
            reference = self.read_reference(reference_path, prediction.shape)
        was = prediction[box][removed].astype(np.intp)
        truth = reference[box][removed].astype(np.intp)
        moved = np.bincount(truth * num_classes + was, minlength=num_classes**2).reshape(num_classes, num_classes)
        change -= moved
        change[:, 0] += moved.sum(axis=1)  # the removed voxels now predict background
        prediction[box][removed] = 0
        return change, int(was.size)

    def summary(self, confusions, names) -> dict:
        """nnU-Net's means (`dice_summary`) of the structures `names` over the cases' `confusions`."""
        return dice_summary([dice_from_confusion(c, names) for c in confusions])

    def try_step(self, step: Step, name: str) -> tuple[list[np.ndarray], dict, dict, dict]:
        """(each case's confusion with `step` added to the kept ones, Dice before, after, the report entry)."""
        tried, removed_total, changed = [], 0, 0
        for i, (prediction_path, reference_path) in enumerate(self.pairs):
            prediction, reference = self.read(prediction_path), None
            if len(self.baseline) == i:  # the first pass also scores the predictions as they are
                reference = self.read_reference(reference_path, prediction.shape)
                self.baseline.append(confusion_matrix(prediction, reference, self.num_classes))
                self.current.append(self.baseline[i])
            for done in self.kept:
                _keep_largest(prediction, done)
            change, removed = self.confusion_change(prediction, reference, reference_path, step)
            del reference
            tried.append(self.current[i] + change)
            removed_total += removed
            changed += removed > 0
            del prediction
        before, after = self.summary(self.current, self.structures), self.summary(tried, self.structures)
        entry = {
            "structure": name,
            "labels": self.foreground_labels if step is None else list(step),
            "voxels_removed": removed_total,
            "cases_changed": changed,
            "before": _json_scores(before),
            "after": _json_scores(after),
        }
        return tried, before, after, entry

    def keep(self, step: Step, tried: list[np.ndarray]) -> None:
        """Keeps `step`: the cases' current confusion becomes the one `try_step` gave with it."""
        self.kept.append(step)
        self.current[:] = tried


def _decide_foreground(oof: _OutOfFoldCases, say: Callable[[str], None]) -> dict:
    """Step 1, the whole foreground: kept (nnU-Net) only if the foreground mean Dice rises strictly and no structure's
    mean falls. Returns the step's report entry."""
    tried, before, after, entry = oof.try_step(None, FOREGROUND)
    keep = after["foreground_mean"] > before["foreground_mean"] and not any(
        after["mean"][name] < before["mean"][name] for name in oof.structures
    )
    say(
        f"largest foreground component: foreground mean Dice {before['foreground_mean']:.5f} -> "
        f"{after['foreground_mean']:.5f}, {'kept' if keep else 'not kept'}"
    )
    if keep:
        oof.keep(None, tried)
    return entry | {"kept": bool(keep)}


def _decide_structures(oof: _OutOfFoldCases, say: Callable[[str], None]) -> list[dict]:
    """Step 2, each structure in order (after the steps kept before it): kept when its mean Dice rises strictly.
    Returns the steps' report entries."""
    entries = []
    for name, labels in oof.structures.items():
        tried, before, after, entry = oof.try_step(labels, name)
        keep = after["mean"][name] > before["mean"][name]
        entries.append(entry | {"kept": bool(keep)})
        say(
            f"largest component of {name}: Dice {before['mean'][name]:.5f} -> {after['mean'][name]:.5f}, "
            f"{'kept' if keep else 'not kept'}"
        )
        if keep:
            oof.keep(labels, tried)
    return entries


def _final_scores(oof: _OutOfFoldCases, scored: dict) -> dict:
    """The report's "final": for each kind of `scored` structures ({"classes": ..., "regions": ...}) the Dice means
    before and after the kept steps, and each case's Dice per scored structure before and after."""
    final = {
        kind: {
            "before": _json_scores(oof.summary(oof.baseline, names)),
            "after": _json_scores(oof.summary(oof.current, names)),
        }
        for kind, names in scored.items()
    }
    final["per_case"] = [
        {
            "case": _case_id(prediction_path),
            "prediction": str(prediction_path),
            "before": {k: _json_number(v) for k, v in dice_from_confusion(was, oof.structures).items()},
            "after": {k: _json_number(v) for k, v in dice_from_confusion(now, oof.structures).items()},
        }
        for (prediction_path, _), was, now in zip(oof.pairs, oof.baseline, oof.current)
    ]
    return final


def _write_postprocessed(pairs, spec: PostprocessingConfig, folder: Path, read) -> None:
    """Each prediction with `spec` applied, written to `folder` under its own name with its affine and header."""
    from tfmis.data.sources.image_io import read_geometry

    for prediction_path, _ in pairs:
        labels = apply_postprocessing(read(prediction_path), spec)
        affine, header = read_geometry(prediction_path)
        save_like(labels, affine, header, folder / prediction_path.name, labels.dtype)
