"""Prediction through a coarse-to-fine cascade (seed 003's coarse localisation + fine region of interest).

The coarse stage (a low-resolution run) predicts the whole scan; the box around its foreground, grown by
`cascade.margin_mm` per side, is cut from the original scan and only that box goes through the fine stage (a
full-resolution run trained on cases cropped the same way, `data.conversion.crop_to_label_mm`); outside the box
the label is background. When the coarse stage finds nothing, the fine stage sees the whole scan. The written
label map has the input's geometry, as with one stage.

Example:
```python
predictor = make_predictor(load_config("runs/Task03/fullres/config.yaml"), "runs/Task03/fullres")
result = predictor.predict_file(InputCase("ct_001", "ct_001.nii.gz"), "predictions/")
print(result.region)  # "box 212x180x96 = 6.1% of the scan"
```
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tfmis.data.preprocess import bounding_box
from tfmis.inference.predictor import GridPrediction, Predictor, run_config
from tfmis.inference.restore import original_box

MIN_COMPONENT_SHARE = 0.01  # coarse foreground specks below this share of it do not widen the region


def main_box(mask: np.ndarray, min_share: float = MIN_COMPONENT_SHARE) -> tuple[np.ndarray, np.ndarray] | None:
    """(start, stop) of the True voxels of `mask` without the connected pieces holding less than `min_share` of them;
    None when `mask` is empty. A coarse stage's specks at the scan's edge would otherwise stretch the box over the
    whole scan (seen on a 512x512x600 CT: three specks of 10-43 voxels at the first and last slices, against 2.5
    million in the organs)."""
    if not mask.any():
        return None
    if min_share > 0:
        from scipy import ndimage

        pieces, count = ndimage.label(mask)
        if count > 1:
            sizes = np.bincount(pieces.ravel())[1:]
            kept = np.zeros(count + 1, dtype=bool)  # a lookup table: np.isin sorts, with int64 copies of the scan
            kept[1:] = sizes >= min_share * sizes.sum()
            mask = kept[pieces]
        del pieces
    return bounding_box(mask)


def grow_box(start, stop, affine: np.ndarray, margin_mm: float, shape) -> tuple[slice, ...]:
    """The box [start, stop) grown by `margin_mm` on each side (ceil(margin / spacing) voxels per axis of the grid
    of `affine`), clipped to `shape`, as slices."""
    spacing = np.linalg.norm(np.asarray(affine, dtype=np.float64)[:3, :3], axis=0)
    margin = np.ceil(float(margin_mm) / spacing - 1e-9).astype(int)
    start = np.maximum(np.asarray(start) - margin, 0)
    stop = np.minimum(np.asarray(stop) + margin, np.asarray(shape[:3]))
    return tuple(slice(int(a), int(b)) for a, b in zip(start, stop))


def region_of_interest(
    mask: np.ndarray, affine: np.ndarray, margin_mm: float, min_share: float = MIN_COMPONENT_SHARE
) -> tuple[slice, ...] | None:
    """The box (slices on the grid of `mask` and `affine`) around the True voxels of `mask`, specks left out
    (`main_box`), grown by `margin_mm` on each side; None when `mask` is empty.

    Example:
        >>> m = np.zeros((40, 40, 20), bool); m[10:12, 20:30, 5] = True
        >>> region_of_interest(m, np.diag([2.0, 2.0, 5.0, 1.0]), 10.0)
        (slice(5, 17, None), slice(15, 35, None), slice(3, 8, None))
        >>> m[39, 39, 19] = True  # a speck: 1 of 21 voxels is under 10%
        >>> region_of_interest(m, np.diag([2.0, 2.0, 5.0, 1.0]), 10.0, min_share=0.1)
        (slice(5, 17, None), slice(15, 35, None), slice(3, 8, None))
    """
    found = main_box(mask, min_share)
    return None if found is None else grow_box(*found, affine, margin_mm, mask.shape)


def coarse_region(grid: GridPrediction, affine: np.ndarray, margin_mm: float) -> tuple[slice, ...] | None:
    """The fine stage's box on the scan's grid (`affine`): the coarse stage's foreground found on its own grid
    (`main_box` of the argmax, a few hundred times fewer voxels than the scan), mapped to the scan's voxels and grown
    by `margin_mm`; None when the coarse stage found nothing."""
    if grid.probabilities is None:
        return None
    foreground = grid.grid_labels() > 0
    found = main_box(foreground)
    if found is None:
        return None
    offset = np.asarray(grid.offset)
    start, stop = original_box(found[0] + offset, found[1] + offset, grid.geometry)
    return grow_box(start, stop, affine, margin_mm, grid.geometry.original_shape)


def crop_affine(affine: np.ndarray, box: tuple[slice, ...]) -> np.ndarray:
    """The affine of `image[box]`: the same axes, the origin moved to the box's first voxel."""
    out = np.array(affine, dtype=np.float64, copy=True)
    out[:3, 3] = out[:3, :3] @ np.array([s.start for s in box], dtype=np.float64) + out[:3, 3]
    return out


