"""Spatial model parallelism's geometry: a patch cut along one axis into slabs aligned to the network's strides
(`slab_bounds`, `slab_axis`: in the TensorFlow-free `tfmis.networks.slab_geometry`), TensorFlow's "same"
padding per side (`same_padding`), and `Slabs`, one batch of feature maps held as slabs on their devices, whose
`gather_range` is the halo exchange: each neighbour slices its own rows, so only the halo crosses devices.

Used by `tfmis.networks.parallel.ModelParallel` (the spatial mode) and `tfmis.networks.spatial` (the layers run
slab by slab).
"""

from __future__ import annotations

import tensorflow as tf


def same_padding(length: int, kernel: int, stride: int) -> tuple[int, int]:
    """(before, after) zero rows TensorFlow's "same" padding adds to `length` rows for this kernel and stride.

    Example:
        >>> same_padding(32, 3, 1), same_padding(32, 3, 2), same_padding(32, 1, 1)
        ((1, 1), (0, 1), (0, 0))
    """
    out = -(-length // stride)
    total = max((out - 1) * stride + kernel - length, 0)
    return total // 2, total - total // 2


def slice_along_axis(x, axis: int, start: int, stop: int):
    index = [slice(None)] * 5
    index[axis] = slice(start, stop)
    return x[tuple(index)]


def zero_pad(x, paddings):
    """`tf.pad(x, paddings)` written as concatenations with zeros: Grappler's remapper fuses a Pad into the
    following oneDNN Conv3D and then fails on the gradient's use of that Pad ("remapper failed: ... missing
    node 'Pad'"), dropping its other fusions for the whole graph."""
    for axis, (before, after) in enumerate(paddings):
        if not (before or after):
            continue
        shape = tf.unstack(tf.shape(x))
        pieces = []
        if before:
            pieces.append(tf.zeros(tf.stack(shape[:axis] + [before] + shape[axis + 1 :]), x.dtype))
        pieces.append(x)
        if after:
            pieces.append(tf.zeros(tf.stack(shape[:axis] + [after] + shape[axis + 1 :]), x.dtype))
        x = tf.concat(pieces, axis)
    return x


def slice_labels(labels, axis: int, start: int, stop: int):
    """Rows [start, stop) along spatial tensor axis `axis` of labels (B, X, Y, Z) or (B, X, Y, Z, 1)."""
    index = [slice(None)] * labels.shape.rank
    index[axis] = slice(start, stop)
    return labels[tuple(index)]


def static_side(x, axis: int) -> int:
    side = x.shape[axis]
    if side is None:
        raise ValueError(
            "model parallelism needs static spatial sizes (the training patch, the validation window): got "
            f"a tensor of shape {tuple(x.shape)}"
        )
    return int(side)


class Slabs:
    """One batch of feature maps cut along a spatial `axis` (1, 2 or 3 of a (B, X, Y, Z, C) tensor).

    Attributes:
        parts: parts[g][i], the slab `i` of data group `g`, a tensor on devices[g][i].
        bounds: [start, stop) of slab `i` along the axis (the same for every group).
        devices: devices[g][i].
    """

    def __init__(self, parts, bounds, axis: int, devices):
        self.parts, self.bounds, self.axis, self.devices = parts, list(bounds), axis, devices

    @property
    def length(self) -> int:
        return self.bounds[-1][1]

    def like(self, parts, bounds=None) -> Slabs:
        return Slabs(parts, self.bounds if bounds is None else bounds, self.axis, self.devices)

    def map(self, fn) -> Slabs:
        """`fn(part)` on each slab's device."""
        parts = []
        for group, devices in zip(self.parts, self.devices):
            row = []
            for part, device in zip(group, devices):
                with tf.device(device):
                    row.append(fn(part))
            parts.append(row)
        return self.like(parts)

    def gather_range(self, group: int, lo: int, hi: int, device: str):
        """Rows [lo, hi) along the axis of group `group` on `device`, and the (before, after) zero rows beyond the
        volume's ends that complete the range (the caller pads them with the other axes' padding). Each neighbour
        slices its own rows on its own device, so only the halo crosses devices."""
        pieces = []
        for (a, b), part, source in zip(self.bounds, self.parts[group], self.devices[group]):
            start, stop = max(lo, a), min(hi, b)
            if start >= stop:
                continue
            if (start, stop) == (a, b):
                pieces.append(part)
                continue
            with tf.device(source):
                pieces.append(slice_along_axis(part, self.axis, start - a, stop - a))
        with tf.device(device):
            x = pieces[0] if len(pieces) == 1 else tf.concat(pieces, self.axis)
        return x, (max(0, -lo), max(0, hi - self.length))

    def join(self, group: int, device: str):
        """The whole tensor of group `group` on `device`."""
        with tf.device(device):
            parts = self.parts[group]
            return parts[0] if len(parts) == 1 else tf.concat(parts, self.axis)
