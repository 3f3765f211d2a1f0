"""Prediction through a coarse-to-fine cascade: a coarse stage finds the structures, a fine stage segments each.

The coarse stage (a low-resolution run) predicts the whole scan. Each connected piece of its foreground (classes
that touch form one piece, 26-connected) is either a region of its own or keeps the coarse stage's label; no piece is
ever dropped. `cascade.min_region_mm3` (0 by default, a volume on the coarse grid) decides which, the same way
whether the scan holds other pieces or not:

- a piece of at least `min_region_mm3` gets a region: its box grown by `cascade.margin_mm` per side and, where the
  scan allows, to at least the fine stage's patch (`validation.roi_size` at its spacing); boxes that overlap are
  merged. Each box is cut from the original scan and goes through the fine stage (a full-resolution run trained on
  cases cropped the same way, `data.conversion.crop_to_label_mm`), normalised with the whole scan's statistics
  (`tfmis.data.preprocess.image_statistics`), as the fine stage's training crops are;
- a smaller piece keeps the coarse stage's label (and probabilities) at its place, unless it lies in another
  piece's region, where the fine stage decides as everywhere in a region.

The prediction is one probability map and its argmax (its painting, for `model.output: regions`): the coarse stage's
probabilities (restored to the scan's grid) outside the regions, and inside them the fine stage's for the classes it
decides, `F` (`cascade.fine_classes`; every foreground class when unset), composed with the coarse stage's for the
rest (`compose_probabilities`): p(c) = p_fine(c) for c in F, and p(c) = p_fine(not F) * p_coarse(c | not F) for the
other classes and the background. Without `fine_classes` that is the fine stage's probabilities in the regions.
When the coarse stage finds nothing at all, the fine stage runs over the whole scan and decides every class; the
CSV's `region` column says so. The written label map has the input's geometry, as with one stage.

Example:
```python
predictor = make_predictor(load_config("runs/Task03/fullres/config.yaml"), "runs/Task03/fullres")
result = predictor.predict_file(InputCase("ct_001", "ct_001.nii.gz"), "predictions/")
print(result.region)  # "3 regions = 6.1% of the scan: 212x180x96, 40x38x22, 96x90x60"
```
"""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
from scipy import ndimage

from tfmis.config import load_config
from tfmis.data.preprocess import ImageStatistics, PreprocessConfig, image_statistics, preprocess
from tfmis.errors import ConfigError, DataError, MissingInput
from tfmis.inference.inputs import run_config
from tfmis.inference.predictor import GridPrediction, Predictor, ScanPredictor
from tfmis.inference.restore import original_box
from tfmis.metrics.boxes import Box, grow_box, merge_boxes, pad_box


