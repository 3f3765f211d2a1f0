import nibabel as nib
import numpy as np
import pytest

from tfmis.data.preprocess import (
    Geometry,
    PreprocessConfig,
    preprocess,
    ras_spacing,
    reorient_to_ras,
    restore_geometry,
    spacing_of,
)
from tfmis.metrics.boxes import mask_bounds


def ras_volume(shape=(24, 20, 16), channels=2, seed=0):
    """An asymmetric volume (random body in zero background) and a label, RAS, 1x2x3 mm."""
    rng = np.random.default_rng(seed)
    image = np.zeros(shape + (channels,), np.float32)
    image[2:20, 3:17, 1:14] = rng.uniform(10, 100, (18, 14, 13, channels))
    label = np.zeros(shape, np.uint8)
    label[5:9, 6:12, 3:8] = 1
    label[12:15, 7:9, 9:12] = 2
    affine = np.diag([1.0, 2.0, 3.0, 1.0])
    affine[:3, 3] = [-12.0, 30.0, 5.0]
    return image, label, affine


def to_orientation(image, label, affine, axcodes):
    """The same anatomy stored in another voxel order (what a DICOM→NIfTI tool would write)."""
    ornt = nib.orientations.ornt_transform(nib.orientations.axcodes2ornt("RAS"), nib.orientations.axcodes2ornt(axcodes))
    new_affine = affine @ nib.orientations.inv_ornt_aff(ornt, image.shape[:3])
    return (
        nib.orientations.apply_orientation(image, ornt),
        nib.orientations.apply_orientation(label, ornt),
        new_affine,
    )


def world(affine, voxel):
    return (np.asarray(affine) @ np.append(voxel, 1.0))[:3]


@pytest.mark.parametrize("axcodes", ["LPS", "LAS", "PSL", "SRA"])
def test_any_orientation_gives_the_same_ras_result(axcodes):
    image, label, affine = ras_volume()
    other = to_orientation(image, label, affine, axcodes)
    assert "".join(nib.aff2axcodes(other[2])) == axcodes
    config = PreprocessConfig(spacing=(1.0, 2.0, 3.0), image_dtype="float32")
    a_img, a_lab, a_geo = preprocess(image, label, affine, config)
    b_img, b_lab, b_geo = preprocess(*other, config)
    np.testing.assert_array_equal(a_img, b_img)
    np.testing.assert_array_equal(a_lab, b_lab)
    np.testing.assert_allclose(a_geo.affine, b_geo.affine, atol=1e-9)
    assert b_geo.original_axcodes == axcodes and b_geo.ras_shape == [24, 20, 16]


def test_reorient_to_ras_keeps_world_coordinates():
    image, label, affine = ras_volume()
    lps_img, lps_lab, lps_aff = to_orientation(image, label, affine, "LPS")
    ras, ras_aff = reorient_to_ras(lps_lab, lps_aff)
    assert nib.aff2axcodes(ras_aff) == ("R", "A", "S")
    voxel = np.argwhere(lps_lab == 2)[0]
    ras_voxel = np.round(np.linalg.inv(ras_aff) @ np.append(world(lps_aff, voxel), 1))[:3].astype(int)
    assert ras[tuple(ras_voxel)] == 2


def test_crop_keeps_label_world_positions():
    image, label, affine = ras_volume()
    out_img, out_lab, geo = preprocess(image, label, affine, PreprocessConfig(spacing=(1.0, 2.0, 3.0)))
    assert geo.crop_start == [2, 3, 1] and geo.crop_stop == [20, 17, 14]
    assert out_lab.shape == (18, 14, 13) and out_img.shape == (18, 14, 13, 2) and out_img.dtype == np.float16
    for v in np.argwhere(out_lab == 2):
        original_voxel = np.linalg.inv(affine) @ np.append(world(geo.affine, v), 1)
        assert label[tuple(np.round(original_voxel[:3]).astype(int))] == 2


