"""Segmentation networks (Keras 3, channels-last 3D)."""

from tfmis.networks.unet import (
    ConvNormAct,
    RecomputableBlock,
    ResidualUnit,
    UNetConfig,
    UpBlock,
    build_unet,
    check_patch_size,
    recompute_call,
    required_divisor,
)

__all__ = [
    "ConvNormAct",
    "RecomputableBlock",
    "ResidualUnit",
    "UNetConfig",
    "UpBlock",
    "build_unet",
    "check_patch_size",
    "recompute_call",
    "required_divisor",
]
