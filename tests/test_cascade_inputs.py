"""The fine stage of a cascade sees the intensities it was trained on: the training crop around the labels (the
conversion's `preprocess(..., crop_to_label_mm=...)`) and the regions cut at prediction (`cut_regions`,
`region_input`, what `CascadePredictor` runs) give the same normalised value to the same physical voxel, for every
normaliser, from a real NIfTI read as prediction reads it."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest

from tfmis.data.preprocess import PreprocessConfig, preprocess
from tfmis.data.sources.image_io import load_image
from tfmis.inference.cascade import cut_regions, region_input, regions_of_interest

SPACING = (1.0, 1.0, 2.0)
MARGIN_MM = 8.0


def two_structure_mri(zscored: bool):
    """(image (X, Y, Z, 2), label): a head-like ellipsoid of noisy tissue (two channels, scanner units with 0 outside,
    or z-scored with a constant background) holding two labelled structures far apart, one bright and one dark, so
    the statistics of a box around one differ from those of the whole head and of a box around both."""
    shape = (96, 80, 40)
    grid = np.indices(shape, dtype=np.float64)
    centre, radii = np.array([48, 40, 20]), np.array([44, 36, 18])
    body = (((grid - centre[:, None, None, None]) / radii[:, None, None, None]) ** 2).sum(axis=0) <= 1
    rng = np.random.default_rng(0)
    label = np.zeros(shape, np.uint8)
    label[16:26, 30:42, 14:22] = 1
    label[70:78, 36:46, 18:26] = 2
    channels = []
    for level in (300.0, 900.0):
        x = rng.normal(level, 0.1 * level, shape)
        x[label == 1] *= 2.0
        x[label == 2] *= 0.4
        x[~body] = 0.0
        if zscored:  # as BraTS-style data arrive: z-scored, the air a constant (-3.6 or so)
            x = np.where(body, (x - x[body].mean()) / x[body].std(), -x[body].mean() / x[body].std())
        channels.append(x.astype(np.float32))
    return np.stack(channels, axis=-1), label


@pytest.mark.parametrize(
    "normalization, zscored",
    [(("zscore",), False), (("zscore",), True), (("ct",), False), (("ct_zscore",), False), (("none",), False)],
    ids=["zscore", "zscore_of_a_zscored_scan", "ct", "ct_zscore", "none"],
)
@pytest.mark.parametrize("axcodes", ["RAS", "LPS"])
def test_the_training_crop_and_the_prediction_regions_normalise_each_voxel_alike(
    tmp_path, normalization, zscored, axcodes
):
    """A two-structure case: training crops one box around both labels (+8 mm) and normalises it; prediction cuts a
    region around each structure (+8 mm, the coarse stage finding the labels) and normalises each. At every physical
    voxel both hold, the values are equal within float32 rounding (before the whole image's statistics were used for
    both, a z-score channel differed by its box's mean and std). In RAS and in an LPS file order."""
    image, label = two_structure_mri(zscored)
    affine = np.diag([*SPACING, 1.0])
    if axcodes == "LPS":  # flipped file order, as DICOM converters write
        image, label = image[::-1, ::-1], label[::-1, ::-1]
        affine = np.diag([-SPACING[0], -SPACING[1], SPACING[2], 1.0])
        affine[:3, 3] = ((image.shape[0] - 1) * SPACING[0], (image.shape[1] - 1) * SPACING[1], 0.0)
    nib.save(nib.Nifti1Image(image, affine), str(tmp_path / "case.nii.gz"))
    image, affine, _ = load_image(tmp_path / "case.nii.gz", 2, "case", integers=True)
    config = PreprocessConfig(
        spacing=SPACING,
        normalization=normalization,
        ct_window=(100.0, 1200.0),
        ct_mean_std=(500.0, 250.0),
        crop_to_label_mm=MARGIN_MM,
        image_dtype="float32",
    )
    # training: the conversion's call (the worker normalises in the image's own memory)
    trained, _, trained_geometry = preprocess(np.array(image, np.float32), label, affine, config, overwrite_image=True)
    # prediction: a region per structure, cut from the scan as CascadePredictor cuts them
    boxes = regions_of_interest(label > 0, affine, MARGIN_MM)
    assert len(boxes) == 2
    subs, statistics = cut_regions([image], boxes, config)
    to_trained = np.linalg.inv(np.array(trained_geometry.affine))
    compared = 0
    for sub, box in zip(subs, boxes):
        volume, geometry = region_input(sub, affine, box, config, statistics)
        voxels = np.indices(volume.shape[:3]).reshape(3, -1)
        world = np.array(geometry.affine)[:3, :3] @ voxels + np.array(geometry.affine)[:3, 3:]
        at = np.rint(to_trained[:3, :3] @ world + to_trained[:3, 3:]).astype(int)
        both = np.all((at >= 0) & (at < np.array(trained.shape[:3])[:, None]), axis=0)
        assert both.mean() > 0.9  # the region lies in the training crop but near the scan's edge
        ours = volume.reshape(-1, volume.shape[-1])[both]
        theirs = trained[at[0, both], at[1, both], at[2, both]]
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
        assert np.ptp(ours) > 0  # normalised tissue, not only background
        compared += int(both.sum())
    assert compared > 5000