class CascadePredictor(Predictor):
    """A `Predictor` for the fine stage that first runs `coarse` on the whole scan to find where to look.

    Args:
        config, checkpoint: the fine stage's run (its `cascade.margin_mm` is the margin).
        coarse: the coarse stage's `Predictor`.
        kwargs: `Predictor`'s (sliding-window settings, device, test-time augmentation), for both stages.

    After each case, `last_region` describes what the fine stage saw (also in `CaseResult.region`) and `last_box` is
    that box (slices of the scan's grid; None for the whole scan).
    """

    def __init__(self, config, checkpoint, coarse: Predictor, **kwargs):
        super().__init__(config, checkpoint, **kwargs)
        if list(coarse.class_names) != list(self.class_names):
            raise ValueError(
                f"cascade.coarse_run: its classes {coarse.class_names} differ from this run's {self.class_names}"
            )
        self.coarse = coarse
        self.margin_mm = float(config.cascade.margin_mm)
        fine = config.cascade.fine_classes
        self.fine_classes = sorted(fine) if fine else None
        if self.fine_classes and max(self.fine_classes) >= len(self.class_names):
            raise ValueError(f"cascade.fine_classes {fine}: this run has labels 0..{len(self.class_names) - 1}")
        self.last_region = ""
        self.last_box = None

    def predict_image(self, holder: list, affine: np.ndarray, case_id: str = "", probabilities: bool = True):
        """(label map, probabilities (X, Y, Z, K) or None, device) of the image in `holder` ([image], emptied
        once the fine stage's box is cut): the coarse stage over the whole scan, the fine stage over the box around
        what it found (cut from the original scan, so it is preprocessed as the fine stage's training crops). With
        `cascade.fine_classes` the label map is the coarse stage's with those classes taken from the fine stage
        (inside the box); the probabilities are the fine stage's inside the box either way. The coarse stage's
        labels are restored to the scan's grid only when `fine_classes` needs them."""
        image = holder.pop()
        shape = image.shape[:3]
        grid = self.coarse.grid_prediction(image, affine, case_id)
        coarse_device = grid.device
        box = self.last_box = coarse_region(grid, affine, self.margin_mm)
        coarse_labels = grid.restore()[0] if box is not None and self.fine_classes is not None else None
        del grid
        if box is None:
            self.last_region = "whole scan (the coarse stage found nothing)"
            return super().predict_image([image], affine, case_id, probabilities)
        sub = [np.ascontiguousarray(image[box])]
        del image
        sub_labels, sub_probabilities, device = super().predict_image(
            sub, crop_affine(affine, box), case_id, probabilities
        )
        share = float(np.prod(sub_labels.shape)) / float(np.prod(shape))
        self.last_region = f"box {'x'.join(str(s.stop - s.start) for s in box)} = {100 * share:.3g}% of the scan"
        if self.fine_classes is None:
            labels = np.zeros(shape, dtype=sub_labels.dtype)
            labels[box] = sub_labels
        else:  # large structures from the coarse stage, the fine classes painted over them from the fine stage
            is_fine = np.zeros(256, dtype=bool)  # a lookup table on the uint8 labels (np.isin sorts a copy)
            is_fine[self.fine_classes] = True
            labels = coarse_labels.astype(sub_labels.dtype, copy=False)
            labels[is_fine[labels]] = 0
            inside = labels[box]
            fine = is_fine[sub_labels]
            inside[fine] = sub_labels[fine]
        del coarse_labels
        full = None
        if sub_probabilities is not None:
            full = np.zeros((*shape, sub_probabilities.shape[-1]), dtype=sub_probabilities.dtype)
            if self.task.regions is None:  # background outside the box (region probabilities stay 0 there)
                full[..., 0] = 1
            full[box] = sub_probabilities
        return labels, full, f"{coarse_device} / {device}" if coarse_device != device else device

    def predict_array(self, image, affine, case_id: str = "", roi=None, probabilities: bool = True):
        if roi is not None:
            raise ValueError("a cascade chooses its own region: predict_array(roi=...) is for one stage")
        return self.predict_image([image], affine, case_id, probabilities)

    def predict_file(self, case, output_dir, probabilities: bool = False):
        result = super().predict_file(case, output_dir, probabilities)
        result.region = self.last_region if result.status == "ok" else ""
        return result


def make_predictor(config, checkpoint, **kwargs) -> Predictor:
    """A `Predictor` for the run of `config`, or a `CascadePredictor` when it is a cascade's fine stage
    (`cascade.coarse_run` set): the coarse run's config and best weights are loaded from its folder."""
    coarse_run = config.cascade.coarse_run
    if not coarse_run:
        return Predictor(config, checkpoint, **kwargs)
    from tfmis.config import load_config

    if not Path(coarse_run).is_dir():
        raise FileNotFoundError(
            f"cascade.coarse_run: {coarse_run} is not a run folder; train the coarse stage first (python -m "
            f"tfmis.train --config <its plan.yaml>) or set cascade.coarse_run to where it is"
        )
    coarse = Predictor(load_config(run_config(coarse_run)), coarse_run, **kwargs)
    return CascadePredictor(config, checkpoint, coarse, **kwargs)
