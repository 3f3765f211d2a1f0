"""Random patch crops balanced between foreground and background, as TF ops.

Like MONAI's `RandCropByPosNegLabeld` (and `RandCropByLabelClassesd` with `class_ratios`): a crop
centre is a random foreground voxel with probability pos/(pos+neg), otherwise a random background
voxel. Foreground voxel indices are computed once per volume (`foreground_indices`, cacheable);
volumes smaller than the patch are padded first.

Example:
```python
fg, fg_class = foreground_indices(label, max_per_class=20000)
images, labels = rand_crop_by_pos_neg(image, label, fg, fg_class, patch_size=(64, 64, 64),
                                      num_samples=2, pos=1.0, neg=1.0, seed=tf.constant([0, 7]))
```
"""

from __future__ import annotations

import tensorflow as tf


def pad_to_patch(image: tf.Tensor, label: tf.Tensor, patch_size) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Pads (symmetrically, with zeros = background) dims smaller than the patch; returns the offset."""
    shape = tf.shape(label)
    need = tf.maximum(tf.constant(patch_size, tf.int32) - shape, 0)
    before = need // 2
    paddings = tf.stack([before, need - before], axis=1)
    image = tf.pad(image, tf.concat([paddings, [[0, 0]]], axis=0))
    label = tf.pad(label, paddings)
    return image, label, before


def foreground_indices(label: tf.Tensor, num_classes: int, max_per_class: int = 20000, seed: int = 0):
    """Voxel indices (K, 3) int32 of each foreground class (at most `max_per_class` each) and their class (K,).

    Deterministic (stateless subsampling), so it can sit in the cached part of the pipeline.
    """
    indices, classes = [], []
    for c in range(1, num_classes):
        idx = tf.cast(tf.where(tf.equal(label, c)), tf.int32)
        n = tf.shape(idx)[0]
        keep = tf.argsort(tf.random.stateless_uniform([n], seed=[seed, c]))[:max_per_class]
        idx = tf.gather(idx, tf.sort(keep))
        indices.append(idx)
        classes.append(tf.fill([tf.shape(idx)[0]], tf.constant(c, tf.int32)))
    return tf.concat(indices, axis=0), tf.concat(classes, axis=0)


def _random_background_voxel(shape: tf.Tensor, label_at, seed: tf.Tensor, tries: int = 32) -> tf.Tensor:
    """A uniformly random voxel of a volume of `shape` with label 0 (rejection sampling; any voxel if none is
    found). `label_at(candidates)` gives the labels at (tries, 3) int32 voxel indices: only those are read."""
    candidates = tf.cast(tf.random.stateless_uniform([tries, 3], seed=seed) * tf.cast(shape, tf.float32), tf.int32)
    candidates = tf.minimum(candidates, shape - 1)
    is_background = tf.equal(tf.cast(label_at(candidates), tf.int32), 0)
    first = tf.argmax(tf.cast(is_background, tf.int32), output_type=tf.int32)  # 0 if none: any voxel
    return candidates[first]


def _random_foreground_voxel(fg: tf.Tensor, fg_class: tf.Tensor, class_probs, seed: tf.Tensor) -> tf.Tensor:
    seeds = tf.random.experimental.stateless_split(seed, 2)
    if class_probs is None:
        pick = tf.random.stateless_uniform([], seed=seeds[0], maxval=tf.shape(fg)[0], dtype=tf.int32)
        return fg[pick]
    # choose a class among those present (per the ratios), then a voxel of that class
    present = tf.reduce_any(tf.equal(fg_class[:, None], tf.range(1, len(class_probs) + 1)[None, :]), axis=0)
    probs = tf.where(present, tf.constant(class_probs, tf.float32), 0.0)
    cls = tf.random.stateless_categorical(tf.math.log(probs[None, :] + 1e-12), 1, seed=seeds[0])[0, 0]
    members = tf.where(tf.equal(fg_class, tf.cast(cls, tf.int32) + 1))[:, 0]
    pick = tf.random.stateless_uniform([], seed=seeds[1], maxval=tf.shape(members)[0], dtype=tf.int32)
    return fg[tf.cast(members[pick], tf.int32)]


def _padded_crop_starts(
    shape: tf.Tensor,
    label_at,
    fg: tf.Tensor,
    fg_class: tf.Tensor,
    patch_size,
    num_samples: int,
    pos: float,
    neg: float,
    seed: tf.Tensor,
    class_ratios=None,
) -> tf.Tensor:
    """(num_samples, 3) int32 crop origins in a volume already padded to at least `patch_size`, of `shape` (`fg` in
    its coordinates; `label_at(indices)` its labels at (N, 3) voxel indices): the one definition of how
    `rand_crop_by_pos_neg`, `crop_starts` and `crop_starts_at` draw their crops."""
    patch = tf.constant(patch_size, tf.int32)
    if class_ratios is not None:
        neg, pos = float(class_ratios[0]), float(sum(class_ratios[1:]))
        class_probs = [r / max(pos, 1e-12) for r in class_ratios[1:]]
    else:
        class_probs = None
    p_fg = pos / (pos + neg)
    has_fg = tf.shape(fg)[0] > 0
    starts = []
    for s in tf.unstack(tf.random.experimental.stateless_split(seed, num_samples)):
        s_choice, s_fg, s_bg = tf.unstack(tf.random.experimental.stateless_split(s, 3))
        want_fg = tf.logical_and(has_fg, tf.random.stateless_uniform([], seed=s_choice) < p_fg)
        centre = tf.cond(
            want_fg,
            lambda s=s_fg: _random_foreground_voxel(fg, fg_class, class_probs, s),
            lambda s=s_bg: _random_background_voxel(shape, label_at, s),
        )
        starts.append(tf.clip_by_value(centre - patch // 2, 0, shape - patch))
    return tf.stack(starts)


def crop_starts(
    label: tf.Tensor,
    fg: tf.Tensor,
    fg_class: tf.Tensor,
    patch_size,
    num_samples: int,
    pos: float,
    neg: float,
    seed: tf.Tensor,
    class_ratios=None,
) -> tf.Tensor:
    """(num_samples, 3) int32: where `rand_crop_by_pos_neg` with the same arguments cuts its crops, in voxels of
    the volume (negative where a volume smaller than the patch is padded): `window(image, label, start,
    patch_size)` is its crop. The same draw (`_padded_crop_starts`), so the spatial augmentations can read a
    crop's context around it without cutting anything."""
    return crop_starts_at(
        tf.shape(label),
        lambda indices: tf.gather_nd(label, indices),
        fg,
        fg_class,
        patch_size,
        num_samples,
        pos,
        neg,
        seed,
        class_ratios,
    )


