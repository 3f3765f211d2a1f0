"""Prediction through a coarse-to-fine cascade: a coarse stage finds the structures, a fine stage segments each.

The coarse stage (a low-resolution run) predicts the whole scan. Each connected piece of its foreground (classes
that touch form one piece) gets its own box, grown by `cascade.margin_mm` per side; boxes that overlap are merged.
Each box is cut from the original scan and goes through the fine stage (a full-resolution run trained on cases
cropped the same way, `data.conversion.crop_to_label_mm`). Small pieces are regions like any other: only pieces
under `cascade.min_region_mm3` (0 by default) are left out. Outside the boxes the label is background, or the
coarse stage's label for the classes the fine stage does not decide (`cascade.fine_classes`). When the coarse stage
finds nothing, the fine stage runs over the whole scan and decides every class; the CSV's `region` column says so.
The written label map has the input's geometry, as with one stage.

Example:
```python
predictor = make_predictor(load_config("runs/Task03/fullres/config.yaml"), "runs/Task03/fullres")
result = predictor.predict_file(InputCase("ct_001", "ct_001.nii.gz"), "predictions/")
print(result.region)  # "3 regions = 6.1% of the scan: 212x180x96, 40x38x22, 96x90x60"
```
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from scipy import ndimage

from tfmis.config import load_config
from tfmis.data.boxes import Box, grow_box, merge_boxes
from tfmis.errors import ConfigError, DataError, MissingInput
from tfmis.inference.inputs import run_config
from tfmis.inference.predictor import GridPrediction, Predictor
from tfmis.inference.restore import original_box


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
    grid: GridPrediction, affine: np.ndarray, margin_mm: float, min_volume_mm3: float = 0.0
) -> list[Box]:
    """The fine stage's boxes on the scan's grid (`affine`): each connected piece of the coarse stage's foreground,
    found on its own grid (the argmax, a few hundred times fewer voxels than the scan), mapped to the scan's voxels
    (flips and anisotropic spacings included), grown by `margin_mm`; overlapping boxes merged. Pieces under
    `min_volume_mm3` (measured on the coarse grid) are left out. [] when the coarse stage found nothing."""
    if grid.probabilities is None:
        return []
    coarse_voxel_mm3 = float(np.prod(grid.geometry.spacing))
    min_voxels = min_volume_mm3 / coarse_voxel_mm3 if min_volume_mm3 > 0 else 0
    offset = np.asarray(grid.offset)
    shape = grid.geometry.original_shape
    boxes = []
    for start, stop in pieces(grid.grid_labels() > 0, min_voxels):
        first, last = original_box(start + offset, stop + offset, grid.geometry)
        if np.all(last > first):
            boxes.append(grow_box(first, last, affine, margin_mm, shape))
    return merge_boxes(boxes)


def describe_regions(boxes: list[Box], shape) -> str:
    """One line for the CSV's `region` column: the number of boxes, their share of the scan and their sizes."""
    share = sum(float(np.prod([s.stop - s.start for s in b])) for b in boxes) / float(np.prod(shape[:3]))
    sizes = ", ".join("x".join(str(s.stop - s.start) for s in b) for b in boxes)
    what = "1 region" if len(boxes) == 1 else f"{len(boxes)} regions"
    return f"{what} = {100 * share:.3g}% of the scan: {sizes}"


def crop_affine(affine: np.ndarray, box: Box) -> np.ndarray:
    """The affine of `image[box]`: the same axes, the origin moved to the box's first voxel."""
    out = np.array(affine, dtype=np.float64, copy=True)
    out[:3, 3] = out[:3, :3] @ np.array([s.start for s in box], dtype=np.float64) + out[:3, 3]
    return out