def test_anisotropic_spacing_is_resampled_in_physical_space():
    """1x2x3 mm → 1 mm isotropic: shape grows per axis, spacing is the target, anatomy stays put."""
    image, label, affine = ras_volume()
    lps = to_orientation(image, label, affine, "LPS")
    assert ras_spacing(lps[2]).tolist() == [1.0, 2.0, 3.0]
    out_img, out_lab, geo = preprocess(*lps, PreprocessConfig(spacing=(1.0, 1.0, 1.0), crop_foreground=False))
    assert out_lab.shape == (24, 40, 48)
    np.testing.assert_allclose(spacing_of(geo.affine), [1, 1, 1])
    np.testing.assert_allclose(geo.spacing, [1, 1, 1])
    assert set(np.unique(out_lab)) == {0, 1, 2}  # nearest neighbour: no invented label values
    # the centre of mass of each class, in mm, moves by less than half the coarsest voxel
    for cls in (1, 2):
        before = world(affine, np.argwhere(label == cls).mean(axis=0))
        after = world(geo.affine, np.argwhere(out_lab == cls).mean(axis=0))
        assert np.abs(before - after).max() < 1.5
    # linear interpolation of the image: values stay within the input range
    assert out_img.max() <= image.max() + 1e-2


def test_reshape_gives_fixed_shape_and_consistent_affine():
    image, label, affine = ras_volume()
    _, out_lab, geo = preprocess(image, label, affine, PreprocessConfig(reshape=(32, 32, 32)))
    assert out_lab.shape == (32, 32, 32) and geo.shape == [32, 32, 32]
    # the cropped block's centre is the same point in mm before and after
    crop_centre = (np.array(geo.crop_start) + np.array(geo.crop_stop) - 1) / 2
    np.testing.assert_allclose(world(geo.affine, np.array([31, 31, 31]) / 2), world(affine, crop_centre), atol=1e-9)


def test_zscore_uses_the_foreground_and_zeroes_background():
    image, label, affine = ras_volume(channels=1)
    out, _, _ = preprocess(
        image, label, affine, PreprocessConfig(spacing=(1.0, 2.0, 3.0), crop_foreground=False, image_dtype="float32")
    )
    body = image[..., 0] != 0
    assert abs(out[body].mean()) < 1e-4 and abs(out[body].std() - 1) < 1e-4
    assert np.all(out[~body] == 0)


def test_ct_window_clips_and_scales():
    hu = np.array([-1000, -57, 0, 53.5, 164, 3000], np.float32).reshape(6, 1, 1, 1) * np.ones((6, 2, 2, 1))
    config = PreprocessConfig(
        spacing=(1, 1, 1), normalization=("ct",), ct_window=(-57, 164), crop_foreground=False, image_dtype="float32"
    )
    out, _, _ = preprocess(hu.astype(np.float32), None, np.eye(4), config)
    np.testing.assert_allclose(out[:, 0, 0, 0], [0, 0, 57 / 221, 110.5 / 221, 1, 1], rtol=1e-6)


def test_ct_zscore_clips_to_the_window_then_uses_the_dataset_statistics():
    """nnU-Net's CTNormalization written out: clip(x, p0.5, p99.5), minus the dataset foreground mean, over its
    std; the case's own statistics play no part (two cases with different contents get the same map)."""
    hu = np.array([-1000, -57, 0, 53.5, 164, 3000], np.float32).reshape(6, 1, 1, 1) * np.ones((6, 2, 2, 1))
    config = PreprocessConfig(
        spacing=(1, 1, 1),
        normalization=("ct_zscore",),
        ct_window=(-57, 164),
        ct_mean_std=(40.0, 25.0),
        crop_foreground=False,
        image_dtype="float32",
    )
    out, _, _ = preprocess(hu.astype(np.float32), None, np.eye(4), config)
    expected = [(-57 - 40) / 25, (-57 - 40) / 25, (0 - 40) / 25, (53.5 - 40) / 25, (164 - 40) / 25, (164 - 40) / 25]
    np.testing.assert_allclose(out[:, 0, 0, 0], expected, rtol=1e-6)
    shifted, _, _ = preprocess((hu + 10).astype(np.float32), None, np.eye(4), config)
    np.testing.assert_allclose(shifted[2, 0, 0, 0], (10 - 40) / 25, rtol=1e-6)
    with pytest.raises(ValueError, match="ct_mean_std"):
        PreprocessConfig(spacing=(1, 1, 1), normalization=("ct_zscore",), ct_window=(-57, 164))


