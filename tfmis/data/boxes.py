"""Box arithmetic on a voxel grid (numpy only): grow a box by a margin in mm, merge overlapping boxes.

A cascade's regions are made of these boxes (`tfmis.inference.cascade`), and the planner measures the regions the
training labels would give with the same arithmetic (`tfmis.planning.stages.measure_regions`) without importing
TensorFlow.

Example:
```python
boxes = merge_boxes([grow_box(start, stop, affine, 20.0, shape) for start, stop in pieces])
```
"""

from __future__ import annotations

import numpy as np

Box = tuple[slice, ...]


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
