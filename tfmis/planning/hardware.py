"""What this machine runs well: precision, XLA and input parallelism from its GPUs and CPU.

Nothing here initialises a GPU: TensorFlow is asked for its physical devices and their details
(`tf.config.list_physical_devices`, `tf.config.experimental.get_device_details`), the GPU memory comes
from NVML (`tfmis.tune.trial.accelerators`), the CPU's instruction-set flags from /proc/cpuinfo.

Measured on the 2-core development CPU (avx512_bf16, no AMX; demo U-Net, 48^3 patches): float32 and
mixed_bfloat16 train at the same speed (7.8 and 7.3 images/s back to back, noisy; see
`recommended_precision`), mixed_float16 at 0.3 images/s (CPUs have no float16 arithmetic: every op is
emulated), and `jit_compile: true` (XLA) is about 10x slower than plain TensorFlow.

Example:
```python
from tfmis.planning.hardware import detect_hardware, hardware_warnings, resolve_precision

hardware = detect_hardware()
print(hardware.describe())                       # "CPU only: 2 cores (avx512_bf16), 23.5 GB RAM"
keras.mixed_precision.set_global_policy(resolve_precision("auto"))
for line in hardware_warnings(config.training, hardware):
    print("warning:", line)
```
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # CPU instructions with bfloat16 arithmetic


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The devices a training run on this machine would use.

    Args:
        gpus: one dict per GPU TensorFlow sees: name, compute_capability (major, minor) or None,
            memory_mb (NVML's total, or None).
        cpu_name: the CPU model name.
        cpu_count: logical cores this process may use.
        cpu_flags: the bfloat16-related instruction-set flags of the CPU (amx_bf16, avx512_bf16).
        host_memory_mb, host_available_mb: total and available RAM (a container's limit applied).
    """

    gpus: tuple[dict, ...] = ()
    cpu_name: str = "cpu"
    cpu_count: int = 1
    cpu_flags: tuple[str, ...] = ()
    host_memory_mb: float = 0.0
    host_available_mb: float = 0.0

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        """The lowest compute capability among the GPUs (every replica must run the plan)."""
        caps = [tuple(g["compute_capability"]) for g in self.gpus if g.get("compute_capability")]
        return min(caps) if caps else None

    @property
    def gpu_memory_mb(self) -> float | None:
        """The smallest GPU's memory (one replica's plan must fit on every GPU)."""
        sizes = [g["memory_mb"] for g in self.gpus if g.get("memory_mb")]
        return min(sizes) if sizes else None

    @property
    def cpu_bf16(self) -> bool:
        return any(flag in self.cpu_flags for flag in BF16_CPU_FLAGS)

    def describe(self) -> str:
        """One line: the GPUs (or "CPU only"), the cores with their bfloat16 flags, the RAM."""
        flags = f" ({', '.join(self.cpu_flags)})" if self.cpu_flags else ""
        cpu = f"{self.cpu_count} cores{flags}, {self.host_memory_mb / 1024:.1f} GB RAM"
        if not self.gpus:
            return f"CPU only: {cpu}"
        g = self.gpus[0]
        cc = self.compute_capability
        memory = f", {self.gpu_memory_mb / 1024:.0f} GB" if self.gpu_memory_mb else ""
        return (f"{len(self.gpus)} x {g['name']} (compute capability {cc[0]}.{cc[1]}{memory})" if cc else
                f"{len(self.gpus)} x {g['name']}{memory}") + f"; host: {cpu}"


def cpu_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The bfloat16 flags (`BF16_CPU_FLAGS`) on the first `flags` line of /proc/cpuinfo (empty elsewhere).

    Example:
        >>> cpu_flags("processor : 0\\nflags : fpu sse avx512f avx512_bf16\\n")
        ('avx512_bf16',)
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ()
    line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    present = set(line.partition(":")[2].split())
    return tuple(flag for flag in BF16_CPU_FLAGS if flag in present)


@functools.lru_cache(maxsize=1)
def detect_hardware() -> Hardware:
    """The `Hardware` of this machine, without initialising any GPU (cached for the process)."""
    import tensorflow as tf

    from tfmis.tune.trial import accelerators, host_memory

    gpus = []
    physical = tf.config.list_physical_devices("GPU")
    nvml = accelerators() if physical else []
    for i, device in enumerate(physical):
        try:
            details = tf.config.experimental.get_device_details(device)
        except Exception:  # noqa: BLE001 - details are optional (e.g. non-CUDA builds)
            details = {}
        cc = details.get("compute_capability")
        gpus.append({"name": details.get("device_name") or (nvml[i]["name"] if i < len(nvml) else device.name),
                     "compute_capability": tuple(int(c) for c in cc) if cc else None,
                     "memory_mb": nvml[i]["total_mb"] if i < len(nvml) else None})
    host = host_memory()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return Hardware(gpus=tuple(gpus), cpu_name=host.get("cpu_name") or "cpu", cpu_count=cores,
                    cpu_flags=cpu_flags(), host_memory_mb=host["total_mb"], host_available_mb=host["available_mb"])


