"""Segmentation networks (Keras 3, channels-last 3D).

Names are imported on first use, so `tfmis.networks.architecture` (read by the config) does not
import Keras and TensorFlow.
"""

import importlib

_EXPORTS = {
    "ConvNormAct": "blocks",
    "RecomputableBlock": "blocks",
    "ResidualUnit": "blocks",
    "UNetConfig": "unet",
    "UpBlock": "blocks",
    "build_unet": "unet",
    "recompute_call": "blocks",
    "UNetArchitecture": "architecture",
    "check_patch_size": "architecture",
    "required_divisor": "architecture",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tfmis.networks' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tfmis.networks.{_EXPORTS[name]}"), name)
