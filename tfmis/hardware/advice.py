"""The settings this machine runs badly, one line each naming the fix (`hardware_warnings`): on a CPU
mixed_float16 (CPUs have no float16 arithmetic: every op is emulated) and `jit_compile: true` (XLA on a CPU is slower
than plain TensorFlow); mixed_bfloat16 on GPUs below compute capability 8.0; oneDNN turned off where `auto` would
turn it on; thread counts above the CPUs this process may use."""

from __future__ import annotations

import os

from tfmis.hardware.cpu import usable_cpu_count
from tfmis.hardware.machine import Hardware, detect_hardware
from tfmis.hardware.onednn import ONEDNN_ENV, ONEDNN_MEASURED, current_onednn, onednn_choice
from tfmis.hardware.precision import recommended_precision
from tfmis.hardware.threads import THREAD_ENVS, threads_set_by_user


def hardware_warnings(training, hardware: Hardware | None = None) -> list[str]:
    """One line per setting of `training` (a `TrainingConfig`) that this machine runs badly, naming the fix.

    CPU only: `mixed_float16` (float16 is emulated, far slower than float32) and `jit_compile: true` (XLA is
    slower than plain TensorFlow on CPUs; docs/benchmarks.md, "Per CPU kind"). GPUs below compute capability
    8.0: `mixed_bfloat16`. Any machine: oneDNN off (by the environment or the config) where tfmis's `auto` would
    turn it on, and thread counts set above the CPUs this process may use.
    """
    hardware = hardware or detect_hardware()
    lines = []
    onednn = current_onednn()
    if onednn.enabled is False and onednn_choice("auto", env={}).enabled:
        lines.append(
            f"oneDNN is off ({onednn.reason}) on an x86-64 CPU with AVX2 and FMA, where {ONEDNN_MEASURED}; "
            f"unset {ONEDNN_ENV} and use runtime.onednn: auto"
        )
    usable = usable_cpu_count()
    for name in THREAD_ENVS:
        value = os.environ.get(name, "")
        if threads_set_by_user() and value.isdigit() and int(value) > usable:
            lines.append(
                f"{name}={value} but this process may use {usable} CPU(s) (affinity and cgroup quota): threads "
                f"beyond that are throttled; unset it and tfmis sizes the pools"
            )
    precision = training.precision
    best = recommended_precision(hardware)[0]
    if not hardware.has_gpu:
        if precision == "mixed_float16":
            lines.append(
                f"training.precision is mixed_float16 but this machine has no GPU: CPUs emulate float16 "
                f"(~30x slower than float32 on the development CPU); use --set training.precision=auto "
                f"(here: {best})"
            )
        if training.jit_compile:
            lines.append(
                "training.jit_compile is true but this machine has no GPU: XLA on the CPU ran ~10x slower "
                "than plain TensorFlow on the development CPU; use --set training.jit_compile=false"
            )
    else:
        cc = hardware.compute_capability
        if precision == "mixed_bfloat16" and cc is not None and cc < (8, 0):
            lines.append(
                f"training.precision is mixed_bfloat16 but the GPU's compute capability is {cc[0]}.{cc[1]} "
                f"(bfloat16 arithmetic needs 8.0); use --set training.precision=auto (here: {best})"
            )
    return lines
