"""GPUs as TensorFlow and the driver see them: whether a driver is loaded, TensorFlow's physical devices, the
device a process computes on and the devices of a model split over several, the GPU ids a launcher shares out
(nvidia-smi), and the GPU models a plan can be made for by name (`GPU_MODELS`, `gpu_model`). NVML is
`tfmis.hardware.nvml`.

Nothing here initialises a GPU but `accelerator_device`, which lists the *logical* devices of a process that is
about to compute; TensorFlow is imported only inside the functions that need it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tfmis.errors import ConfigError

CPU = "/CPU:0"
GPU_RESERVED_MB = 1024  # of a GPU's memory, for the CUDA context and libraries, outside TensorFlow's allocator


def nvidia_driver_present() -> bool:
    """Whether an NVIDIA driver is loaded (/proc/driver/nvidia or /dev/nvidiaN), without importing TensorFlow."""
    return Path("/proc/driver/nvidia").exists() or bool(list(Path("/dev").glob("nvidia[0-9]*")))


def physical_gpus() -> list:
    """TensorFlow's physical GPUs (`tf.config.list_physical_devices`: no device memory is allocated)."""
    import tensorflow as tf

    return tf.config.list_physical_devices("GPU")


def accelerator_device() -> str:
    """The first GPU of this process's logical devices, else the CPU (a process about to compute)."""
    import tensorflow as tf

    return "/GPU:0" if tf.config.list_logical_devices("GPU") else CPU


def model_parallel_devices(count: int) -> list[str]:
    """`count` devices for one model split over devices: the first `count` GPUs, or on a machine without GPUs
    the CPU split into `count` logical devices (`tf.config.set_logical_device_configuration`; they share the
    cores, so equality and the cross-device exchanges are real but no speed-up is). Call it before TensorFlow
    initialises its devices; afterwards it only checks that enough logical devices exist.

    Raises:
        ValueError: fewer GPUs than `count` (naming the key and the fix), or a CPU already initialised with
            fewer logical devices.
    """
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if len(gpus) < count:
            raise ConfigError(
                f"runtime.model_parallel needs {count} devices (devices x data) but this process sees {len(gpus)} "
                f"GPU(s): lower runtime.model_parallel.devices / data, or make more GPUs visible"
            )
        return [f"/GPU:{i}" for i in range(count)]
    cpu = tf.config.list_physical_devices("CPU")[0]
    if count > 1 and len(tf.config.get_logical_device_configuration(cpu) or []) < count:
        try:
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
        except RuntimeError as e:  # the runtime is initialised
            raise ConfigError(
                f"runtime.model_parallel needs {count} logical CPU devices, but TensorFlow's devices were "
                f"initialised with {len(tf.config.list_logical_devices('CPU'))}: set them up first "
                "(tfmis.engine.distribution.make_backend does, before anything touches a device)"
            ) from e
    return [f"/CPU:{i}" for i in range(count)]


def visible_gpu_ids(env: dict | None = None) -> list[str]:
    """The GPU ids a launcher may share out: `CUDA_VISIBLE_DEVICES`' entries when it is set (without "-1"),
    else the indices nvidia-smi lists (empty without nvidia-smi or a driver)."""
    env = os.environ if env is None else env
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip() and g.strip() != "-1"]
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def nvidia_smi_available() -> bool:
    return shutil.which("nvidia-smi") is not None


# GPUs a plan can be made for by name (`--gpu NAME`, `Hardware.target`): each one's memory and compute capability,
# the two fields of a GPU the planner reads (memory: the patch budget, batch sizes; compute capability:
# `recommended_precision`, >= 7.0 has float16 tensor cores and plans mixed_float16, >= 8.0 has bfloat16 too).
# Memory: the GB of NVIDIA's product datasheet x 1024 (nvidia-smi shows a little less on some, e.g. 81559 MiB on an
# H100 80GB); compute capability: NVIDIA's list of CUDA GPUs (developer.nvidia.com/cuda-gpus).
GPU_MODELS = {
    "V100-16GB": {"memory_mb": 16 * 1024, "compute_capability": (7, 0)},  # Tesla V100 datasheet; Volta
    "V100-32GB": {"memory_mb": 32 * 1024, "compute_capability": (7, 0)},  # Tesla V100 datasheet; Volta
    "T4": {"memory_mb": 16 * 1024, "compute_capability": (7, 5)},  # Tesla T4 datasheet; Turing
    "A10": {"memory_mb": 24 * 1024, "compute_capability": (8, 6)},  # A10 datasheet; Ampere GA102
    "A100-40GB": {"memory_mb": 40 * 1024, "compute_capability": (8, 0)},  # A100 datasheet; Ampere GA100
    "A100-80GB": {"memory_mb": 80 * 1024, "compute_capability": (8, 0)},  # A100 datasheet; Ampere GA100
    "A40": {"memory_mb": 48 * 1024, "compute_capability": (8, 6)},  # A40 datasheet; Ampere GA102
    "RTX-3090": {"memory_mb": 24 * 1024, "compute_capability": (8, 6)},  # GeForce RTX 3090 specs; Ampere GA102
    "RTX-4090": {"memory_mb": 24 * 1024, "compute_capability": (8, 9)},  # GeForce RTX 4090 specs; Ada AD102
    "L4": {"memory_mb": 24 * 1024, "compute_capability": (8, 9)},  # L4 datasheet; Ada AD104
    "L40S": {"memory_mb": 48 * 1024, "compute_capability": (8, 9)},  # L40S datasheet; Ada AD102
    "H100-80GB": {"memory_mb": 80 * 1024, "compute_capability": (9, 0)},  # H100 SXM / PCIe datasheet; Hopper
    "H200-141GB": {"memory_mb": 141 * 1024, "compute_capability": (9, 0)},  # H200 datasheet; Hopper
}


def gpu_model(name: str) -> tuple[str, dict] | None:
    """(the `GPU_MODELS` name, its entry) for `name`, ignoring case, spaces, dashes and underscores, or a unique
    start of one ("h100"); None for an unknown or ambiguous name ("A100": 40 or 80 GB).

    Example:
        >>> gpu_model("a100 80gb")[0], gpu_model("rtx4090")[0], gpu_model("A100")
        ('A100-80GB', 'RTX-4090', None)
    """
    import re

    def key(text: str) -> str:
        return re.sub(r"[^A-Z0-9]", "", text.upper())

    wanted = key(name)
    exact = [n for n in GPU_MODELS if key(n) == wanted]
    starts = [n for n in GPU_MODELS if key(n).startswith(wanted)] if wanted else []
    found = exact or (starts if len(starts) == 1 else [])
    return (found[0], GPU_MODELS[found[0]]) if found else None
