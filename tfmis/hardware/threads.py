"""TensorFlow's and tf.data's thread pools sized to the CPUs this process may really use (`usable_cpu_count`),
where a cgroup CPU quota is below the affinity mask that TensorFlow sizes them from.

Decided before TensorFlow is imported (tfmis/__init__.py runs `apply_cpu_threads`): TensorFlow reads its thread
counts once, at import. A launcher puts its workers' counts in their environment (`set_thread_env`)."""

from __future__ import annotations

import os
import sys

from tfmis.hardware.cpu import usable_cpu_count, usable_cpus

THREAD_ENVS = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")
_THREADS_DECIDED_ENV = "TFMIS_THREADS_DECIDED"


def threads_set_by_user(env=None) -> bool:
    """Whether `TF_NUM_INTRAOP_THREADS` / `TF_NUM_INTEROP_THREADS` in `env` are the user's (not tfmis's own)."""
    env = os.environ if env is None else env
    values = [env.get(name) for name in THREAD_ENVS]
    return any(v is not None for v in values) and ",".join(v or "" for v in values) != env.get(_THREADS_DECIDED_ENV)


def set_thread_env(env, intra: int, inter: int) -> None:
    """Puts tfmis's thread counts in `env` (os.environ or a child's), marked as tfmis's (`threads_set_by_user`)."""
    env["TF_NUM_INTRAOP_THREADS"], env["TF_NUM_INTEROP_THREADS"] = str(intra), str(inter)
    env[_THREADS_DECIDED_ENV] = f"{intra},{inter}"


def data_threads() -> int | None:
    """tf.data's private thread pool size where a cgroup CPU quota is below the affinity mask (tf.data sizes its
    pools from the mask), else None: tf.data's own default."""
    count = usable_cpu_count()
    return count if count < len(usable_cpus()) else None


def apply_cpu_threads() -> int:
    """Sizes TensorFlow's intra-op and inter-op thread pools from `usable_cpu_count()`, before its import.

    TensorFlow sizes them from the affinity mask and does not see a cgroup CPU quota (a container, a SLURM job):
    there it would run more threads than the CPUs it gets, and each would be throttled. Sets
    `TF_NUM_INTRAOP_THREADS` / `TF_NUM_INTEROP_THREADS` only where the quota is below the affinity mask and the
    user has set neither. Returns the usable CPU count.
    """
    count = usable_cpu_count()
    if count < len(usable_cpus()) and not threads_set_by_user() and "tensorflow" not in sys.modules:
        set_thread_env(os.environ, count, count)
    return count
