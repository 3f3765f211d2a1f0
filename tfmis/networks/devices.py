"""Device names in one form: "/CPU:1" for every spelling TensorFlow gives of a device (the placer's full names,
`tf.device` scopes, variables' devices), so that placements can be compared."""

from __future__ import annotations

import re

import tensorflow as tf


def canonical_device(device: str | None, default: str = "/CPU:0") -> str:
    """The "/TYPE:index" form of a device string ("/cpu:1", "/device:CPU:1",
    "/job:localhost/replica:0/task:0/device:CPU:1"); `default` (in that form) for an empty one.

    Example:
        >>> canonical_device("/job:localhost/replica:0/task:0/device:CPU:1"), canonical_device("/gpu:0")
        ('/CPU:1', '/GPU:0')
        >>> canonical_device("", "/cpu:2")
        '/CPU:2'
    """
    if not device:
        return canonical_device(default, "/CPU:0") if default else "/CPU:0"
    match = re.search(r"(?:^|/)(?:device:)?([A-Za-z_]+):(\d+)$", device)
    if match is None:
        spec = tf.DeviceSpec.from_string(device)
        if spec.device_type is None:
            return canonical_device(default)
        return f"/{spec.device_type.upper()}:{spec.device_index or 0}"
    return f"/{match.group(1).upper()}:{int(match.group(2))}"
