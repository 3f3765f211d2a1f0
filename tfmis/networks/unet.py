"""A configurable 3D U-Net (channels-last) in Keras 3, modelled on MONAI's `UNet`.

Layout (one *level* per entry of `filters`/`strides`)::

    input ─ enc0 ─────────────────────────────────── dec0 ─ head (1×1×1) ─ logits (float32)
              └ enc1 (stride s1) ──────────── dec1 ┘
                    └ ...  ── bottleneck ──┘

* Encoder level `i` is a residual unit (or a plain conv block when `num_res_units=0`)
  whose first convolution has stride `strides[i]`. With `strides[0] = 1` the first
  level works at full resolution.
* Decoder level `i` upsamples level `i+1` with a transposed convolution (stride
  `strides[i+1]`), concatenates the encoder skip and fuses both with one residual
  sub-unit (or one conv block).
* Conv blocks are conv → norm → dropout → activation (MONAI's "NDA" order).
* With `strides[0] > 1` (the first layer downsamples, as in MONAI's `UNet`; about 3× less
  compute) the logits get back to the input resolution by `output_upsampling`:
  "refine" adds a last decoder level whose skip is the input image itself
  (`decoder_full`: upsample, concatenate the image, fuse at full resolution, 1×1×1 head);
  "light" upsamples (`upsample_full`), concatenates the image (`concat_image`) and
  convolves once (3×3×3) to the logits; "transposed" is MONAI's single transposed
  convolution to the logits (`head`); "transposed_image" adds to it a 3×3×3 convolution
  of the input image (`image_head`, zero-initialised).

Differences from MONAI's `UNet`: `strides` has one entry per level (MONAI's has one
fewer and its first level always downsamples), the skip is concatenated *after*
upsampling, and logits come from a 1×1×1 convolution instead of a transposed one
(unless `output_upsampling="transposed"`).

Example:
    >>> model = build_unet(in_channels=2, num_classes=4, filters=(8, 16, 32, 64),
    ...                    strides=(1, 2, 2, 2))
    >>> from tfmis.networks.architecture import check_patch_size
    >>> check_patch_size((48, 64, 32), (1, 2, 2, 2))
    (8, 8, 8)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import keras
from keras import layers

from tfmis.networks.architecture import UNetArchitecture
from tfmis.networks.blocks import (
    ConvNormAct,
    UpBlock,
    full_resolution_upsample_filters,
    level_block,
    make_kernel_initializer,
)

# ------------------------------------------------------------------------ model


@dataclasses.dataclass
class UNetConfig(UNetArchitecture):
    """A U-Net for data with `in_channels` channels and `num_classes` classes; `.build()` makes the model.

    Args:
        in_channels: input image channels (modalities).
        num_classes: output channels (logits, background included).
        **architecture: the `UNetArchitecture` fields (filters, strides, norm, ...), e.g. the `model`
            section of a training config: `UNetConfig(2, 4, **dataclasses.asdict(config.model))`.

    Example:
        >>> config = UNetConfig(in_channels=1, num_classes=3, filters=(8, 16, 32), strides=(1, 2, 2))
        >>> config.patch_divisor
        (4, 4, 4)
        >>> model = config.build()
    """

    in_channels: int
    num_classes: int

    def validate(self) -> None:
        """Raises ValueError on an inconsistent configuration."""
        if self.in_channels < 1 or self.num_classes < 1:
            raise ValueError(f"in_channels and num_classes must be >= 1, got {self.in_channels}, {self.num_classes}")
        super().validate()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> UNetConfig:
        """Like `UNetConfig(**values)` but names unknown keys in the error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown U-Net config keys {unknown}; expected some of {sorted(known)}")
        return cls(**values)

    def build(self) -> keras.Model:
        """Builds the Keras model described by this config (the inference model: logits only)."""
        return _build_from_config(self)

    def build_for_training(self) -> tuple[keras.Model, keras.Model]:
        """(model, training model): `build()`'s model and the one the optimizer trains.

        Without deep supervision both are the same object. With `deep_supervision: k` the training model
        shares every layer of the model and returns `[logits, head_1, ..., head_k]`: float32 logits of its
        1×1×1 heads on `deep_supervision_levels` (named `deep_supervision{level}`), finest first.

        Example:
            >>> config = UNetConfig(2, 4, filters=(8, 16, 32, 64), strides=(2, 2, 2, 1), deep_supervision=2)
            >>> model, training_model = config.build_for_training()
            >>> [tuple(y.shape) for y in training_model(keras.ops.zeros((1, 48, 48, 48, 2)))]
            [(1, 48, 48, 48, 4), (1, 24, 24, 24, 4), (1, 12, 12, 12, 4)]
        """
        model = self.build()
        if not self.deep_supervision:
            return model, model
        heads = []
        for level, _ in self.deep_supervision_levels:
            features = model.get_layer(f"decoder{level}").output
            x = layers.Conv3D(
                self.num_classes, 1, kernel_initializer=_head_initializer(self), name=f"deep_supervision{level}"
            )(features)
            heads.append(layers.Activation("linear", dtype="float32", name=f"deep_supervision{level}_logits")(x))
        return model, keras.Model(model.input, [model.output, *heads], name=f"{self.name}_deep_supervision")


