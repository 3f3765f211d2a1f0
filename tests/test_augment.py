"""Spatial augmentation (tfmis.transforms.augment): rotation, scaling and elastic deformation as one resampling,
checked against scipy.ndimage on the same matrix and centre, plus exact identities and label invariants."""

import numpy as np
import pytest
import tensorflow as tf
from scipy import ndimage

from tfmis.config import AugmentConfig, ConfigError, load_config
from tfmis.transforms.augment import (
    affine_resample,
    augment_patch,
    center_crop,
    elastic_displacement,
    random_spatial,
    rotation_matrix,
    sampled_box,
    spatial_draw,
    spatial_margin,
    spatial_seed,
    window,
)

SPATIAL_ONLY = dict(flip_prob=0.0, rot90_prob=0.0, intensity_prob=0.0, noise_std=0.0)


def random_volume(shape=(20, 22, 18), channels=2, labels=(0, 1, 2), seed=0):
    rng = np.random.default_rng(seed)
    image = rng.normal(size=(*shape, channels)).astype(np.float32)
    label = rng.choice(np.array(labels, np.int32), size=shape)
    return image, label


def scipy_reference(image, label, matrix, output_size, displacement=None):
    """scipy.ndimage on the same mapping: output o reads the input at matrix·(o - c_out) + c_in (+ displacement),
    order 1 for the image, order 0 for the label, zeros outside (mode grid-constant)."""
    matrix = np.asarray(matrix, np.float64)
    c_in = (np.array(image.shape[:3]) - 1) / 2
    c_out = (np.array(output_size) - 1) / 2
    if displacement is None:
        offset = c_in - matrix @ c_out
        ref_image = np.stack(
            [
                ndimage.affine_transform(
                    image[..., c].astype(np.float64),
                    matrix,
                    offset,
                    output_shape=output_size,
                    order=1,
                    mode="grid-constant",
                )
                for c in range(image.shape[-1])
            ],
            -1,
        )
        ref_label = ndimage.affine_transform(
            label, matrix, offset, output_shape=output_size, order=0, mode="grid-constant"
        )
        return ref_image, ref_label
    grid = np.stack(np.meshgrid(*[np.arange(n) for n in output_size], indexing="ij"), -1) - c_out
    coords = np.einsum("ij,xyzj->ixyz", matrix, grid) + c_in[:, None, None, None]
    coords = coords + np.moveaxis(np.asarray(displacement, np.float64), -1, 0)
    ref_image = np.stack(
        [
            ndimage.map_coordinates(image[..., c].astype(np.float64), coords, order=1, mode="grid-constant")
            for c in range(image.shape[-1])
        ],
        -1,
    )
    return ref_image, ndimage.map_coordinates(label, coords, order=0, mode="grid-constant")


@pytest.mark.parametrize(
    "angles, scale",
    [((0.3, -0.2, 0.5), 1.2), ((-0.52, 0.52, 0.1), 0.7), ((0.0, 0.0, 0.4), 1.4), ((0.1, 0.25, -0.45), 1.0)],
)
def test_affine_resample_matches_scipy_affine_transform(angles, scale):
    """Trilinear image within 1e-4 and nearest label (< 0.1 % of voxels, float32 vs float64 rounding at exact
    half-voxel ties) of scipy.ndimage.affine_transform with order 1 / order 0 on the same matrix and centres,
    including samples that fall partly or wholly outside the input."""
    image, label = random_volume()
    matrix = rotation_matrix(angles).numpy() * scale
    out_image, out_label = affine_resample(tf.constant(image), tf.constant(label), matrix, (16, 18, 14))
    ref_image, ref_label = scipy_reference(image, label, matrix, (16, 18, 14))
    assert out_image.shape == (16, 18, 14, 2) and out_label.dtype == tf.int32
    np.testing.assert_allclose(out_image.numpy(), ref_image, atol=1e-4)
    assert np.mean(out_label.numpy() != ref_label) < 1e-3
    assert (ref_image == 0).any() or scale <= 1.0  # the zoomed-out cases do sample outside the input