def test_ct_foreground_is_above_the_window():
    hu = np.full((10, 10, 10, 1), -1000, np.float32)
    hu[3:6, 2:8, 4:5] = 40
    config = PreprocessConfig(spacing=(1, 1, 1), normalization=("ct",), ct_window=(-57, 164), crop_margin=1)
    _, _, geo = preprocess(hu, None, np.eye(4), config)
    assert geo.crop_start == [2, 1, 3] and geo.crop_stop == [7, 9, 6]


def test_mask_bounds_of_an_empty_mask_is_the_whole_grid():
    start, stop = mask_bounds(np.zeros((4, 5, 6), bool))
    assert start.tolist() == [0, 0, 0] and stop.tolist() == [4, 5, 6]


@pytest.mark.parametrize("axcodes", ["RAS", "LPS", "PSL"])
def test_restore_geometry_inverts_reorient_and_crop_exactly(axcodes):
    image, label, affine = ras_volume()
    img, lab, aff = to_orientation(image, label, affine, axcodes)
    _, out_lab, geo = preprocess(img, lab, aff, PreprocessConfig(spacing=(1.0, 2.0, 3.0)))
    restored = restore_geometry(out_lab, Geometry.from_dict(geo.to_dict()))
    np.testing.assert_array_equal(restored, lab)


def test_restore_geometry_after_resampling_matches_closely():
    image, label, affine = ras_volume()
    img, lab, aff = to_orientation(image, label, affine, "LPS")
    _, out_lab, geo = preprocess(img, lab, aff, PreprocessConfig(spacing=(0.8, 1.1, 1.7)))
    restored = restore_geometry(out_lab, geo.to_dict())
    assert restored.shape == lab.shape
    for cls in (1, 2):
        dice = 2 * np.sum((restored == cls) & (lab == cls)) / (np.sum(restored == cls) + np.sum(lab == cls))
        assert dice > 0.85, (cls, dice)


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="ct_window"):
        PreprocessConfig(spacing=(1, 1, 1), normalization=("ct",))
    with pytest.raises(ValueError, match="spacing"):
        PreprocessConfig()
    with pytest.raises(ValueError, match="normalization"):
        PreprocessConfig(spacing=(1, 1, 1), normalization=("minmax",))


def box_scan(shape, box, spacing):
    """A RAS scan whose body (nonzero image) is exactly `box`, with a label that fills the box.

    The foreground crop therefore is `box`, and the label touches all six faces of the crop box.
    """
    image = np.zeros(shape + (1,), np.float32)
    region = tuple(slice(a, b) for a, b in box)
    image[region] = 50.0
    label = np.zeros(shape, np.uint8)
    label[region] = 1
    return image, label, np.diag([*spacing, 1.0])


def dice(a, b, cls=1):
    return 2 * np.sum((a == cls) & (b == cls)) / (np.sum(a == cls) + np.sum(b == cls))


@pytest.mark.parametrize("axcodes", ["RAS", "LPS"])
@pytest.mark.parametrize(
    "scan_spacing, train_spacing",
    [
        ((0.8, 0.8, 0.8), (1.6, 1.6, 1.6)),  # training grid 2x coarser than the scan on every axis
        ((1.2, 1.2, 5.0), (1.5, 1.5, 1.5)),  # thick-slice CT: coarser in-plane, finer across slices
    ],
)
def test_label_filling_the_crop_box_restores_exactly_on_a_coarser_grid(axcodes, scan_spacing, train_spacing):
    """Original voxels between the outermost coarse voxel centres and the crop box faces keep the label.

    The box sizes are odd/even so that the coarse grid's extent falls short of or matches the box.
    """
    box = ((4, 25), (5, 23), (3, 22)) if scan_spacing[2] < 1 else ((3, 24), (4, 26), (2, 9))
    image, label, affine = box_scan((30, 29, 26) if scan_spacing[2] < 1 else (28, 30, 12), box, scan_spacing)
    img, lab, aff = to_orientation(image, label, affine, axcodes)
    _, out_lab, geo = preprocess(img, lab, aff, PreprocessConfig(spacing=train_spacing))
    assert [b - a for a, b in zip(geo.crop_start, geo.crop_stop)] == [b - a for a, b in box]
    assert np.all(out_lab == 1)  # the preprocessed grid lies entirely inside the box
    restored = restore_geometry(out_lab, geo)
    assert restored.shape == lab.shape
    assert dice(restored, lab) == 1.0, dice(restored, lab)
    np.testing.assert_array_equal(restored, lab)


