"""Deep supervision: the loss of a U-Net's output plus the losses of its lower-resolution heads.

As nnU-Net trains by default, and as MONAI's `DeepSupervisionLoss` does: each head's logits are compared with
the labels subsampled to the head's resolution, and the losses are weighted 1, 1/2, 1/4, ... from the output
down, the weights normalised to sum to 1 (nnU-Net's weighting; MONAI's `weight_mode="exp"` leaves them
unnormalised). The labels are subsampled as PyTorch's `nearest-exact` interpolation does (MONAI's default for
deep supervision): output voxel `o` of a head downsampled by `f` along an axis takes the label at
`floor((o + 0.5) * f)`, the voxel at offset `f // 2` of each block of `f`.

Example:
```python
loss_fn = DeepSupervisionLoss(build_loss("dice_ce"), factors=[(2, 2, 2), (4, 4, 4)])
loss = loss_fn(labels, training_model(images, training=True))   # [logits, 1/2-resolution, 1/4-resolution]
```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf


def deep_supervision_weights(num_outputs: int) -> list[float]:
    """nnU-Net's weights of the output and `num_outputs - 1` heads: 1/2^i, normalised to sum to 1.

    Example:
        >>> deep_supervision_weights(3)
        [0.5714285714285714, 0.2857142857142857, 0.14285714285714285]
    """
    raw = [0.5**i for i in range(num_outputs)]
    return [w / sum(raw) for w in raw]


def subsample_labels(labels, factor: Sequence[int]):
    """Integer labels (B, X, Y, Z) or (B, X, Y, Z, 1) at 1/`factor` resolution per axis (`nearest-exact`)."""
    fx, fy, fz = (int(f) for f in factor)
    return labels[:, fx // 2 :: fx, fy // 2 :: fy, fz // 2 :: fz]


class DeepSupervisionLoss:
    """`loss_fn` applied to the output and to each deep-supervision head, weighted and summed.

    Args:
        loss_fn: `fn(labels, logits) -> scalar`, e.g. `build_loss("dice_ce")`.
        factors: per-axis downsampling factor of each head, finest first (a `UNetArchitecture`'s
            `deep_supervision_levels`); the output itself is at factor 1.
        weights: one per output (the output first); default `deep_supervision_weights`.
    """

    def __init__(self, loss_fn: Callable, factors: Sequence[Sequence[int]], weights: Sequence[float] | None = None):
        self.loss_fn = loss_fn
        self.factors = [tuple(int(f) for f in factor) for factor in factors]
        self.weights = list(weights) if weights is not None else deep_supervision_weights(len(self.factors) + 1)
        if len(self.weights) != len(self.factors) + 1:
            raise ValueError(f"deep supervision: {len(self.weights)} weights for {len(self.factors) + 1} outputs")

    @property
    def supports_partial_sums(self) -> bool:
        return bool(getattr(self.loss_fn, "supports_partial_sums", False))

    def partial_sums(self, labels, outputs) -> list:
        """Each output's `loss_fn.partial_sums` over a part of the patch (labels subsampled per head; a part
        starting at a multiple of every head's factor subsamples the voxels the whole patch would)."""
        self._check(outputs)
        sums = [self.loss_fn.partial_sums(labels, outputs[0])]
        for factor, logits in zip(self.factors, outputs[1:]):
            sums.append(self.loss_fn.partial_sums(subsample_labels(labels, factor), logits))
        return sums

    def from_sums(self, sums: list):
        """The weighted loss from the totals of `partial_sums` over all parts."""
        total = sum(w * self.loss_fn.from_sums(s) for w, s in zip(self.weights, sums))
        return tf.cast(total, tf.float32)

    def _check(self, outputs):
        if not isinstance(outputs, (list, tuple)) or len(outputs) != len(self.factors) + 1:
            raise ValueError(
                f"deep supervision expects [logits, {len(self.factors)} head logits], got "
                f"{type(outputs).__name__} of {len(outputs) if isinstance(outputs, (list, tuple)) else 1}"
            )

    def __call__(self, labels, outputs):
        self._check(outputs)
        total = self.weights[0] * self.loss_fn(labels, outputs[0])
        for weight, factor, logits in zip(self.weights[1:], self.factors, outputs[1:]):
            total += weight * self.loss_fn(subsample_labels(labels, factor), logits)
        return tf.cast(total, tf.float32)
