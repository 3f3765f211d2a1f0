"""The planner's data step (`DataSteps.determine_data`): where the dataset is converted to, the target spacing
(nnU-Net's rule), the CT window and normalisation, the split and the shards, and the median shape the patch is
planned from (for a cascade's fine stage: of the labels' boxes, `roi_median_shape`)."""

from __future__ import annotations

import numpy as np

from tfmis.planning.decisions import DataDecision, Settings
from tfmis.planning.fingerprint import DatasetFingerprint
from tfmis.planning.inputs import PlanningInputs
from tfmis.planning.plan_file import fmt_shape
from tfmis.planning.rules import target_spacing


def normalisation_lines(fingerprint: DatasetFingerprint) -> list[str]:
    """Per channel, what the conversion does to it (from its modality name)."""
    lines = []
    for i, m in enumerate(fingerprint.modalities):
        if i in fingerprint.ct_channels:
            lo, hi = fingerprint.ct_window
            lines.append(
                f"channel {i} {m}: clip to [{lo:g}, {hi:g}] HU, then z-score with the labelled-foreground "
                f"mean and std of the training cases (measured by the conversion)"
            )
        else:
            lines.append(
                f"channel {i} {m}: z-score per case over the foreground (voxels unlike the background: 0, or a "
                "z-scored scan's border constant)"
            )
    return lines


def roi_median_shape(fingerprint: DatasetFingerprint, spacing, margin_mm: float) -> np.ndarray:
    """Median shape (voxels at `spacing`) of the cases' labelled boxes grown by `margin_mm` per side, each within
    its foreground crop; a case with no labelled voxels, or a fingerprint without label boxes, counts its crop."""
    spacing = np.asarray(spacing, dtype=np.float64)
    crop_mm = fingerprint.crop_shapes * fingerprint.spacings
    extents = fingerprint.label_extents_mm
    if extents is None:
        extents = np.full_like(crop_mm, np.nan)
    roi_mm = np.where(np.isnan(extents), crop_mm, np.minimum(extents + 2 * margin_mm, crop_mm))
    return np.median(np.maximum(np.round(roi_mm / spacing), 1), axis=0)


class DataSteps:
    """`ExperimentPlanner`'s data and conversion step, from the planner's `inputs` alone."""

    def __init__(self, inputs: PlanningInputs):
        self.inputs = inputs

    def determine_data(self) -> DataDecision:
        """Source and target folders, target spacing (nnU-Net's rule, or the fixed one), CT window and
        normalisation, split, shards; the median shape at the target spacing."""
        from tfmis.data.folds import assign_splits

        fp = self.inputs.fp
        out = Settings()
        out.set("data.source_dir", str(self.inputs.source_dir), "the dataset folder this plan was made from")
        out.set("data.dataset_dir", str(self.inputs.dataset_dir), "converted TFRecords (written on first use)")
        spacing, spacing_reason = self.inputs.fixed_spacing or target_spacing(fp.spacings, fp.crop_shapes)
        spacing = [float(round(s, 4)) for s in spacing]
        out.set("data.conversion.spacing", spacing, spacing_reason + " (mm, R,A,S)")
        norm = normalisation_lines(fp)
        notes = {
            "data.conversion": [
                "Normalisation, done by the conversion from the modality names: "
                + "; ".join(norm)
                + " (nnU-Net: CT clipped to the foreground percentiles, "
                "then z-scored with the foreground statistics; MRI z-score per case)."
            ]
        }
        if fp.ct_channels:
            lo, hi = fp.ct_window
            out.set(
                "data.conversion.ct_window",
                [float(lo), float(hi)],
                f"CT: the 0.5/99.5 percentiles of the labelled-foreground HU ({fp.source}), as nnU-Net clips",
            )
            out.set(
                "data.conversion.ct_normalization",
                "zscore",
                "CT after clipping: minus the labelled-foreground mean, over its std, both over all training "
                "cases (nnU-Net's CTNormalization; the conversion measures them)",
            )
        ids = assign_splits(list(fp.case_ids), self.inputs.split, None, self.inputs.seed)
        n_train = len(ids["train"])
        out.set(
            "data.conversion.split",
            list(self.inputs.split),
            f"train/val/test: {n_train}/{len(ids['val'])}/{len(ids.get('test', []))} cases (or folds: 5 as nnU-Net)",
        )
        shards = max(1, min(8, n_train // 4))
        out.set("data.conversion.shards", shards, f"about 4 training cases per shard ({n_train} training cases)")
        median_shape = fp.median_shape_at(spacing)
        if self.inputs.roi_margin_mm is not None:
            median_shape = roi_median_shape(fp, spacing, self.inputs.roi_margin_mm)
            out.set(
                "data.conversion.crop_to_label_mm",
                float(self.inputs.roi_margin_mm),
                f"the fine stage trains on the labels' box grown by {self.inputs.roi_margin_mm:g} mm per side, the "
                f"region the coarse stage cuts at prediction (median {fmt_shape(median_shape)} voxels)",
            )
        return DataDecision(
            settings=tuple(out),
            notes=notes,
            spacing=spacing,
            median_shape=median_shape,
            norm=norm,
            n_train=n_train,
            n_val=max(1, len(ids["val"])),
        )