@pytest.mark.parametrize("axcodes", ["RAS", "PSL"])
def test_restored_labels_are_the_nearest_coarse_voxel_inside_the_crop_box(axcodes):
    """0.8 → 1.6 mm: each original voxel k (counted from the box start) takes coarse voxel min(k // 2, n - 1).

    Resample convention: coarse voxel j covers original coordinates [2j - .5, 2j + 1.5], so the nearest
    coarse centre to original voxel k is floor((k + .5) / 2) = k // 2, clamped to the last coarse voxel
    when an odd box size leaves the last original slab beyond the coarse grid. Outside the box: 0.
    """
    rng = np.random.default_rng(3)
    box = ((4, 25), (5, 23), (3, 22))
    image, label, affine = box_scan((30, 29, 26), box, (0.8, 0.8, 0.8))
    region = tuple(slice(a, b) for a, b in box)
    # two classes in blocks of 2x2x2 original voxels (what a 1.6 mm grid can represent), touching every face
    blocks = rng.integers(1, 3, (11, 9, 10)).astype(np.uint8)
    label[region] = blocks.repeat(2, 0).repeat(2, 1).repeat(2, 2)[:21, :18, :19]
    img, lab, aff = to_orientation(image, label, affine, axcodes)
    _, out_lab, geo = preprocess(img, lab, aff, PreprocessConfig(spacing=(1.6, 1.6, 1.6)))
    restored = restore_geometry(out_lab, geo.to_dict())
    restored_ras, _ = reorient_to_ras(restored, aff)
    expected = np.zeros_like(label)
    n = np.array(out_lab.shape)
    k = [np.minimum(np.arange(b - a) // 2, n[axis] - 1) for axis, (a, b) in enumerate(box)]
    expected[region] = out_lab[np.ix_(*k)]
    np.testing.assert_array_equal(restored_ras, expected)
    # the 2-voxel blocks survive the round trip; only the last odd x slab (box size 21) is extrapolated
    for cls in (1, 2):
        assert dice(restored_ras[:24], label[:24], cls) == 1.0
        assert dice(restored_ras, label, cls) > 0.97


def test_restored_probabilities_take_the_nearest_edge_value_inside_the_crop_box():
    """Linear restoration of a linear ramp p(x, y, z) on the 1.6 mm grid, back onto the 0.8 mm scan.

    Trilinear interpolation reproduces a linear function exactly, so inside the box the restored
    value is the ramp at the coarse coordinate (k + .5) / 2 - .5 clamped into [0, n - 1];
    outside the box the background probability is 1 and the others 0.
    """
    from tfmis.inference.restore import restore_probabilities

    box = ((4, 25), (5, 23), (3, 22))
    image, label, affine = box_scan((30, 29, 26), box, (0.8, 0.8, 0.8))
    img, lab, aff = to_orientation(image, label, affine, "LPS")
    _, out_lab, geo = preprocess(img, lab, aff, PreprocessConfig(spacing=(1.6, 1.6, 1.6)))
    n = np.array(out_lab.shape)
    slope = np.array([0.03, -0.02, 0.025])
    ramp = lambda x, y, z: 0.4 + slope[0] * x + slope[1] * y + slope[2] * z  # noqa: E731
    ramp_grid = ramp(*np.meshgrid(*[np.arange(s) for s in n], indexing="ij"))
    assert 0 < ramp_grid.min() and ramp_grid.max() < 1
    probabilities = np.stack([1 - ramp_grid, ramp_grid], axis=-1).astype(np.float32)
    restored = restore_probabilities(probabilities, geo.to_dict())
    restored_ras, _ = reorient_to_ras(restored, aff)
    coords = [np.clip((np.arange(b - a) + 0.5) / 2 - 0.5, 0, n[axis] - 1) for axis, (a, b) in enumerate(box)]
    expected = np.zeros(label.shape + (2,), np.float64)
    expected[..., 0] = 1.0
    region = tuple(slice(a, b) for a, b in box)
    expected_ramp = ramp(*np.meshgrid(*coords, indexing="ij"))
    expected[region] = np.stack([1 - expected_ramp, expected_ramp], axis=-1)
    np.testing.assert_allclose(restored_ras, expected, atol=1e-5)
    # every voxel of the box is still class 1 after the argmax when class 1 dominates everywhere
    confident = np.stack([np.full(n, 0.2), np.full(n, 0.8)], axis=-1).astype(np.float32)
    argmax = np.argmax(restore_probabilities(confident, geo), axis=-1)
    assert dice(argmax, lab) == 1.0, dice(argmax, lab)


# ---------------------------------------------------------------- memory-lean paths give the same numbers


def test_resample_into_a_dtype_equals_resample_then_astype():
    from tfmis.data.preprocess import resample

    image = np.random.default_rng(1).normal(size=(21, 17, 37, 2)).astype(np.float32)
    for scale, shape in (((0.7, 1.3, 0.45), (30, 13, 82)), ((1.0, 1.0, 1.0), (21, 17, 37))):
        expected = resample(image, scale, shape, order=1).astype(np.float16)
        out = resample(image, scale, shape, order=1, dtype="float16")
        assert out.dtype == np.float16 and np.array_equal(out, expected)
    out = resample(image[::-1, :, ::-1], (0.7, 1.3, 0.45), (30, 13, 82), order=1)  # a flipped view as input
    assert np.array_equal(out, resample(np.ascontiguousarray(image[::-1, :, ::-1]), (0.7, 1.3, 0.45), (30, 13, 82), 1))


def test_normalize_by_slabs_equals_the_whole_volume_formulas():
    from tfmis.data.preprocess import NORMALIZE_SLICES, normalize

    rng = np.random.default_rng(2)
    depth = 2 * NORMALIZE_SLICES + 5  # a last, partial slab
    image = rng.normal(40, 300, size=(9, 11, depth, 4)).astype(np.float32)[:, ::-1]  # a non-contiguous view
    mask = rng.random((9, 11, depth)) > 0.3
    window, mean_std = (-57.0, 164.0), (60.0, 30.0)
    out = normalize(image, mask, ("ct", "ct_zscore", "zscore", "none"), window, mean_std)
    x = [image[..., c] for c in range(4)]
    np.testing.assert_array_equal(out[..., 0], (np.clip(x[0], *window) - window[0]) / (window[1] - window[0]))
    np.testing.assert_array_equal(out[..., 1], (np.clip(x[1], *window) - 60.0) / 30.0)
    values = x[2][mask]
    y = (x[2] - float(values.mean(dtype=np.float64))) / max(float(values.std(dtype=np.float64)), 1e-8)
    np.testing.assert_array_equal(out[..., 2], np.where(mask, y, 0.0))
    np.testing.assert_array_equal(out[..., 3], x[3])


def test_preprocess_leaves_its_input_alone():
    image, label, affine = to_orientation(*ras_volume(), ("L", "P", "S"))
    before = image.copy(), label.copy()
    preprocess(image, label, affine, PreprocessConfig(spacing=(1.5, 1.5, 2.0)))
    assert np.array_equal(image, before[0]) and np.array_equal(label, before[1])


def test_class_voxels_equals_bincount_across_chunks():
    from tfmis.data.case_stats import class_voxels

    label = np.random.default_rng(3).integers(0, 4, size=(13, 7, 5)).astype(np.uint8)
    label[0, 0, 0] = 6  # a value beyond num_classes still counted, as bincount does
    expected = np.bincount(label.ravel(), minlength=4)
    for chunk in (1, 50, 455, 10_000):
        assert class_voxels(label, 4, chunk=chunk).tolist() == expected.tolist()


def test_overwrite_image_gives_the_same_results():
    for axcodes in (("R", "A", "S"), ("L", "P", "S"), ("A", "S", "L")):
        image, label, affine = to_orientation(*ras_volume(channels=2), axcodes)
        for config in (
            PreprocessConfig(spacing=(1.5, 1.5, 2.0), normalization=("zscore", "ct"), ct_window=(20.0, 80.0)),
            PreprocessConfig(reshape=(10, 9, 8), crop_margin=2, image_dtype="float32"),
        ):
            expected = preprocess(image, label, affine, config)
            own = np.array(image, dtype=np.float32)  # a caller done with its image
            result = preprocess(own, label, affine, config, overwrite_image=True)
            assert np.array_equal(result[0], expected[0]) and np.array_equal(result[1], expected[1])
            assert result[2] == expected[2]
    with pytest.raises(ValueError, match="float32"):
        preprocess(image.astype(np.float64), label, affine, config, overwrite_image=True)


@pytest.mark.parametrize("normalization", [("ct",), ("ct_zscore",), ("zscore",), ("none",)])
def test_an_int16_image_preprocesses_as_its_float32_copy(normalization, tmp_path):
    """A CT kept as the int16 it is stored in (`load_image(..., integers=True)`, from a real NIfTI) gives the same
    bits as its float32 copy, for every normalisation, in an LPS voxel order with resampling."""
    from tfmis.data.sources.image_io import load_image

    rng = np.random.default_rng(4)
    hu = rng.integers(-1024, 1500, (30, 26, 12)).astype(np.int16)
    hu[:4] = -1024  # air, outside a CT's foreground
    affine = np.diag([-0.8, -0.8, 2.5, 1.0])
    nib.save(nib.Nifti1Image(hu, affine), tmp_path / "ct.nii.gz")
    kept, read_affine, _ = load_image(tmp_path / "ct.nii.gz", 1, "ct", integers=True)
    as_float, _, _ = load_image(tmp_path / "ct.nii.gz", 1, "ct")
    assert kept.dtype == np.int16 and as_float.dtype == np.float32
    np.testing.assert_array_equal(kept, as_float)
    config = PreprocessConfig(
        spacing=(1.3, 1.1, 2.0),
        normalization=normalization,
        ct_window=(-100.0, 300.0),
        ct_mean_std=(80.0, 50.0),
        image_dtype="float32",
    )
    a, _, ga = preprocess(kept, None, read_affine, config)
    b, _, gb = preprocess(as_float, None, read_affine, config)
    assert ga == gb
    np.testing.assert_array_equal(a, b)
    scaled = nib.Nifti1Image(hu, affine)
    scaled.header.set_slope_inter(0.5, 10.0)  # a scale factor: the values are not the stored integers
    nib.save(scaled, tmp_path / "scaled.nii.gz")
    assert load_image(tmp_path / "scaled.nii.gz", 1, "ct", integers=True)[0].dtype == np.float32


def test_the_foreground_intensity_sample_is_image_mask_sampled_and_selects_without_index_arrays():
    """`tfmis.data.case_stats.intensity_sample` draws its sample from the labelled voxels' values in C order, as
    numpy's `image[label > 0]` lists them, with the same generator call; selecting channel by channel allocates
    under 0.6 of what `image[mask]` does (tracemalloc counts numpy's buffers: the (K, 3) int64 indices it
    builds first are 24 bytes a selected voxel, against 4 for the float32 values)."""
    import tracemalloc

    from tfmis.data.case_stats import intensity_sample

    rng = np.random.default_rng(3)
    image = rng.normal(size=(64, 48, 40, 2)).astype(np.float32)
    label = np.zeros((64, 48, 40), np.uint8)
    label[8:56, 4:44, 5:35] = 1
    label[20:30, 10:20, 10:20] = 2
    expected = image[label > 0]
    expected = expected[np.random.default_rng(0).choice(len(expected), 500, replace=False)]
    np.testing.assert_array_equal(intensity_sample(image, label, 500, np.random.default_rng(0)), expected)

    tracemalloc.start()
    try:
        image[label > 0]
        reference = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        intensity_sample(image, label, 500, np.random.default_rng(0))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 0.6 * reference, (peak, reference)
