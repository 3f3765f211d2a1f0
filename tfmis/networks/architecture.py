"""The U-Net's architecture as data, without Keras: the `model` section of a training config.

Kept apart from `unet.py` so that reading and checking a config does not import TensorFlow.


Example:
    >>> arch = UNetArchitecture(filters=(8, 16, 32), strides=(1, 2, (2, 2, 1)))
    >>> arch.patch_divisor
    (4, 4, 2)
    >>> UNetArchitecture(filters=(8, 16, 32, 64), strides=(2, 2, 2, 1)).full_resolution_first_level
    False
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Literal

from tfmis.errors import ConfigError

NORMS = ("batch", "instance", "group")
ACTIVATIONS = ("prelu", "leaky_relu")
OUTPUT_UPSAMPLINGS = ("refine", "light", "transposed", "transposed_image")
KERNEL_INITIALIZERS = ("he_normal", "pytorch")
OUTPUTS = ("classes", "regions")


def expand_per_axis(value, what: str) -> tuple[int, int, int]:
    """An int or a 3-sequence as a 3-tuple of ints."""
    if isinstance(value, numbers.Integral):
        return (int(value),) * 3
    value = tuple(int(v) for v in value)
    if len(value) != 3:
        raise ValueError(f"{what} must be an int or 3 ints (one per spatial axis), got {value}")
    return value


def required_divisor(strides: Sequence) -> tuple[int, int, int]:
    """Per-axis product of the strides: every patch side must be a multiple of it.

    Args:
        strides: one stride per level, each an int or a 3-tuple (anisotropic).

    Example:
        >>> required_divisor((1, 2, 2, (2, 2, 1)))
        (8, 8, 4)
    """
    per_level = [expand_per_axis(s, "each stride") for s in strides]
    return tuple(math.prod(s[axis] for s in per_level) for axis in range(3))


def check_patch_size(patch, strides: Sequence) -> tuple[int, int, int]:
    """Raises a clear ValueError unless `patch` fits a U-Net with these `strides`.

    The model accepts any spatial size at build time (`None` dims), so a bad size only
    fails deep inside a skip concatenation; call this on the training/inference patch.

    Args:
        patch: spatial patch size, an int (cube) or 3 ints.
        strides: the U-Net's per-level strides.

    Returns:
        The per-axis divisor every patch side must be a multiple of.

    Example:
        >>> check_patch_size(64, (1, 2, 2, 2, 2))
        (16, 16, 16)
        >>> check_patch_size((48, 64, 30), (1, 2, 2, 2, 2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        tfmis.errors.ConfigError: patch size (48, 64, 30) does not fit strides (1, 2, 2, 2, 2): ...
    """
    patch = expand_per_axis(patch, "patch size")
    divisor = required_divisor(strides)
    bad = [axis for axis in range(3) if patch[axis] <= 0 or patch[axis] % divisor[axis]]
    if bad:
        suggestions = ", ".join(
            f"axis {a}: {patch[a]} -> {max(divisor[a], round(patch[a] / divisor[a]) * divisor[a])}" for a in bad
        )
        raise ConfigError(
            f"patch size {patch} does not fit strides {tuple(strides)}: every spatial size "
            f"must be a positive multiple of the per-axis stride product {divisor} "
            f"(nearest valid: {suggestions})"
        )
    return divisor


@dataclasses.dataclass(kw_only=True)
class UNetArchitecture:
    """Everything that defines a U-Net apart from the data's channels and classes.

    Args:
        filters: channels per level, shallow to deep; the last level is the bottleneck.
        strides: one stride per level (int or 3 ints for anisotropic data); level `i`
            downsamples by `strides[i]`. `strides[0] = 1` runs the first level at full
            resolution; `strides[0] = 2` downsamples in the first layer, as MONAI's `UNet` does
            (about 3x less compute per step for the same filters), and the decoder returns to the
            input resolution as `output_upsampling` says.
        num_res_units: residual sub-units per encoder level; 0 = plain conv blocks.
        norm: "batch", "instance" or "group".
        norm_groups: groups for `norm="group"`; must divide every entry of `filters`.
        dropout: dropout rate after every normalization (0 disables it).
        kernel_size: convolution kernel size (int or 3 ints).
        recompute: recompute encoder/decoder block activations in the backward pass
            (less memory, more compute).
        activation: "prelu" (default, as MONAI) or "leaky_relu".
        output_upsampling: how the logits get back to the input resolution when `strides[0]`
            is not 1 (ignored otherwise): "refine" (a last decoder level: transposed-conv
            upsampling of the features, concatenated with the input image and fused by one
            block at full resolution, then the 1×1×1 head), "light" (the upsampled features
            and the image go through one 3×3×3 convolution straight to the logits) or
            "transposed" (MONAI's: one transposed convolution from the features straight to
            the class logits) or "transposed_image" (that, plus a 3×3×3 convolution of the image
            to the logits, zero-initialised: the image's intensities at full resolution for
            about 1/8 the cost of one 8-channel convolution there). "refine" and "light" upsample to
            `filters[0] − in_channels` features so that, with the image, the full-resolution tensor has `filters[0]`
            channels (see `tfmis.networks.unet.full_resolution_upsample_filters`).
        deep_supervision: extra 1×1×1 heads on the decoder levels below the output resolution, finest first
            (nnU-Net's deep supervision): training adds their losses against the labels subsampled to their
            resolution (`tfmis.losses.DeepSupervisionLoss`); inference uses the output alone, and the saved best
            weights are the inference model's. 0 = off.
        kernel_initializer: "he_normal" (default; the 1×1×1 heads Glorot-uniform) or "pytorch": PyTorch's default
            convolution initialisation, which MONAI's networks get, kaiming-uniform with a=√5, i.e. U(±1/√fan_in)
            for every convolution and head. Its weights are √6 ≈ 2.4× smaller than He-normal's (standard
            deviation); behind a normalization that scales Adam's relative update up by as much (its effect on
            the demo: docs/benchmarks.md, "Other variants measured").
        output: what the output channels mean: "classes" (one logit per class, background included: softmax,
            argmax) or "regions" (nnU-Net's region-based training, its BraTS setting: one sigmoid logit per label
            union of the training config's `validation.regions`, painted back into a label map in their order;
            `tfmis.task.SegmentationTask` sets the channel count). The network itself is the same.
        name: model name.
    """

    filters: tuple[int, ...] = (16, 32, 64, 128, 256)
    strides: tuple[int | tuple[int, int, int], ...] = (1, 2, 2, 2, 2)
    num_res_units: int = 2
    norm: Literal["batch", "instance", "group"] = "instance"
    norm_groups: int = 8
    dropout: float = 0.0
    kernel_size: int | tuple[int, int, int] = 3
    recompute: bool = False
    activation: Literal["prelu", "leaky_relu"] = "prelu"
    output_upsampling: Literal["refine", "light", "transposed", "transposed_image"] = "refine"
    deep_supervision: int = 0
    kernel_initializer: Literal["he_normal", "pytorch"] = "he_normal"
    output: Literal["classes", "regions"] = "classes"
    name: str = "unet3d"

    def __post_init__(self):
        # YAML/JSON give lists; tuples keep the config hashable and comparable
        self.filters = tuple(int(f) for f in self.filters)
        self.strides = tuple(
            int(s) if isinstance(s, numbers.Integral) else expand_per_axis(s, "each stride") for s in self.strides
        )
        self.kernel_size = (
            int(self.kernel_size)
            if isinstance(self.kernel_size, numbers.Integral)
            else expand_per_axis(self.kernel_size, "kernel_size")
        )
        self.validate()

    def validate(self) -> None:
        """Raises ValueError on an inconsistent configuration."""
        if len(self.filters) < 2:
            raise ValueError(f"filters needs at least 2 levels (one encoder + bottleneck), got {self.filters}")
        if len(self.strides) != len(self.filters):
            raise ValueError(f"strides needs one entry per level of filters {self.filters}, got {self.strides}")
        required_divisor(self.strides)  # validates each stride's form
        if self.num_res_units < 0:
            raise ValueError(f"num_res_units must be >= 0, got {self.num_res_units}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.norm == "group" and any(f % self.norm_groups for f in self.filters):
            raise ValueError(f"norm_groups={self.norm_groups} must divide every filter count, got {self.filters}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.output_upsampling not in OUTPUT_UPSAMPLINGS:
            raise ValueError(f"output_upsampling must be one of {OUTPUT_UPSAMPLINGS}, got {self.output_upsampling!r}")
        if self.kernel_initializer not in KERNEL_INITIALIZERS:
            raise ValueError(
                f"kernel_initializer must be one of {KERNEL_INITIALIZERS}, got {self.kernel_initializer!r}"
            )
        if self.output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {self.output!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        available = len(self._decoder_levels_below_output())
        if not 0 <= self.deep_supervision <= available:
            raise ValueError(
                f"deep_supervision must be between 0 and {available} (the decoder levels below the output "
                f"resolution for strides {self.strides}), got {self.deep_supervision}"
            )

    @property
    def patch_divisor(self) -> tuple[int, int, int]:
        """Every patch side must be a multiple of this (per axis)."""
        return required_divisor(self.strides)

    @property
    def full_resolution_first_level(self) -> bool:
        """True when the first level works at the input resolution (`strides[0]` is 1 on every axis)."""
        return expand_per_axis(self.strides[0], "strides[0]") == (1, 1, 1)

    def _decoder_levels_below_output(self) -> list[tuple[int, tuple[int, int, int]]]:
        """(decoder level, its per-axis downsampling factor) of every decoder level coarser than the output, finest
        first; decoder level i works at encoder level i's resolution."""
        levels, factor = [], (1, 1, 1)
        for level, stride in enumerate(self.strides[:-1]):
            factor = tuple(f * s for f, s in zip(factor, expand_per_axis(stride, "each stride")))
            if factor != (1, 1, 1):
                levels.append((level, factor))
        return levels

    @property
    def deep_supervision_levels(self) -> list[tuple[int, tuple[int, int, int]]]:
        """(decoder level, per-axis downsampling factor) of each deep-supervision head, finest first.

        Example:
            >>> strided = UNetArchitecture(filters=(8, 16, 32, 64), strides=(2, 2, 2, 1), deep_supervision=2)
            >>> strided.deep_supervision_levels
            [(0, (2, 2, 2)), (1, (4, 4, 4))]
            >>> full = UNetArchitecture(filters=(8, 16, 32, 64), strides=(1, 2, 2, 2), deep_supervision=1)
            >>> full.deep_supervision_levels
            [(1, (2, 2, 2))]
        """
        return self._decoder_levels_below_output()[: self.deep_supervision]

    def check_patch_size(self, patch) -> tuple[int, int, int]:
        """`check_patch_size(patch, self.strides)`."""
        return check_patch_size(patch, self.strides)