def test_elastic_field_is_added_to_the_sampling_grid_like_scipy_map_coordinates():
    """With a displacement field, output o reads the input at matrix·(o - c) + c + d(o) (scipy map_coordinates)."""
    image, label = random_volume()
    field = elastic_displacement(tf.constant([3, 4], tf.int64), (16, 18, 14), [3.0, 4.0], [2.0, 3.0])
    matrix = rotation_matrix([0.1, 0.0, -0.2]).numpy()
    out_image, out_label = affine_resample(tf.constant(image), tf.constant(label), matrix, (16, 18, 14), field)
    ref_image, ref_label = scipy_reference(image, label, matrix, (16, 18, 14), field.numpy())
    np.testing.assert_allclose(out_image.numpy(), ref_image, atol=1e-4)
    assert np.mean(out_label.numpy() != ref_label) < 1e-3


def test_elastic_field_is_smooth_and_bounded_by_its_magnitude():
    """Each component's largest |displacement| is the drawn magnitude (within [low, high]); neighbouring voxels
    move almost together (sigma 3-4 voxels); another seed gives another field."""
    fields = [
        elastic_displacement(tf.constant([i, 9], tf.int64), (20, 20, 20), [3.0, 4.0], [1.0, 2.0]).numpy()
        for i in range(3)
    ]
    for field in fields:
        assert field.shape == (20, 20, 20, 3)
        peak = np.abs(field).max(axis=(0, 1, 2))
        assert np.all(peak >= 1.0 - 1e-5) and np.all(peak <= 2.0 + 1e-5) and np.allclose(peak, peak[0], atol=1e-5)
        step = max(np.abs(np.diff(field, axis=a)).max() for a in range(3))
        assert step < 0.5 * peak[0]
    assert not np.allclose(fields[0], fields[1])


def test_identity_parameters_give_the_input_back_exactly():
    """Identity matrix: the input (or, from a larger input, its centre crop) bit for bit; through augment_patch,
    rotation by 0 and scaling by 1 drawn with probability 1 give the centre crop bit for bit too."""
    image, label = random_volume(shape=(16, 16, 16))
    out_image, out_label = affine_resample(tf.constant(image), tf.constant(label), np.eye(3), (16, 16, 16))
    np.testing.assert_array_equal(out_image.numpy(), image)
    np.testing.assert_array_equal(out_label.numpy(), label)
    big_image, big_label = random_volume(shape=(24, 22, 20))
    out_image, out_label = affine_resample(tf.constant(big_image), tf.constant(big_label), np.eye(3), (16, 16, 16))
    np.testing.assert_array_equal(out_image.numpy(), big_image[4:20, 3:19, 2:18])
    np.testing.assert_array_equal(out_label.numpy(), big_label[4:20, 3:19, 2:18])
    config = AugmentConfig(
        **SPATIAL_ONLY, rotate_prob=1.0, rotate_range=[0.0, 0.0, 0.0], scale_prob=1.0, scale_range=[1.0, 1.0]
    )
    for i in range(3):
        aug_image, aug_label = augment_patch(
            tf.constant(big_image),
            tf.constant(big_label),
            config,
            tf.constant([i, 0], tf.int64),
            patch_size=[16, 16, 16],
        )
        np.testing.assert_array_equal(aug_image.numpy(), big_image[4:20, 3:19, 2:18])
        np.testing.assert_array_equal(aug_label.numpy(), big_label[4:20, 3:19, 2:18])


@pytest.mark.parametrize(
    "angles, expected",
    [
        ((0, 0, np.pi / 2), lambda v: np.rot90(v, k=-1, axes=(0, 1))),
        ((0, 0, -np.pi / 2), lambda v: np.rot90(v, k=1, axes=(0, 1))),
        ((0, np.pi / 2, 0), lambda v: np.rot90(v, k=1, axes=(0, 2))),
        ((np.pi / 2, 0, 0), lambda v: np.rot90(v, k=-1, axes=(1, 2))),
    ],
)
def test_rotation_by_90_degrees_equals_np_rot90(angles, expected):
    """A quarter turn about one axis is np.rot90 in the other two axes (image within 1e-5: cos(pi/2) is not
    exactly 0 in float32; labels exact)."""
    image, label = random_volume(shape=(12, 12, 12), channels=1)
    out_image, out_label = affine_resample(
        tf.constant(image), tf.constant(label), rotation_matrix(angles), (12, 12, 12)
    )
    np.testing.assert_allclose(out_image.numpy(), expected(image), atol=1e-5)
    np.testing.assert_array_equal(out_label.numpy(), expected(label))


