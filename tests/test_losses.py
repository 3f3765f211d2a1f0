"""Segmentation losses against values worked out by hand on tiny volumes and against MONAI's formulas.

Logits are chosen so that the probabilities are round numbers: softmax(log p) = p when p sums to
one, and sigmoid(log(p / (1 − p))) = p. The volumes are (B, X, Y, Z) = (B, 2, 2, 1); the voxel
order in the comments is the row-major order of the 2×2 grid.

The MONAI references are NumPy transcriptions (channels-last) of MONAI 1.6.1's `DiceLoss.forward`,
`FocalLoss.forward` with `sigmoid_focal_loss` / `softmax_focal_loss` (monai/losses/focal_loss.py) and
`DiceFocalLoss` (monai/losses/dice.py), with `to_onehot_y=True` and reduction "mean".
"""

import math
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmis.losses import DiceCELoss, DiceFocalLoss, DiceLoss, build_loss

ln = math.log
NO_SMOOTH = dict(smooth_nr=0.0, smooth_dr=0.0)

# Sample 0: labels 0, 1, 2, 1 with softmax probabilities (rows sum to one)
LABELS_0 = [0, 1, 2, 1]
SOFTMAX_P0 = [[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6], [0.5, 0.4, 0.1]]
# Sample 1: labels 0, 0, 0, 1 (class 2 absent)
LABELS_1 = [0, 0, 0, 1]
SOFTMAX_P1 = [[0.8, 0.1, 0.1], [0.6, 0.3, 0.1], [0.5, 0.25, 0.25], [0.2, 0.7, 0.1]]
# Sample 0 again with independent per-channel sigmoid probabilities
SIGMOID_P0 = [[0.9, 0.2, 0.5], [0.3, 0.8, 0.1], [0.1, 0.4, 0.7], [0.6, 0.5, 0.2]]


def volume_labels(*samples, dtype=tf.uint8):
    return tf.constant(np.array(samples).reshape(len(samples), 2, 2, 1), dtype)


def softmax_logits(*tables, dtype=tf.float32):
    return tf.constant(np.log(np.array(tables)).reshape(len(tables), 2, 2, 1, -1), dtype)


def sigmoid_logits(*tables, dtype=tf.float32):
    p = np.array(tables)
    return tf.constant(np.log(p / (1 - p)).reshape(len(tables), 2, 2, 1, -1), dtype)


def value(loss_fn, labels, logits):
    return float(loss_fn(labels, logits))


# ---------------------------------------------------------------- Dice, softmax


def test_softmax_dice_by_hand():
    # class 0: g = 1,0,0,0  I = 0.7  Σp = 0.7+0.1+0.2+0.5 = 1.5  Σg = 1  dice = 1.4/2.5
    # class 1: g = 0,1,0,1  I = 0.6+0.4 = 1.0  Σp = 0.2+0.6+0.2+0.4 = 1.4  Σg = 2  dice = 2.0/3.4
    # class 2: g = 0,0,1,0  I = 0.6  Σp = 0.1+0.3+0.6+0.1 = 1.1  Σg = 1  dice = 1.2/2.1
    labels, logits = volume_labels(LABELS_0), softmax_logits(SOFTMAX_P0)
    with_background = 1 - (1.4 / 2.5 + 2.0 / 3.4 + 1.2 / 2.1) / 3
    without_background = 1 - (2.0 / 3.4 + 1.2 / 2.1) / 2
    assert value(DiceLoss(**NO_SMOOTH), labels, logits) == pytest.approx(with_background, abs=1e-6)
    assert value(DiceLoss(include_background=False, **NO_SMOOTH), labels, logits) == pytest.approx(
        without_background, abs=1e-6
    )