def pieces(mask: np.ndarray, min_voxels: float = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(start, stop) of each connected piece of the True voxels of `mask` (26-connected: pieces that touch at a
    corner are one) with at least `min_voxels` voxels, in label order; [] when `mask` is empty."""
    labelled, count = ndimage.label(mask, structure=np.ones((3, 3, 3), bool))
    if count == 0:
        return []
    sizes = np.bincount(labelled.ravel(), minlength=count + 1)[1:] if min_voxels > 0 else None
    found = []
    for index, slices in enumerate(ndimage.find_objects(labelled)):
        if slices is None or (sizes is not None and sizes[index] < min_voxels):
            continue
        found.append((np.array([s.start for s in slices]), np.array([s.stop for s in slices])))
    return found


def regions_of_interest(
    mask: np.ndarray, affine: np.ndarray, margin_mm: float, min_volume_mm3: float = 0.0
) -> list[Box]:
    """The boxes (slices on the grid of `mask` and `affine`) around each connected piece of the True voxels of
    `mask` of at least `min_volume_mm3`, each grown by `margin_mm` per side, overlapping boxes merged; [] when no
    piece is left.

    Example:
        >>> m = np.zeros((40, 40, 20), bool); m[10:12, 20:30, 5] = True; m[39, 39, 19] = True
        >>> boxes = regions_of_interest(m, np.diag([2.0, 2.0, 5.0, 1.0]), 4.0)
        >>> [[(s.start, s.stop) for s in box] for box in boxes]
        [[(8, 14), (18, 32), (4, 7)], [(37, 40), (37, 40), (18, 20)]]
        >>> len(regions_of_interest(m, np.diag([2.0, 2.0, 5.0, 1.0]), 4.0, min_volume_mm3=40.0))  # the speck: 20 mm3
        1
    """
    voxel_mm3 = float(abs(np.linalg.det(np.asarray(affine, dtype=np.float64)[:3, :3])))
    found = pieces(mask, min_volume_mm3 / voxel_mm3 if min_volume_mm3 > 0 else 0)
    return merge_boxes([grow_box(a, b, affine, margin_mm, mask.shape) for a, b in found])


def coarse_regions(
    grid: GridPrediction, affine: np.ndarray, margin_mm: float, min_volume_mm3: float = 0.0, min_size_mm=None
) -> tuple[list[Box], int]:
    """(the fine stage's boxes on the scan's grid (`affine`), the number of pieces that keep the coarse label).

    Each connected piece of the coarse stage's foreground, found on its own grid (the argmax or the painted regions,
    a few hundred times fewer voxels than the scan), of at least `min_volume_mm3` (measured on the coarse grid) is
    mapped to the scan's voxels (flips and anisotropic spacings included), grown by `margin_mm` per side and to at
    least `min_size_mm` (mm along R, A, S: the fine patch) where the scan allows; overlapping boxes are merged. The
    smaller pieces are counted, not boxed. ([], 0) when the coarse stage found nothing."""
    if grid.probabilities is None:
        return [], 0
    coarse_voxel_mm3 = float(np.prod(grid.geometry.spacing))
    min_voxels = min_volume_mm3 / coarse_voxel_mm3 if min_volume_mm3 > 0 else 0
    offset = np.asarray(grid.offset)
    shape = grid.geometry.original_shape
    foreground = grid.grid_labels() > 0
    found = pieces(foreground, min_voxels)
    small = len(pieces(foreground)) - len(found) if min_voxels > 0 else 0
    del foreground
    min_size = scan_extent_voxels(affine, min_size_mm) if min_size_mm is not None else None
    boxes = []
    for start, stop in found:
        first, last = original_box(start + offset, stop + offset, grid.geometry)
        if np.all(last > first):
            box = grow_box(first, last, affine, margin_mm, shape)
            boxes.append(box if min_size is None else pad_box(box, min_size, shape))
    return merge_boxes(boxes), small


def scan_extent_voxels(affine: np.ndarray, extent_mm) -> np.ndarray:
    """Per axis of the scan of `affine`, the voxels that span `extent_mm` (mm along R, A, S), rounded up.

    Example:
        >>> scan_extent_voxels(np.diag([-0.8, 2.0, 1.0, 1.0])[:, [2, 0, 1, 3]], (48.0, 48.0, 60.0)).tolist()
        [60, 60, 24]
    """
    ornt = nib.orientations.io_orientation(affine)
    spacing = np.linalg.norm(np.asarray(affine, dtype=np.float64)[:3, :3], axis=0)
    extent = np.array([float(extent_mm[int(ras)]) for ras, _ in ornt])
    return np.ceil(extent / spacing - 1e-9).astype(int)


def describe_regions(boxes: list[Box], shape, small: int = 0) -> str:
    """One line for the CSV's `region` column: the number of boxes, their share of the scan and their sizes, and the
    pieces under `cascade.min_region_mm3` that keep the coarse stage's label."""
    kept = ""
    if small:
        kept = f"{small} piece{'s' if small > 1 else ''} under cascade.min_region_mm3 keep{'' if small > 1 else 's'}"
        kept += " the coarse label"
    if not boxes:
        return f"no region: {kept}"
    share = sum(float(np.prod([s.stop - s.start for s in b])) for b in boxes) / float(np.prod(shape[:3]))
    sizes = ", ".join("x".join(str(s.stop - s.start) for s in b) for b in boxes)
    what = "1 region" if len(boxes) == 1 else f"{len(boxes)} regions"
    return f"{what} = {100 * share:.3g}% of the scan: {sizes}" + (f"; {kept}" if kept else "")


def crop_affine(affine: np.ndarray, box: Box) -> np.ndarray:
    """The affine of `image[box]`: the same axes, the origin moved to the box's first voxel."""
    out = np.array(affine, dtype=np.float64, copy=True)
    out[:3, 3] = out[:3, :3] @ np.array([s.start for s in box], dtype=np.float64) + out[:3, 3]
    return out


