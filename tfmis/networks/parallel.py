"""Model parallelism for the U-Net on plain TensorFlow: one Keras model, its weights unchanged, run over several
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
  statistics). Each stage owns its variables: they are moved to its device once the stages are cut
  (`place_stage_variables`), with their gradients, optimizer slots and updates (`place_optimizer`).
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

This module is the front (the mesh, the batch split over the groups, the loss, the two runs); the spatial mode's
slabs and halo exchange are `tfmis.networks.slabs`, its layers slab by slab `tfmis.networks.spatial`, and the
pipeline's stages `tfmis.networks.pipeline_stages`.

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
from collections.abc import Sequence

import keras
import tensorflow as tf

from tfmis.errors import ConfigError
from tfmis.networks.architecture import required_divisor
from tfmis.networks.pipeline_stages import colocate_updates, cut_stages, place_stage_variables, stage_table
from tfmis.networks.slab_geometry import slab_axis, slab_bounds
from tfmis.networks.slabs import Slabs, slice_along_axis, slice_labels, static_side
from tfmis.networks.spatial import SpatialRunner

MODES = ("pipeline", "spatial")


class ModelParallel:
    """A Keras functional U-Net run over a mesh of devices by layers or by space.

    Args:
        model: the model (or the deep-supervision training model) to run; its variables keep their values (a
            pipeline with `place_variables` moves each to its stage's device).
        mode: "pipeline" or "spatial".
        devices: devices[g] = the devices of data group g (all groups the same length: N per group).
        strides: the U-Net's per-level strides (`model.strides`): spatial slabs are aligned to their product.
        axis: spatial: the patch axis (0, 1, 2) to cut; None = the longest that can be cut into N slabs.
        micro_batches: pipeline: micro-batches per group batch (GPipe's M); must divide it.
        patch_size: the training patch (spatial sizes), used to choose the axis and to size the pipeline stages.
        in_channels: the image channels (sizes the pipeline stages).
        place_variables: pipeline: move each stage's variables to the stage's device (group 0's), so that their
            reads, gradient sums and optimizer slots are there (`place_stage_variables`: before any
            `tf.function` traces the model and before the optimizer is built). Off for a second `ModelParallel`
            over the same layers (e.g. validation's, cut at another window size), which would move them again.
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
        place_variables: bool = True,
    ):
        if mode not in MODES:
            raise ConfigError(f"runtime.model_parallel.mode must be one of none, {', '.join(MODES)}; got {mode!r}")
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
        self.placed_variable_bytes: dict[str, int] | None = None  # pipeline: device -> bytes of variables on it
        if mode == "pipeline":
            self._plan_stages()
            if place_variables:
                self.placed_variable_bytes = place_stage_variables(self.model, self.stages, self.devices[0])

    # ------------------------------------------------------------------ placement

    def choose_axis(self, patch_size, axis: int | None) -> int:
        """The patch axis (0, 1, 2) to cut: the named one (checked), else the longest that fits N slabs."""
        return slab_axis(patch_size, axis, self.divisor, self.size)

    def _plan_stages(self) -> None:
        """Cuts the top-level layers (in execution order) into `size` contiguous stages of about equal bytes."""
        self.stages, self.stage_costs, self.layer_costs = cut_stages(
            self.model, self.size, self.patch_size, self.in_channels
        )
        if len(self.layer_costs) < self.size:  # stages without a layer: devices that would hold nothing
            raise ConfigError(
                f"runtime.model_parallel.mode=pipeline, runtime.model_parallel.devices={self.size}: the network has "
                f"{len(self.layer_costs)} top-level layers to cut into stages ({', '.join(self.layer_costs)}), so "
                f"{self.size - len(self.layer_costs)} devices would hold none: set runtime.model_parallel.devices="
                f"{len(self.layer_costs)} or fewer, or use runtime.model_parallel.mode=spatial"
            )

    def stage_table(self) -> str:
        """The pipeline's stages: device, layers, forward bytes per image (activations + parameters), and the bytes
        of the variables placed on each stage's device."""
        return stage_table(self.stage_costs, self.devices[0], self.micro_batches, self.placed_variable_bytes)

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

    def place_optimizer(self, optimizer) -> None:
        """Runs each variable's optimizer update on the variable's device (`colocate_updates`): with a pipeline's
        stages owning their variables, the update of a stage's weights and slots stays on its device."""
        if self.placed_variable_bytes is not None:
            colocate_updates(optimizer)

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
            raise ConfigError(
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
        length = static_side(shares[0], tensor_axis)
        bounds = slab_bounds(length, self.divisor[axis], self.size)
        parts = []
        for share, devices in zip(shares, self.devices):
            row = []
            for (a, b), device in zip(bounds, devices):
                piece = slice_along_axis(share, tensor_axis, a, b)  # sliced where the batch is: only a slab travels
                with tf.device(device):
                    row.append(tf.identity(piece))
            parts.append(row)
        slabs = Slabs(parts, bounds, tensor_axis, self.devices)
        runner = SpatialRunner(training)
        try:
            outputs = self.model._run_through_graph(slabs, operation_fn=runner.operation)
        except NotImplementedError as e:  # a layer the slabs cannot split: a setting to change, not a bug
            raise ConfigError(
                f"runtime.model_parallel.mode=spatial cannot split this network: {e}; use "
                "runtime.model_parallel.mode=pipeline (or none) for it"
            ) from e
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
                rows = slice_labels(y, first.axis, a, b)  # sliced where the labels are: only a slab travels
                with tf.device(device):
                    part = tf.nest.map_structure(lambda s, g=g, i=i: s.parts[g][i], outputs)
                    sums.append(loss_fn.partial_sums(tf.identity(rows), part))
            with tf.device(self.devices[g][0]):
                totals = tf.nest.map_structure(lambda *xs: tf.add_n(list(xs)), *sums)
                losses.append(tf.cast(loss_fn.from_sums(totals), tf.float32))
        if len(losses) == 1:
            return losses[0]
        with tf.device(self.devices[0][0]):
            return tf.add_n(losses) / len(losses)