def test_softmax_dice_squared_denominator():
    # Σp²: class 0 .49+.01+.04+.25 = .79, class 1 .04+.36+.04+.16 = .6, class 2 .01+.09+.36+.01 = .47
    # Σg² = Σg (one-hot): 1, 2, 1
    expected = 1 - (1.4 / 1.79 + 2.0 / 2.6 + 1.2 / 1.47) / 3
    loss = DiceLoss(squared_pred=True, **NO_SMOOTH)
    assert value(loss, volume_labels(LABELS_0), softmax_logits(SOFTMAX_P0)) == pytest.approx(expected, abs=1e-6)


def test_smoothing_terms_go_to_numerator_and_denominator():
    # (2I + 1) / (Σp + Σg + 0.5) per class
    expected = 1 - ((1.4 + 1) / (2.5 + 0.5) + (2.0 + 1) / (3.4 + 0.5) + (1.2 + 1) / (2.1 + 0.5)) / 3
    loss = DiceLoss(smooth_nr=1.0, smooth_dr=0.5)
    assert value(loss, volume_labels(LABELS_0), softmax_logits(SOFTMAX_P0)) == pytest.approx(expected, abs=1e-6)


def test_batch_dice_pools_the_samples_and_per_sample_dice_averages_them():
    labels = volume_labels(LABELS_0, LABELS_1)
    logits = softmax_logits(SOFTMAX_P0, SOFTMAX_P1)
    # sample 1: class 0: g = 1,1,1,0  I = .8+.6+.5 = 1.9  Σp = 2.1  Σg = 3  dice = 3.8/5.1
    #           class 1: g = 0,0,0,1  I = .7  Σp = .1+.3+.25+.7 = 1.35  Σg = 1  dice = 1.4/2.35
    #           class 2: absent, Σp = .55 > 0, dice = 0/.55 = 0
    per_sample = 1 - (1.4 / 2.5 + 2.0 / 3.4 + 1.2 / 2.1 + 3.8 / 5.1 + 1.4 / 2.35 + 0.0) / 6
    # pooled: class 0 I = .7+1.9 = 2.6  Σp = 1.5+2.1 = 3.6  Σg = 4  dice = 5.2/7.6
    #         class 1 I = 1.0+.7 = 1.7  Σp = 1.4+1.35 = 2.75  Σg = 3  dice = 3.4/5.75
    #         class 2 I = .6  Σp = 1.1+.55 = 1.65  Σg = 1  dice = 1.2/2.65
    pooled = 1 - (5.2 / 7.6 + 3.4 / 5.75 + 1.2 / 2.65) / 3
    assert value(DiceLoss(**NO_SMOOTH), labels, logits) == pytest.approx(per_sample, abs=1e-6)
    assert value(DiceLoss(batch=True, **NO_SMOOTH), labels, logits) == pytest.approx(pooled, abs=1e-6)


def test_empty_class_with_default_smoothing_costs_a_full_point():
    # sample 1, class 2: (0 + 1e-5) / (0.55 + 1e-5) ≈ 1.8e-5, so its loss is ≈ 1
    labels, logits = volume_labels(LABELS_1), softmax_logits(SOFTMAX_P1)
    expected = 1 - (3.8 / 5.1 + 1.4 / 2.35 + 1e-5 / 0.55) / 3
    assert value(DiceLoss(), labels, logits) == pytest.approx(expected, abs=1e-5)


# ---------------------------------------------------------------- Dice, sigmoid


def test_sigmoid_dice_by_hand():
    # each channel on its own, against the one-hot of labels 0, 1, 2, 1
    # class 0: I = .9  Σp = .9+.3+.1+.6 = 1.9  Σg = 1  dice = 1.8/2.9
    # class 1: I = .8+.5 = 1.3  Σp = .2+.8+.4+.5 = 1.9  Σg = 2  dice = 2.6/3.9
    # class 2: I = .7  Σp = .5+.1+.7+.2 = 1.5  Σg = 1  dice = 1.4/2.5
    labels, logits = volume_labels(LABELS_0), sigmoid_logits(SIGMOID_P0)
    loss = DiceLoss(activation="sigmoid", **NO_SMOOTH)
    assert value(loss, labels, logits) == pytest.approx(1 - (1.8 / 2.9 + 2.6 / 3.9 + 1.4 / 2.5) / 3, abs=1e-6)
    loss = DiceLoss(activation="sigmoid", include_background=False, **NO_SMOOTH)
    assert value(loss, labels, logits) == pytest.approx(1 - (2.6 / 3.9 + 1.4 / 2.5) / 2, abs=1e-6)


