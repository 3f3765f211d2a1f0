"""nnU-Net v2's scores (`nnunetv2/evaluation/evaluate_predictions.py`): Dice 2TP / (2TP + FP + FN), NaN when the
prediction and the reference both lack a structure (`nnunet_dice`); a structure is a label or a union of labels
(a region), scored from one case's confusion counts (`dice_from_confusion`) or label maps (`structure_dice`); the
means over cases leave NaN out and the foreground mean is an ordinary mean of those means (`dice_summary`).

These differ from `tfmis.metrics.segmentation`'s MONAI rules on purpose: cross-validation's choices (the best
configuration, postprocessing) are nnU-Net's, on nnU-Net's numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from tfmis.errors import DataError
from tfmis.metrics.segmentation import confusion_matrix


def nnunet_dice(tp: int, fp: int, fn: int) -> float:
    """nnU-Net's Dice 2TP / (2TP + FP + FN); NaN when TP + FP + FN = 0 (prediction and reference both empty; a
    prediction on an empty reference scores 0, unlike `tfmis.metrics.dice_per_class`'s MONAI rule)."""
    if tp + fp + fn == 0:
        return math.nan
    return 2.0 * tp / (2.0 * tp + fp + fn)


def dice_from_confusion(confusion: np.ndarray, structures: Mapping[str, Sequence[int]]) -> dict[str, float]:
    """nnU-Net's Dice of each structure (a label union, as nnU-Net's `region_or_label_to_mask`) from one case's
    confusion counts confusion[reference, prediction]."""
    dice = {}
    for name, labels in structures.items():
        labels = list(labels)
        tp = int(confusion[np.ix_(labels, labels)].sum())
        predicted, reference = int(confusion[:, labels].sum()), int(confusion[labels].sum())
        dice[name] = nnunet_dice(tp, predicted - tp, reference - tp)
    return dice


def structure_dice(
    prediction: np.ndarray, reference: np.ndarray, structures: Mapping[str, Sequence[int]]
) -> dict[str, float]:
    """nnU-Net's Dice (`nnunet_dice`) of each structure {name: labels} in one case's label maps (nnU-Net's
    `compute_metrics`, no ignore label): a structure's voxels are those labelled with any of its labels.

    Example:
    ```python
    structure_dice(prediction, reference, {"1": [1], "2": [2], "tumour": [1, 2]})
    ```
    """
    if prediction.shape != reference.shape:
        raise DataError(f"prediction shape {prediction.shape} differs from reference shape {reference.shape}")
    highest = max(max(labels) for labels in structures.values())
    if prediction.size:
        highest = max(highest, int(prediction.max()), int(reference.max()))
    return dice_from_confusion(confusion_matrix(prediction, reference, highest + 1), structures)


def _nanmean(values) -> float:
    """np.nanmean without its warning: the mean of the non-NaN values, NaN when there are none."""
    values = np.asarray(list(values), np.float64)
    finite = values[~np.isnan(values)]
    return float(finite.mean()) if finite.size else math.nan


def dice_summary(per_case: Sequence[Mapping[str, float]]) -> dict:
    """nnU-Net's `compute_metrics_on_folder` means: {"mean": {structure: mean over cases, NaN left out (nanmean)},
    "foreground_mean": the ordinary mean of those means (np.mean, so one structure with no finite Dice makes it
    NaN)}. Structures are those of the first case."""
    names = list(per_case[0]) if per_case else []
    means = {name: _nanmean(case[name] for case in per_case) for name in names}
    foreground_mean = float(np.mean(list(means.values()))) if means else math.nan
    return {"mean": means, "foreground_mean": foreground_mean}
