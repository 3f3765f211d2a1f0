"""The precision this machine trains in: `recommended_precision` (with its reason) and `training.precision`
resolved to a Keras mixed-precision policy (`resolve_precision`: `auto` becomes this machine's choice).

On a CPU, `auto` is float32; the measurements behind the choices are in docs/benchmarks.md ("Per CPU kind";
"First epoch, precision and other costs")."""

from __future__ import annotations

from tfmis.errors import ConfigError
from tfmis.hardware.cpu import BF16_CPU_FLAGS
from tfmis.hardware.machine import Hardware, detect_hardware

PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")


def recommended_precision(hardware: Hardware) -> tuple[str, str]:
    """(precision, reason): the precision this hardware trains fastest in, the more precise one on a tie.

    GPUs with tensor cores (compute capability >= 7): `mixed_float16` with dynamic loss scaling (as
    nnU-Net's and MONAI's AMP; on compute capability >= 8 bfloat16 is as fast, float16 keeps 3 more
    mantissa bits); below 7: `float32`. CPUs: `float32`, also with bfloat16 instructions: `mixed_bfloat16`
    trained no faster than float32 on one CPU with avx512_bf16 and faster, with the same Dice, on another
    (docs/benchmarks.md, "Per CPU kind"), so it is not the default until both CPU kinds are measured in one
    run (benchmarks/cpu_kinds.py); `mixed_float16` is emulated on CPUs. `mixed_bfloat16` stays available by
    name (e.g. to try on CPUs with AMX, whose bfloat16 matrix units are faster).

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
            return "mixed_float16", (
                f"GPU compute capability {cc[0]}.{cc[1]} >= 7.0: float16 tensor cores with "
                f"dynamic loss scaling (nnU-Net's AMP; float16 keeps 3 more mantissa bits than "
                f"bfloat16 at the same speed)"
            )
        return "float32", f"GPU compute capability {cc[0]}.{cc[1]} < 7.0: no tensor cores, mixed precision gains little"
    if hardware.cpu_bf16:
        flags = "/".join(f for f in BF16_CPU_FLAGS if f in hardware.cpu_flags)
        return "float32", (
            f"CPU only: float16 is emulated (~30x slower); bfloat16 ({flags}) trained no faster than "
            f"float32 on the earlier development CPU (1.18x faster on an AMD EPYC Zen 4), so the more precise float32"
        )
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
            raise ConfigError(f"training.precision: {name!r} is not one of {['auto', *PRECISIONS]}")
        return name
    return recommended_precision(hardware or detect_hardware())[0]