def test_single_sigmoid_channel_predicts_foreground():
    # one channel, probabilities .9 .2 .5 .6 of label > 0 for labels 0, 1, 2, 1 → g = 0,1,1,1
    # I = .2+.5+.6 = 1.3  Σp = 2.2  Σg = 3  dice = 2.6/5.2 = 0.5
    logits = sigmoid_logits([[0.9], [0.2], [0.5], [0.6]])
    loss = DiceLoss(activation="sigmoid", **NO_SMOOTH)
    assert value(loss, volume_labels(LABELS_0), logits) == pytest.approx(0.5, abs=1e-6)


# ---------------------------------------------------------------- Dice + CE, Dice + focal


def test_dice_ce_softmax_by_hand():
    # CE = mean −ln p_true = −(ln .7 + ln .6 + ln .6 + ln .4) / 4
    ce = -(ln(0.7) + ln(0.6) + ln(0.6) + ln(0.4)) / 4
    dice = 1 - (1.4 / 2.5 + 2.0 / 3.4 + 1.2 / 2.1) / 3
    loss = DiceCELoss(lambda_dice=0.5, lambda_ce=2.0, **NO_SMOOTH)
    assert value(loss, volume_labels(LABELS_0), softmax_logits(SOFTMAX_P0)) == pytest.approx(
        0.5 * dice + 2.0 * ce, abs=1e-6
    )
    # the CE covers background even when the Dice term leaves it out
    loss = DiceCELoss(include_background=False, **NO_SMOOTH)
    assert value(loss, volume_labels(LABELS_0), softmax_logits(SOFTMAX_P0)) == pytest.approx(
        1 - (2.0 / 3.4 + 1.2 / 2.1) / 2 + ce, abs=1e-6
    )


def test_dice_ce_sigmoid_by_hand():
    # binary CE of each (voxel, channel) against the one-hot target, averaged over all 12:
    # v0 (label 0): −ln .9 − ln .8 − ln .5     v1 (label 1): −ln .7 − ln .8 − ln .9
    # v2 (label 2): −ln .9 − ln .6 − ln .7     v3 (label 1): −ln .4 − ln .5 − ln .8
    bce = (
        -(
            ln(0.9)
            + ln(0.8)
            + ln(0.5)
            + ln(0.7)
            + ln(0.8)
            + ln(0.9)
            + ln(0.9)
            + ln(0.6)
            + ln(0.7)
            + ln(0.4)
            + ln(0.5)
            + ln(0.8)
        )
        / 12
    )
    dice = 1 - (1.8 / 2.9 + 2.6 / 3.9 + 1.4 / 2.5) / 3
    loss = DiceCELoss(activation="sigmoid", **NO_SMOOTH)
    assert value(loss, volume_labels(LABELS_0), sigmoid_logits(SIGMOID_P0)) == pytest.approx(dice + bce, abs=1e-6)


