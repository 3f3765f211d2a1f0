"""The U-Net's building blocks (Keras 3 layers, channels-last 3D): convolution blocks, residual units, decoder
levels, normalisation and activation factories, and activation recomputation (`recompute`).

`tfmis.networks.unet` assembles them into the network; every layer here is registered for Keras
serialisation and returns its constructor's arguments from `get_config`.
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf
from keras import layers, ops

from tfmis.networks.architecture import ACTIVATIONS, KERNEL_INITIALIZERS, NORMS, expand_per_axis

_SPATIAL_AXES = (1, 2, 3)
_SERIAL_PACKAGE = "tfmis"


# ------------------------------------------------------------------------ recompute


def recompute_call(forward, inputs, state_variables):
    """Calls `forward(inputs)` without keeping its activations for the backward pass.

    Wraps `keras.remat` (= `tf.recompute_grad` on the TensorFlow backend), which runs
    `forward` twice: once in the forward pass and again inside the gradient. Two things
    make a naive `keras.remat(layer.call)` wrong for a Keras block:

    * stateful layers would not replay: Dropout draws a new mask (its seed generator
      has already advanced) and BatchNorm would update its moving statistics twice;
    * `tf.custom_gradient` rejects keyword arguments (e.g. `training`) in graph mode.

    So `forward` is made pure: it runs inside a `keras.StatelessScope` that reads the
    state variables (seed-generator states, moving statistics) from a snapshot taken
    before the call and returns their updates as extra outputs, which are assigned once
    here. The recomputation therefore replays the exact forward pass.

    Args:
        forward: `inputs -> outputs`, with `training` already bound.
        inputs: a tensor or a (flat) list of tensors.
        state_variables: the block's non-trainable variables.

    Returns:
        `forward(inputs)`.
    """
    flat_inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    num_inputs = len(flat_inputs)

    def replayable_forward(*tensors):
        block_inputs = list(tensors[:num_inputs]) if isinstance(inputs, (list, tuple)) else tensors[0]
        state_values = tensors[num_inputs:]
        mapping = list(zip(state_variables, state_values))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            outputs = forward(block_inputs)
        updated = [scope.get_current_value(v) for v in state_variables]
        return (outputs, *updated)

    # copies, not the variables: a variable passed in would be re-read after its update
    snapshot = [ops.copy(v.value) for v in state_variables]
    outputs, *updated = keras.remat(replayable_forward)(*flat_inputs, *snapshot)
    for variable, value in zip(state_variables, updated):
        variable.assign(value)
    return outputs


class RecomputableBlock(layers.Layer):
    """Base for U-Net blocks: `call` runs `forward`, recomputed in backprop if asked.

    Subclasses implement `forward(inputs, training)` and pass `training` explicitly to
    every sublayer: during recomputation Keras' call context (which would otherwise
    propagate `training`) is gone, and BatchNorm/Dropout would silently switch to
    inference behaviour.

    Args:
        recompute: drop this block's activations after the forward pass and recompute
            them for the gradient (only when `training` is true).
    """

    def __init__(self, recompute: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.recompute = bool(recompute)

    def forward(self, inputs, training=None):
        raise NotImplementedError

    def call(self, inputs, training=None):
        # inference needs no gradient, so recomputation would only cost time
        if self.recompute and training:
            bound = functools.partial(self.forward, training=training)
            return recompute_call(bound, inputs, self.non_trainable_variables)
        return self.forward(inputs, training=training)

    def get_config(self):
        return {**super().get_config(), "recompute": self.recompute}


# ------------------------------------------------------------------------ instance normalisation


@keras.saving.register_keras_serializable(package=_SERIAL_PACKAGE)
class InstanceNormalization(layers.GroupNormalization):
    """GroupNormalization with one group per channel, computed over the spatial axes of the 5-D tensor itself.

    The same variables (`gamma`, `beta`), names, checkpoints and outputs as `GroupNormalization(groups=channels)`
    (to float32 round-off, tested), without its reshape into groups. That reshape makes the exported graph
    reduce a 6-D tensor, which OpenVINO's CPU plugin runs in a reference kernel (69 % of a CT window batch's time,
    measured in docs/deploying.md); over the spatial axes it fuses into one MVN.

    Example:
        >>> InstanceNormalization(epsilon=1e-5).get_config()["groups"]
        -1
    """

    def __init__(self, groups: int = -1, **kwargs):
        super().__init__(groups=groups, **kwargs)

    def build(self, input_shape):
        super().build(input_shape)  # groups -1 becomes the channel count
        if self.groups != input_shape[-1]:
            raise ValueError(f"{self.name}: instance normalisation has one group per channel, got groups={self.groups}")

    def call(self, inputs):
        compute_dtype = keras.backend.result_type(inputs.dtype, "float32")  # float32 under mixed precision, as GN
        x = ops.cast(inputs, compute_dtype)
        mean, variance = ops.moments(x, axes=list(range(1, len(x.shape) - 1)), keepdims=True)
        inv = ops.rsqrt(variance + self.epsilon)
        if self.scale:
            inv = inv * ops.cast(self.gamma, compute_dtype)
        shift = -mean * inv
        if self.center:
            shift = shift + ops.cast(self.beta, compute_dtype)
        return ops.cast(x * inv + shift, self.compute_dtype)


# ------------------------------------------------------------------------ blocks


def make_normalization(norm: str, channels: int, norm_groups: int = 8, name: str | None = None):
    """The normalization layer for `channels` features.

    "batch" built in the scope of a tf.distribute strategy with several replicas (as the trainer
    does under MirroredStrategy) is synchronised BatchNorm: the batch statistics are those of all
    replicas' images together, so every replica normalises alike and keeps identical moving
    statistics, equal to those of one device given the same global batch (like PyTorch's
    `SyncBatchNorm`). With one replica it is the ordinary layer.

    Args:
        norm: "batch", "instance" (`InstanceNormalization`: one group per channel) or "group"
            (GroupNorm with `norm_groups` groups).
        channels: number of feature channels being normalized.
        norm_groups: groups for `norm="group"`; must divide `channels`.
        name: layer name.

    Example:
        >>> make_normalization("instance", 16).groups
        16
        >>> make_normalization("batch", 16).synchronized  # no multi-replica strategy here
        False
    """
    # epsilon 1e-5 and BatchNorm momentum 0.9 match PyTorch (and so MONAI) defaults
    if norm == "batch":
        # unsynchronised, each replica would update its own copy of the moving statistics from its
        # share of the batch (Keras' aggregation "none"), and checkpoints would hold replica 0's
        replicas = tf.distribute.get_strategy().num_replicas_in_sync if tf.distribute.has_strategy() else 1
        return layers.BatchNormalization(momentum=0.9, epsilon=1e-5, synchronized=replicas > 1, name=name)
    if norm == "instance":
        return InstanceNormalization(groups=channels, epsilon=1e-5, name=name)
    if norm == "group":
        if channels % norm_groups:
            raise ValueError(f"norm_groups={norm_groups} must divide the channel count {channels}")
        return layers.GroupNormalization(groups=norm_groups, epsilon=1e-5, name=name)
    raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")


def make_kernel_initializer(name: str = "he_normal"):
    """The convolutions' kernel initializer: He-normal, or PyTorch's default (kaiming-uniform, a=√5).

    PyTorch's bound is gain·√(3/fan_in) with gain = √(2/(1+a²)) = √(1/3): U(±1/√fan_in), i.e. Keras'
    variance scaling with scale 1/3, fan-in mode, uniform.

    Example:
        >>> make_kernel_initializer("pytorch").scale
        0.3333333333333333
    """
    if name == "he_normal":
        return keras.initializers.HeNormal()
    if name == "pytorch":
        return keras.initializers.VarianceScaling(scale=1.0 / 3.0, mode="fan_in", distribution="uniform")
    raise ValueError(f"kernel_initializer must be one of {KERNEL_INITIALIZERS}, got {name!r}")


def make_activation(activation: str, name: str | None = None):
    """PReLU (MONAI's default; one learnable slope per channel, initialised to 0.25 as in
    PyTorch) or LeakyReLU with slope 0.01 (nnU-Net's choice).

    Example:
        >>> make_activation("leaky_relu").negative_slope
        0.01
    """
    if activation == "prelu":
        return layers.PReLU(
            alpha_initializer=keras.initializers.Constant(0.25), shared_axes=list(_SPATIAL_AXES), name=name
        )
    if activation == "leaky_relu":
        return layers.LeakyReLU(negative_slope=0.01, name=name)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


@keras.saving.register_keras_serializable(package=_SERIAL_PACKAGE)
class ConvNormAct(RecomputableBlock):
    """Conv3D (or Conv3DTranspose) → norm → dropout → activation, like MONAI `Convolution`.

    Args:
        filters: output channels.
        kernel_size: int or 3 ints.
        strides: int or 3 ints; downsamples (or, if `transposed`, upsamples) by it.
        norm, norm_groups, activation, dropout: see `build_unet`.
        transposed: use a transposed convolution (upsampling).
        conv_only: only the convolution (with bias), no norm/dropout/activation.

    Example:
        >>> block = ConvNormAct(8, strides=2)
        >>> tuple(block(keras.ops.zeros((1, 8, 8, 8, 2))).shape)
        (1, 4, 4, 4, 8)
    """

    def __init__(
        self,
        filters: int,
        kernel_size=3,
        strides=1,
        norm: str = "instance",
        norm_groups: int = 8,
        activation: str = "prelu",
        dropout: float = 0.0,
        transposed: bool = False,
        conv_only: bool = False,
        kernel_initializer: str = "he_normal",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.filters = int(filters)
        self.kernel_size = kernel_size
        self.strides = strides
        self.norm = norm
        self.norm_groups = int(norm_groups)
        self.activation = activation
        self.dropout = float(dropout)
        self.transposed = bool(transposed)
        self.conv_only = bool(conv_only)
        self.kernel_initializer = kernel_initializer
        conv_class = layers.Conv3DTranspose if transposed else layers.Conv3D
        # a bias right before a normalization is cancelled by its mean subtraction
        self.conv = conv_class(
            filters,
            kernel_size,
            strides=strides,
            padding="same",
            use_bias=conv_only,
            kernel_initializer=make_kernel_initializer(kernel_initializer),
            name="conv",
        )
        if not conv_only:
            self.normalization = make_normalization(norm, filters, norm_groups, name="norm")
            self.dropout_layer = layers.Dropout(dropout, name="dropout") if dropout > 0 else None
            self.act = make_activation(activation, name="act")

    def build(self, input_shape):
        self.conv.build(input_shape)
        output_shape = self.conv.compute_output_shape(input_shape)
        if not self.conv_only:
            self.normalization.build(output_shape)
            self.act.build(output_shape)

    def compute_output_shape(self, input_shape):
        return self.conv.compute_output_shape(input_shape)

    def forward(self, inputs, training=None):
        x = self.conv(inputs)
        if self.conv_only:
            return x
        x = self.normalization(x, training=training)
        if self.dropout_layer is not None:
            x = self.dropout_layer(x, training=training)
        return self.act(x)

    def get_config(self):
        return {
            **super().get_config(),
            "filters": self.filters,
            "kernel_size": self.kernel_size,
            "strides": self.strides,
            "norm": self.norm,
            "norm_groups": self.norm_groups,
            "activation": self.activation,
            "dropout": self.dropout,
            "transposed": self.transposed,
            "conv_only": self.conv_only,
            "kernel_initializer": self.kernel_initializer,
        }


@keras.saving.register_keras_serializable(package=_SERIAL_PACKAGE)
class ResidualUnit(RecomputableBlock):
    """`subunits` ConvNormAct blocks plus a residual path, like MONAI `ResidualUnit`.

    The first sub-unit carries the stride. The residual path is the identity, or a
    convolution when the stride or channel count changes (kernel `kernel_size` when
    strided, else 1×1×1). Output = conv path + residual path (no activation after the
    sum, as in MONAI).

    Args:
        filters: output channels.
        strides: stride of the first sub-unit (int or 3 ints).
        subunits: number of ConvNormAct sub-units (at least 1).
        kernel_size, norm, norm_groups, activation, dropout: see `build_unet`.

    Example:
        >>> unit = ResidualUnit(8, strides=2, subunits=2)
        >>> tuple(unit(keras.ops.zeros((1, 8, 8, 8, 2))).shape)
        (1, 4, 4, 4, 8)
    """

    def __init__(
        self,
        filters: int,
        strides=1,
        subunits: int = 2,
        kernel_size=3,
        norm: str = "instance",
        norm_groups: int = 8,
        activation: str = "prelu",
        dropout: float = 0.0,
        kernel_initializer: str = "he_normal",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.filters = int(filters)
        self.strides = strides
        self.kernel_initializer = kernel_initializer
        self.subunits = max(1, int(subunits))
        self.kernel_size = kernel_size
        self.norm = norm
        self.norm_groups = int(norm_groups)
        self.activation = activation
        self.dropout = float(dropout)
        self.units = [
            ConvNormAct(
                filters,
                kernel_size,
                strides if i == 0 else 1,
                norm,
                norm_groups,
                activation,
                dropout,
                kernel_initializer=kernel_initializer,
                name=f"unit{i}",
            )
            for i in range(self.subunits)
        ]
        self.projection = None  # created in build(), once the input channel count is known

    def build(self, input_shape):
        strided = any(s != 1 for s in expand_per_axis(self.strides, "strides"))
        if strided or input_shape[-1] != self.filters:
            self.projection = layers.Conv3D(
                self.filters,
                self.kernel_size if strided else 1,
                strides=self.strides,
                padding="same",
                kernel_initializer=make_kernel_initializer(self.kernel_initializer),
                name="residual",
            )
            self.projection.build(input_shape)
        shape = input_shape
        for unit in self.units:
            unit.build(shape)
            shape = unit.compute_output_shape(shape)

    def compute_output_shape(self, input_shape):
        return self.units[0].compute_output_shape(input_shape)

    def forward(self, inputs, training=None):
        residual = inputs if self.projection is None else self.projection(inputs)
        x = inputs
        for unit in self.units:
            x = unit(x, training=training)
        return x + residual

    def get_config(self):
        return {
            **super().get_config(),
            "filters": self.filters,
            "strides": self.strides,
            "subunits": self.subunits,
            "kernel_size": self.kernel_size,
            "norm": self.norm,
            "norm_groups": self.norm_groups,
            "activation": self.activation,
            "dropout": self.dropout,
            "kernel_initializer": self.kernel_initializer,
        }


def level_block(
    filters,
    strides,
    subunits,
    kernel_size,
    norm,
    norm_groups,
    activation,
    dropout,
    name,
    recompute=False,
    kernel_initializer="he_normal",
):
    """A residual unit, or a single ConvNormAct when `subunits == 0` (MONAI's plain mode)."""
    if subunits > 0:
        return ResidualUnit(
            filters,
            strides,
            subunits,
            kernel_size,
            norm,
            norm_groups,
            activation,
            dropout,
            kernel_initializer=kernel_initializer,
            recompute=recompute,
            name=name,
        )
    return ConvNormAct(
        filters,
        kernel_size,
        strides,
        norm,
        norm_groups,
        activation,
        dropout,
        kernel_initializer=kernel_initializer,
        recompute=recompute,
        name=name,
    )


@keras.saving.register_keras_serializable(package=_SERIAL_PACKAGE)
class UpBlock(RecomputableBlock):
    """Decoder level: transposed-conv upsampling, skip concatenation, fusion block.

    Called on `[coarse, skip]`; returns features at the skip's resolution.

    Args:
        filters: output channels (normally the skip's channel count).
        strides: upsampling factor (the stride of the level below), int or 3 ints.
        num_res_units: 0 → the fusion is one ConvNormAct; otherwise a residual unit
            with one sub-unit (MONAI's up path also uses a single sub-unit).
        upsample_filters: channels of the upsampled tensor (default `filters`).
        kernel_size, norm, norm_groups, activation, dropout: see `build_unet`.

    Example:
        >>> up = UpBlock(8, strides=2)
        >>> coarse, skip = keras.ops.zeros((1, 4, 4, 4, 16)), keras.ops.zeros((1, 8, 8, 8, 8))
        >>> tuple(up([coarse, skip]).shape)
        (1, 8, 8, 8, 8)
    """

    def __init__(
        self,
        filters: int,
        strides=2,
        num_res_units: int = 2,
        kernel_size=3,
        norm: str = "instance",
        norm_groups: int = 8,
        activation: str = "prelu",
        dropout: float = 0.0,
        upsample_filters: int | None = None,
        kernel_initializer: str = "he_normal",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.kernel_initializer = kernel_initializer
        self.filters = int(filters)
        self.strides = strides
        self.num_res_units = int(num_res_units)
        self.kernel_size = kernel_size
        self.norm = norm
        self.norm_groups = int(norm_groups)
        self.activation = activation
        self.dropout = float(dropout)
        self.upsample_filters = int(upsample_filters) if upsample_filters else self.filters
        self.upsample = ConvNormAct(
            self.upsample_filters,
            kernel_size,
            strides,
            norm,
            norm_groups,
            activation,
            dropout,
            transposed=True,
            kernel_initializer=kernel_initializer,
            name="upsample",
        )
        self.concat = layers.Concatenate(axis=-1, name="concat")
        self.fuse = level_block(
            filters,
            1,
            min(self.num_res_units, 1),
            kernel_size,
            norm,
            norm_groups,
            activation,
            dropout,
            kernel_initializer=kernel_initializer,
            name="fuse",
        )

    def build(self, input_shape):
        coarse_shape, skip_shape = input_shape
        self.upsample.build(coarse_shape)
        up_shape = self.upsample.compute_output_shape(coarse_shape)
        self.fuse.build(tuple(skip_shape[:-1]) + (up_shape[-1] + skip_shape[-1],))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[1][:-1]) + (self.filters,)

    def forward(self, inputs, training=None):
        coarse, skip = inputs
        upsampled = self.upsample(coarse, training=training)
        _check_same_spatial_shape(upsampled, skip, self.strides)
        return self.fuse(self.concat([upsampled, skip]), training=training)

    def get_config(self):
        return {
            **super().get_config(),
            "filters": self.filters,
            "strides": self.strides,
            "num_res_units": self.num_res_units,
            "kernel_size": self.kernel_size,
            "norm": self.norm,
            "norm_groups": self.norm_groups,
            "activation": self.activation,
            "dropout": self.dropout,
            "upsample_filters": self.upsample_filters,
            "kernel_initializer": self.kernel_initializer,
        }


def full_resolution_upsample_filters(filters0: int, in_channels: int) -> int:
    """Channels the features are upsampled to when they join the image at full resolution (`strides[0] > 1`).

    `filters0 − in_channels`, so that features and image together have `filters0` channels: oneDNN's CPU
    convolutions are blocked by 8 channels, so a 3×3×3 convolution over 10 channels (8 features + a 2-channel
    image) is much slower than over 8 (docs/benchmarks.md, "First epoch, precision and other costs"). Falls back
    to `filters0` when that would keep fewer than half of them.

    Example:
        >>> full_resolution_upsample_filters(8, 2), full_resolution_upsample_filters(8, 6)
        (6, 8)
    """
    narrowed = filters0 - in_channels
    return narrowed if narrowed >= max(1, filters0 // 2) else filters0


def _check_same_spatial_shape(upsampled, skip, strides):
    """Turns the concat's shape error into one that names the cause (when shapes are static)."""
    up_shape, skip_shape = tuple(upsampled.shape[1:4]), tuple(skip.shape[1:4])
    if None in up_shape or None in skip_shape or up_shape == skip_shape:
        return
    raise ValueError(
        f"decoder cannot join a {up_shape} upsampled tensor (stride {strides}) with its {skip_shape} skip: "
        "the input patch size must be divisible by the product of the strides; check it with "
        "tfmis.networks.check_patch_size(patch, strides)"
    )
