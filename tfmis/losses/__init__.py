"""Segmentation losses: Dice, Dice + cross-entropy, Dice + focal (Keras 3, TensorFlow backend).

Example:
```python
from tfmis.losses import build_loss
loss_fn = build_loss("dice_ce", include_background=False)
```
"""

from tfmis.losses.deep_supervision import DeepSupervisionLoss, deep_supervision_weights
from tfmis.losses.dice import (
    ACTIVATIONS,
    LOSSES,
    DiceCELoss,
    DiceFocalLoss,
    DiceLoss,
    build_loss,
    cross_entropy,
    focal_loss,
    soft_dice_loss,
)

__all__ = [
    "ACTIVATIONS",
    "LOSSES",
    "DiceLoss",
    "DiceCELoss",
    "DiceFocalLoss",
    "build_loss",
    "soft_dice_loss",
    "cross_entropy",
    "focal_loss",
    "DeepSupervisionLoss",
    "deep_supervision_weights",
]
