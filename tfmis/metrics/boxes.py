"""Boxes on a voxel grid (numpy only): every bounding box tfmis computes, and the box arithmetic of a cascade's
regions.

- the box of a mask's voxels: `mask_box` (slices, None when empty), `slab_box` (the same, found a slab of the first
  axis at a time through each axis's projection: no mask of the whole map), `mask_bounds` (start and stop arrays,
  grown by a margin in voxels, the whole grid when empty), `label_box` (grown by a margin in mm);
- `union_box`: the smallest box holding several;
- a cascade's regions (`tfmis.inference.cascade`; the planner measures the same regions from the training labels,
  `tfmis.planning.stages.measure_regions`, without TensorFlow): `grow_box`, `merge_boxes`, `clip_box`, `pad_box`,
  `box_voxels`.

Scoring (`tfmis.metrics.segmentation`, `tfmis.metrics.surface`), postprocessing, preprocessing's crop and the
cascade all take their boxes from here.

Example:
```python
boxes = merge_boxes([grow_box(start, stop, affine, 20.0, shape) for start, stop in pieces])
```
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Box = tuple[slice, ...]


def _slices(projections) -> Box | None:
    """The box spanned by each axis's projection (a boolean per index); None when any projection is empty."""
    box = []
    for projection in projections:
        indices = np.flatnonzero(projection)
        if not indices.size:
            return None
        box.append(slice(int(indices[0]), int(indices[-1]) + 1))
    return tuple(box)


def mask_box(mask: np.ndarray) -> Box | None:
    """The smallest box holding every voxel of `mask` (one slice per axis); None when it holds none.

    Example:
        >>> m = np.zeros((6, 5, 4), bool); m[1:3, 2, 0:4] = True
        >>> mask_box(m)
        (slice(1, 3, None), slice(2, 3, None), slice(0, 4, None))
    """
    mask = np.asarray(mask, bool)
    axes = range(mask.ndim)
    return _slices(mask.any(axis=tuple(a for a in axes if a != axis)) for axis in axes)


def slab_box(array: np.ndarray, mask_of: Callable[[np.ndarray], np.ndarray], slab_slices: int) -> Box | None:
    """`mask_box(mask_of(array))` computed `slab_slices` slices of the first axis at a time: one slab's mask in
    memory, never the whole map's.

    Example:
        >>> a = np.zeros((70, 4, 4), np.uint8); a[33:40, 1, 2] = 3
        >>> slab_box(a, lambda slab: slab == 3, 32)
        (slice(33, 40, None), slice(1, 2, None), slice(2, 3, None))
    """
    axes = range(array.ndim)
    projections = [np.zeros(n, bool) for n in array.shape]
    for start in range(0, array.shape[0], slab_slices):
        slab = slice(start, start + slab_slices)
        mask = mask_of(array[slab])
        projections[0][slab] = mask.any(axis=tuple(axes[1:]))
        for axis in axes[1:]:
            projections[axis] |= mask.any(axis=tuple(a for a in axes if a != axis))
        del mask  # one slab's mask at a time
    return _slices(projections)


def union_box(*boxes) -> Box | None:
    """The smallest box holding all `boxes` (a None is an empty box); None when all are empty."""
    boxes = [b for b in boxes if b is not None]
    if not boxes:
        return None
    return tuple(slice(min(s.start for s in axis), max(s.stop for s in axis)) for axis in zip(*boxes))


