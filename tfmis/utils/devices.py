"""Device names shared by training and prediction."""

import tensorflow as tf

CPU = "/CPU:0"


def accelerator_device() -> str:
    """The first GPU if TensorFlow sees one, else the CPU."""
    return "/GPU:0" if tf.config.list_logical_devices("GPU") else CPU
