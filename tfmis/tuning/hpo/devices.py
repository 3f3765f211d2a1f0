"""Where the trials of a hyperparameter search run: each worker's share of the GPUs and CPU cores, and the
environment and process settings that pin a worker's training processes to it.

Example:
    >>> [a["cpus"] for a in assign_devices(2, [0, 1, 2], [])]
    [[0, 1], [2]]
    >>> format_cpus([0, 1, 2, 5])
    '0-2,5'
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from pathlib import Path

from tfmis.config import ConfigError


def assign_devices(workers: int, cpus: list[int], gpus: list[dict]) -> list[dict]:
    """Each worker's share: its GPUs (an equal share; round-robin when there are fewer GPUs than workers)
    and its CPU cores (an equal share of `cpus`; round-robin when there are fewer cores than workers).

    Returns:
        [{"tuner_id": "tuner0", "cpus": [0], "gpus": [{"index", "uuid", "name", ...}], "gpu_shared": False}, ...]

    Example:
        >>> [a["cpus"] for a in assign_devices(2, [0, 1], [])]
        [[0], [1]]
        >>> [a["cpus"] for a in assign_devices(2, [0, 1, 2], [])]
        [[0, 1], [2]]
    """
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    plan = []
    for k in range(workers):
        if len(cpus) >= workers:
            share, extra = divmod(len(cpus), workers)
            start = k * share + min(k, extra)
            mine = cpus[start : start + share + (1 if k < extra else 0)]
        else:
            mine = [cpus[k % len(cpus)]] if cpus else []
        if len(gpus) >= workers:
            per = len(gpus) // workers
            my_gpus = gpus[k * per : (k + 1) * per]
        else:
            my_gpus = [gpus[k % len(gpus)]] if gpus else []
        plan.append({"tuner_id": f"tuner{k}", "cpus": mine, "gpus": my_gpus, "gpu_shared": 0 < len(gpus) < workers})
    return plan


def describe_assignment(plan: list[dict], cpus: list[int]) -> str:
    gpus = {g["index"] for a in plan for g in a["gpus"]}
    where = f"{len(gpus)} GPU(s) and {len(cpus)} CPU core(s)" if gpus else f"{len(cpus)} CPU core(s), no GPU"
    parts = []
    for a in plan:
        text = f"{a['tuner_id']}: cores {format_cpus(a['cpus'])}"
        if a["gpus"]:
            text += f", GPU {','.join(str(g['index']) for g in a['gpus'])}" + (" (shared)" if a["gpu_shared"] else "")
        parts.append(text)
    note = ""
    if len(cpus) < len(plan):
        note += f"; {len(plan)} workers share {len(cpus)} cores"
    if plan and plan[0]["gpu_shared"]:
        note += "; workers share GPUs (memory growth on)"
    return f"{len(plan)} worker(s) on {where}: " + "; ".join(parts) + note


def format_cpus(values: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the kernel's CPU list format, as taskset writes it; `hardware.parse_cpus` reads it)."""
    out, run = [], []
    for v in sorted(values):
        if run and v == run[-1] + 1:
            run.append(v)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [v]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out) or "-"


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def dies_with_parent(command: list[str], sig: int) -> list[str]:
    """`command`, started so that it receives `sig` when its parent dies (Linux prctl PR_SET_PDEATHSIG), so
    that killing the search (or a worker) leaves no orphaned training process behind.

    The death signal is set by a tiny Python wrapper that then execs the command (the setting survives
    exec), not by a `preexec_fn`: that would run Python between fork and exec in a process holding gRPC
    (the Keras Tuner client), whose fork handler can then abort the child ("epoll_wait error: Bad file
    descriptor", exit -6). Without a `preexec_fn`, subprocess uses vfork + exec.
    """
    if _libc() is None or not sys.platform.startswith("linux"):
        return list(command)
    wrapper = (
        "import ctypes, ctypes.util, os, sys; "
        "ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6').prctl(1, int(sys.argv[1])); "
        "os.execvp(sys.argv[2], sys.argv[2:])"
    )
    return [sys.executable, "-c", wrapper, str(int(sig)), *command]


def package_env(env: dict) -> dict:
    """The child imports this copy of tfmis, wherever the search runs from."""
    package_root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def trial_env(assignment: dict, base_env: dict | None = None) -> dict:
    """The environment of a worker's training process: its GPUs (or none) and its thread counts."""
    env = {
        k: v for k, v in (base_env if base_env is not None else os.environ).items() if not k.startswith("KERASTUNER_")
    }
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's device numbers = NVML's
    gpus = assignment["gpus"]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(g.get("uuid") or str(g["index"]) for g in gpus) if gpus else "-1"
    if assignment.get("gpu_shared"):
        env["TF_FORCE_GPU_ALLOW_GROWTH"] = "true"
    cores = len(assignment["cpus"])
    if cores:
        env["TF_NUM_INTRAOP_THREADS"] = str(cores)
        env["TF_NUM_INTEROP_THREADS"] = str(max(2, cores))  # one inter-op thread can starve tf.data
        env["OMP_NUM_THREADS"] = str(cores)
    return package_env(env)
