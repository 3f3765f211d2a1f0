"""Spatial model parallelism's layers: each layer of the U-Net run on `Slabs` (`tfmis.networks.slabs`), slab by slab
on the slabs' devices.

A convolution first gathers the rows its "same" padding reads from its neighbours (the halo; zeros beyond the
volume's ends) and convolves without padding along the cut axis, so each output row is computed from exactly the
rows one device would use; a transposed convolution likewise. Instance, group and batch normalisation reduce their
statistics over all slabs (the mean, then the squared deviations from it); element-wise layers run on each slab;
a block with `recompute: true` is recomputed in the backward pass. `tfmis.networks.parallel.ModelParallel` runs the
model's graph with `SpatialRunner.operation`.
"""

from __future__ import annotations

import math

import tensorflow as tf
from keras import layers

from tfmis.networks.architecture import expand_per_axis
from tfmis.networks.blocks import ConvNormAct, ResidualUnit, UpBlock
from tfmis.networks.slabs import Slabs, same_padding, static_side, zero_pad


def _statistics_dtype(x: Slabs):
    """Normalisation statistics in float32 (Keras': float16 overflows), or float64 for float64 features."""
    return tf.float64 if x.parts[0][0].dtype == tf.float64 else tf.float32


class SpatialRunner:
    """The spatial version of each layer of the U-Net, called on `Slabs` by `_run_through_graph`."""

    def __init__(self, training: bool):
        self.training = bool(training)

    def operation(self, layer):
        return lambda *args, **kwargs: self.call(layer, *args, **kwargs)

    def call(self, layer, inputs, *args, training=None, recompute=True, **kwargs):
        training = self.training if training is None else bool(training)
        if recompute and training and getattr(layer, "recompute", False):
            return self.recomputed(layer, inputs, training)
        if isinstance(layer, ResidualUnit):
            residual = inputs if layer.projection is None else self.conv(layer.projection, inputs)
            x = inputs
            for unit in layer.units:
                x = self.call(unit, x, training=training)
            return self.elementwise(lambda a, b: a + b, x, residual)
        if isinstance(layer, ConvNormAct):
            x = self.conv(layer.conv, inputs)
            if layer.conv_only:
                return x
            x = self.norm(layer.normalization, x, training)
            if layer.dropout_layer is not None:
                x = x.map(lambda part: layer.dropout_layer(part, training=training))
            return x.map(layer.act)
        if isinstance(layer, UpBlock):
            coarse, skip = inputs
            upsampled = self.call(layer.upsample, coarse, training=training)
            return self.call(
                layer.fuse, self.elementwise(lambda a, b: layer.concat([a, b]), upsampled, skip), training=training
            )
        if isinstance(layer, (layers.Conv3D, layers.Conv3DTranspose)):
            return self.conv(layer, inputs)
        if isinstance(layer, (layers.GroupNormalization, layers.BatchNormalization)):
            return self.norm(layer, inputs, training)
        if isinstance(layer, layers.Concatenate):
            if layer.axis not in (-1, 4):
                raise NotImplementedError(
                    f"spatial partitioning joins channels only; {layer.name} joins axis {layer.axis}"
                )
            return self.elementwise(lambda *parts: layer(list(parts)), *inputs)
        if isinstance(layer, layers.Add):
            return self.elementwise(lambda *parts: layer(list(parts)), *inputs)
        if isinstance(layer, layers.Dropout):
            return inputs.map(lambda part: layer(part, training=training))
        if isinstance(layer, (layers.Activation, layers.PReLU, layers.LeakyReLU, layers.ReLU)):
            return inputs.map(layer)
        raise NotImplementedError(
            f"spatial partitioning has no slab-wise version of {type(layer).__name__} ({layer.name})"
        )

    def recomputed(self, layer, inputs, training: bool):
        """A block with `recompute: true`: its slab-wise forward pass is run again in the backward pass instead of
        keeping its activations (`tf.recompute_grad` over every slab's tensors at once, on their devices).
        BatchNorm would update its moving statistics twice, so blocks with it are not recomputed here."""
        if getattr(layer, "norm", None) == "batch":
            return self.call(layer, inputs, training=training, recompute=False)
        slabs = inputs if isinstance(inputs, (list, tuple)) else [inputs]
        sizes = [len(s.parts) * len(s.parts[0]) for s in slabs]

        def forward(*tensors):
            rebuilt, start = [], 0
            for s, size in zip(slabs, sizes):
                flat = list(tensors[start : start + size])
                width = len(s.parts[0])
                rebuilt.append(s.like([flat[g * width : (g + 1) * width] for g in range(len(s.parts))]))
                start += size
            out = self.call(
                layer, rebuilt if isinstance(inputs, (list, tuple)) else rebuilt[0], training=training, recompute=False
            )
            shapes.append(out)
            return [t for row in out.parts for t in row]

        shapes: list[Slabs] = []
        flat = tf.recompute_grad(forward)(*[t for s in slabs for row in s.parts for t in row])
        first = shapes[0]
        width = len(first.parts[0])
        return first.like([list(flat[g * width : (g + 1) * width]) for g in range(len(first.parts))])

    @staticmethod
    def elementwise(fn, *slabs: Slabs) -> Slabs:
        first = slabs[0]
        for other in slabs[1:]:
            if other.bounds != first.bounds:
                raise ValueError(f"spatial partitioning: slabs {other.bounds} and {first.bounds} do not line up")
        parts = []
        for g, devices in enumerate(first.devices):
            row = []
            for i, device in enumerate(devices):
                with tf.device(device):
                    row.append(fn(*(s.parts[g][i] for s in slabs)))
            parts.append(row)
        return first.like(parts)

    # ------------------------------------------------------------------ convolutions

    def conv(self, layer, x: Slabs) -> Slabs:
        """A "same"-padded Conv3D or Conv3DTranspose of stride >= 1 over slabs, with the halo from the neighbours."""
        transposed = isinstance(layer, layers.Conv3DTranspose)
        kernel_size, strides = expand_per_axis(layer.kernel_size, "kernel"), expand_per_axis(layer.strides, "strides")
        pointwise = all(k == 1 for k in kernel_size) and all(s == 1 for s in strides)  # "valid" = "same" then
        if (
            (layer.padding != "same" and not pointwise)
            or layer.data_format != "channels_last"
            or any(d != 1 for d in expand_per_axis(layer.dilation_rate, "dilation"))
        ):
            raise NotImplementedError(f"spatial partitioning: {layer.name} must be a channels-last 'same' convolution")
        if getattr(layer, "groups", 1) != 1:
            raise NotImplementedError(f"spatial partitioning: {layer.name} is a grouped convolution")
        axis = x.axis
        k, s = kernel_size[axis - 1], strides[axis - 1]
        if transposed and any(kk < ss for kk, ss in zip(kernel_size, strides)):
            raise NotImplementedError(f"spatial partitioning: {layer.name}'s kernel {kernel_size} < stride {strides}")
        dtype = layer.compute_dtype
        length = x.length
        if transposed:
            out_bounds = [(a * s, b * s) for a, b in x.bounds]
            before = same_padding(length * s, k, s)[0]
        else:
            if any(a % s for a, _ in x.bounds):
                raise ValueError(f"spatial partitioning: slabs {x.bounds} are not aligned to {layer.name}'s stride {s}")
            out_bounds = [(a // s, b // s) for a, b in x.bounds]
            before = same_padding(length, k, s)[0]
        parts = []
        for g, devices in enumerate(x.devices):
            row = []
            for (oa, ob), device in zip(out_bounds, devices):
                if transposed:
                    lo = -(-(oa + before - k + 1) // s)
                    hi = (ob - 1 + before) // s + 1
                else:
                    lo, hi = oa * s - before, (ob - 1) * s - before + k
                piece, (pad_lo, pad_hi) = x.gather_range(g, lo, hi, device)
                with tf.device(device):
                    piece = tf.cast(piece, dtype)
                    kernel = tf.cast(layer.kernel, dtype)
                    if transposed:
                        y = self._conv_transpose(piece, kernel, kernel_size, strides, axis, pad_lo, pad_hi, lo, oa, ob)
                    else:
                        y = self._conv_valid(piece, kernel, kernel_size, strides, axis, pad_lo, pad_hi)
                    if layer.use_bias:
                        y = y + tf.cast(layer.bias, dtype)
                row.append(y)
            parts.append(row)
        return Slabs(parts, out_bounds, axis, x.devices)

    @staticmethod
    def _conv_valid(x, kernel, kernel_size, strides, axis, pad_lo, pad_hi):
        paddings = [[0, 0]] * 5
        for a in (1, 2, 3):
            if a == axis:
                paddings[a] = [pad_lo, pad_hi]
            else:
                paddings[a] = list(same_padding(static_side(x, a), kernel_size[a - 1], strides[a - 1]))
        if any(p != [0, 0] for p in paddings):
            x = zero_pad(x, paddings)
        return tf.nn.conv3d(x, kernel, strides=[1, *strides, 1], padding="VALID")

    @staticmethod
    def _conv_transpose(x, kernel, kernel_size, strides, axis, pad_lo, pad_hi, lo, oa, ob):
        if pad_lo or pad_hi:  # rows beyond the volume: zeros, which add nothing to any output row
            paddings = [[0, 0]] * 5
            paddings[axis] = [pad_lo, pad_hi]
            x = zero_pad(x, paddings)
        full, crop = [], []
        for a in (1, 2, 3):
            n, k, s = static_side(x, a), kernel_size[a - 1], strides[a - 1]
            full.append((n - 1) * s + k)  # the unpadded ("valid") transposed output
            before = max(k - s, 0) // 2  # "same": the rows the equivalent convolution pads before
            if a == axis:  # output row o of the volume is row o - lo * s + before of this piece's output
                start = oa - lo * s + before
                crop.append((start, start + ob - oa))
            else:
                crop.append((before, before + n * s))
        shape = tf.stack([tf.shape(x)[0], *full, kernel.shape[3]])
        y = tf.nn.conv3d_transpose(x, kernel, shape, strides=[1, *strides, 1], padding="VALID")
        index = [slice(None)] + [slice(a, b) for a, b in crop] + [slice(None)]
        return y[tuple(index)]

    # ------------------------------------------------------------------ normalisation

    def norm(self, layer, x: Slabs, training: bool) -> Slabs:
        """Group/instance norm (per sample and group) or batch norm (per channel, over every group's batch) with
        statistics over all slabs."""
        if isinstance(layer, layers.BatchNormalization):
            return self._batch_norm(layer, x, training)
        if layer.axis not in (-1, 4):
            raise NotImplementedError(f"spatial partitioning: {layer.name} normalises axis {layer.axis}")
        groups = layer.groups
        dt = _statistics_dtype(x)
        parts = []
        for g, devices in enumerate(x.devices):
            grouped, sums, counts = [], [], 0
            for part, device in zip(x.parts[g], devices):
                with tf.device(device):
                    channels = part.shape[-1]
                    shape = tf.concat([tf.shape(part)[:4], [groups, channels // groups]], 0)
                    xr = tf.cast(tf.reshape(part, shape), dt)
                    grouped.append(xr)
                    sums.append(tf.reduce_sum(xr, axis=[1, 2, 3, 5]))
                    counts += math.prod(static_side(part, a) for a in (1, 2, 3)) * (channels // groups)
            with tf.device(devices[0]):
                mean = tf.add_n(sums) / counts
            # the mean's gradient through the squared deviations is zero in exact arithmetic: stopped, as
            # tf.nn.moments (and so Keras) stops it, so that float32 rounding does not make it a large error
            centre = tf.stop_gradient(mean)[:, None, None, None, :, None]
            squares = []
            for xr, device in zip(grouped, devices):
                with tf.device(device):
                    squares.append(tf.reduce_sum(tf.square(xr - centre), axis=[1, 2, 3, 5]))
            with tf.device(devices[0]):
                variance = tf.add_n(squares) / counts
                inv = tf.math.rsqrt(variance + layer.epsilon)[:, None, None, None, :, None]
                shift = -mean[:, None, None, None, :, None] * inv
            row = []
            for part, xr, device in zip(x.parts[g], grouped, devices):
                with tf.device(device):
                    scale, offset = inv, shift
                    channels = part.shape[-1]
                    if layer.scale:
                        gamma = tf.reshape(tf.cast(layer.gamma, dt), [1, 1, 1, 1, groups, channels // groups])
                        scale, offset = inv * gamma, shift * gamma
                    if layer.center:
                        offset = offset + tf.reshape(tf.cast(layer.beta, dt), [1, 1, 1, 1, groups, channels // groups])
                    y = tf.cast(xr * scale + offset, part.dtype)
                    row.append(tf.cast(tf.reshape(y, tf.shape(part)), layer.compute_dtype))
            parts.append(row)
        return x.like(parts)

    def _batch_norm(self, layer, x: Slabs, training: bool) -> Slabs:
        dt = _statistics_dtype(x)
        flat = [
            (g, i, part, device)
            for g, row in enumerate(x.parts)
            for i, (part, device) in enumerate(zip(row, x.devices[g]))
        ]
        home = x.devices[0][0]
        if training and layer.trainable:
            sums, cast = [], {}
            for g, i, part, device in flat:
                with tf.device(device):
                    cast[g, i] = tf.cast(part, dt)
                    sums.append(tf.reduce_sum(cast[g, i], axis=[0, 1, 2, 3]))
            voxels = sum(math.prod(static_side(part, a) for a in (1, 2, 3)) for part in x.parts[0])
            with tf.device(home):
                images = tf.add_n([tf.shape(row[0])[0] for row in x.parts])
                n = tf.cast(images * voxels, dt)
                mean = tf.add_n(sums) / n
            squares = []
            for g, i, _, device in flat:
                with tf.device(device):
                    squares.append(tf.reduce_sum(tf.square(cast[g, i] - tf.stop_gradient(mean)), axis=[0, 1, 2, 3]))
            with tf.device(home):
                variance = tf.add_n(squares) / n
                momentum = layer.momentum
                layer.moving_mean.assign(layer.moving_mean * momentum + mean * (1.0 - momentum))
                layer.moving_variance.assign(layer.moving_variance * momentum + variance * (1.0 - momentum))
        else:
            mean, variance = tf.cast(layer.moving_mean, dt), tf.cast(layer.moving_variance, dt)
        with tf.device(home):
            scale = tf.math.rsqrt(variance + layer.epsilon)
            if layer.scale:
                scale = scale * tf.cast(layer.gamma, dt)
            offset = -mean * scale
            if layer.center:
                offset = offset + tf.cast(layer.beta, dt)
        parts = [list(row) for row in x.parts]
        for g, i, part, device in flat:
            with tf.device(device):
                parts[g][i] = tf.cast(tf.cast(part, dt) * scale + offset, layer.compute_dtype)
        return x.like(parts)
