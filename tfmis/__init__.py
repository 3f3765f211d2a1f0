"""tfmis: fast, GPU-efficient 3D medical image segmentation training with TensorFlow."""

import os

from tfmis.hardware import apply_cpu_threads, apply_onednn

# TensorFlow's C++ INFO lines (oneDNN, CPU features) drown progress bars; warnings still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
# Before TensorFlow is imported (it reads both once): oneDNN where it is measured faster (`runtime.onednn: auto`;
# a command applies its config's value again), and thread pools sized to the CPUs this process may really use.
apply_onednn("auto")
apply_cpu_threads()

__version__ = "0.1.0"
