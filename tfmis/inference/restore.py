"""From blended logits on the preprocessed grid to a label map (and probabilities) on the original grid,
with bounded memory.

Taken whole, the restore would hold several full-size float32 arrays at once: the logits, their
softmax and its temporaries, K probability maps resampled to the original grid and their stack.
Here the softmax is taken in place, a few slices at a time, in the logits' own buffer (float32 or
float16), and the original grid is filled slab by slab (`SLAB_VOXELS` output voxels at a time): each
slab reads only the part of the preprocessed grid it needs, resamples the K classes linearly
(`scipy.ndimage.affine_transform`, order 1, edges clamped, as `restore_geometry`) and takes their
argmax. Full-size memory is then the label map (uint8) plus, only when asked for, the probabilities.

With float32 logits the label map and probabilities are those of the whole-volume computation
(softmax, `restore_geometry` per class, argmax) but for rounding in the last bit of interpolation
coordinates; float16 logits round the probabilities to about 1e-3.

A label map alone is cheaper still (`restore_labels(..., probabilities_out=False)`, what `predict` writes): an
output voxel whose eight interpolation corners on the preprocessed grid share one argmax has that argmax (each
corner's winning class beats every other class there, and a weighted mean keeps that order), so only voxels in
cells whose corners disagree (the classes' borders, a few % of a scan) are interpolated; the rest are looked up
(its speed on a real-size CT: docs/benchmarks.md, "A region per structure, at real anatomy").

The logits may cover only a box of the preprocessed grid (`offset`), and only a box of the original
grid may be filled (`box`, e.g. a cascade's region of interest): the rest is background.

Region outputs (`model.output: regions`, one sigmoid per label union) take the same path: `sigmoid_in_place`,
then `restore_labels(..., paint_labels=...)` resamples the R region probabilities slab by slab and paints each
region's label where its probability exceeds 0.5, in order (nnU-Net's `regions_class_order`), instead of the
argmax.

Example:
```python
softmax_in_place(logits)                                    # (x, y, z, K) → probabilities
labels, _ = restore_labels(logits, geometry)                # uint8 on the original grid
labels, probabilities = restore_labels(logits, geometry, probabilities_out=True)
sigmoid_in_place(region_logits)                             # (x, y, z, R) → region probabilities
labels, _ = restore_labels(region_logits, geometry, paint_labels=[1, 2, 3])   # BraTS: WT→1, TC→2, ET→3
```
"""

from __future__ import annotations

import itertools

import numpy as np
from scipy import ndimage

from tfmis.data.preprocess import Geometry, crop_box_in_original_voxels

SLAB_VOXELS = 2**23  # output voxels resampled at a time (K float32 slabs of 32 MiB)
SOFTMAX_VOXELS = 2**22  # preprocessed voxels per in-place softmax chunk
LOOKUP_SLAB_VOXELS = 2**20  # output voxels per slab of the label-only way (its border indices are int64)
BORDER_POINTS = 2**18  # border voxels interpolated at a time ((points, K) float64 temporaries)


