"""Dice-based segmentation losses (MONAI semantics, channels-last, TensorFlow backend).

All losses take integer class labels `y_true` of shape (B, *spatial) or (B, *spatial, 1) and
logits `y_pred` of shape (B, *spatial, C) in any float dtype; they compute in float32 (safe under
mixed precision) and return one scalar: the mean over the local batch. Under a distribution
strategy the training loop divides that by the number of replicas.

With `regions` (nnU-Net's region-based training, its BraTS setting) the C channels are label unions, one
sigmoid each: the target of channel r is "the voxel's label is one of regions[r]", looked up from the integer
labels in a (labels × regions) membership table, and every channel counts (there is no background channel).

Example:
```python
loss_fn = DiceCELoss(include_background=False)           # or build_loss("dice_ce", ...)
loss = loss_fn(labels, model(images, training=True))     # labels (B, X, Y, Z) uint8
regions = DiceCELoss(activation="sigmoid", regions=[[1, 2, 3], [2, 3], [3]])  # Dice + BCE per region
```
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

ACTIVATIONS = ("softmax", "sigmoid")
# A logit low enough that exp() of it vanishes next to any real logit, yet finite (no inf - inf).
_MASKED_LOGIT = -1e9


def _validate_activation(activation: str) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
    return activation


def _labels_and_logits(y_true, y_pred):
    """(B, *spatial) int32 labels and float32 logits; accepts labels with a trailing axis of 1."""
    logits = tf.cast(y_pred, tf.float32)
    labels = tf.convert_to_tensor(y_true)
    if labels.shape.rank is None or logits.shape.rank is None:
        raise ValueError("losses need tensors of known rank")
    if labels.shape.rank == logits.shape.rank:
        labels = tf.squeeze(labels, axis=-1)
    if labels.shape.rank != logits.shape.rank - 1:
        raise ValueError(f"labels of shape {labels.shape} do not match logits of shape {logits.shape}")
    # Keras' Loss.__call__ hands labels over as float32; small integers are exact there.
    return tf.cast(labels, tf.int32), logits


def _num_channels(logits, activation: str) -> int:
    channels = logits.shape[-1]
    if channels is None:
        raise ValueError("the channel (class) axis of the logits must have a static size")
    if activation == "softmax" and channels < 2:
        raise ValueError("softmax needs at least 2 channels; use activation='sigmoid' for one channel")
    return channels


def _target(labels, channels: int, activation: str):
    """One-hot target (B, *spatial, C); a single sigmoid channel is foreground (label > 0)."""
    if activation == "sigmoid" and channels == 1:
        return tf.cast(labels > 0, tf.float32)[..., tf.newaxis]
    return tf.one_hot(labels, channels, dtype=tf.float32)


def region_membership(regions) -> list[list[float]]:
    """The (L + 2) × R membership table of `regions` (R lists of labels, L the largest label): row k holds 1.0
    in column r when label k is in regions[r]; the last row, all 0, is the row of any label above L.

    Example:
        >>> region_membership([[1, 2], [2]])
        [[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
    """
    regions = [[int(label) for label in region] for region in regions]
    if not regions or any(not region or min(region) < 0 for region in regions):
        raise ValueError(f"regions: expected one or more non-empty lists of labels >= 0, got {regions}")
    largest = max(max(region) for region in regions)
    return [[float(k in region) for region in regions] for k in range(largest + 2)]


def region_target(labels, membership):
    """(B, *spatial, R) float32 region target of integer `labels` from a `region_membership` table."""
    table = tf.constant(membership, tf.float32)
    return tf.gather(table, tf.minimum(labels, table.shape[0] - 1))


def soft_dice_loss(
    probabilities, target, include_background=True, squared_pred=False, batch=False, smooth_nr=1e-5, smooth_dr=1e-5
):
    """1 − soft Dice, averaged over classes (and samples unless `batch`), as MONAI `DiceLoss`.

    Args:
        probabilities: (B, *spatial, C) float32 class probabilities.
        target: (B, *spatial, C) float32 one-hot target.
        include_background: keep channel 0 (ignored, with a warning, when there is one channel).
        squared_pred: denominator Σp² + Σg² instead of Σp + Σg.
        batch: sum intersection and denominator over the batch too (one Dice per class).
        smooth_nr, smooth_dr: added to numerator and denominator (an empty class scores ~1 − 0).

    Example:
    ```python
    loss = soft_dice_loss(tf.nn.softmax(logits), tf.one_hot(labels, 3))
    ```
    """
    if not include_background:
        if probabilities.shape[-1] == 1:
            warnings.warn("single channel prediction, include_background=False ignored", stacklevel=2)
        else:
            probabilities, target = probabilities[..., 1:], target[..., 1:]
    rank = probabilities.shape.rank
    axes = ([0] if batch else []) + list(range(1, rank - 1))
    intersection = tf.reduce_sum(probabilities * target, axis=axes)
    if squared_pred:
        denominator = tf.reduce_sum(tf.square(probabilities), axes) + tf.reduce_sum(tf.square(target), axes)
    else:
        denominator = tf.reduce_sum(probabilities, axes) + tf.reduce_sum(target, axes)
    dice = (2.0 * intersection + smooth_nr) / (denominator + smooth_dr)
    return tf.reduce_mean(1.0 - dice)


def cross_entropy(labels, logits, target, activation: str):
    """Mean cross-entropy: sparse softmax CE per voxel, or binary CE per voxel and channel."""
    if activation == "softmax":
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=target, logits=logits))


def focal_loss(
    logits, target, gamma: float = 2.0, alpha=None, include_background: bool = True, use_softmax: bool = False
):
    """Mean focal loss −α_t (1 − p_t)^γ · log p_t, as MONAI `FocalLoss(reduction="mean")` (Lin et al. 2017).

    As in MONAI, channel 0 is dropped first when `include_background` is False, and the mean runs over
    every element (batch, voxels and channels). Sigmoid form (MONAI's default, `use_softmax=False`): one
    term per voxel and channel with p = sigmoid(logit), p_t = p on the target channel and 1 − p on the
    others, so γ = 0 gives the binary cross-entropy. Softmax form (`FocalLoss(use_softmax=True)`): p =
    softmax over the kept channels, a term only on each voxel's target channel; averaged over channels
    too, so γ = 0 gives the softmax cross-entropy divided by the number of kept channels.

    Args:
        logits: (B, *spatial, C) float32 logits.
        target: (B, *spatial, C) float32 one-hot target.
        gamma: focusing parameter ≥ 0.
        alpha: optional balance in [0, 1]: sigmoid form α on target channels and 1 − α elsewhere;
            softmax form 1 − α on channel 0 and α on the others (ignored without the background
            channel, as MONAI does).
        include_background: keep channel 0 (ignored, with a warning, when there is one channel).
        use_softmax: softmax form instead of the sigmoid one.

    Example:
    ```python
    loss = focal_loss(logits, tf.one_hot(labels, 3), gamma=2.0, include_background=False)
    ```
    """
    if not include_background:
        if logits.shape[-1] == 1:
            warnings.warn("single channel prediction, include_background=False ignored", stacklevel=2)
        else:
            logits, target = logits[..., 1:], target[..., 1:]
    if use_softmax:
        channels = logits.shape[-1]
        if channels == 1:
            warnings.warn("softmax over a single channel is constant: the focal term is 0", stacklevel=2)
        log_p_true = tf.reduce_sum(target * tf.nn.log_softmax(logits, axis=-1), axis=-1)
        # log(1 − p_t) as logsumexp over the other classes minus over all: finite (with finite
        # gradients) even where p_t rounds to 1 in float32, unlike pow(1 − p_t, γ).
        other_logits = tf.where(target > 0, tf.constant(_MASKED_LOGIT, logits.dtype), logits)
        log_1m_p_true = tf.reduce_logsumexp(other_logits, axis=-1) - tf.reduce_logsumexp(logits, axis=-1)
        per_voxel = -tf.exp(gamma * log_1m_p_true) * log_p_true
        if alpha is not None and include_background:
            weights = tf.constant([1.0 - alpha] + [alpha] * (channels - 1), logits.dtype)
            per_voxel *= tf.reduce_sum(target * weights, axis=-1)
        # the other channels' terms are 0 but count in MONAI's mean over every element
        return tf.reduce_mean(per_voxel) / channels
    bce = tf.nn.sigmoid_cross_entropy_with_logits(labels=target, logits=logits)
    # 1 − p_t is sigmoid(−x) for a positive target and sigmoid(x) for a negative one
    log_1m_p_true = tf.math.log_sigmoid(-logits * (2.0 * target - 1.0))
    loss = tf.exp(gamma * log_1m_p_true) * bce
    if alpha is not None:
        loss *= target * alpha + (1.0 - target) * (1.0 - alpha)
    return tf.reduce_mean(loss)


@keras.saving.register_keras_serializable(package="tfmis")
class DiceLoss(keras.losses.Loss):
    """Soft Dice loss from logits, as MONAI `DiceLoss(to_onehot_y=True, softmax=True)`.

    Probabilities come from the logits (softmax over channels, or an independent sigmoid per
    channel predicting membership of that class), the target is one-hot, and per class
    dice = (2·Σpg + smooth_nr) / (Σp + Σg + smooth_dr) over the spatial axes (and the batch when
    `batch=True`). The loss is 1 − dice averaged over classes and samples.

    Args:
        include_background: keep class 0 in the average.
        activation: `softmax` (mutually exclusive classes) or `sigmoid` (one sigmoid per class;
            with a single channel, that channel predicts label > 0).
        regions: None (the channels are classes), or one list of labels per channel: channel r predicts
            membership of the label union regions[r] (needs `activation="sigmoid"`; `include_background` does
            not apply: every channel is a region and counts).
        squared_pred: use Σp² + Σg² in the denominator.
        batch: one Dice per class over the whole local batch instead of one per sample.
        smooth_nr, smooth_dr: numerator and denominator smoothing.
        name: loss name. Other keyword arguments (`reduction`, `dtype`) go to `keras.losses.Loss`;
            the value is already a scalar, so reduction leaves it unchanged.

    Example:
    ```python
    loss_fn = DiceLoss(include_background=False)
    loss = loss_fn(labels, logits)     # labels (B, X, Y, Z) ints, logits (B, X, Y, Z, C)
    ```
    """

    def __init__(
        self,
        include_background=True,
        activation="softmax",
        squared_pred=False,
        batch=False,
        smooth_nr=1e-5,
        smooth_dr=1e-5,
        regions=None,
        name="dice_loss",
        **kwargs,
    ):
        super().__init__(name=name, **kwargs)
        self.include_background = bool(include_background)
        self.activation = _validate_activation(activation)
        self.regions = None if regions is None else [[int(label) for label in region] for region in regions]
        self._membership = None if regions is None else region_membership(self.regions)
        if self.regions is not None and self.activation != "sigmoid":
            raise ValueError("regions overlap, so they need activation='sigmoid' (one sigmoid per region)")
        self.squared_pred = bool(squared_pred)
        self.batch = bool(batch)
        self.smooth_nr = float(smooth_nr)
        self.smooth_dr = float(smooth_dr)

    def __call__(self, y_true, y_pred, sample_weight=None):
        # A scalar loss cannot be weighted per sample; Keras would silently broadcast the weights.
        if sample_weight is not None:
            raise NotImplementedError(f"{type(self).__name__} does not support sample_weight")
        return super().__call__(y_true, y_pred)

    def _probabilities(self, logits):
        return tf.nn.softmax(logits, axis=-1) if self.activation == "softmax" else tf.sigmoid(logits)

    @property
    def _keep_channel_0(self) -> bool:
        """Whether channel 0 counts: with regions it is a region, not the background."""
        return self.include_background or self.regions is not None

    def _inputs(self, y_true, y_pred):
        """(labels, logits, target: one-hot or regions), validated and in float32."""
        labels, logits = _labels_and_logits(y_true, y_pred)
        channels = _num_channels(logits, self.activation)
        if self.regions is None:
            return labels, logits, _target(labels, channels, self.activation)
        if channels != len(self.regions):
            raise ValueError(f"{len(self.regions)} regions but the logits have {channels} channels")
        return labels, logits, region_target(labels, self._membership)

    def _dice(self, logits, target):
        return soft_dice_loss(
            self._probabilities(logits),
            target,
            self._keep_channel_0,
            self.squared_pred,
            self.batch,
            self.smooth_nr,
            self.smooth_dr,
        )

    def call(self, y_true, y_pred):
        _, logits, target = self._inputs(y_true, y_pred)
        return self._dice(logits, target)

    # a loss of sums over voxels: a patch cut into parts (tfmis.networks.parallel, spatial) sums them part by part
    supports_partial_sums = True

    def partial_sums(self, y_true, y_pred) -> dict:
        """The sums this loss is made of, over the voxels of `y_pred` (a part of the patch): per sample and class
        the Dice intersection and denominator. `from_sums` of their totals over all parts is `call` on the whole
        patch."""
        labels, logits, target = self._inputs(y_true, y_pred)
        return self._dice_sums(logits, target)

    def _dice_sums(self, logits, target) -> dict:
        probabilities = self._probabilities(logits)
        if not self._keep_channel_0 and probabilities.shape[-1] > 1:  # one channel: kept, as soft_dice_loss does
            probabilities, target = probabilities[..., 1:], target[..., 1:]
        axes = list(range(1, probabilities.shape.rank - 1))
        if self.squared_pred:
            denominator = tf.reduce_sum(tf.square(probabilities), axes) + tf.reduce_sum(tf.square(target), axes)
        else:
            denominator = tf.reduce_sum(probabilities, axes) + tf.reduce_sum(target, axes)
        return {"intersection": tf.reduce_sum(probabilities * target, axes), "denominator": denominator}

    def _dice_from_sums(self, sums: dict):
        intersection, denominator = sums["intersection"], sums["denominator"]
        if self.batch:
            intersection, denominator = tf.reduce_sum(intersection, 0), tf.reduce_sum(denominator, 0)
        dice = (2.0 * intersection + self.smooth_nr) / (denominator + self.smooth_dr)
        return tf.reduce_mean(1.0 - dice)

    def from_sums(self, sums: dict):
        """The loss from the totals of `partial_sums` over all parts of the patch."""
        return self._dice_from_sums(sums)

    def get_config(self):
        config = super().get_config()
        config.update(
            include_background=self.include_background,
            activation=self.activation,
            squared_pred=self.squared_pred,
            batch=self.batch,
            smooth_nr=self.smooth_nr,
            smooth_dr=self.smooth_dr,
            regions=self.regions,
        )
        return config


@keras.saving.register_keras_serializable(package="tfmis")
class DiceCELoss(DiceLoss):
    """`lambda_dice`·Dice + `lambda_ce`·cross-entropy, as MONAI `DiceCELoss`.

    The cross-entropy always covers every class (`include_background` only affects the Dice term),
    so every output channel is trained and an argmax over them stays meaningful: sparse softmax CE
    for `softmax`, binary CE per channel against the one-hot target for `sigmoid`.

    Args:
        lambda_dice: weight of the Dice term (≥ 0).
        lambda_ce: weight of the cross-entropy term (≥ 0).
        **kwargs: `DiceLoss` arguments (include_background, activation, squared_pred, batch, ...).

    Example:
    ```python
    loss_fn = DiceCELoss(include_background=False, lambda_ce=0.5)
    ```
    """

    def __init__(self, lambda_dice=1.0, lambda_ce=1.0, name="dice_ce_loss", **kwargs):
        super().__init__(name=name, **kwargs)
        if lambda_dice < 0 or lambda_ce < 0:
            raise ValueError("lambda_dice and lambda_ce must be >= 0")
        self.lambda_dice = float(lambda_dice)
        self.lambda_ce = float(lambda_ce)

    def call(self, y_true, y_pred):
        labels, logits, target = self._inputs(y_true, y_pred)
        ce = cross_entropy(labels, logits, target, self.activation)
        return self.lambda_dice * self._dice(logits, target) + self.lambda_ce * ce

    def partial_sums(self, y_true, y_pred) -> dict:
        """`DiceLoss.partial_sums` plus the cross-entropy summed over the part's voxels (and channels) and how
        many terms it sums."""
        labels, logits, target = self._inputs(y_true, y_pred)
        if self.activation == "softmax":
            terms = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        else:
            terms = tf.nn.sigmoid_cross_entropy_with_logits(labels=target, logits=logits)
        count = tf.cast(tf.size(terms), tf.float32)
        return {**self._dice_sums(logits, target), "ce_sum": tf.reduce_sum(terms), "ce_count": count}

    def from_sums(self, sums: dict):
        ce = sums["ce_sum"] / sums["ce_count"]
        return self.lambda_dice * self._dice_from_sums(sums) + self.lambda_ce * ce

    def get_config(self):
        config = super().get_config()
        config.update(lambda_dice=self.lambda_dice, lambda_ce=self.lambda_ce)
        return config


@keras.saving.register_keras_serializable(package="tfmis")
class DiceFocalLoss(DiceLoss):
    """`lambda_dice`·Dice + `lambda_focal`·focal loss, as MONAI `DiceFocalLoss` (matched to MONAI 1.6.1).

    Equals MONAI's `DiceFocalLoss(to_onehot_y=True, softmax=True)` (or `sigmoid=True`) with the same
    `include_background`, `gamma`, `alpha`, `lambda_dice`, `lambda_focal`, `squared_pred`, `batch` and
    smoothing. As in MONAI, the activation only applies to the Dice term: the focal term is MONAI's
    `FocalLoss` on the raw logits, sigmoid form by default (MONAI's DiceFocalLoss does not pass
    `use_softmax` on; see `focal_loss`), averaged over every (sample, voxel, channel) element, and
    `include_background=False` drops channel 0 from both terms. MONAI's per-class `weight` is not
    supported.

    Args:
        gamma: focal focusing parameter (≥ 0; 0 gives the binary cross-entropy).
        lambda_dice: weight of the Dice term (≥ 0).
        lambda_focal: weight of the focal term (≥ 0).
        alpha: optional focal balance in [0, 1] (MONAI's `alpha`); None for none.
        focal_use_softmax: use the softmax focal form (MONAI `FocalLoss(use_softmax=True)`), which
            MONAI's own DiceFocalLoss cannot select.
        **kwargs: `DiceLoss` arguments (include_background, activation, squared_pred, batch, ...).

    Example:
    ```python
    loss_fn = DiceFocalLoss(gamma=2.0, include_background=False)   # MONAI DiceFocalLoss(..., softmax=True)
    ```
    """

    supports_partial_sums = False  # its focal term is not split into parts here: the patch is joined first

    def __init__(
        self,
        gamma=2.0,
        lambda_dice=1.0,
        lambda_focal=1.0,
        alpha=None,
        focal_use_softmax=False,
        name="dice_focal_loss",
        **kwargs,
    ):
        super().__init__(name=name, **kwargs)
        if gamma < 0:
            raise ValueError("gamma must be >= 0")
        if lambda_dice < 0 or lambda_focal < 0:
            raise ValueError("lambda_dice and lambda_focal must be >= 0")
        if alpha is not None and not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1] or None, got {alpha}")
        self.gamma = float(gamma)
        self.lambda_dice = float(lambda_dice)
        self.lambda_focal = float(lambda_focal)
        self.alpha = None if alpha is None else float(alpha)
        self.focal_use_softmax = bool(focal_use_softmax)
        if self.focal_use_softmax and self.regions is not None:
            raise ValueError("focal_use_softmax: regions overlap, the focal term of regions is the sigmoid form")

    def call(self, y_true, y_pred):
        _, logits, target = self._inputs(y_true, y_pred)
        focal = focal_loss(logits, target, self.gamma, self.alpha, self._keep_channel_0, self.focal_use_softmax)
        return self.lambda_dice * self._dice(logits, target) + self.lambda_focal * focal

    def get_config(self):
        config = super().get_config()
        config.update(
            gamma=self.gamma,
            lambda_dice=self.lambda_dice,
            lambda_focal=self.lambda_focal,
            alpha=self.alpha,
            focal_use_softmax=self.focal_use_softmax,
        )
        return config


LOSSES = {"dice": DiceLoss, "dice_ce": DiceCELoss, "dice_focal": DiceFocalLoss}


def build_loss(name: str, **kwargs) -> DiceLoss:
    """The loss called `name` (`dice`, `dice_ce` or `dice_focal`), built with `kwargs`.

    Args:
        name: loss name; case and `-`/`_` do not matter.
        **kwargs: constructor arguments of that loss.

    Example:
    ```python
    loss_fn = build_loss("dice_focal", gamma=1.0, include_background=False)
    ```
    """
    key = str(name).strip().lower().replace("-", "_")
    if key not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; valid names: {', '.join(LOSSES)}")
    return LOSSES[key](**kwargs)