def test_dice_focal_sigmoid_by_hand():
    # MONAI's focal term is the sigmoid one: p_t = p where the one-hot target is 1, else 1 − p;
    # term −(1 − p_t)² ln p_t, mean over all 12 (voxel, channel) pairs
    # v0 g=1,0,0 p=.9,.2,.5 → p_t .9,.8,.5     v1 g=0,1,0 p=.3,.8,.1 → p_t .7,.8,.9
    # v2 g=0,0,1 p=.1,.4,.7 → p_t .9,.6,.7     v3 g=0,1,0 p=.6,.5,.2 → p_t .4,.5,.8
    p_true = [0.9, 0.8, 0.5, 0.7, 0.8, 0.9, 0.9, 0.6, 0.7, 0.4, 0.5, 0.8]
    focal = -sum((1 - p) ** 2 * ln(p) for p in p_true) / 12
    loss = DiceFocalLoss(gamma=2.0, lambda_dice=0.0, activation="sigmoid")
    assert value(loss, volume_labels(LABELS_0), sigmoid_logits(SIGMOID_P0)) == pytest.approx(focal, abs=1e-6)
    # the focal term ignores the Dice activation (MONAI's DiceFocalLoss gives its FocalLoss none)
    loss = DiceFocalLoss(gamma=2.0, lambda_dice=0.0, activation="softmax")
    assert value(loss, volume_labels(LABELS_0), sigmoid_logits(SIGMOID_P0)) == pytest.approx(focal, abs=1e-6)
    # include_background=False drops channel 0 from the focal term too: mean over the 8 others
    focal_fg = -sum((1 - p) ** 2 * ln(p) for k, p in enumerate(p_true) if k % 3) / 8
    loss = DiceFocalLoss(gamma=2.0, lambda_focal=0.5, activation="sigmoid", include_background=False, **NO_SMOOTH)
    dice = 1 - (2.6 / 3.9 + 1.4 / 2.5) / 2  # as in test_sigmoid_dice_by_hand
    assert value(loss, volume_labels(LABELS_0), sigmoid_logits(SIGMOID_P0)) == pytest.approx(
        dice + 0.5 * focal_fg, abs=1e-6
    )


def test_dice_focal_softmax_focal_option_by_hand():
    # focal_use_softmax (MONAI FocalLoss(use_softmax=True)): −(1 − p_t)² ln p_t on the true class of each
    # voxel (p_t = .7, .6, .6, .4), 0 on the other channels, mean over all 4 × 3 (voxel, channel) pairs
    focal = -(0.3**2 * ln(0.7) + 0.4**2 * ln(0.6) + 0.4**2 * ln(0.6) + 0.6**2 * ln(0.4)) / 12
    loss = DiceFocalLoss(gamma=2.0, lambda_dice=0.0, focal_use_softmax=True)
    assert value(loss, volume_labels(LABELS_0), softmax_logits(SOFTMAX_P0)) == pytest.approx(focal, abs=1e-6)


@pytest.mark.parametrize("activation", ["softmax", "sigmoid"])
def test_focal_with_gamma_zero_is_cross_entropy(activation):
    """γ = 0: the (sigmoid) focal term is the binary cross-entropy of every channel, whatever the Dice
    activation; the softmax option is the softmax cross-entropy divided by the number of channels."""
    rng = np.random.default_rng(0)
    labels = tf.constant(rng.integers(0, 3, (2, 4, 4, 3)), tf.int32)
    logits = tf.constant(rng.normal(0, 3, (2, 4, 4, 3, 3)), tf.float32)
    focal = DiceFocalLoss(gamma=0.0, lambda_dice=0.0, activation=activation)
    bce = DiceCELoss(lambda_dice=0.0, activation="sigmoid")
    assert value(focal, labels, logits) == pytest.approx(value(bce, labels, logits), rel=1e-6)
    assert value(bce, labels, logits) > 0.5  # not trivially zero
    softmax_focal = DiceFocalLoss(gamma=0.0, lambda_dice=0.0, focal_use_softmax=True)
    ce = DiceCELoss(lambda_dice=0.0, activation="softmax")
    assert value(softmax_focal, labels, logits) == pytest.approx(value(ce, labels, logits) / 3, rel=1e-6)


