"""The CPUs: which cores this process may use (affinity mask, cgroup CPU quota) and the worker counts sized from
them, the CPU's model name and instruction-set flags (/proc/cpuinfo).

Every default worker and thread count of tfmis comes from `usable_cpu_count` (`os.cpu_count()` sees neither the
affinity mask nor the quota).
"""

from __future__ import annotations

import os
from pathlib import Path

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # CPU instructions with bfloat16 arithmetic
CGROUP_ROOT = "/sys/fs/cgroup"
MAX_CASE_WORKERS = 8  # processes reading cases at once: each holds a case's arrays in memory
# instruction-set flags that decide TensorFlow's CPU kernels (/proc/cpuinfo names)
ISA_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_tile",
    "asimd",
    "sve",
)


def usable_cpus() -> list[int]:
    """The cores this process may run on (its affinity mask; all cores where there is none)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def cgroup_cpu_quota(proc_cgroup: str | None = None, root: str | Path = CGROUP_ROOT) -> float | None:
    """The CPUs this process's cgroup lets it use (CPU quota / period), or None when there is no quota.

    Reads the process's own cgroup (`/proc/self/cgroup`) and its ancestors, cgroup v2 (`cpu.max`, "max" =
    none) and v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`, -1 = none); the smallest quota on the path wins,
    as the kernel throttles at each level. A container or a SLURM allocation (with cgroup CPU limits) that
    shows all the host's cores to `os.cpu_count()` shows its real share here.

    Example (a cgroup v1 tree with a 1.5-CPU quota on the job's cgroup):
        >>> import tempfile
        >>> job = Path(tempfile.mkdtemp()) / "cpu" / "job"
        >>> job.mkdir(parents=True)
        >>> _ = (job / "cpu.cfs_quota_us").write_text("150000"), (job / "cpu.cfs_period_us").write_text("100000")
        >>> cgroup_cpu_quota("3:cpu:/job\\n", root=job.parent.parent)
        1.5
    """
    readers = {2: _cgroup2_quota, 1: _cgroup1_quota}
    quotas = [readers[version](level) for version, level in cgroup_levels("cpu", proc_cgroup, root)]
    quotas = [q for q in quotas if q is not None]
    return min(quotas) if quotas else None


def cgroup_levels(controller: str, proc_cgroup: str | None = None, root: str | Path = CGROUP_ROOT):
    """(cgroup version, folder) of this process's cgroup and each ancestor up to the tree's root, for the v2 tree
    and the v1 tree of `controller` ("cpu", "memory"); nothing when `/proc/self/cgroup` cannot be read."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return
    root = Path(root)
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not path:
            continue
        if hierarchy == "0" and not controllers:  # cgroup v2: one tree, at root or (hybrid) at root/unified
            version, bases = 2, [b for b in (root, root / "unified") if (b / "cgroup.controllers").exists()]
        elif controller in controllers.split(","):  # cgroup v1: the controller's own tree
            version, bases = 1, [b for b in (root / controllers, root / controller) if b.is_dir()]
        else:
            continue
        if not bases:
            continue
        folder = bases[0] / path.strip("/")
        for level in (folder, *folder.parents):
            yield version, level
            if level == bases[0]:
                break


def _cgroup2_quota(folder: Path) -> float | None:
    try:
        quota, _, period = (folder / "cpu.max").read_text().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    except (OSError, ValueError):
        return None


def _cgroup1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def usable_cpu_count(proc_cgroup: str | None = None, cgroup_root: str | Path = CGROUP_ROOT) -> int:
    """How many CPUs this process can keep busy: its affinity mask, capped by its cgroup's CPU quota (rounded
    down, at least 1: a thread more than the quota would be throttled). The count every thread pool and worker
    pool of tfmis is sized from (`os.cpu_count()` sees neither the mask nor the quota).

    Args:
        proc_cgroup, cgroup_root: as `cgroup_cpu_quota` (default: this process's cgroup under /sys/fs/cgroup).
    """
    count = len(usable_cpus())
    quota = cgroup_cpu_quota(proc_cgroup, cgroup_root)
    if quota is not None:
        count = min(count, max(1, int(quota)))
    return max(1, count)


def runnable_tasks(loadavg: str | Path = "/proc/loadavg") -> int | None:
    """Tasks running or ready to run on the machine right now, the caller included (the fourth field of Linux's
    /proc/loadavg, "running/total"), or None where that is not known. What a short parallel section checks
    before taking CPUs other work is using (`tfmis.inference.buffers.blend_threads`).

    Example:
        >>> runnable_tasks("/nonexistent/loadavg") is None
        True
    """
    try:
        with open(loadavg) as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


def worker_cpus() -> list[int]:
    """The cores a launcher shares out among the worker processes it pins (the HPO search's tuner workers, the
    cross-validation's fold workers): the affinity mask, cut to `usable_cpu_count()` cores under a smaller cgroup
    CPU quota."""
    return usable_cpus()[: usable_cpu_count()]


def case_workers() -> int:
    """The default number of processes that read cases in parallel (the conversion, the planner's fingerprint):
    `usable_cpu_count()`, at most `MAX_CASE_WORKERS`."""
    return min(usable_cpu_count(), MAX_CASE_WORKERS)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo; the platform's processor name elsewhere)."""
    try:
        name = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            None,
        )
    except OSError:
        name = None
    if not name:
        import platform

        name = platform.processor() or platform.machine()
    return name


def cpu_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The bfloat16 flags (`BF16_CPU_FLAGS`) on the first `flags` line of /proc/cpuinfo (empty elsewhere).

    Example:
        >>> cpu_flags("processor : 0\\nflags : fpu sse avx512f avx512_bf16\\n")
        ('avx512_bf16',)
    """
    present = cpu_isa(cpuinfo)  # one reader of the flags line; BF16_CPU_FLAGS are among its ISA_FLAGS
    return tuple(flag for flag in BF16_CPU_FLAGS if flag in present)


def cpu_isa(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The CPU's instruction-set flags among `ISA_FLAGS` (first `flags` / `Features` line of /proc/cpuinfo).

    Example:
        >>> cpu_isa("processor : 0\\nflags : fpu sse avx avx2 fma avx512f\\n")
        ('avx', 'avx2', 'fma', 'avx512f')
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ()
    line = next((line for line in cpuinfo.splitlines() if line.split(":")[0].strip() in ("flags", "Features")), "")
    present = set(line.partition(":")[2].split())
    return tuple(flag for flag in ISA_FLAGS if flag in present)