def test_labels_keep_only_existing_label_values():
    """Nearest-neighbour labels: rotated, scaled and deformed patches hold only values of the input (and 0
    outside), never a blend such as 1.5 -> 2 between 0 and 3."""
    image, label = random_volume(shape=(24, 24, 24), labels=(0, 3, 7))
    config = AugmentConfig(
        **SPATIAL_ONLY,
        rotate_prob=1.0,
        scale_prob=1.0,
        elastic_prob=1.0,
        elastic_sigma=[3.0, 4.0],
        elastic_magnitude=[1.0, 3.0],
        enlarge_crop=False,
    )
    for i in range(4):
        _, out = augment_patch(tf.constant(image), tf.constant(label), config, tf.constant([i, 1], tf.int64))
        assert set(np.unique(out.numpy())) <= {0, 3, 7}


def test_augment_patch_rotation_and_scaling_draw_their_probabilities():
    """rotate_prob / scale_prob 0.5: about half the patches change (40 seeds); seeds reproduce; off = centre crop."""
    image, label = random_volume(shape=(30, 30, 30))
    changed = 0
    for config in (AugmentConfig(**SPATIAL_ONLY, rotate_prob=0.5), AugmentConfig(**SPATIAL_ONLY, scale_prob=0.5)):
        outs = [
            augment_patch(
                tf.constant(image), tf.constant(label), config, tf.constant([i, 5], tf.int64), patch_size=[16, 16, 16]
            )[0].numpy()
            for i in range(40)
        ]
        changed = sum(not np.array_equal(o, image[7:23, 7:23, 7:23]) for o in outs)
        assert 10 <= changed <= 30, changed
        again = augment_patch(
            tf.constant(image), tf.constant(label), config, tf.constant([3, 5], tf.int64), patch_size=[16, 16, 16]
        )[0].numpy()
        np.testing.assert_array_equal(again, outs[3])


def test_fixed_scale_through_augment_patch_matches_scipy():
    """scale_range [1.25, 1.25] with probability 1: the patch is the scipy resampling by 1.25·I of the larger crop."""
    image, label = random_volume(shape=(26, 26, 26))
    config = AugmentConfig(**SPATIAL_ONLY, scale_prob=1.0, scale_range=[1.25, 1.25])
    out_image, out_label = augment_patch(
        tf.constant(image), tf.constant(label), config, tf.constant([1, 2], tf.int64), patch_size=[16, 16, 16]
    )
    ref_image, ref_label = scipy_reference(image, label, 1.25 * np.eye(3), (16, 16, 16))
    np.testing.assert_allclose(out_image.numpy(), ref_image, atol=1e-4)
    assert np.mean(out_label.numpy() != ref_label) < 1e-3


def test_spatial_draws_leave_the_other_augmentations_unchanged():
    """With rotation drawn but by 0 degrees, flips, quarter turns, intensity and noise are exactly those of the
    same seed without spatial augmentation on the centre crop (the spatial draws use their own seed stream)."""
    image, label = random_volume(shape=(20, 20, 20))
    others = dict(flip_prob=0.5, rot90_prob=0.5, intensity_prob=0.5, noise_std=0.1, noise_prob=0.5)
    plain = AugmentConfig(**others)
    spatial = AugmentConfig(**others, rotate_prob=1.0, rotate_range=[0.0, 0.0, 0.0])
    crop_image, crop_label = center_crop(tf.constant(image), tf.constant(label), [16, 16, 16])
    for i in range(6):
        seed = tf.constant([i, 7], tf.int64)
        a = augment_patch(crop_image, crop_label, plain, seed)
        b = augment_patch(tf.constant(image), tf.constant(label), spatial, seed, patch_size=[16, 16, 16])
        np.testing.assert_array_equal(a[0].numpy(), b[0].numpy())
        np.testing.assert_array_equal(a[1].numpy(), b[1].numpy())