def crop_starts_at(
    shape: tf.Tensor,
    label_at,
    fg: tf.Tensor,
    fg_class: tf.Tensor,
    patch_size,
    num_samples: int,
    pos: float,
    neg: float,
    seed: tf.Tensor,
    class_ratios=None,
) -> tf.Tensor:
    """`crop_starts` of a volume that is not in memory: its `shape` (3,) int32 and `label_at(indices)`, its labels
    at (N, 3) int32 voxel indices inside it (only the background candidates are read, at most 32 per crop).
    With `label_at` reading the same label volume, the origins equal `crop_starts`' (the same draw)."""
    shape = tf.cast(shape, tf.int32)
    patch = tf.constant(patch_size, tf.int32)
    offset = tf.maximum(patch - shape, 0) // 2  # pad_to_patch's: the volume sits at offset in the padded one

    def padded_label_at(indices):
        inside = tf.reduce_all((indices >= offset) & (indices < offset + shape), axis=1)
        labels = label_at(tf.clip_by_value(indices - offset, 0, shape - 1))
        return tf.where(inside, tf.cast(labels, tf.int32), 0)  # the padding is background

    starts = _padded_crop_starts(
        tf.maximum(shape, patch),
        padded_label_at,
        fg + offset[None, :],
        fg_class,
        patch_size,
        num_samples,
        pos,
        neg,
        seed,
        class_ratios,
    )
    return starts - offset[None, :]


def rand_crop_by_pos_neg(
    image: tf.Tensor,
    label: tf.Tensor,
    fg: tf.Tensor,
    fg_class: tf.Tensor,
    patch_size,
    num_samples: int,
    pos: float,
    neg: float,
    seed: tf.Tensor,
    class_ratios=None,
):
    """`num_samples` crops of `patch_size` from one volume.

    Args:
        image: (X, Y, Z, C) float; label: (X, Y, Z) integer.
        fg, fg_class: from `foreground_indices` (on the unpadded volume).
        patch_size: (px, py, pz) python ints.
        num_samples: crops to return.
        pos, neg: relative frequency of foreground / background crop centres.
        seed: shape (2,) int tensor; the crops are a pure function of it (stateless randomness).
        class_ratios: optional per-class ratios [background, class 1, ...]: a foreground centre is
            drawn from class c with probability ratio[c] (classes absent from the volume are skipped);
            ratio[0] replaces `neg` and sum(ratio[1:]) replaces `pos`.

    Returns:
        images (num_samples, px, py, pz, C), labels (num_samples, px, py, pz).
    """
    image, label, offset = pad_to_patch(image, label, patch_size)
    starts = _padded_crop_starts(
        tf.shape(label),
        lambda indices: tf.gather_nd(label, indices),
        fg + offset[None, :],
        fg_class,
        patch_size,
        num_samples,
        pos,
        neg,
        seed,
        class_ratios,
    )
    patch = tf.constant(patch_size, tf.int32)
    starts = tf.unstack(starts)
    images = [tf.slice(image, tf.concat([start, [0]], 0), tf.concat([patch, [-1]], 0)) for start in starts]
    labels = [tf.slice(label, start, patch) for start in starts]
    return tf.stack(images), tf.stack(labels)