def _head_initializer(config: UNetArchitecture):
    """The 1×1×1 heads': Keras' Glorot-uniform default, or PyTorch's with `kernel_initializer="pytorch"`."""
    return "glorot_uniform" if config.kernel_initializer == "he_normal" else make_kernel_initializer("pytorch")


def _build_from_config(config: UNetConfig) -> keras.Model:
    block_options = dict(
        kernel_size=config.kernel_size,
        norm=config.norm,
        norm_groups=config.norm_groups,
        activation=config.activation,
        dropout=config.dropout,
        kernel_initializer=config.kernel_initializer,
    )
    inputs = keras.Input(shape=(None, None, None, config.in_channels), name="image")
    skips = []
    x = inputs
    last = len(config.filters) - 1
    for level, (filters, strides) in enumerate(zip(config.filters, config.strides)):
        x = level_block(
            filters,
            strides,
            config.num_res_units,
            recompute=config.recompute,
            name="bottleneck" if level == last else f"encoder{level}",
            **block_options,
        )(x)
        skips.append(x)
    for level in reversed(range(last)):
        x = UpBlock(
            config.filters[level],
            config.strides[level + 1],
            config.num_res_units,
            recompute=config.recompute,
            name=f"decoder{level}",
            **block_options,
        )([x, skips[level]])
    if config.full_resolution_first_level:
        x = layers.Conv3D(config.num_classes, 1, kernel_initializer=_head_initializer(config), name="head")(x)
    elif config.output_upsampling == "refine":
        # the first encoder level downsampled: one more decoder level, whose skip is the image itself
        x = UpBlock(
            config.filters[0],
            config.strides[0],
            config.num_res_units,
            recompute=config.recompute,
            upsample_filters=full_resolution_upsample_filters(config.filters[0], config.in_channels),
            name="decoder_full",
            **block_options,
        )([x, inputs])
        x = layers.Conv3D(config.num_classes, 1, kernel_initializer=_head_initializer(config), name="head")(x)
    elif config.output_upsampling == "light":
        # upsampled features next to the image, one full-resolution convolution straight to the logits
        x = ConvNormAct(
            full_resolution_upsample_filters(config.filters[0], config.in_channels),
            strides=config.strides[0],
            transposed=True,
            recompute=config.recompute,
            name="upsample_full",
            **block_options,
        )(x)
        x = layers.Concatenate(axis=-1, name="concat_image")([x, inputs])
        x = layers.Conv3D(
            config.num_classes,
            config.kernel_size,
            padding="same",
            kernel_initializer=make_kernel_initializer(config.kernel_initializer),
            name="head",
        )(x)
    else:  # MONAI's last layer: a transposed convolution straight to the logits
        x = layers.Conv3DTranspose(
            config.num_classes,
            config.kernel_size,
            strides=config.strides[0],
            padding="same",
            kernel_initializer=make_kernel_initializer(config.kernel_initializer),
            name="head",
        )(x)
        if config.output_upsampling == "transposed_image":
            # plus a convolution of the image itself: the only full-resolution input of the logits, at 1/8 the cost
            # of an 8-to-8 convolution there; zero-initialised, so training starts from "transposed"
            image_term = layers.Conv3D(
                config.num_classes,
                config.kernel_size,
                padding="same",
                use_bias=False,
                kernel_initializer="zeros",
                name="image_head",
            )(inputs)
            x = layers.Add(name="head_sum")([x, image_term])
    # logits in float32 even under a mixed-precision policy (stable softmax/loss)
    outputs = layers.Activation("linear", dtype="float32", name="logits")(x)
    return keras.Model(inputs, outputs, name=config.name)


def build_unet(
    in_channels: int,
    num_classes: int,
    filters: Sequence[int] = (16, 32, 64, 128, 256),
    strides: Sequence = (1, 2, 2, 2, 2),
    num_res_units: int = 2,
    norm: str = "instance",
    norm_groups: int = 8,
    dropout: float = 0.0,
    kernel_size=3,
    recompute: bool = False,
    name: str = "unet3d",
    activation: str = "prelu",
    output_upsampling: str = "refine",
) -> keras.Model:
    """Builds a 3D U-Net for `(batch, D, H, W, in_channels)` inputs returning float32 logits.

    Args: see `UNetConfig`. Spatial sizes are dynamic; each must be a multiple of the
    per-axis product of `strides` (check with `check_patch_size`).

    Returns:
        A functional `keras.Model` mapping images to `(batch, D, H, W, num_classes)`
        float32 logits (convolutions compute in the global dtype policy, e.g. float16).

    Example:
        >>> model = build_unet(2, 4, filters=(8, 16, 32, 64), strides=(1, 2, 2, 2))
        >>> tuple(model(keras.ops.zeros((1, 32, 48, 16, 2))).shape)
        (1, 32, 48, 16, 4)
        >>> strided = build_unet(2, 4, filters=(8, 16, 32, 64), strides=(2, 2, 2, 1))  # MONAI-like first layer
        >>> tuple(strided(keras.ops.zeros((1, 48, 48, 48, 2))).shape)
        (1, 48, 48, 48, 4)
    """
    config = UNetConfig(
        in_channels,
        num_classes,
        filters=filters,
        strides=strides,
        num_res_units=num_res_units,
        norm=norm,
        norm_groups=norm_groups,
        dropout=dropout,
        kernel_size=kernel_size,
        recompute=recompute,
        name=name,
        activation=activation,
        output_upsampling=output_upsampling,
    )
    return config.build()