# ---------------------------------------------------------------- Dice + focal against MONAI


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def _log_softmax(x):
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def monai_dice_loss(probabilities, target, include_background, squared_pred, batch, smooth_nr, smooth_dr):
    """MONAI `DiceLoss.forward` after its activation and one-hot (channels last), reduction "mean"."""
    if not include_background and probabilities.shape[-1] > 1:
        probabilities, target = probabilities[..., 1:], target[..., 1:]
    axes = tuple(range(1, probabilities.ndim - 1))
    axes = (0,) + axes if batch else axes
    intersection = np.sum(target * probabilities, axis=axes)
    if squared_pred:
        target, probabilities = target**2, probabilities**2
    denominator = np.sum(target, axis=axes) + np.sum(probabilities, axis=axes)
    return np.mean(1.0 - (2.0 * intersection + smooth_nr) / (denominator + smooth_dr))


def monai_focal_loss(logits, target, include_background, gamma, alpha=None, use_softmax=False):
    """MONAI `FocalLoss.forward` (to_onehot_y already applied, reduction "mean"): background dropped
    from logits and target first, then `sigmoid_focal_loss` or `softmax_focal_loss`, then the mean over
    every element (batch, channel and space)."""
    if not include_background and logits.shape[-1] > 1:
        logits, target = logits[..., 1:], target[..., 1:]
    if use_softmax:
        if not include_background:
            alpha = None  # MONAI ignores a scalar alpha here, with a warning
        input_ls = _log_softmax(logits)
        loss = -((1 - np.exp(input_ls)) ** gamma) * input_ls * target
        if alpha is not None:
            loss = np.array([1 - alpha] + [alpha] * (target.shape[-1] - 1)) * loss
    else:
        loss = logits - logits * target - _log_sigmoid(logits)  # binary cross-entropy with logits
        invprobs = _log_sigmoid(-logits * (target * 2 - 1))  # log(1 − p_t)
        loss = np.exp(invprobs * gamma) * loss
        if alpha is not None:
            loss = (target * alpha + (1 - target) * (1 - alpha)) * loss
    return loss.mean()


def monai_dice_focal_loss(
    labels,
    logits,
    activation="softmax",
    include_background=True,
    gamma=2.0,
    alpha=None,
    lambda_dice=1.0,
    lambda_focal=1.0,
    squared_pred=False,
    batch=False,
    smooth_nr=1e-5,
    smooth_dr=1e-5,
):
    """MONAI `DiceFocalLoss(to_onehot_y=True, softmax=..., sigmoid=...)`: the focal term never gets the
    activation (MONAI does not pass `use_softmax` to its FocalLoss), so it is always the sigmoid form."""
    logits = np.asarray(logits, np.float64)
    target = np.eye(logits.shape[-1])[np.asarray(labels)]
    probabilities = np.exp(_log_softmax(logits)) if activation == "softmax" else 1 / (1 + np.exp(-logits))
    dice = monai_dice_loss(probabilities, target, include_background, squared_pred, batch, smooth_nr, smooth_dr)
    focal = monai_focal_loss(logits, target, include_background, gamma, alpha)
    return lambda_dice * dice + lambda_focal * focal


MONAI_DICE_FOCAL_CASES = [
    dict(activation="softmax"),
    dict(activation="softmax", include_background=False, lambda_focal=0.7),
    dict(activation="sigmoid"),
    dict(activation="sigmoid", include_background=False, gamma=1.5, alpha=0.25, lambda_dice=0.5),
    dict(activation="softmax", gamma=0.0, batch=True, squared_pred=True, alpha=0.75),
]


@pytest.mark.parametrize("options", MONAI_DICE_FOCAL_CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_dice_focal_matches_monai_dice_focal_loss(options):
    """DiceFocalLoss equals MONAI's DiceFocalLoss written out in NumPy: Dice on softmax/sigmoid
    probabilities, the sigmoid focal term averaged over every (sample, voxel, channel) element, channel 0
    dropped from both terms without include_background, optional alpha balance, lambda weights."""
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 3, (2, 4, 3, 5))
    logits = rng.normal(0, 2.5, (2, 4, 3, 5, 3)).astype(np.float32)
    expected = monai_dice_focal_loss(labels, logits, **options)
    actual = value(DiceFocalLoss(**options), tf.constant(labels, tf.uint8), tf.constant(logits))
    assert actual == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("include_background", [True, False])
