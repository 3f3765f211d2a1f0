"""tfmis: fast, GPU-efficient 3D medical image segmentation training with TensorFlow."""

import os

# TensorFlow's C++ INFO lines (oneDNN, CPU features) drown progress bars; warnings still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

__version__ = "0.1.0"