def cut_regions(holder: list, boxes: list[Box], preprocessing: PreprocessConfig) -> tuple[list, ImageStatistics]:
    """(each box of the image in `holder` ([image], emptied), the image's normalisation statistics): what the fine
    stage preprocesses, each box with the whole image's statistics (`preprocess(box, ..., statistics=...)`), so its
    voxels get the values the fine stage's training crops give them (`tfmis.data.preprocess.image_statistics`)."""
    image = holder.pop()
    statistics = image_statistics(image, preprocessing.normalization, preprocessing.ct_window)
    return [np.ascontiguousarray(image[box]) for box in boxes], statistics


def region_input(sub: np.ndarray, affine: np.ndarray, box: Box, preprocessing: PreprocessConfig, statistics):
    """(volume, `Geometry`): the fine stage's input for the box `sub` = image[box] of the image of `affine` and
    `statistics` (`cut_regions`)."""
    volume, _, geometry = preprocess(sub, None, crop_affine(affine, box), preprocessing, statistics=statistics)
    return volume, geometry


COMPOSE_SLICES = 8  # x-slices composed at a time (bounds the temporaries to a few slices of K channels)
REGION_CHUNK_VOXELS = 2**21  # a region's voxels restored (K channels of each stage) and composed at a time


def compose_probabilities(fine: np.ndarray, coarse: np.ndarray, fine_classes, out=None) -> np.ndarray:
    """The cascade's probabilities (..., K) in a region: the fine stage's for its classes F (`fine_classes`), the
    fine stage's probability of none of them shared among the other classes (the background included) as the coarse
    stage shares its probability of those: p(c) = p_fine(c) for c in F, p(c) = p_fine(not F) * p_coarse(c) /
    p_coarse(not F) otherwise (all of it to the background where the coarse stage gives those classes 0). A
    distribution (sums to 1); with F every foreground class it is `fine` itself. `out` may be `fine`.

    Example:
        >>> fine = np.array([[0.5, 0.1, 0.4], [0.2, 0.7, 0.1]], np.float32)
        >>> coarse = np.array([[0.2, 0.6, 0.2], [0.0, 0.0, 1.0]], np.float32)
        >>> compose_probabilities(fine, coarse, [2]).astype(float).round(3).tolist()
        [[0.15, 0.45, 0.4], [0.9, 0.0, 0.1]]
    """
    out = np.empty(fine.shape, np.float32) if out is None else out
    is_fine = np.zeros(fine.shape[-1], bool)
    is_fine[list(fine_classes)] = True
    others, chosen = np.flatnonzero(~is_fine), np.flatnonzero(is_fine)
    for first in range(0, fine.shape[0], COMPOSE_SLICES):
        rows = slice(first, first + COMPOSE_SLICES)
        rest = fine[rows][..., others].astype(np.float32).sum(axis=-1, keepdims=True)  # p_fine(not F)
        share = coarse[rows][..., others].astype(np.float32)
        total = share.sum(axis=-1, keepdims=True)
        share[..., 0] = np.where(total[..., 0] > 0, share[..., 0], 1.0)
        share /= np.where(total > 0, total, 1.0)
        block = out[rows]
        if out is not fine:
            block[..., chosen] = fine[rows][..., chosen]
        block[..., others] = rest * share
    return out


def argmax_labels(probabilities: np.ndarray) -> np.ndarray:
    """uint8 argmax over the last axis, a few x-slices at a time (no int64 array of the volume's size)."""
    labels = np.empty(probabilities.shape[:-1], np.uint8)
    for first in range(0, probabilities.shape[0], COMPOSE_SLICES):
        labels[first : first + COMPOSE_SLICES] = np.argmax(probabilities[first : first + COMPOSE_SLICES], axis=-1)
    return labels


def box_corners(box: Box) -> tuple[np.ndarray, np.ndarray]:
    """(start, stop) of a box of slices."""
    return np.array([s.start for s in box]), np.array([s.stop for s in box])