def test_spatial_margin_matches_the_geometry():
    """Margins per side: scaling by s needs ceil(h (s - 1)), a rotation by r about one axis ceil(h (cos r + sin r
    - 1)) in the other two axes (h = (patch - 1) / 2); off or enlarge_crop false: no margin."""
    assert spatial_margin(AugmentConfig(scale_prob=0.2), [48, 48, 48]) == [10, 10, 10]  # 23.5 * 0.4 = 9.4
    r = 0.5236
    expected = int(np.ceil(23.5 * (np.cos(r) + np.sin(r) - 1)))
    assert spatial_margin(AugmentConfig(rotate_prob=0.2, rotate_range=[0, 0, r]), [48, 48, 48]) == [
        expected,
        expected,
        0,
    ]
    assert spatial_margin(AugmentConfig(elastic_prob=0.1, elastic_magnitude=[0, 3.5]), [48, 48, 48]) == [4, 4, 4]
    assert spatial_margin(AugmentConfig(), [48, 48, 48]) == [0, 0, 0]
    assert spatial_margin(AugmentConfig(rotate_prob=0.2, enlarge_crop=False), [48, 48, 48]) == [0, 0, 0]


def test_enlarged_crop_keeps_every_sample_inside_the_crop():
    """With the spatial_margin context, extreme and random rotations, scales and displacements never sample the
    zeros outside the crop: on an all-ones crop every output voxel is 1 (trilinear weights all inside)."""
    config = AugmentConfig(
        **SPATIAL_ONLY,
        rotate_prob=1.0,
        scale_prob=1.0,
        elastic_prob=1.0,
        elastic_sigma=[3.0, 4.0],
        elastic_magnitude=[0.0, 2.0],
    )
    patch = [12, 14, 10]
    margin = spatial_margin(config, patch)
    crop = [p + 2 * m for p, m in zip(patch, margin)]
    ones, zeros = tf.ones([*crop, 1]), tf.zeros(crop, tf.int32)
    for corner in np.array(np.meshgrid(*[[-1, 0, 1]] * 3)).reshape(3, -1).T:
        out, _ = affine_resample(ones, zeros, rotation_matrix(corner * 0.5236) * 1.4, patch)
        assert out.numpy().min() > 1 - 1e-5, corner
    for i in range(12):
        out, _ = augment_patch(ones, zeros, config, tf.constant([i, 3], tf.int64), patch_size=patch)
        assert out.numpy().min() > 1 - 1e-5
    # control: without the margin, the same rotations and scales do reach the zeros outside
    out, _ = affine_resample(
        tf.ones([*patch, 1]), tf.zeros(patch, tf.int32), rotation_matrix([0.5236] * 3) * 1.4, patch
    )
    assert out.numpy().min() < 0.5


@pytest.mark.parametrize(
    "override, message",
    [
        ("pipeline.augment.rotate_range=[0.5,0.5]", "pipeline.augment: rotate_range"),
        ("pipeline.augment.rotate_range=[4,0,0]", "pipeline.augment: rotate_range"),
        ("pipeline.augment.scale_prob=1.5", "pipeline.augment: scale_prob is a probability"),
        ("pipeline.augment.scale_range=[1.4,0.7]", "pipeline.augment: scale_range"),
        ("pipeline.augment.scale_range=[0,1.4]", "pipeline.augment: scale_range"),
        ("pipeline.augment.elastic_sigma=[0,3]", "pipeline.augment: elastic_sigma"),
        ("pipeline.augment.elastic_magnitude=[-1,3]", "pipeline.augment: elastic_magnitude"),
        ("pipeline.augment.placement=gpu", "pipeline.augment.placement"),
    ],
)
def test_invalid_spatial_augmentation_settings_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_spatial_augmentation_settings_load_from_overrides():
    config = load_config(
        None,
        [
            "pipeline.augment.rotate_prob=0.2",
            "pipeline.augment.scale_range=[0.8,1.2]",
            "pipeline.augment.placement=step",
        ],
    )
    a = config.pipeline.augment
    assert (a.rotate_prob, a.scale_range, a.placement, a.scale_prob) == (0.2, [0.8, 1.2], "step", 0.0)


