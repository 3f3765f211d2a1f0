"""The label-only restore (`restore_labels(..., probabilities_out=False)`), which looks up the argmax where an
interpolation cell's corners agree and interpolates only at borders, against the K-map way (every class resampled
with `scipy.ndimage.affine_transform`, then the argmax)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import ndimage

from tfmis.data.preprocess import PreprocessConfig, preprocess
from tfmis.inference.restore import axis_permutation, original_to_preprocessed, restore_labels, softmax_in_place


def smooth_probabilities(shape, classes, seed, sigma=2.0, dtype=np.float32):
    """Softmax of smoothed noise: blobs of each class with borders between them, as a network's output."""
    rng = np.random.default_rng(seed)
    logits = np.stack([ndimage.gaussian_filter(rng.normal(size=shape), sigma) * 40 for _ in range(classes)], -1)
    return softmax_in_place(logits.astype(dtype))


def case_geometry(shape, affine, spacing):
    """The `Geometry` of preprocessing an image of `shape` (all foreground) at `affine` to `spacing`."""
    image = np.ones((*shape, 1), np.float32)
    config = PreprocessConfig(spacing=spacing, normalization=("none",), crop_foreground=False)
    return preprocess(image, None, affine, config)[2]


@pytest.mark.parametrize(
    "affine, spacing, dtype",
    [
        (np.diag([0.8, 0.8, 2.5, 1.0]), (3.1, 3.3, 4.0), np.float32),  # coarse → fine, as a cascade's first stage
        (np.diag([-0.8, -0.8, 2.5, 1.0]), (0.5, 0.6, 1.7), np.float32),  # LPS, fine → coarse
        (np.array([[0, 0, 1.5, 0], [-1.2, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 0, 1.0]]), (2.0, 2.0, 2.0), np.float16),
    ],
)
def test_label_only_restore_equals_the_argmax_of_every_class_resampled(affine, spacing, dtype):
    """Same label map as resampling all K maps and taking the argmax, for a coarse→fine and a fine→coarse
    grid, flips, a permuted axis order and float16 probabilities; a voxel may differ only where the two best
    interpolated classes are within float32 rounding of a tie."""
    shape = (47, 39, 23)
    geometry = case_geometry(shape, affine, spacing)
    assert axis_permutation(original_to_preprocessed(geometry)[:3, :3]) is not None
    probabilities = smooth_probabilities(tuple(geometry.shape), 4, seed=int(abs(affine[0]).sum() * 10), dtype=dtype)
    reference, restored = restore_labels(probabilities, geometry, probabilities_out=True)
    labels, none = restore_labels(probabilities, geometry)
    assert none is None and labels.shape == shape
    assert len(np.unique(reference)) == 4  # borders between all classes are exercised
    differ = labels != reference
    top2 = np.sort(restored, axis=-1)[..., -2:]
    assert np.all(top2[differ][:, 1] - top2[differ][:, 0] < 1e-6), int(differ.sum())
    assert differ.mean() < 1e-4


def test_label_only_restore_of_a_box_with_an_offset():
    """Probabilities covering only a box of the preprocessed grid (`offset`) restored into a box of the original
    grid: the same labels inside as the K-map way, background outside."""
    shape = (40, 36, 30)
    geometry = case_geometry(shape, np.diag([1.0, 1.0, 2.0, 1.0]), (2.2, 1.7, 2.9))
    full = smooth_probabilities(tuple(geometry.shape), 3, seed=3)
    low = np.array([2, 3, 1])
    sub = np.ascontiguousarray(full[low[0] :, low[1] : -2, low[2] :])
    box = (np.array([8, 10, 4]), np.array([33, 28, 25]))
    reference, _ = restore_labels(sub, geometry, offset=low, box=box, probabilities_out=True)
    labels, _ = restore_labels(sub, geometry, offset=low, box=box)
    np.testing.assert_array_equal(labels, reference)
    inside = np.zeros(shape, bool)
    inside[tuple(slice(a, b) for a, b in zip(*box))] = True
    assert not labels[~inside].any() and labels[inside].any()


def test_label_only_restore_of_region_outputs_paints_them_as_the_probability_path():
    """Region outputs (`paint_labels`, sigmoids per label union) restored as a label map only give the regions painted
    in order from the resampled region probabilities (the probability path's `paint_regions`), not an argmax over the
    region channels (which the class lookup would give)."""
    from tfmis.inference.restore import paint_regions, sigmoid_in_place

    shape = (40, 36, 30)
    geometry = case_geometry(shape, np.diag([1.0, 1.0, 2.0, 1.0]), (2.2, 1.7, 2.9))
    rng = np.random.default_rng(5)
    logits = np.stack([ndimage.gaussian_filter(rng.normal(size=tuple(geometry.shape)), 2.0) * 40 for _ in range(3)], -1)
    regions = sigmoid_in_place(logits.astype(np.float32))
    _, restored = restore_labels(regions, geometry, probabilities_out=True, paint_labels=[1, 2, 3])
    labels, _ = restore_labels(regions, geometry, paint_labels=[1, 2, 3])
    expected = paint_regions(restored, [1, 2, 3])
    np.testing.assert_array_equal(labels, expected)
    assert not np.array_equal(expected, np.argmax(restored, axis=-1))  # the two rules differ on this case