@pytest.mark.parametrize("alpha", [None, 0.25])
def test_softmax_focal_option_matches_monai_focal_loss_use_softmax(include_background, alpha):
    """focal_use_softmax=True equals MONAI `FocalLoss(use_softmax=True)`: softmax over the kept channels
    (background dropped first), only the true class's term, mean over every element."""
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 4, (2, 5, 4, 3))
    logits = rng.normal(0, 2.0, (2, 5, 4, 3, 4)).astype(np.float32)
    target = np.eye(4)[labels]
    expected = monai_focal_loss(logits.astype(np.float64), target, include_background, 2.0, alpha, use_softmax=True)
    loss = DiceFocalLoss(lambda_dice=0.0, include_background=include_background, alpha=alpha, focal_use_softmax=True)
    assert value(loss, tf.constant(labels, tf.uint8), tf.constant(logits)) == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------- behaviour


def perfect_logits(labels, num_classes, activation, scale=1e4):
    """Confident and right for softmax and for per-channel sigmoids alike (which the focal term uses)."""
    return scale * (2.0 * tf.one_hot(labels, num_classes) - 1.0)


@pytest.mark.parametrize("activation", ["softmax", "sigmoid"])
def test_perfect_prediction_gives_zero_loss(activation):
    labels = volume_labels(LABELS_0, [2, 1, 0, 0])  # every class present in every sample
    logits = perfect_logits(tf.cast(labels, tf.int32), 3, activation)
    for loss_fn in (
        DiceLoss(activation=activation),
        DiceCELoss(activation=activation),
        DiceFocalLoss(activation=activation),
        DiceLoss(activation=activation, squared_pred=True),
    ):
        assert value(loss_fn, labels, logits) == pytest.approx(0.0, abs=1e-5)
    # and a wrong confident prediction is far from it
    assert value(DiceLoss(activation=activation), labels, tf.reverse(logits, axis=[-1])) > 0.5


LOSS_FACTORIES = [
    lambda a: DiceLoss(activation=a),
    lambda a: DiceLoss(activation=a, include_background=False, squared_pred=True, batch=True),
    lambda a: DiceCELoss(activation=a),
    lambda a: DiceFocalLoss(activation=a),
    lambda a: DiceFocalLoss(activation=a, include_background=False, focal_use_softmax=True, alpha=0.25),
]


@pytest.mark.parametrize("activation", ["softmax", "sigmoid"])
@pytest.mark.parametrize("make_loss", LOSS_FACTORIES)
def test_gradients_are_finite_and_nonzero(make_loss, activation):
    rng = np.random.default_rng(1)
    labels = tf.constant(rng.integers(0, 3, (2, 3, 3, 2)), tf.uint8)
    logits = tf.Variable(rng.normal(0, 2, (2, 3, 3, 2, 3)), dtype=tf.float32)
    loss_fn = make_loss(activation)
    with tf.GradientTape() as tape:
        loss = loss_fn(labels, logits)
    gradient = tape.gradient(loss, logits).numpy()
    assert np.all(np.isfinite(gradient)) and np.abs(gradient).max() > 1e-4
    # still finite at saturated (near-perfect) logits, where 1 − p_t underflows in float32
    logits.assign(perfect_logits(tf.cast(labels, tf.int32), 3, activation, scale=200.0))
    with tf.GradientTape() as tape:
        loss = loss_fn(labels, logits)
    assert np.all(np.isfinite(tape.gradient(loss, logits).numpy()))