def softmax_in_place(logits: np.ndarray, chunk_voxels: int = SOFTMAX_VOXELS) -> np.ndarray:
    """Softmax over the last axis of (x, y, z, K) logits, written over them, a few x-slices at a time.

    The arithmetic is float32 whatever the buffer's dtype (exactly `e / e.sum()` with `e = exp(l - max l)`),
    so float32 logits give the same bits as a whole-volume softmax without its K-channel temporaries.
    """
    per_slice = max(1, int(np.prod(logits.shape[1:-1])))
    step = max(1, chunk_voxels // per_slice)
    for first in range(0, logits.shape[0], step):
        chunk = logits[first : first + step].astype(np.float32)
        shifted = chunk - chunk.max(axis=-1, keepdims=True)
        del chunk
        e = np.exp(shifted, out=shifted)
        logits[first : first + step] = e / e.sum(axis=-1, keepdims=True)
    return logits


def sigmoid_in_place(logits: np.ndarray, chunk_voxels: int = SOFTMAX_VOXELS) -> np.ndarray:
    """The logistic sigmoid of (x, y, z, R) region logits, written over them, a few x-slices at a time (float32
    arithmetic whatever the buffer's dtype, as `softmax_in_place`)."""
    per_slice = max(1, int(np.prod(logits.shape[1:-1])))
    step = max(1, chunk_voxels // per_slice)
    for first in range(0, logits.shape[0], step):
        chunk = logits[first : first + step].astype(np.float32)
        logits[first : first + step] = 0.5 + 0.5 * np.tanh(0.5 * chunk, out=chunk)  # no overflow in exp
    return logits


def paint_regions(probabilities: np.ndarray, paint_labels, threshold: float = 0.5) -> np.ndarray:
    """uint8 label map (...) of region probabilities (..., R): background, then region r painted with
    `paint_labels[r]` where its probability exceeds `threshold`, in order (nnU-Net's `regions_class_order`).

    Example:
        >>> paint_regions(np.array([[0.9, 0.2, 0.1], [0.9, 0.8, 0.6], [0.4, 0.9, 0.9]]), [1, 2, 3])
        array([1, 3, 3], dtype=uint8)
    """
    labels = np.zeros(probabilities.shape[:-1], np.uint8)
    for channel, label in enumerate(paint_labels):
        labels[probabilities[..., channel] > threshold] = label
    return labels


def original_to_preprocessed(geometry) -> np.ndarray:
    """4x4 matrix from original voxel indices to preprocessed voxel indices (as `restore_geometry`)."""
    g = Geometry.from_dict(geometry) if isinstance(geometry, dict) else geometry
    matrix = np.linalg.inv(np.array(g.affine)) @ np.array(g.original_affine)
    return np.round(matrix, 9)  # pure permutations/flips stay exact integers


def preprocessed_box(
    start, stop, geometry, shape, margin: int = 1, min_size=None
) -> tuple[np.ndarray, np.ndarray] | None:
    """The box of the preprocessed grid (`shape`) that linear resampling of original voxels [start, stop)
    reads, grown by `margin` voxels and, where the grid allows, to at least `min_size` (e.g. the sliding
    window, so that no padding is needed); None if the two do not meet."""
    start, stop = np.asarray(start), np.asarray(stop)
    if np.any(stop <= start):
        return None
    matrix = original_to_preprocessed(geometry)
    corners = np.array(np.meshgrid(*zip(start, stop - 1), indexing="ij")).reshape(3, -1)
    points = matrix[:3, :3] @ corners + matrix[:3, 3:4]
    shape = np.asarray(shape[:3])
    low = np.maximum(np.floor(points.min(axis=1)).astype(int) - margin, 0)
    high = np.minimum(np.ceil(points.max(axis=1)).astype(int) + 1 + margin, shape)
    if np.any(high <= low):
        return None
    if min_size is not None:
        for axis, size in enumerate(min_size):
            missing = min(int(size), int(shape[axis])) - (high[axis] - low[axis])
            if missing > 0:
                low[axis] = max(0, low[axis] - missing // 2)
                high[axis] = min(int(shape[axis]), low[axis] + int(size))
                low[axis] = max(0, high[axis] - int(size))
    return low, high


def original_box(start, stop, geometry) -> tuple[np.ndarray, np.ndarray]:
    """The box (start, stop) of the original voxels whose centres lie in the preprocessed voxels [start, stop) (each
    with its half-voxel extent), clipped to the original grid: where a region found on the preprocessed grid lies.

    Example:
        >>> from tfmis.data.preprocess import PreprocessConfig, preprocess
        >>> g = preprocess(np.ones((40, 40, 10, 1), np.float32), None, np.diag([1.0, 1.0, 4.0, 1.0]),
        ...                PreprocessConfig(spacing=(4.0, 4.0, 4.0), normalization=("none",)))[2]
        >>> [v.tolist() for v in original_box([2, 3, 1], [5, 6, 4], g)]
        [[8, 12, 1], [20, 24, 4]]
    """
    g = Geometry.from_dict(geometry) if isinstance(geometry, dict) else geometry
    inverse = np.linalg.inv(original_to_preprocessed(g))
    low, high = np.asarray(start, np.float64) - 0.5, np.asarray(stop, np.float64) - 0.5
    corners = np.array(np.meshgrid(*zip(low, high), indexing="ij")).reshape(3, -1)
    points = inverse[:3, :3] @ corners + inverse[:3, 3:4]
    shape = np.asarray(g.original_shape)
    first = np.clip(np.ceil(points.min(axis=1) - 1e-6).astype(int), 0, shape)
    last = np.clip(np.floor(points.max(axis=1) + 1e-6).astype(int) + 1, 0, shape)
    return first, last


def restore_labels(
    probabilities: np.ndarray,
    geometry,
    offset=(0, 0, 0),
    box: tuple | None = None,
    probabilities_out: bool = False,
    slab_voxels: int = SLAB_VOXELS,
    paint_labels=None,
    within: tuple | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Label map (and optionally probabilities) on the original grid from probabilities on the preprocessed grid.

    Args:
        probabilities: (x, y, z, K) float32 or float16 softmax on a box of the preprocessed grid
            (e.g. after `softmax_in_place`), or with `paint_labels` (x, y, z, R) region probabilities (after
            `sigmoid_in_place`); read, not changed.
        geometry: the case's `Geometry` (or its dict).
        offset: where `probabilities` starts on the preprocessed grid (its box's lower corner).
        box: (start, stop) in original voxel indices to fill; default the whole preprocessing crop.
            Only its part inside the crop is resampled; everything else is background.
        probabilities_out: also return the (X, Y, Z, K) float32 probabilities on the original grid
            (background 1 outside the filled part).
        slab_voxels: output voxels resampled at a time (bounds the temporary memory).
        paint_labels: None (the channels are classes: argmax), or the label each region channel paints
            (`paint_regions`); the probabilities returned are then the regions', 0 outside the filled part.
        within: (start, stop) in original voxel indices: return only that box of the original grid (arrays of its
            shape, e.g. a cascade's region), the same values as the box of the whole result.

    Returns:
        (uint8 label map of the original shape (or of `within`'s), float32 probabilities or None).
    """
    g = Geometry.from_dict(geometry) if isinstance(geometry, dict) else geometry
    shape = tuple(int(s) for s in g.original_shape)
    origin = np.zeros(3, int)
    if within is not None:
        origin, corner = np.asarray(within[0], int), np.asarray(within[1], int)
        box = within if box is None else (np.maximum(box[0], origin), np.minimum(box[1], corner))
        shape = tuple(int(n) for n in corner - origin)
    classes = probabilities.shape[-1]
    labels = np.zeros(shape, np.uint8)
    restored = None
    if probabilities_out:
        restored = np.zeros((*shape, classes), np.float32)
        if paint_labels is None:
            restored[..., 0] = 1.0
    start, stop = crop_box_in_original_voxels(g)
    if box is not None:
        start, stop = np.maximum(start, np.asarray(box[0])), np.minimum(stop, np.asarray(box[1]))
    if np.any(stop <= start):
        return labels, restored
    matrix = original_to_preprocessed(g)
    linear, translation = matrix[:3, :3], matrix[:3, 3] - np.asarray(offset)
    source_axes = axis_permutation(linear)
    if restored is None and source_axes is not None and paint_labels is None:  # argmax only
        _labels_by_cells(
            probabilities,
            linear,
            translation,
            source_axes,
            start,
            stop,
            labels,
            min(slab_voxels, LOOKUP_SLAB_VOXELS),
            origin,
        )
        return labels, None
    source_shape = probabilities.shape[:3]
    per_slice = int(np.prod(stop[1:] - start[1:]))
    step = max(1, slab_voxels // per_slice)
    for first in range(int(start[0]), int(stop[0]), step):
        slab_start = np.array([first, start[1], start[2]])
        slab_stop = np.array([min(first + step, int(stop[0])), stop[1], stop[2]])
        read = preprocessed_box(slab_start, slab_stop, _shifted(g, offset), source_shape)
        low, high = read if read is not None else (np.zeros(3, int), np.asarray(source_shape))
        region = tuple(slice(a, b) for a, b in zip(low, high))
        slab = []
        for k in range(classes):
            source = np.ascontiguousarray(probabilities[(*region, k)], dtype=np.float32)
            slab.append(
                ndimage.affine_transform(
                    source,
                    linear,
                    linear @ slab_start + translation - low,
                    output_shape=tuple(int(n) for n in slab_stop - slab_start),
                    order=1,
                    mode="nearest",
                )
            )
        slab = np.stack(slab, axis=-1)
        where = tuple(slice(a, b) for a, b in zip(slab_start - origin, slab_stop - origin))
        labels[where] = np.argmax(slab, axis=-1) if paint_labels is None else paint_regions(slab, paint_labels)
        if restored is not None:
            restored[where] = slab
    return labels, restored


def restore_probabilities(probabilities: np.ndarray, geometry) -> np.ndarray:
    """Per-class probabilities back on the original grid (linear), background = 1 outside the crop.

    One float32 (X, Y, Z, K) array, filled slab by slab (`tfmis.inference.restore.restore_labels`).
    """
    g = Geometry.from_dict(geometry) if isinstance(geometry, dict) else geometry
    return restore_labels(probabilities, g, probabilities_out=True)[1]


def axis_permutation(linear: np.ndarray) -> np.ndarray | None:
    """For each original axis, the preprocessed axis it maps to, when each maps to exactly one (reorientation,
    crop and per-axis scaling, as `preprocess` does); None for any other matrix."""
    nonzero = linear != 0
    if not (np.all(nonzero.sum(axis=0) == 1) and np.all(nonzero.sum(axis=1) == 1)):
        return None
    return np.argmax(nonzero, axis=0)


def _labels_by_cells(
    probabilities, linear, translation, source_axes, start, stop, labels, slab_voxels, origin=(0, 0, 0)
) -> None:
    """Fills `labels[start - origin:stop - origin]` with the argmax of the linearly resampled `probabilities` (as the
    K-map `affine_transform` way, order 1, edges clamped): looked up where the interpolation cell's eight corners
    share one argmax, interpolated only where they do not (see the module's docstring)."""
    shape = np.array(probabilities.shape[:3])
    winner = np.empty(tuple(shape), np.uint8)
    rows = max(1, SOFTMAX_VOXELS // max(1, int(np.prod(shape[1:]))))
    for first in range(0, shape[0], rows):  # in chunks: argmax's int64 result would be 8 bytes a voxel
        winner[first : first + rows] = np.argmax(probabilities[first : first + rows], axis=-1)
    padded = np.pad(winner, [(0, 1)] * 3, mode="edge")  # a cell at the last index has its corners clamped
    uniform = np.ones(tuple(shape), bool)
    for first in range(0, shape[0], rows):
        block = slice(first, min(first + rows, int(shape[0])))
        base = padded[block, : shape[1], : shape[2]]
        for corner in itertools.product((0, 1), repeat=3):
            if any(corner):
                x = slice(block.start + corner[0], block.stop + corner[0])
                uniform[block] &= padded[x, corner[1] : corner[1] + shape[1], corner[2] : corner[2] + shape[2]] == base
    del padded
    # per original axis: the lower corner's index on its preprocessed axis and the weight of the upper one
    lower, weight = [], []
    for axis, source in enumerate(source_axes):
        o = np.arange(int(start[axis]), int(stop[axis]), dtype=np.float64)
        c = np.clip(linear[source, axis] * o + translation[source], 0, shape[source] - 1)
        i0 = np.floor(c).astype(np.intp)
        lower.append(i0)
        weight.append(c - i0)
    winner_t, uniform_t = winner.transpose(source_axes), uniform.transpose(source_axes)
    per_slice = int(np.prod(stop[1:] - start[1:]))
    step = max(1, slab_voxels // per_slice)
    for first in range(0, int(stop[0] - start[0]), step):
        rows_here = slice(first, min(first + step, int(stop[0] - start[0])))
        index = np.ix_(lower[0][rows_here], lower[1], lower[2])
        slab = winner_t[index]
        border = np.nonzero(~uniform_t[index])
        for chunk in range(0, len(border[0]), BORDER_POINTS):
            points = [b[chunk : chunk + BORDER_POINTS] for b in border]
            base = [lower[0][rows_here][points[0]], lower[1][points[1]], lower[2][points[2]]]
            w = [weight[0][rows_here][points[0]], weight[1][points[1]], weight[2][points[2]]]
            total = np.zeros((len(points[0]), probabilities.shape[-1]), np.float64)
            for corner in itertools.product((0, 1), repeat=3):
                factor = np.ones(len(points[0]))
                at = [None] * 3
                for axis, d in enumerate(corner):
                    factor *= w[axis] if d else 1 - w[axis]
                    at[source_axes[axis]] = np.minimum(base[axis] + d, shape[source_axes[axis]] - 1)
                total += factor[:, None] * probabilities[at[0], at[1], at[2]]
            slab[tuple(points)] = np.argmax(total.astype(np.float32), axis=-1)
        first_row = int(start[0] - origin[0]) + first
        y, z = slice(start[1] - origin[1], stop[1] - origin[1]), slice(start[2] - origin[2], stop[2] - origin[2])
        labels[first_row : first_row + slab.shape[0], y, z] = slab


def _shifted(g: Geometry, offset) -> Geometry:
    """`g` with its preprocessed grid starting at `offset` (a box of it)."""
    affine = np.array(g.affine, dtype=np.float64)
    affine[:3, 3] = affine[:3, :3] @ np.asarray(offset, dtype=np.float64) + affine[:3, 3]
    return Geometry(**{**g.to_dict(), "affine": affine.tolist()})