@pytest.mark.parametrize("enlarge", [True, False])
def test_resampling_in_place_equals_resampling_the_cut_out_crop(enlarge):
    """random_spatial on a window of the volume read in place (origin, input_size) gives bit for bit what it gives
    on that window cut out with zeros outside the volume (window), for windows inside, across and beyond the
    volume's faces, with and without the enlarged-crop margin (without it, zeros outside the patch)."""
    image, label = random_volume(shape=(30, 26, 22))
    config = AugmentConfig(
        **SPATIAL_ONLY,
        rotate_prob=0.7,
        scale_prob=0.7,
        elastic_prob=0.3,
        elastic_sigma=[3.0, 4.0],
        elastic_magnitude=[0.0, 2.0],
        enlarge_crop=enlarge,
    )
    patch = [12, 12, 10]
    size = [p + 2 * m for p, m in zip(patch, spatial_margin(config, patch))]
    image, label = tf.constant(image), tf.constant(label)
    for i, origin in enumerate([(5, 4, 3), (-6, 10, -2), (20, 18, 15), (-30, 0, 0)]):
        seed = spatial_seed(tf.constant([i, 4], tf.int32))
        origin = tf.constant(origin, tf.int32)
        in_place = random_spatial(image, label, config, seed, patch, origin=origin, input_size=size)
        crop_image, crop_label = window(image, label, origin, size)
        cut_out = random_spatial(crop_image, crop_label, config, seed, patch)
        np.testing.assert_array_equal(in_place[0].numpy(), cut_out[0].numpy())
        np.testing.assert_array_equal(in_place[1].numpy(), cut_out[1].numpy())


def test_reading_only_the_sampled_box_gives_the_patch_that_reading_the_whole_window_gives():
    """sampled_box bounds what random_spatial reads: resampling only that box of the enlarged window (passed at
    origin -low) gives bit for bit the patch resampled from the whole window, over 40 seeds of rotation, scaling
    (zooming in and out) and elastic fields. Without a draw the box is the centre patch; with one it stays inside
    the window and is smaller than the window on average (what `cache: patches` then reads per crop)."""
    config = AugmentConfig(
        **SPATIAL_ONLY,
        rotate_prob=0.5,
        scale_prob=0.5,
        scale_range=[0.7, 1.4],
        elastic_prob=0.3,
        elastic_sigma=[3.0, 4.0],
        elastic_magnitude=[0.0, 2.0],
    )
    patch = [12, 14, 10]
    size = [p + 2 * m for p, m in zip(patch, spatial_margin(config, patch))]
    rng = np.random.default_rng(3)
    image = tf.constant(rng.normal(size=(*size, 2)).astype(np.float32) + 5.0)  # no zero a missed voxel could match
    label = tf.constant(rng.integers(1, 4, size=size).astype(np.int32))
    drawn, box_voxels = 0, []
    for i in range(40):
        seed = spatial_seed(tf.constant([i, 11], tf.int32))
        low, high = (t.numpy() for t in sampled_box(config, seed, patch, size))
        assert np.all(low >= 0) and np.all(high <= size) and np.all(high > low)
        whole = random_spatial(image, label, config, seed, patch)
        box = tuple(slice(a, b) for a, b in zip(low, high))
        boxed = random_spatial(
            image[box], label[box], config, seed, patch, origin=tf.constant(-low, tf.int32), input_size=size
        )
        np.testing.assert_array_equal(boxed[0].numpy(), whole[0].numpy())
        np.testing.assert_array_equal(boxed[1].numpy(), whole[1].numpy())
        if bool(spatial_draw(config, seed)[0]):
            drawn += 1
            box_voxels.append(np.prod(high - low))
        else:
            np.testing.assert_array_equal(low, (np.array(size) - patch) // 2)
            np.testing.assert_array_equal(high - low, patch)
    assert 10 <= drawn <= 38, drawn
    assert np.mean(box_voxels) < 0.9 * np.prod(size), (np.mean(box_voxels), np.prod(size))