@pytest.mark.parametrize("make_loss", LOSS_FACTORIES)
def test_float16_logits_match_float32(make_loss):
    rng = np.random.default_rng(2)
    labels = tf.constant(rng.integers(0, 3, (2, 4, 4, 2)), tf.uint8)
    logits16 = tf.constant(rng.normal(0, 2, (2, 4, 4, 2, 3)), tf.float16)
    for activation in ("softmax", "sigmoid"):
        loss_fn = make_loss(activation)
        reference = value(loss_fn, labels, tf.cast(logits16, tf.float32))
        # call() directly: the float32 cast must happen inside, not only in Keras' __call__
        direct = loss_fn.call(labels, logits16)
        assert direct.dtype == tf.float32
        assert float(direct) == pytest.approx(reference, abs=1e-6)
        assert value(loss_fn, labels, logits16) == pytest.approx(reference, abs=1e-6)


def test_labels_with_channel_axis_and_tf_function():
    labels = volume_labels(LABELS_0, LABELS_1)
    logits = softmax_logits(SOFTMAX_P0, SOFTMAX_P1)
    loss_fn = DiceFocalLoss(include_background=False)
    eager = value(loss_fn, labels, logits)

    @tf.function
    def compiled(y, p):
        return loss_fn(y, p)

    assert float(compiled(labels, logits)) == pytest.approx(eager, abs=1e-6)
    assert float(compiled(labels[..., tf.newaxis], logits)) == pytest.approx(eager, abs=1e-6)
    assert float(compiled(tf.cast(labels, tf.int32), logits)) == pytest.approx(eager, abs=1e-6)


def test_mirrored_strategy_gives_the_local_batch_mean():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    labels = volume_labels(LABELS_0, LABELS_1)
    logits = softmax_logits(SOFTMAX_P0, SOFTMAX_P1)
    with strategy.scope():
        loss_fn = DiceCELoss()
    expected = value(loss_fn, labels, logits)

    @tf.function
    def step(y, p):
        return strategy.run(loss_fn, args=(y, p))

    per_replica = step(labels, logits)
    local = strategy.experimental_local_results(per_replica)
    assert len(local) == 1 and float(local[0]) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    "loss_fn",
    [
        DiceLoss(
            include_background=False,
            activation="sigmoid",
            squared_pred=True,
            batch=True,
            smooth_nr=0.0,
            smooth_dr=1e-3,
            name="my_dice",
        ),
        DiceCELoss(lambda_dice=0.3, lambda_ce=0.7, include_background=False),
        DiceFocalLoss(gamma=1.5, lambda_focal=2.0, activation="sigmoid"),
        DiceFocalLoss(alpha=0.25, focal_use_softmax=True, include_background=False),
    ],
)
def test_config_round_trip(loss_fn):
    restored = type(loss_fn).from_config(loss_fn.get_config())
    assert restored.get_config() == loss_fn.get_config()
    # through Keras' registry too, as when a compiled model is saved and loaded
    deserialized = keras.losses.deserialize(keras.losses.serialize(loss_fn))
    assert type(deserialized) is type(loss_fn) and deserialized.get_config() == loss_fn.get_config()
    labels, logits = volume_labels(LABELS_0), softmax_logits(SOFTMAX_P0)
    assert value(deserialized, labels, logits) == pytest.approx(value(loss_fn, labels, logits), abs=1e-7)


def test_build_loss_by_name():
    assert type(build_loss("dice")) is DiceLoss
    assert type(build_loss("Dice-CE", lambda_ce=0.5)) is DiceCELoss
    loss = build_loss("dice_focal", gamma=1.0, include_background=False)
    assert type(loss) is DiceFocalLoss and loss.gamma == 1.0 and not loss.include_background
    with pytest.raises(ValueError, match="dice, dice_ce, dice_focal"):
        build_loss("jaccard")