def recommended_precision(hardware: Hardware) -> tuple[str, str]:
    """(precision, reason): the precision this hardware trains fastest in, the more precise one on a tie.

    GPUs with tensor cores (compute capability >= 7): `mixed_float16` with dynamic loss scaling (as
    nnU-Net's and MONAI's AMP; on compute capability >= 8 bfloat16 is as fast, float16 keeps 3 more
    mantissa bits); below 7: `float32`. CPUs: `float32`, also with bfloat16 instructions: on the
    development CPU (avx512_bf16, no AMX) `mixed_bfloat16` trained no faster (7.3 against 7.8 images/s,
    back to back), and the demo plan's best Dice was 0.85 and 0.88 in two bfloat16 runs against 0.93 and
    0.87 in float32 (runs vary by a few hundredths); `mixed_float16` is emulated on CPUs (~30x slower).
    `mixed_bfloat16` stays available by name (e.g. to try on CPUs with AMX, whose bfloat16 matrix units
    are faster).

    Example:
        >>> recommended_precision(Hardware(gpus=({"name": "A100", "compute_capability": (8, 0)},)))[0]
        'mixed_float16'
        >>> recommended_precision(Hardware(cpu_flags=("avx512_bf16",)))[0]
        'float32'
    """
    if hardware.has_gpu:
        cc = hardware.compute_capability
        if cc is None:
            return "float32", "GPU of unknown compute capability: float32 is safe everywhere"
        if cc >= (7, 0):
            return "mixed_float16", (f"GPU compute capability {cc[0]}.{cc[1]} >= 7.0: float16 tensor cores with "
                                     f"dynamic loss scaling (nnU-Net's AMP; float16 keeps 3 more mantissa bits than "
                                     f"bfloat16 at the same speed)")
        return "float32", f"GPU compute capability {cc[0]}.{cc[1]} < 7.0: no tensor cores, mixed precision gains little"
    if hardware.cpu_bf16:
        flags = "/".join(f for f in BF16_CPU_FLAGS if f in hardware.cpu_flags)
        return "float32", (f"CPU only: float16 is emulated (~30x slower); bfloat16 ({flags}) trained no faster than "
                           f"float32 on the development CPU, so the more precise float32")
    return "float32", "CPU only, no bfloat16 instructions: float16 and bfloat16 would be emulated (~30x slower)"


def resolve_precision(name: str, hardware: Hardware | None = None) -> str:
    """`training.precision` as a Keras mixed-precision policy name: `auto` becomes this machine's choice.

    Args:
        name: `auto`, `float32`, `mixed_float16` or `mixed_bfloat16`.
        hardware: default `detect_hardware()` (no GPU is initialised).

    Example:
        >>> resolve_precision("float32")
        'float32'
    """
    if name != "auto":
        if name not in PRECISIONS:
            raise ValueError(f"training.precision: {name!r} is not one of {['auto', *PRECISIONS]}")
        return name
    return recommended_precision(hardware or detect_hardware())[0]


def hardware_warnings(training, hardware: Hardware | None = None) -> list[str]:
    """One line per setting of `training` (a `TrainingConfig`) that this machine runs badly, naming the fix.

    CPU only: `mixed_float16` (float16 emulated: ~30x slower than float32 here) and `jit_compile: true`
    (XLA ~10x slower than plain TensorFlow here). GPUs below compute capability 8.0: `mixed_bfloat16`.
    """
    hardware = hardware or detect_hardware()
    lines = []
    precision = training.precision
    best = recommended_precision(hardware)[0]
    if not hardware.has_gpu:
        if precision == "mixed_float16":
            lines.append(f"training.precision is mixed_float16 but this machine has no GPU: CPUs emulate float16 "
                         f"(~30x slower than float32 on the development CPU); use --set training.precision=auto "
                         f"(here: {best})")
        if training.jit_compile:
            lines.append("training.jit_compile is true but this machine has no GPU: XLA on the CPU ran ~10x slower "
                         "than plain TensorFlow on the development CPU; use --set training.jit_compile=false")
    else:
        cc = hardware.compute_capability
        if precision == "mixed_bfloat16" and cc is not None and cc < (8, 0):
            lines.append(f"training.precision is mixed_bfloat16 but the GPU's compute capability is {cc[0]}.{cc[1]} "
                         f"(bfloat16 arithmetic needs 8.0); use --set training.precision=auto (here: {best})")
    return lines
