"""Model parallelism for the U-Net on plain TensorFlow: one Keras model, its variables unchanged, run over several
devices by layers (`pipeline`) or by space (`spatial`), with device placement, cross-device tensors and autodiff.

Keras 3's `keras.distribution` is JAX-only and TF DTensor's Conv3D is forward-only, so both modes walk the
model's own functional graph (`keras.Model._run_through_graph`) and place each computation with `tf.device`;
TensorFlow moves the tensors that cross devices and differentiates through the moves, so the gradient of the
loss with respect to the model's variables is the ordinary `tf.GradientTape` one. A checkpoint of the model is
therefore the same whichever mode trained it (train spatial, predict on one device, and back).

- **pipeline** (GPipe): the model's top-level layers, in execution order (encoder levels, bottleneck, decoder
  levels, heads), are cut into `N` contiguous stages of about equal bytes (each layer's forward tensors and
  parameters at the patch size, `stage_table`). The batch is cut into `M` micro-batches; each flows through the
  stages, and inside a `tf.function` the dataflow executor runs stage `s` of micro-batch `m + 1` while stage
  `s + 1` works on micro-batch `m`. The micro-batch outputs are joined before the loss, so the loss and its
  gradient are those of the whole batch (BatchNorm, as in GPipe, normalises each micro-batch by its own
  statistics).
- **spatial**: each sample's patch is cut along one axis into `N` slabs, one per device, whose boundaries are
  multiples of the product of the network's strides along that axis (so every level's slabs stay aligned).
  Every convolution first gathers the rows it needs from its neighbours (a halo of `kernel // 2` rows for a
  3×3×3 convolution of stride 1; for a strided or transposed convolution the rows its "same" padding reads),
  with zeros beyond the volume's ends, and then convolves without padding along that axis: each output row is
  computed from exactly the rows one device would use. Instance, group and batch normalisation reduce their
  statistics over all slabs (two passes: the mean, then the squared deviations from it). Element-wise layers
  (activations, dropout, sums, channel concatenation) run on each slab. The outputs are joined on the group's
  first device, where the loss sees the whole patch (Dice's global sums and deep supervision included).

Both modes take `data` groups of devices (a data × model mesh): the batch is split over the groups, each group
runs the model over its own devices, and the loss is the mean of the groups' losses (as data parallelism
averages its replicas'); spatial BatchNorm reduces over every group (synchronised, like the trainer's mirrored
BatchNorm).

Example:
```python
model = UNetConfig(1, 3, filters=(8, 16, 32), strides=(1, 2, 2)).build()
parallel = ModelParallel(model, "spatial", devices=[["/cpu:0", "/cpu:1"]], strides=(1, 2, 2))
logits = parallel(images, training=False)            # equal to model(images)
loss = parallel.loss(loss_fn, labels, images, training=True)
```
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Sequence

import keras
import tensorflow as tf
from keras import layers

from tfmis.networks.architecture import _per_axis, required_divisor
from tfmis.networks.blocks import ConvNormAct, ResidualUnit, UpBlock

MODES = ("pipeline", "spatial")


def slab_bounds(length: int, unit: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of `parts` slabs covering `length` voxels, each a multiple of `unit` long, as equal as can be.

    Example:
        >>> slab_bounds(80, 16, 2)
        [(0, 48), (48, 80)]
    """
    units = length // unit
    if length % unit or units < parts:
        raise ValueError(
            f"a side of {length} voxels cannot be cut into {parts} slabs whose sizes are multiples of {unit} (the "
            f"product of the network's strides along it): make that side a multiple of {unit} of at least "
            f"{unit * parts} voxels, or use fewer devices"
        )
    base, extra = divmod(units, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + (base + (i < extra)) * unit
        bounds.append((start, stop))
        start = stop
    return bounds


def same_padding(length: int, kernel: int, stride: int) -> tuple[int, int]:
    """(before, after) zero rows TensorFlow's "same" padding adds to `length` rows for this kernel and stride.

    Example:
        >>> same_padding(32, 3, 1), same_padding(32, 3, 2), same_padding(32, 1, 1)
        ((1, 1), (0, 1), (0, 0))
    """
    out = -(-length // stride)
    total = max((out - 1) * stride + kernel - length, 0)
    return total // 2, total - total // 2


def _slice(x, axis: int, start: int, stop: int):
    index = [slice(None)] * 5
    index[axis] = slice(start, stop)
    return x[tuple(index)]


def _zero_pad(x, paddings):
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


def _slice_labels(labels, axis: int, start: int, stop: int):
    """Rows [start, stop) along spatial tensor axis `axis` of labels (B, X, Y, Z) or (B, X, Y, Z, 1)."""
    index = [slice(None)] * labels.shape.rank
    index[axis] = slice(start, stop)
    return labels[tuple(index)]


def _static_side(x, axis: int) -> int:
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
                pieces.append(_slice(part, self.axis, start - a, stop - a))
        with tf.device(device):
            x = pieces[0] if len(pieces) == 1 else tf.concat(pieces, self.axis)
        return x, (max(0, -lo), max(0, hi - self.length))

    def join(self, group: int, device: str):
        """The whole tensor of group `group` on `device`."""
        with tf.device(device):
            parts = self.parts[group]
            return parts[0] if len(parts) == 1 else tf.concat(parts, self.axis)


class ModelParallel:
    """A Keras functional U-Net run over a mesh of devices by layers or by space.

    Args:
        model: the model (or the deep-supervision training model) to run; its variables are used as they are.
        mode: "pipeline" or "spatial".
        devices: devices[g] = the devices of data group g (all groups the same length: N per group).
        strides: the U-Net's per-level strides (`model.strides`): spatial slabs are aligned to their product.
        axis: spatial: the patch axis (0, 1, 2) to cut; None = the longest that can be cut into N slabs.
        micro_batches: pipeline: micro-batches per group batch (GPipe's M); must divide it.
        patch_size: the training patch (spatial sizes), used to choose the axis and to size the pipeline stages.
        in_channels: the image channels (sizes the pipeline stages).
    """

    def __init__(
        self,
        model: keras.Model,
        mode: str,
        devices: Sequence[Sequence[str]],
        strides: Sequence,
        axis: int | None = None,
        micro_batches: int = 1,
        patch_size: Sequence[int] | None = None,
        in_channels: int | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"runtime.model_parallel.mode must be one of none, {', '.join(MODES)}; got {mode!r}")
        self.model, self.mode = model, mode
        self.devices = [list(group) for group in devices]
        if not self.devices or len({len(group) for group in self.devices}) != 1 or not self.devices[0]:
            raise ValueError(f"model parallelism: devices must be equal-length groups, got {devices}")
        self.size = len(self.devices[0])
        self.groups = len(self.devices)
        self.divisor = required_divisor(strides)
        self.micro_batches = max(1, int(micro_batches))
        self.patch_size = tuple(patch_size) if patch_size is not None else None
        self.in_channels = in_channels
        self.axis = None
        if mode == "spatial":
            self.axis = self.choose_axis(self.patch_size, axis) if (axis is not None or self.patch_size) else None
        self.stages: dict[str, int] | None = None  # pipeline: top-level layer name -> stage
        self.stage_costs: list[dict] = []
        if mode == "pipeline":
            self._plan_stages()

    # ------------------------------------------------------------------ placement

    def choose_axis(self, patch_size, axis: int | None) -> int:
        """The patch axis (0, 1, 2) to cut: the named one (checked), else the longest that fits N slabs."""
        if axis is not None:
            if axis not in (0, 1, 2):
                raise ValueError(f"runtime.model_parallel.axis must be 0, 1, 2 or null, got {axis}")
            if patch_size is not None:
                slab_bounds(int(patch_size[axis]), self.divisor[axis], self.size)
            return int(axis)
        fits = [
            a
            for a in range(3)
            if patch_size[a] % self.divisor[a] == 0 and patch_size[a] // self.divisor[a] >= self.size
        ]
        if not fits:
            raise ValueError(
                f"runtime.model_parallel: no axis of the patch {tuple(patch_size)} can be cut into {self.size} slabs "
                f"aligned to the strides' product {self.divisor}: each slab must be a multiple of it; use a larger "
                "patch or fewer devices"
            )
        return max(fits, key=lambda a: (patch_size[a], -a))

    def _plan_stages(self) -> None:
        """Cuts the top-level layers (in execution order) into `size` contiguous stages of about equal bytes."""
        order = [layer for layer in _execution_order(self.model) if not isinstance(layer, layers.InputLayer)]
        costs = self._layer_bytes(order)
        cut = _balanced_cuts([costs[layer.name]["bytes"] for layer in order], self.size)
        self.stages = {}
        self.stage_costs = [{"layers": [], "bytes": 0, "parameter_bytes": 0} for _ in range(self.size)]
        for layer, stage in zip(order, cut):
            self.stages[layer.name] = stage
            entry = self.stage_costs[stage]
            entry["layers"].append(layer.name)
            entry["bytes"] += costs[layer.name]["bytes"]
            entry["parameter_bytes"] += costs[layer.name]["parameter_bytes"]
        self.layer_costs = costs

    def _layer_bytes(self, order) -> dict[str, dict]:
        """Each top-level layer's forward tensor bytes (one micro-batch image at the patch size, from the traced
        training forward pass, by the layer's name scope) plus its parameter bytes."""
        costs = {layer.name: {"bytes": 0, "parameter_bytes": 0} for layer in order}
        for layer in order:
            params = sum(math.prod(v.shape) * 4 for v in layer.trainable_variables)
            costs[layer.name]["parameter_bytes"] = params
            costs[layer.name]["bytes"] += params
        if self.patch_size is None or self.in_channels is None:
            return costs
        spec = tf.TensorSpec((1, *self.patch_size, self.in_channels), tf.float32)
        graph = tf.function(lambda x: self.model(x, training=True), autograph=False).get_concrete_function(spec).graph
        names = set(costs)
        for op in graph.get_operations():
            # a scope traced again is uniquified with a suffix: "encoder0_1"
            scopes = [c for part in op.name.split("/") for c in (part, re.sub(r"_\d+$", "", part))]
            owner = next((scope for scope in scopes if scope in names), None)
            if owner is None:
                continue
            for tensor in op.outputs:
                if tensor.shape.is_fully_defined() and tensor.dtype.size:
                    costs[owner]["bytes"] += tensor.shape.num_elements() * tensor.dtype.size
        return costs

    def stage_table(self) -> str:
        """The pipeline's stages: device, layers, forward bytes per image (activations + parameters)."""
        lines = [
            f"pipeline over {self.size} devices x {self.micro_batches} micro-batches (bytes per image at the patch):"
        ]
        for stage, entry in enumerate(self.stage_costs):
            lines.append(
                f"  stage {stage} on {self.devices[0][stage]}: {entry['bytes'] / 2**20:8.1f} MiB "
                f"(parameters {entry['parameter_bytes'] / 2**20:.2f} MiB)  {', '.join(entry['layers'])}"
            )
        return "\n".join(lines)

    def describe(self) -> str:
        """One line (spatial) or a table (pipeline) saying how the model is placed."""
        if self.mode == "pipeline":
            return self.stage_table()
        axis = "chosen per input" if self.axis is None else f"axis {self.axis}"
        line = f"spatial partitioning over {self.size} devices ({axis}, slabs aligned to {self.divisor})"
        if self.patch_size is not None and self.axis is not None:
            bounds = slab_bounds(self.patch_size[self.axis], self.divisor[self.axis], self.size)
            line += f": slabs {bounds} of the patch {tuple(self.patch_size)}"
        return line + (f", {self.groups} data groups" if self.groups > 1 else "")

    # ------------------------------------------------------------------ running

    def _split_batch(self, x):
        if self.groups == 1:
            return [x]
        return tf.split(x, self.groups)

    def group_outputs(self, images, training: bool = False) -> list:
        """The model's outputs of each data group's share of the batch, each on the group's first device."""
        shares = self._split_batch(images)
        if self.mode == "pipeline":
            return [self._pipeline(share, g, training) for g, share in enumerate(shares)]
        return self._spatial(shares, training)

    def __call__(self, images, training: bool = False):
        """The model's outputs (structure as `model(images)`), equal to them within float32 rounding."""
        outputs = self.group_outputs(images, training)
        if self.groups == 1:
            return outputs[0]
        with tf.device(self.devices[0][0]):
            return tf.nest.map_structure(lambda *xs: tf.concat(xs, 0), *outputs)

    def loss(self, loss_fn, labels, images, training: bool = True):
        """`loss_fn(labels, outputs)` of the whole batch (one group), or the mean of the groups' losses.

        Spatial, with a loss made of sums over voxels (`loss_fn.supports_partial_sums`: Dice, Dice + CE, and deep
        supervision over them), each slab's sums are taken on its device and only their totals meet, so the first
        device never holds the whole patch's logits; other losses see the joined outputs."""
        if self.mode == "spatial" and getattr(loss_fn, "supports_partial_sums", False):
            return self._spatial_loss(loss_fn, labels, images, training)
        outputs = self.group_outputs(images, training)
        label_shares = self._split_batch(labels)
        losses = []
        for g, (y, out) in enumerate(zip(label_shares, outputs)):
            with tf.device(self._loss_device(g)):
                losses.append(tf.cast(loss_fn(y, out), tf.float32))
        if len(losses) == 1:
            return losses[0]
        with tf.device(self.devices[0][0]):
            return tf.add_n(losses) / len(losses)

    @staticmethod
    def gradients(loss, variables):
        """d loss / d variables with each backward op placed on its forward op's device (`tf.gradients`, inside a
        `tf.function`): `tf.GradientTape.gradient` leaves the backward ops unplaced, so TensorFlow would run the
        whole backward pass, and hold its tensors, on the first device (tensorflow/tensorflow#54460)."""
        if tf.executing_eagerly():
            raise RuntimeError("ModelParallel.gradients runs inside a tf.function (graph mode), as training does")
        return tf.gradients(loss, variables)

    def _loss_device(self, group: int) -> str:
        if self.mode == "pipeline":
            return self.devices[group][self.stages.get("logits", self.size - 1)]
        return self.devices[group][0]

    # ------------------------------------------------------------------ pipeline

    def _pipeline(self, images, group: int, training: bool):
        devices = self.devices[group]
        batch = images.shape[0]
        m = self.micro_batches
        if batch is not None and batch % m:
            raise ValueError(
                f"runtime.model_parallel.micro_batches={m} must divide the batch of {batch} images per model "
                "replica (pipeline.num_images_per_batch / accumulation steps)"
            )

        def place(layer):
            stage = self.stages.get(layer.name, 0)

            def call(*args, **kwargs):
                with tf.device(devices[stage]):
                    if "training" in inspect.signature(layer.call).parameters:
                        kwargs.setdefault("training", training)
                    return layer(*args, **kwargs)

            return call

        outputs = [
            self.model._run_through_graph(x, operation_fn=place) for x in (tf.split(images, m) if m > 1 else [images])
        ]
        with tf.device(self._loss_device(group)):
            if len(outputs) == 1:
                return outputs[0]
            return tf.nest.map_structure(lambda *xs: tf.concat(xs, 0), *outputs)

    # ------------------------------------------------------------------ spatial

    def _spatial(self, shares, training: bool, join: bool = True):
        axis = self.axis if self.axis is not None else self.choose_axis(tuple(shares[0].shape[1:4]), None)
        tensor_axis = axis + 1
        length = _static_side(shares[0], tensor_axis)
        bounds = slab_bounds(length, self.divisor[axis], self.size)
        parts = []
        for share, devices in zip(shares, self.devices):
            row = []
            for (a, b), device in zip(bounds, devices):
                piece = _slice(share, tensor_axis, a, b)  # sliced where the batch is: only a slab travels
                with tf.device(device):
                    row.append(tf.identity(piece))
            parts.append(row)
        slabs = Slabs(parts, bounds, tensor_axis, self.devices)
        runner = _SpatialRunner(training)
        outputs = self.model._run_through_graph(slabs, operation_fn=runner.operation)
        if join:
            return [
                tf.nest.map_structure(lambda s, g=g: s.join(g, self.devices[g][0]), outputs) for g in range(self.groups)
            ]
        return outputs

    def _spatial_loss(self, loss_fn, labels, images, training: bool):
        """A loss of sums (`loss_fn.partial_sums`) slab by slab on the slabs' devices, its totals on the first device:
        the whole patch's loss without joining the whole patch's outputs there."""
        outputs = self._spatial(self._split_batch(images), training, join=False)
        first = tf.nest.flatten(outputs)[0]
        losses = []
        for g, y in enumerate(self._split_batch(labels)):
            sums = []
            for i, ((a, b), device) in enumerate(zip(first.bounds, self.devices[g])):
                with tf.device(device):
                    part = tf.nest.map_structure(lambda s, g=g, i=i: s.parts[g][i], outputs)
                    sums.append(loss_fn.partial_sums(tf.identity(_slice_labels(y, first.axis, a, b)), part))
            with tf.device(self.devices[g][0]):
                totals = tf.nest.map_structure(lambda *xs: tf.add_n(list(xs)), *sums)
                losses.append(tf.cast(loss_fn.from_sums(totals), tf.float32))
        if len(losses) == 1:
            return losses[0]
        with tf.device(self.devices[0][0]):
            return tf.add_n(losses) / len(losses)


def _execution_order(model: keras.Model) -> list:
    """The model's top-level layers in the order `_run_through_graph` calls them."""
    order = []

    def record(layer):
        order.append(layer)
        return lambda *args, **kwargs: _symbolic(layer, *args, **kwargs)

    specs = [keras.KerasTensor(x.shape, x.dtype) for x in model.inputs]
    model._run_through_graph(specs if len(specs) > 1 else specs[0], operation_fn=record)
    return order


def _symbolic(layer, *args, **kwargs):
    return layer.compute_output_spec(*args, **kwargs)


def _balanced_cuts(costs: Sequence[float], parts: int) -> list[int]:
    """Stage of each item: `parts` contiguous groups (none empty while items last) minimising the largest sum."""
    n = len(costs)
    parts = min(parts, n)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest possible largest group of the first i items in k groups
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    stages, i = [0] * n, n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        for item in range(j, i):
            stages[item] = k - 1
        i = j
    return stages


def _statistics_dtype(x: Slabs):
    """Normalisation statistics in float32 (Keras': float16 overflows), or float64 for float64 features."""
    return tf.float64 if x.parts[0][0].dtype == tf.float64 else tf.float32


class _SpatialRunner:
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
            f"spatial partitioning has no slab-wise version of {type(layer).__name__} ({layer.name}); use "
            "runtime.model_parallel.mode=pipeline for this network"
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
        kernel_size, strides = _per_axis(layer.kernel_size, "kernel"), _per_axis(layer.strides, "strides")
        pointwise = all(k == 1 for k in kernel_size) and all(s == 1 for s in strides)  # "valid" = "same" then
        if (
            (layer.padding != "same" and not pointwise)
            or layer.data_format != "channels_last"
            or any(d != 1 for d in _per_axis(layer.dilation_rate, "dilation"))
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
                paddings[a] = list(same_padding(_static_side(x, a), kernel_size[a - 1], strides[a - 1]))
        if any(p != [0, 0] for p in paddings):
            x = _zero_pad(x, paddings)
        return tf.nn.conv3d(x, kernel, strides=[1, *strides, 1], padding="VALID")

    @staticmethod
    def _conv_transpose(x, kernel, kernel_size, strides, axis, pad_lo, pad_hi, lo, oa, ob):
        if pad_lo or pad_hi:  # rows beyond the volume: zeros, which add nothing to any output row
            paddings = [[0, 0]] * 5
            paddings[axis] = [pad_lo, pad_hi]
            x = _zero_pad(x, paddings)
        full, crop = [], []
        for a in (1, 2, 3):
            n, k, s = _static_side(x, a), kernel_size[a - 1], strides[a - 1]
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
                    counts += math.prod(_static_side(part, a) for a in (1, 2, 3)) * (channels // groups)
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
            voxels = sum(math.prod(_static_side(part, a) for a in (1, 2, 3)) for part in x.parts[0])
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