def mask_bounds(mask: np.ndarray, margin: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(start, stop) of the True voxels of a 3-D `mask`, grown by `margin` voxels and clipped to the grid; the whole
    grid if there are none (the crop of a case with no foreground keeps it all).

    Example:
        >>> m = np.zeros((8, 8, 8), bool); m[2:4, 3, 5] = True
        >>> [v.tolist() for v in mask_bounds(m, 1)]
        [[1, 2, 4], [5, 5, 7]]
    """
    shape = np.array(mask.shape)
    box = mask_box(mask)
    if box is None:
        return np.zeros(3, dtype=int), shape
    start, stop = np.array([s.start for s in box]), np.array([s.stop for s in box])
    return np.maximum(start - margin, 0), np.minimum(stop + margin, shape)


def label_box(mask: np.ndarray, spacing, margin_mm: float) -> tuple[np.ndarray, np.ndarray]:
    """(start, stop) of the True voxels of `mask` grown by `margin_mm` on each side (ceil(margin / spacing)
    voxels per axis), clipped to the grid: the region a cascade's fine stage sees.

    Example:
        >>> m = np.zeros((20, 20, 10), bool); m[8:10, 8:10, 4:6] = True
        >>> [v.tolist() for v in label_box(m, (1.0, 1.0, 2.5), 5.0)]
        [[3, 3, 2], [15, 15, 8]]
    """
    margin = np.ceil(float(margin_mm) / np.asarray(spacing, dtype=np.float64) - 1e-9).astype(int)
    start, stop = mask_bounds(mask)
    return np.maximum(start - margin, 0), np.minimum(stop + margin, np.array(mask.shape))


def grow_box(start, stop, affine: np.ndarray, margin_mm: float, shape) -> Box:
    """The box [start, stop) grown by `margin_mm` on each side (ceil(margin / spacing) voxels per axis of the grid
    of `affine`), clipped to `shape`, as slices.

    Example:
        >>> grow_box([10, 10, 4], [12, 20, 6], np.diag([2.0, 2.0, 5.0, 1.0]), 4.0, (40, 40, 20))
        (slice(8, 14, None), slice(8, 22, None), slice(3, 7, None))
    """
    spacing = np.linalg.norm(np.asarray(affine, dtype=np.float64)[:3, :3], axis=0)
    margin = np.ceil(float(margin_mm) / spacing - 1e-9).astype(int)
    start = np.maximum(np.asarray(start) - margin, 0)
    stop = np.minimum(np.asarray(stop) + margin, np.asarray(shape[:3]))
    return tuple(slice(int(a), int(b)) for a, b in zip(start, stop))


def _overlap(a: Box, b: Box) -> bool:
    return all(x.start < y.stop and y.start < x.stop for x, y in zip(a, b))


def _union(a: Box, b: Box) -> Box:
    return tuple(slice(min(x.start, y.start), max(x.stop, y.stop)) for x, y in zip(a, b))


def merge_boxes(boxes: list[Box]) -> list[Box]:
    """`boxes` with every overlapping pair replaced by the box around both, until no two overlap; in the order of
    their first corners. Boxes that only touch stay apart (they share no voxel).

    Example:
        >>> boxes = merge_boxes([(slice(0, 4), slice(0, 4)), (slice(3, 6), slice(3, 6)), (slice(10, 12), slice(0, 2))])
        >>> [[(s.start, s.stop) for s in box] for box in boxes]
        [[(0, 6), (0, 6)], [(10, 12), (0, 2)]]
    """
    merged = list(boxes)
    changed = True
    while changed:
        changed = False
        for i in range(len(merged)):
            for j in range(i + 1, len(merged)):
                if _overlap(merged[i], merged[j]):
                    merged[i] = _union(merged[i], merged.pop(j))
                    changed = True
                    break
            if changed:
                break
    return sorted(merged, key=lambda b: tuple(s.start for s in b))


def clip_box(box: Box, start, stop) -> Box:
    """`box` within [start, stop) (an empty slice on an axis where they do not meet).

    Example:
        >>> clip_box((slice(0, 10), slice(5, 9)), [2, 0], [8, 6])
        (slice(2, 8, None), slice(5, 6, None))
    """
    out = []
    for s, low, high in zip(box, start, stop):
        a = min(max(s.start, int(low)), int(high))
        out.append(slice(a, max(min(s.stop, int(high)), a)))
    return tuple(out)


def box_voxels(box: Box) -> int:
    """The number of voxels in `box`."""
    return int(np.prod([max(s.stop - s.start, 0) for s in box]))


def pad_box(box: Box, min_size, shape) -> Box:
    """`box` grown about its centre to at least `min_size` voxels per axis (shifted back inside the grid at its
    edges), never beyond `shape`: a cascade's region holds at least one fine patch of the scan around its piece.

    Example:
        >>> pad_box((slice(10, 14), slice(0, 4), slice(2, 30)), (8, 8, 8), (40, 6, 40))
        (slice(8, 16, None), slice(0, 6, None), slice(2, 30, None))
    """
    out = []
    for s, size, n in zip(box, min_size, shape):
        size, n = min(int(size), int(n)), int(n)
        missing = size - (s.stop - s.start)
        if missing <= 0:
            out.append(s)
            continue
        start = min(max(s.start - missing // 2, 0), n - size)
        out.append(slice(start, start + size))
    return tuple(out)
