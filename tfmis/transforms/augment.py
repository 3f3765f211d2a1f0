"""Random augmentation of one (image, label) patch, as stateless TF ops.

Spatial: random flips per axis, in-plane (x, y) quarter turns. Intensity: random scale and shift
(MONAI `RandScaleIntensity` / `RandShiftIntensity`), gaussian noise. Every draw comes from `seed`,
so a given seed always gives the same patch.

Example:
```python
image, label = augment_patch(image, label, AugmentConfig(), seed=tf.constant([0, 3]))
```
"""

from __future__ import annotations

import tensorflow as tf


def augment_patch(image: tf.Tensor, label: tf.Tensor, config, seed: tf.Tensor):
    """Augments image (X, Y, Z, C) float32 and label (X, Y, Z) with the probabilities in `config`.

    Args:
        config: an `AugmentConfig` (flip_prob, flip_axes, rot90_prob, intensity_*, noise_*).
        seed: shape (2,) int tensor.
    """
    seeds = tf.unstack(tf.random.experimental.stateless_split(seed, 8))
    for i, axis in enumerate(config.flip_axes):
        if config.flip_prob > 0:
            flip = tf.random.stateless_uniform([], seed=seeds[i]) < config.flip_prob
            image = tf.cond(flip, lambda a=axis: tf.reverse(image, [a]), lambda: image)
            label = tf.cond(flip, lambda a=axis: tf.reverse(label, [a]), lambda: label)
    if config.rot90_prob > 0:
        image, label = _random_rot90(image, label, config.rot90_prob, seeds[3])
    if config.intensity_prob > 0 and (config.intensity_scale > 0 or config.intensity_shift > 0):
        apply = tf.random.stateless_uniform([], seed=seeds[4]) < config.intensity_prob
        factor = 1.0 + tf.random.stateless_uniform(
            [], seed=seeds[5], minval=-config.intensity_scale, maxval=config.intensity_scale)
        offset = tf.random.stateless_uniform(
            [], seed=seeds[6], minval=-config.intensity_shift, maxval=config.intensity_shift)
        image = tf.cond(apply, lambda: image * factor + offset, lambda: image)
    if config.noise_std > 0 and config.noise_prob > 0:
        s_apply, s_noise = tf.unstack(tf.random.experimental.stateless_split(seeds[7], 2))
        apply = tf.random.stateless_uniform([], seed=s_apply) < config.noise_prob
        noise = tf.random.stateless_normal(tf.shape(image), stddev=config.noise_std, seed=s_noise)
        image = tf.cond(apply, lambda: image + noise, lambda: image)
    return image, label


def _random_rot90(image, label, prob, seed):
    s_apply, s_k = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    k = tf.where(tf.random.stateless_uniform([], seed=s_apply) < prob,
                 tf.random.stateless_uniform([], seed=s_k, minval=1, maxval=4, dtype=tf.int32), 0)
    shape = tf.shape(image)
    # rot90 turns the first two axes of an (H, W, channels) tensor: fold (Z, C) into channels
    flat_image = tf.reshape(image, [shape[0], shape[1], -1])
    flat_label = tf.reshape(label, [shape[0], shape[1], -1])
    rot_image = tf.image.rot90(flat_image, k)
    rot_label = tf.image.rot90(flat_label, k)
    new_xy = tf.shape(rot_image)[:2]
    image = tf.reshape(rot_image, tf.concat([new_xy, shape[2:]], 0))
    label = tf.reshape(rot_label, tf.concat([new_xy, shape[2:3]], 0))
    return image, label