class CascadePredictor(Predictor):
    """A `Predictor` for the fine stage that first runs `coarse` on the whole scan to find where to look.

    Args:
        config, checkpoint: the fine stage's run (its `cascade.margin_mm`, `cascade.min_region_mm3` and
            `cascade.fine_classes`), or its folds (a list: `Predictor`'s fold ensemble).
        coarse: the coarse stage's `Predictor` (for folds, the fold ensemble of their coarse runs).
        kwargs: `Predictor`'s (sliding-window settings, device, test-time augmentation), for both stages.

    After each case, `last_region` describes what the fine stage saw (also in `CaseResult.region`) and `last_boxes`
    are its boxes (slices of the scan's grid; [] when it saw the whole scan).
    """

    def __init__(self, config, checkpoint, coarse: Predictor, **kwargs):
        super().__init__(config, checkpoint, **kwargs)
        if list(coarse.class_names) != list(self.class_names):
            raise DataError(
                f"cascade.coarse_run: its classes {coarse.class_names} differ from this run's {self.class_names}"
            )
        self.coarse = coarse
        self.margin_mm = float(config.cascade.margin_mm)
        self.min_region_mm3 = float(config.cascade.min_region_mm3)
        fine = config.cascade.fine_classes
        self.fine_classes = sorted(fine) if fine else None
        if self.fine_classes and max(self.fine_classes) >= len(self.class_names):
            raise ConfigError(f"cascade.fine_classes {fine}: this run has labels 0..{len(self.class_names) - 1}")
        self.last_region = ""
        self.last_boxes: list[Box] = []

    def predict_image(self, holder: list, affine: np.ndarray, case_id: str = "", probabilities: bool = True):
        """(label map, probabilities (X, Y, Z, K) or None, device) of the image in `holder` ([image], emptied
        once the fine stage's boxes are cut): the coarse stage over the whole scan, the fine stage over each box
        around what it found (cut from the original scan, so it is preprocessed as the fine stage's training crops).
        Without `cascade.fine_classes` the label map is the fine stage's inside the boxes and background outside;
        with them, the coarse stage's everywhere, those classes replaced inside the boxes by the fine stage's. The
        probabilities are the fine stage's inside the boxes, background outside. When the coarse stage found
        nothing, the fine stage's over the whole scan, every class."""
        image = holder.pop()
        shape = image.shape[:3]
        grid = self.coarse.grid_prediction(image, affine, case_id)
        boxes = self.last_boxes = coarse_regions(grid, affine, self.margin_mm, self.min_region_mm3)
        if not boxes:
            self.last_region = "whole scan (the coarse stage found nothing)"
            del grid
            return super().predict_image([image], affine, case_id, probabilities)
        # every box cut first, so the scan goes before the first fine sliding window (the boxes are a part of it)
        subs = [np.ascontiguousarray(image[box]) for box in boxes]
        del image
        fine_results, full, devices = [], None, [grid.device]
        for number, box in enumerate(boxes):
            sub_labels, sub_probabilities, device = super().predict_image(
                [subs[number]], crop_affine(affine, box), case_id, probabilities
            )
            subs[number] = None
            devices.append(device)
            fine_results.append(sub_labels)
            if sub_probabilities is not None:
                if full is None:
                    full = np.zeros((*shape, sub_probabilities.shape[-1]), dtype=sub_probabilities.dtype)
                    if self.task.regions is None:  # background outside the boxes (region probabilities stay 0)
                        full[..., 0] = 1
                full[box] = sub_probabilities
            del sub_probabilities
        # the scan-sized label map only now: the coarse labels (restored from the small coarse grid) or background
        if self.fine_classes is None:
            labels = np.zeros(shape, dtype=np.uint8)
            is_fine = np.ones(256, dtype=bool)
        else:
            labels = grid.restore()[0].astype(np.uint8, copy=False)
            is_fine = np.zeros(256, dtype=bool)  # a lookup table on the uint8 labels (np.isin sorts a copy)
            is_fine[self.fine_classes] = True
        del grid
        # the boxes are disjoint (merged), so each writes its own voxels
        for box, sub_labels in zip(boxes, fine_results):
            inside = labels[box]
            inside[is_fine[inside]] = 0
            fine = is_fine[sub_labels]
            inside[fine] = sub_labels[fine]
        self.last_region = describe_regions(boxes, shape)
        return labels, full, " / ".join(dict.fromkeys(devices))

    def predict_array(self, image, affine, case_id: str = "", roi=None, probabilities: bool = True):
        if roi is not None:
            raise ValueError("a cascade chooses its own regions: predict_array(roi=...) is for one stage")
        return self.predict_image([image], affine, case_id, probabilities)


def make_predictor(config, checkpoint, **kwargs) -> Predictor:
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
    return CascadePredictor(config, checkpoint, coarse, **kwargs)
