"""Random augmentation of one (image, label) patch, as stateless TF ops.

Spatial, nnU-Net's (off by default): random rotation (per axis), scaling (one factor for all axes) and
elastic deformation, applied together as one resampling of the patch about its centre: trilinear for the image,
nearest for the label, zeros (image) and background (label) outside the input. When the input is a crop
enlarged by `spatial_margin` (what `tfmis.data.pipeline.volume_crops` cuts), the transformed patch samples
real voxels instead of padding, as nnU-Net's "patch size for spatial transform" does.
Then random flips per axis, in-plane (x, y) quarter turns, intensity scale and shift (MONAI
`RandScaleIntensity` / `RandShiftIntensity`) and gaussian noise. Every draw comes from `seed`, so a given seed
always gives the same patch, wherever it runs (tf.data on the CPU or the compiled training step).

Example:
```python
image, label = augment_patch(image, label, AugmentConfig(), seed=tf.constant([0, 3]))
config = AugmentConfig(rotate_prob=0.2, scale_prob=0.2)
margin = spatial_margin(config, [64, 64, 64])              # crop 64 + 2 * margin per axis, get a 64^3 patch back
image, label = augment_patch(big_image, big_label, config, seed, patch_size=[64, 64, 64])
```
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import tensorflow as tf

_SPATIAL_FOLD = 8  # the spatial draws come from fold_in(seed, 8): the 8 split seeds below keep their streams


def augment_patch(image: tf.Tensor, label: tf.Tensor, config, seed: tf.Tensor, patch_size=None, spatial: bool = True):
    """Augments image (X, Y, Z, C) float32 and label (X, Y, Z) with the probabilities in `config`.

    Args:
        config: an `AugmentConfig` (flip_*, rot90_prob, intensity_*, noise_*, rotate_*, scale_*, elastic_*).
        seed: shape (2,) int tensor.
        patch_size: the output's spatial size (python ints); None = the input's. A larger input (a crop with
            `spatial_margin` context) gives its centre patch, rotated / scaled / deformed when drawn.
        spatial: False skips rotation, scaling and elastic deformation (`random_spatial` already applied them
            with this seed where the crop was cut, as `tfmis.data.pipeline.volume_crops` does).

    Returns:
        image (px, py, pz, C), label (px, py, pz) of label's dtype.
    """
    if patch_size is not None or (spatial and spatial_enabled(config)):
        size = _static_size(image, patch_size)
        if spatial and spatial_enabled(config):
            image, label = random_spatial(image, label, config, spatial_seed(seed), size)
        elif patch_size is not None and image.shape[:3].as_list() != size:
            image, label = center_crop(image, label, size)
    seeds = tf.unstack(_split(seed, 8))
    for i, axis in enumerate(config.flip_axes):
        if config.flip_prob > 0:
            flip = uniform([], seeds[i]) < config.flip_prob
            image = tf.cond(flip, lambda a=axis, x=image: tf.reverse(x, [a]), lambda x=image: x)
            label = tf.cond(flip, lambda a=axis, y=label: tf.reverse(y, [a]), lambda y=label: y)
    if config.rot90_prob > 0:
        image, label = _random_rot90(image, label, config.rot90_prob, seeds[3])
    if config.intensity_prob > 0 and (config.intensity_scale > 0 or config.intensity_shift > 0):
        apply = uniform([], seeds[4]) < config.intensity_prob
        # U(1 - s, 1 + s), not 1 + U(-s, s): grappler folds (x + c1) + c2 into x + (c1 + c2) inside a tf.function
        # but not in tf.data, which would move the factor by one float32 step between the two placements
        factor = uniform([], seeds[5], 1.0 - config.intensity_scale, 1.0 + config.intensity_scale)
        offset = uniform([], seeds[6], -config.intensity_shift, config.intensity_shift)
        image = tf.cond(apply, lambda: image * factor + offset, lambda: image)
    if config.noise_std > 0 and config.noise_prob > 0:
        s_apply, s_noise = tf.unstack(_split(seeds[7], 2))
        apply = uniform([], s_apply) < config.noise_prob
        noise = normal(tf.shape(image), s_noise) * config.noise_std
        image = tf.cond(apply, lambda: image + noise, lambda: image)
    return image, label


def _split(seed, num):
    """`stateless_split` with the Philox algorithm named (the CPU's and GPU's "auto_select"): under XLA,
    "auto_select" derives other seeds from negative ones, and the step would draw other augmentations."""
    return tf.random.experimental.stateless_split(seed, num, alg="philox")


def uniform(shape, seed, minval: float = 0.0, maxval: float = 1.0) -> tf.Tensor:
    """Stateless float32 uniform in [minval, maxval): 24 random bits of Philox, scaled.

    Not `tf.random.stateless_uniform`: its float conversion differs under XLA (`jit_compile`), whereas the
    integer bits are the same in tf.data, in a tf.function and under XLA, on the CPU and the GPU, so every
    placement draws the same flips, angles and factors.
    """
    bits = tf.random.stateless_uniform(shape, seed=seed, minval=None, maxval=None, dtype=tf.uint32, alg="philox")
    unit = tf.cast(tf.bitwise.right_shift(bits, 8), tf.float32) * (1.0 / (1 << 24))  # exact
    if minval == 0.0 and maxval == 1.0:
        return unit
    return minval + unit * (maxval - minval)


def normal(shape, seed) -> tf.Tensor:
    """Stateless standard normal float32 (Box-Muller on `uniform`, for the same reason)."""
    s_radius, s_angle = tf.unstack(_split(seed, 2))
    radius = tf.sqrt(-2.0 * tf.math.log(1.0 - uniform(shape, s_radius)))  # 1 - u in (0, 1]
    return radius * tf.cos(uniform(shape, s_angle) * (2.0 * math.pi))


def _random_rot90(image, label, prob, seed):
    s_apply, s_k = tf.unstack(_split(seed, 2))
    k = tf.where(
        uniform([], s_apply) < prob,
        tf.random.stateless_uniform([], seed=s_k, minval=1, maxval=4, dtype=tf.int32, alg="philox"),
        0,
    )
    shape = tf.shape(image)
    # rot90 turns the first two axes of an (H, W, channels) tensor: fold (Z, C) into channels
    flat_image = tf.reshape(image, [shape[0], shape[1], -1])
    # turned as float32 (exact for label values): an integer Transpose asks oneDNN for a kernel it lacks, which
    # logs an error line once per process; the cast back keeps the label's dtype
    flat_label = tf.cast(tf.reshape(label, [shape[0], shape[1], -1]), tf.float32)
    rot_image = tf.image.rot90(flat_image, k)
    rot_label = tf.cast(tf.image.rot90(flat_label, k), label.dtype)
    new_xy = tf.shape(rot_image)[:2]
    image = tf.reshape(rot_image, tf.concat([new_xy, shape[2:]], 0))
    label = tf.reshape(rot_label, tf.concat([new_xy, shape[2:3]], 0))
    return image, label


# ----------------------------------------------------------------------------------------------------------------
# spatial: rotation, scaling, elastic deformation as one resampling


def spatial_enabled(config) -> bool:
    """Whether `config` (an `AugmentConfig`) turns on any of rotation, scaling or elastic deformation."""
    return config.rotate_prob > 0 or config.scale_prob > 0 or config.elastic_prob > 0


def spatial_margin(config, patch_size) -> list[int]:
    """Voxels of context per side, per axis, that a crop needs so that every rotation, scale and elastic
    displacement `config` can draw samples inside it (nnU-Net's enlarged "patch size for spatial transform").

    Zeros when the spatial augmentations are off or `config.enlarge_crop` is false (the patch is then
    resampled from itself, zeros outside). Crop `patch_size + 2 * margin` and pass `patch_size` to
    `augment_patch`.

    Example:
    ```python
    spatial_margin(AugmentConfig(rotate_prob=0.2, scale_prob=0.2), [64, 64, 64])   # e.g. [44, 44, 44]
    ```
    """
    if not spatial_enabled(config) or not config.enlarge_crop:
        return [0, 0, 0]
    rotate = tuple(float(r) for r in config.rotate_range) if config.rotate_prob > 0 else (0.0, 0.0, 0.0)
    scale = max(1.0, float(config.scale_range[1])) if config.scale_prob > 0 else 1.0
    elastic = float(config.elastic_magnitude[1]) if config.elastic_prob > 0 else 0.0
    return list(_margin(rotate, scale, elastic, tuple(int(s) for s in patch_size)))


def train_crop_size(pipeline) -> list[int]:
    """The spatial size of the training crops: `patch_size` plus 2 x `spatial_margin` (rotation, scaling,
    elastic deformation with `augment.enlarge_crop`); what `augment.placement: step` batches carry."""
    margin = spatial_margin(pipeline.augment, pipeline.patch_size)
    return [s + 2 * m for s, m in zip(pipeline.patch_size, margin)]


@functools.lru_cache(maxsize=64)
def _margin(rotate_range, scale_max, elastic_max, patch_size):
    half = (np.asarray(patch_size, np.float64) - 1) / 2
    # the largest reach of the patch corners, sum_j |A_ij| * half_j, over a fine grid of the angle box (the
    # maximum is smooth or on the box's faces, which the grid includes): 61 steps of <= 1 degree for 30 degrees
    angles = np.meshgrid(*[np.linspace(-r, r, 61) if r > 0 else np.zeros(1) for r in rotate_range], indexing="ij")
    angles = [a.ravel() for a in angles]
    matrix = np.stack(
        [np.stack(row, -1) for row in _rotation_rows([np.cos(a) for a in angles], [np.sin(a) for a in angles])], -2
    )
    reach = (np.abs(matrix) @ half).max(axis=0) * scale_max + elastic_max
    return tuple(max(0, math.ceil(r - h - 1e-9)) for r, h in zip(reach, half))


def _rotation_rows(cos, sin):
    """Rows of R = Rz(a2) Ry(a1) Rx(a0) (rotations about axes 2, 1, 0) from cos / sin of (a0, a1, a2)."""
    (c0, c1, c2), (s0, s1, s2) = cos, sin
    return (
        [c2 * c1, c2 * s1 * s0 - s2 * c0, c2 * s1 * c0 + s2 * s0],
        [s2 * c1, s2 * s1 * s0 + c2 * c0, s2 * s1 * c0 - c2 * s0],
        [-s1, c1 * s0, c1 * c0],
    )


def rotation_matrix(angles) -> tf.Tensor:
    """(3, 3) float32 rotation R = Rz(a2) · Ry(a1) · Rx(a0) for angles (3,) in radians, a_i about voxel axis i.

    Used as `affine_resample`'s matrix (output voxel o reads the input at R · (o - c) + c): +90 degrees about
    axis 2 gives `np.rot90(input, k=-1, axes=(0, 1))`.
    """
    angles = tf.cast(angles, tf.float32)
    cos, sin = tf.unstack(tf.cos(angles)), tf.unstack(tf.sin(angles))
    return tf.stack([tf.stack(row) for row in _rotation_rows(cos, sin)])


def affine_resample(
    image: tf.Tensor, label: tf.Tensor | None, matrix, output_size, displacement=None, origin=None, input_size=None
):
    """Samples an `output_size` patch of image (X, Y, Z, C) and label (X, Y, Z) through `matrix` about the centres.

    Output voxel o reads the input at `matrix · (o - c_out) + c_in (+ displacement[o])`, with c = (size - 1) / 2:
    `scipy.ndimage.affine_transform(input, matrix, offset=c_in - matrix · c_out, output_shape=output_size)`.
    Image: trilinear (order 1), label: nearest (order 0, halves round up), both zero outside the input (scipy's
    `mode="grid-constant"`). Gather-based (8 `tf.gather`s of the image, 1 of the label), graph- and XLA-safe.

    Args:
        image: (X, Y, Z, C) float32.
        label: (X, Y, Z) integer, or None.
        matrix: (3, 3), e.g. `rotation_matrix(angles) * scale`; the identity gives the centre crop exactly.
        output_size: (px, py, pz) python ints.
        displacement: optional (px, py, pz, 3) float32 voxel offsets added to the sampling positions (elastic).
        origin, input_size: the input is the window of `input_size` (python ints) voxels starting at voxel `origin`
            ((3,) int, may reach outside) of `image`, read in place: the result is exactly that of cutting the
            window out first (zeros outside `image`) and resampling it, without copying the window.

    Returns:
        image (px, py, pz, C) float32, label (px, py, pz) of label's dtype (or None).

    Example:
    ```python
    image, label = affine_resample(image, label, rotation_matrix([0.0, 0.0, 0.3]) * 1.2, [48, 48, 48])
    ```
    """
    out = [int(s) for s in output_size]
    matrix = tf.cast(matrix, tf.float32)
    shape = tf.shape(image)[:3]
    size = shape if origin is None else tf.constant([int(s) for s in input_size], tf.int32)
    centre_in = (tf.cast(size, tf.float32) - 1.0) / 2.0
    grids = [
        tf.reshape(tf.range(n, dtype=tf.float32) - (n - 1) / 2.0, s)
        for n, s in zip(out, ([-1, 1, 1], [1, -1, 1], [1, 1, -1]))
    ]
    coords = []
    for i in range(3):
        # elementwise, no matmul (the identity is exact), summed by one reduce_sum: a chain of adds is regrouped by
        # grappler's arithmetic optimizer in some graphs (inside a tf.cond in tf.data) and not in others, and the
        # patch would differ by 1e-6 between the tf.data pipeline and the training step
        terms = [tf.broadcast_to(matrix[i, j] * grids[j], out) for j in range(3)] + [tf.fill(out, centre_in[i])]
        if displacement is not None:
            terms.append(displacement[..., i])
        coords.append(tf.reduce_sum(tf.stack(terms), axis=0))
    strides = [shape[1] * shape[2], shape[2], 1]

    if origin is None:
        first, stop, origin = tf.zeros([3], tf.int32), shape, tf.zeros([3], tf.int32)
    else:  # window indices [first, stop) lie in both the window and the image
        origin = tf.cast(origin, tf.int32)
        first, stop = tf.maximum(-origin, 0), tf.minimum(size, shape - origin)

    def locate(index, i):
        """(flat offset along axis i, inside the window and the image) of window index `index`."""
        inside = tf.logical_and(index >= first[i], index < stop[i])
        return tf.clip_by_value(index + origin[i], 0, shape[i] - 1) * strides[i], inside

    corners = []  # per axis: [(offset, weight) of the lower and the upper neighbour]
    for i in range(3):
        floor = tf.floor(coords[i])
        frac = coords[i] - floor
        lower = tf.cast(floor, tf.int32)
        axis = []
        for step, weight in ((0, 1.0 - frac), (1, frac)):
            offset, inside = locate(lower + step, i)
            axis.append((offset, tf.where(inside, weight, 0.0)))
        corners.append(axis)
    flat = tf.reshape(image, [-1, tf.shape(image)[3]])
    pairs = [(a0 + a1, w0 * w1) for (a0, w0), (a1, w1) in itertools.product(corners[0], corners[1])]
    result = None
    for (a01, w01), (a2, w2) in itertools.product(pairs, corners[2]):
        value = tf.gather(flat, a01 + a2) * (w01 * w2)[..., None]
        result = value if result is None else result + value

    if label is None:
        return result, None
    located = [locate(tf.cast(tf.floor(c + 0.5), tf.int32), i) for i, c in enumerate(coords)]
    inside = tf.logical_and(tf.logical_and(located[0][1], located[1][1]), located[2][1])
    sampled = tf.gather(tf.reshape(label, [-1]), located[0][0] + located[1][0] + located[2][0])
    return result, tf.where(inside, sampled, tf.zeros([], label.dtype))


def center_crop(image: tf.Tensor, label: tf.Tensor, size):
    """The centre `size` patch of image (X, Y, Z, C) and label (X, Y, Z) (X - px even: exactly centred)."""
    start = (tf.shape(label) - tf.constant(size, tf.int32)) // 2
    return (tf.slice(image, tf.concat([start, [0]], 0), [*size, -1]), tf.slice(label, start, size))


def window(image: tf.Tensor, label: tf.Tensor, begin, size):
    """The `size` (python ints) window of image (X, Y, Z, C) and label (X, Y, Z) starting at voxel `begin` ((3,)
    int tensor, may reach outside): only the part inside is read, the rest is zeros (background)."""
    begin = tf.cast(begin, tf.int32)
    size = [int(s) for s in size]
    shape = tf.shape(label)
    low = tf.clip_by_value(begin, 0, shape)
    high = tf.maximum(tf.clip_by_value(begin + size, 0, shape), low)  # a window wholly outside reads nothing
    before = tf.clip_by_value(low - begin, 0, size)
    pads = tf.stack([before, size - before - (high - low)], axis=1)
    cut = tf.slice(image, tf.concat([low, [0]], 0), tf.concat([high - low, [-1]], 0))
    image = tf.ensure_shape(tf.pad(cut, tf.concat([pads, [[0, 0]]], 0)), [*size, image.shape[-1]])
    return image, tf.ensure_shape(tf.pad(tf.slice(label, low, high - low), pads), size)


def elastic_displacement(seed: tf.Tensor, output_size, sigma_range, magnitude_range) -> tf.Tensor:
    """A smooth random displacement field (px, py, pz, 3) float32, in voxels.

    Gaussian-smoothed white noise: gaussians of width sigma ~ U(sigma_range) (voxels) with random normal weights
    on a lattice of spacing <= sigma/2 (three small matmuls, not a convolution over the patch), each component
    scaled so that its largest |displacement| is magnitude ~ U(magnitude_range) voxels.
    """
    s_sigma, s_magnitude, s_noise = tf.unstack(_split(seed, 3))
    sigma = uniform([], s_sigma, float(sigma_range[0]), float(sigma_range[1]))
    magnitude = uniform([], s_magnitude, float(magnitude_range[0]), float(magnitude_range[1]))
    spacing = max(1, int(sigma_range[0] // 2))
    reach = int(math.ceil(3 * sigma_range[1]))
    kernels = []
    for n in (int(s) for s in output_size):
        lattice = tf.constant(np.arange(-reach, n + reach, spacing), tf.float32)
        distance = tf.range(n, dtype=tf.float32)[:, None] - lattice[None, :]
        kernels.append(tf.exp(-tf.square(distance) / (2.0 * tf.square(sigma))))  # (n, lattice)
    noise = normal([3, *(int(k.shape[1]) for k in kernels)], s_noise)
    field = tf.einsum("kc,nabc->nabk", kernels[2], noise)
    field = tf.einsum("jb,nabk->najk", kernels[1], field)
    field = tf.einsum("ia,najk->ijkn", kernels[0], field)  # (px, py, pz, 3)
    peak = tf.reduce_max(tf.abs(field), axis=[0, 1, 2])
    return field * (magnitude / tf.maximum(peak, 1e-12))


def _static_size(image, patch_size):
    size = list(patch_size) if patch_size is not None else image.shape[:3].as_list()
    if len(size) != 3 or any(s is None for s in size):
        raise ValueError(
            f"augment_patch: the spatial augmentations need a static patch size, got {size}: pass "
            "patch_size=[px, py, pz]"
        )
    return [int(s) for s in size]


def spatial_seed(seed: tf.Tensor) -> tf.Tensor:
    """The seed of a crop's rotation / scaling / elastic draws, from its augmentation seed (int32 (2,))."""
    return tf.random.experimental.stateless_fold_in(seed, _SPATIAL_FOLD, alg="philox")


def spatial_draw(config, seed):
    """The spatial draws of `seed` (a crop's `spatial_seed`): (apply, matrix, deform) — whether anything is
    resampled, the (3, 3) rotation x scale matrix (the identity when neither is drawn) and whether an elastic field
    is added. `random_spatial` resamples with them; `sampled_box` bounds what they read."""
    s_rotate, s_angles, s_scale, s_side, s_factor, s_elastic, _ = tf.unstack(_split(seed, 7))
    no = tf.constant(False)
    rotate = uniform([], s_rotate) < config.rotate_prob if config.rotate_prob > 0 else no
    angles = uniform([3], s_angles, -1.0, 1.0) * tf.constant([float(r) for r in config.rotate_range], tf.float32)
    angles = tf.where(rotate, angles, 0.0)
    scaled = uniform([], s_scale) < config.scale_prob if config.scale_prob > 0 else no
    low, high = (float(v) for v in config.scale_range)
    # as nnU-Net: half the draws zoom in (factor below 1), half zoom out, when the range spans 1
    zoom_in = tf.logical_and(uniform([], s_side) < 0.5, low < 1.0)
    u = uniform([], s_factor)
    factor = tf.where(zoom_in, low + u * (min(high, 1.0) - low), max(low, 1.0) + u * (high - max(low, 1.0)))
    factor = tf.where(scaled, factor, 1.0)
    matrix = rotation_matrix(angles) * factor
    deform = uniform([], s_elastic) < config.elastic_prob if config.elastic_prob > 0 else no
    return tf.logical_or(tf.logical_or(rotate, scaled), deform), matrix, deform


def sampled_box(config, seed, size, input_size):
    """(low, high) int32 (3,): the box of an `input_size` window that `random_spatial(..., seed, size,
    input_size=input_size)` reads, inside the window. The centre `size` patch when nothing is drawn; otherwise the
    bounding box of the resampled positions (the patch corners through the drawn matrix, plus the largest elastic
    displacement) with a voxel to spare for the trilinear neighbours and float rounding. Reading only this box
    (and passing `origin=-low`) gives exactly what reading the whole window gives, for fewer bytes: without a draw
    the patch, with one a box that is the whole window only for the largest rotation and scale."""
    size = [int(s) for s in size]
    full = tf.constant([int(s) for s in input_size], tf.int32)
    apply, matrix, deform = spatial_draw(config, seed)
    half = tf.constant([(s - 1) / 2.0 for s in size], tf.float32)
    centre = (tf.cast(full, tf.float32) - 1.0) / 2.0
    reach = tf.reduce_sum(tf.abs(matrix) * half[None, :], axis=1)
    if config.elastic_prob > 0:
        reach += tf.where(deform, float(config.elastic_magnitude[1]), 0.0)
    low = tf.maximum(tf.cast(tf.floor(centre - reach), tf.int32) - 1, 0)
    high = tf.minimum(tf.cast(tf.floor(centre + reach), tf.int32) + 2, full)
    patch_low = (full - tf.constant(size, tf.int32)) // 2
    return tf.where(apply, low, patch_low), tf.where(apply, high, patch_low + size)


def random_spatial(image, label, config, seed, size, origin=None, input_size=None):
    """The spatial part of `augment_patch`: draws rotation, scale and elastic field from `seed` (its
    `spatial_seed`, `spatial_draw`) and resamples the centre `size` patch of the input, or cuts it when nothing is
    drawn.

    `origin` / `input_size`: the input is that window of `image` (e.g. a crop's context in the whole volume), read
    in place; the result is exactly that of `augment_patch` on the window cut out (`window`), without the copy.
    """
    apply, matrix, deform = spatial_draw(config, seed)
    s_field = _split(seed, 7)[6]

    def resample():
        field = None
        if config.elastic_prob > 0:
            field = tf.cond(
                deform,
                lambda: elastic_displacement(s_field, size, config.elastic_sigma, config.elastic_magnitude),
                lambda: tf.zeros([*size, 3]),
            )
        return affine_resample(image, label, matrix, size, field, origin, input_size)

    def cut():
        if origin is None:
            return center_crop(image, label, size)
        return window(image, label, tf.cast(origin, tf.int32) + [(i - s) // 2 for i, s in zip(input_size, size)], size)

    return tf.cond(apply, resample, cut)