def test_invalid_arguments_are_rejected():
    with pytest.raises(ValueError, match="activation"):
        DiceLoss(activation="relu")
    with pytest.raises(ValueError, match="gamma"):
        DiceFocalLoss(gamma=-1.0)
    with pytest.raises(ValueError, match="alpha"):
        DiceFocalLoss(alpha=1.5)
    with pytest.raises(ValueError, match="softmax needs at least 2 channels"):
        DiceLoss()(volume_labels(LABELS_0), tf.zeros((1, 2, 2, 1, 1)))
    with pytest.raises(NotImplementedError, match="sample_weight"):
        DiceLoss()(volume_labels(LABELS_0), softmax_logits(SOFTMAX_P0), sample_weight=tf.ones((1,)))


TWO_REPLICAS = """
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from tfmis.losses import DiceFocalLoss
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
rng = np.random.default_rng(0)
labels = rng.integers(0, 3, (4, 4, 4, 2)).astype(np.uint8)
logits = rng.normal(0, 2, (4, 4, 4, 2, 3)).astype(np.float32)
with strategy.scope():
    loss_fn = DiceFocalLoss(activation="sigmoid", include_background=False)
dataset = tf.data.Dataset.from_tensor_slices((labels, logits)).batch(4)
@tf.function
def step(y, p):
    return strategy.run(loss_fn, args=(y, p))
for y, p in strategy.experimental_distribute_dataset(dataset):
    local = [float(v) for v in strategy.experimental_local_results(step(y, p))]
expected = [float(loss_fn(labels[:2], logits[:2])), float(loss_fn(labels[2:], logits[2:]))]
assert np.allclose(local, expected, atol=1e-6), (local, expected)
print("OK")
"""


@pytest.mark.slow
def test_two_replicas_each_return_their_local_batch_mean():
    # Logical devices must be set before TensorFlow starts, hence a fresh interpreter.
    result = subprocess.run([sys.executable, "-c", TWO_REPLICAS], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


# ---------------------------------------------------------------- deep supervision


def nearest_exact(labels: np.ndarray, size) -> np.ndarray:
    """PyTorch's `interpolate(mode="nearest-exact")` (MONAI DeepSupervisionLoss's default) of integer labels
    (B, X, Y, Z) to `size`: output voxel o takes input voxel floor((o + 0.5) * in / out) on each axis."""
    index = [np.floor((np.arange(out) + 0.5) * (n / out)).astype(int) for n, out in zip(labels.shape[1:], size)]
    return labels[:, index[0]][:, :, index[1]][:, :, :, index[2]]


@pytest.mark.parametrize("trailing_axis", [False, True])
def test_deep_supervision_loss_is_nnunet_weighted_sum_over_nearest_exact_labels(trailing_axis):
    """DeepSupervisionLoss over [8^3 output, 4^3 head, (4, 4, 2) head (anisotropic, factors (2,2,2) and (2,2,4))]
    equals 4/7 L(y, p0) + 2/7 L(y↓, p1) + 1/7 L(y↓↓, p2): nnU-Net's 1, 1/2, 1/4 normalised to sum 1, with the labels
    resized as MONAI's nearest-exact, computed here from that formula."""
    from tfmis.losses import DeepSupervisionLoss

    rng = np.random.default_rng(3)
    labels = rng.integers(0, 3, (2, 8, 8, 8)).astype(np.uint8)
    outputs = [rng.normal(0, 2, (2, *size, 3)).astype(np.float32) for size in ((8, 8, 8), (4, 4, 4), (4, 4, 2))]
    base = DiceCELoss(include_background=False)
    expected = sum(
        w * value(base, tf.constant(nearest_exact(labels, p.shape[1:4])), tf.constant(p))
        for w, p in zip((4 / 7, 2 / 7, 1 / 7), outputs)
    )
    given = labels[..., None] if trailing_axis else labels
    loss = DeepSupervisionLoss(base, factors=[(2, 2, 2), (2, 2, 4)])
    assert float(loss(tf.constant(given), [tf.constant(p) for p in outputs])) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match=r"expects \[logits, 2 head logits\]"):
        loss(tf.constant(labels), tf.constant(outputs[0]))