class CascadePredictor(ScanPredictor):
    """A cascade's predictor of whole scans, made of two stage predictors: `coarse` runs over the whole scan to find
    where to look, `fine` predicts in the regions it finds. Either may be a `Predictor` (training runs, or their
    folds) or an `ExportedPredictor` (an exported model run by an engine): the cascade only calls them.

    Args:
        fine: the fine stage's predictor; its classes, preprocessing, windows, metrics and postprocessing are the
            cascade's.
        coarse: the coarse stage's predictor (for folds, the fold ensemble of their coarse runs), with the same
            classes and outputs (classes, or the same `model.output: regions`).
        margin_mm, min_region_mm3, fine_classes: `cascade.margin_mm`, `.min_region_mm3`, `.fine_classes` (as the
            module describes).

    After each case, `last_region` describes what the fine stage saw (also in `CaseResult.region`) and `last_boxes`
    are its boxes (slices of the scan's grid; [] when it saw the whole scan or no region).
    """

    def __init__(self, fine: Predictor, coarse: Predictor, margin_mm: float, min_region_mm3: float, fine_classes=None):
        if list(coarse.class_names) != list(fine.class_names):
            raise DataError(
                f"cascade.coarse_run: its classes {coarse.class_names} differ from this run's {fine.class_names}"
            )
        if coarse.task.paint_labels != fine.task.paint_labels:
            raise DataError(
                "cascade.coarse_run: its outputs (model.output, validation.regions) differ from this run's: the "
                "cascade's probabilities are the coarse stage's outside the regions and the fine stage's inside"
            )
        self.fine, self.coarse = fine, coarse
        # what the case loop (`ScanPredictor`) and the commands read: the fine stage's
        self.config, self.task, self.class_names = fine.config, fine.task, fine.class_names
        self.modalities, self.score_columns, self.index = fine.modalities, fine.score_columns, fine.index
        self.preprocessing, self.postprocessing = fine.preprocessing, fine.postprocessing
        self.margin_mm = float(margin_mm)
        self.min_region_mm3 = float(min_region_mm3)
        self.fine_classes = sorted(fine_classes) if fine_classes else None
        if self.fine_classes and max(self.fine_classes) >= len(self.class_names):
            raise ConfigError(
                f"cascade.fine_classes {fine_classes}: this run has labels 0..{len(self.class_names) - 1}"
            )
        if self.fine_classes and self.task.paint_labels is not None:
            raise ConfigError(
                "cascade.fine_classes needs class outputs: with model.output: regions the fine stage decides every "
                "class in its regions (set cascade.fine_classes: null)"
            )
        spacing = self.preprocessing.spacing
        self.min_size_mm = (
            None if spacing is None else tuple(float(n) * float(s) for n, s in zip(fine.roi_size, spacing))
        )
        self.last_region = ""
        self.last_boxes: list[Box] = []

    @property
    def events(self) -> list:
        """The fine stage's placement events (what ran out of memory, and what worked), in order."""
        return self.fine.events

    def describe(self) -> str:
        """One line: the fine stage's predictor (an exported model's folder and engine), after its coarse stage."""
        return f"{self.fine.describe()}, a cascade after its coarse stage"

    def predict_image(self, holder: list, affine: np.ndarray, case_id: str = "", probabilities: bool = True):
        """(label map, probabilities (X, Y, Z, K) or None, device) of the image in `holder` ([image], emptied once
        the regions are cut), as the module describes: the coarse stage over the whole scan, the fine stage over
        each region (cut from the original scan and normalised with its statistics); the label map is the argmax (or
        the painting) of the probabilities, whether they are returned or not."""
        shape = holder[0].shape[:3]
        grid = self.coarse.grid_prediction(holder[0], affine, case_id)
        boxes, small = coarse_regions(grid, affine, self.margin_mm, self.min_region_mm3, self.min_size_mm)
        self.last_boxes = boxes
        if not boxes and not small:
            self.last_region = "whole scan (the coarse stage found nothing)"
            del grid
            return self.fine.predict_image(holder, affine, case_id, probabilities)
        # every box cut first, so the scan goes before the first fine sliding window (the boxes are a part of it)
        subs, statistics = cut_regions(holder, boxes, self.preprocessing)
        labels, full = grid.restore(True) if probabilities else (None, None)
        devices, inside = [grid.device], []
        for number, box in enumerate(boxes):
            volume, geometry = region_input(subs[number], affine, box, self.preprocessing, statistics)
            subs[number] = None
            fine = self.fine.preprocessed_prediction([volume], geometry, case_id, None)
            devices.append(fine.device)
            inside.append(self._region(fine, grid, box, full))
            del fine
        if labels is None:  # the scan-sized label map only now
            labels = self._coarse_labels(grid, small)
        del grid
        for box, box_labels in zip(boxes, inside):  # the boxes are disjoint (merged): each writes its own voxels
            labels[box] = box_labels
        self.last_region = describe_regions(boxes, shape, small)
        return labels, full, " / ".join(dict.fromkeys(devices))

    def _region(self, fine: GridPrediction, coarse: GridPrediction, box: Box, full) -> np.ndarray:
        """The uint8 label map of `box` from the fine stage's prediction there (`fine`, on the box's grid) and, with
        `cascade.fine_classes`, the coarse stage's (`compose_probabilities`); its probabilities are written into
        `full[box]` when `full` is given (then holding the coarse stage's). The probabilities are restored a few
        x-slices at a time (`REGION_CHUNK_VOXELS`), so a large region costs no region-sized K-channel arrays."""
        compose = self.fine_classes is not None
        if not compose and full is None:  # the fine stage's argmax: the label-only restore
            return fine.restore()[0]
        first, last = box_corners(box)
        size = last - first
        labels = np.empty(tuple(int(n) for n in size), np.uint8)
        rows = max(1, REGION_CHUNK_VOXELS // int(np.prod(size[1:])))
        for x in range(0, int(size[0]), rows):
            low, high = np.array([x, 0, 0]), np.array([min(x + rows, int(size[0])), size[1], size[2]])
            chunk_labels, probabilities = fine.restore(True, within=(low, high))
            where = tuple(slice(int(a), int(b)) for a, b in zip(first + low, first + high))
            if compose:
                below = full[where] if full is not None else coarse.restore(True, within=(first + low, first + high))[1]
                probabilities = compose_probabilities(probabilities, below, self.fine_classes, out=probabilities)
                chunk_labels = argmax_labels(probabilities)
            if full is not None:
                full[where] = probabilities
            labels[low[0] : high[0]] = chunk_labels
        return labels

    def _coarse_labels(self, grid: GridPrediction, small: int) -> np.ndarray:
        """The coarse stage's label map on the scan's grid. Background without restoring when every piece got a
        region and the margin is at least a coarse voxel: a voxel the restore labels foreground interpolates a coarse
        voxel of a piece (a mean of corners whose argmax is the background has the background as its argmax, and a
        mean of region probabilities at most 0.5 paints nothing), so it lies within a coarse voxel of the piece,
        inside its region."""
        if small == 0 and self.margin_mm >= float(np.max(grid.geometry.spacing)):
            return np.zeros(tuple(grid.geometry.original_shape), np.uint8)
        return grid.restore()[0]

    def predict_array(self, image, affine, case_id: str = "", roi=None, probabilities: bool = True):
        if roi is not None:
            raise ValueError("a cascade chooses its own regions: predict_array(roi=...) is for one stage")
        return self.predict_image([image], affine, case_id, probabilities)


def make_predictor(config, checkpoint, **kwargs) -> Predictor | CascadePredictor:
    """A `Predictor` for the run of `config`, or a `CascadePredictor` when it is a cascade's fine stage
    (`cascade.coarse_run` set): the coarse run's config and best weights are loaded from its folder.

    `checkpoint` may be a list of runs of one configuration (its folds: `Predictor`'s fold ensemble). For a
    cascade's folds, each fold's config.yaml names its own coarse run (`cascade.coarse_run`, the coarse
    configuration's fold of the same number), and the coarse stage is the fold ensemble of those runs.
    """
    checkpoints = list(checkpoint) if isinstance(checkpoint, (list, tuple)) else [checkpoint]
    if len(checkpoints) == 1:
        coarse_runs = [config.cascade.coarse_run] if config.cascade.coarse_run else []
    else:
        coarse_runs = [load_config(run_config(run)).cascade.coarse_run for run in checkpoints]
        if any(coarse_runs) and not all(coarse_runs):
            missing = next(run for run, coarse in zip(checkpoints, coarse_runs) if not coarse)
            raise DataError(
                f"{missing}: its config.yaml has no cascade.coarse_run, other folds of this ensemble have one: the "
                "folds of an ensemble must be one configuration"
            )
        coarse_runs = coarse_runs if all(coarse_runs) else []
    if not coarse_runs:
        return Predictor(config, checkpoint, **kwargs)
    for coarse_run in coarse_runs:
        if not Path(coarse_run).is_dir():
            raise MissingInput(
                f"cascade.coarse_run: {coarse_run} is not a run folder; train the coarse stage first (python -m "
                f"tfmis.train --config <its plan.yaml>) or set cascade.coarse_run to where it is"
            )
    coarse_config = load_config(run_config(coarse_runs[0]))
    coarse = Predictor(coarse_config, coarse_runs if len(coarse_runs) > 1 else coarse_runs[0], **kwargs)
    c = config.cascade
    return CascadePredictor(
        Predictor(config, checkpoint, **kwargs), coarse, c.margin_mm, c.min_region_mm3, c.fine_classes
    )
