"""Memory: sizes in MB (`MB`, `parse_memory_mb`) and the host's RAM as this process may use it (`host_memory`:
/proc/meminfo, lowered to the memory limit of this process's cgroup, `cgroup_memory`)."""

from __future__ import annotations

import os
from pathlib import Path

from tfmis.hardware.cpu import CGROUP_ROOT, cgroup_levels, cpu_name, usable_cpu_count

MB = 2.0**20
_MEMORY_UNITS = {"": 1.0, "m": 1.0, "mb": 1.0, "mib": 1.0, "g": 1024.0, "gb": 1024.0, "gib": 1024.0, "t": 2**20}
_MEMORY_UNITS.update({"tb": 2.0**20, "tib": 2.0**20})


def parse_memory_mb(text: str) -> float:
    """A memory size as MB: "80GB", "80G", "80 GiB", "81920MB", "81920" (a plain number is MB); GB = 1024 MB,
    as nvidia-smi counts.

    Raises:
        ValueError: not a positive number with one of the units MB, GB, TB (or M, G, T; MiB, GiB, TiB).

    Example:
        >>> parse_memory_mb("80GB"), parse_memory_mb("80g"), parse_memory_mb("81920MB"), parse_memory_mb("40960")
        (81920.0, 81920.0, 81920.0, 40960.0)
    """
    import re

    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _MEMORY_UNITS:
        raise ValueError(f"{text!r} is not a memory size (a number with MB, GB or TB, or plain MB)")
    mb = float(match.group(1)) * _MEMORY_UNITS[unit]
    if mb <= 0:
        raise ValueError(f"{text!r} is not a memory size above 0")
    return mb


def format_gb(mb: float) -> str:
    """MB as whole GB (one decimal under 10 GB): "80", "7.5"."""
    return f"{mb / 1024:.0f}" if mb >= 10 * 1024 else f"{mb / 1024:.1f}".removesuffix(".0")


def host_memory() -> dict:
    """The host's memory and CPU: {"total_mb", "available_mb", "cgroup_limit_mb", "cpu_name", "cpu_count"}.

    `available_mb` is /proc/meminfo's MemAvailable, lowered to what a cgroup memory limit (a
    container's) leaves; `cgroup_limit_mb` is that limit, or None.
    """
    meminfo = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                meminfo[key] = int(value.split()[0]) / 1024.0
    except OSError:  # no /proc: the page count, and nothing known to be available beyond it
        meminfo["MemTotal"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / MB
    total = meminfo.get("MemTotal", 0.0)
    available = meminfo.get("MemAvailable", meminfo.get("MemFree", 0.0))
    limit = None
    cgroup = cgroup_memory()
    if cgroup is not None:
        limit = cgroup["limit_mb"]
        available = min(available, limit - cgroup["unreclaimable_mb"])
    return {
        "total_mb": total,
        "available_mb": max(available, 0.0),
        "cgroup_limit_mb": limit,
        "cpu_name": cpu_name(),
        "cpu_count": usable_cpu_count(),
    }


def cgroup_memory(proc_cgroup: str | None = None, root: str | Path = CGROUP_ROOT) -> dict | None:
    """The memory limit of this process's cgroup and what the cgroup holds that the kernel cannot reclaim:
    {"limit_mb", "unreclaimable_mb", "path"}, or None when no cgroup on the path has a limit.

    Reads the process's own cgroup (`/proc/self/cgroup`) and its ancestors, as `cgroup_cpu_quota` does: cgroup v2
    (`memory.max`, "max" = none; `memory.stat` `anon`) and v1 (`memory.limit_in_bytes`, 2^60 and up = none;
    `memory.stat` `total_rss`); the smallest limit on the path wins, as the kernel enforces each level. The
    unreclaimable memory is the anonymous memory of every process in that cgroup (this one included): the page
    cache a cgroup also counts (the files it read) is given back under pressure, so it is not subtracted.

    Example (a cgroup v1 tree with a 1.5 GB limit on the job's cgroup, 200 MB of it held):
        >>> import tempfile
        >>> job = Path(tempfile.mkdtemp()) / "memory" / "job"
        >>> job.mkdir(parents=True)
        >>> _ = (job / "memory.limit_in_bytes").write_text(str(1536 * 2**20))
        >>> _ = (job / "memory.stat").write_text(f"cache 1000\\nrss 5\\ntotal_rss {200 * 2**20}\\n")
        >>> found = cgroup_memory("4:memory:/job\\n", root=job.parent.parent)
        >>> found["limit_mb"], found["unreclaimable_mb"]
        (1536.0, 200.0)
    """
    found = None
    files = {2: ("memory.max", "anon"), 1: ("memory.limit_in_bytes", "total_rss")}
    for version, level in cgroup_levels("memory", proc_cgroup, root):
        limit = _cgroup_limit(level / files[version][0])
        if limit is not None and (found is None or limit < found["limit_mb"]):
            held = _cgroup_stat(level / "memory.stat", files[version][1])
            found = {"limit_mb": limit, "unreclaimable_mb": held or 0.0, "path": str(level)}
    return found


def _cgroup_limit(path: Path) -> float | None:
    """A cgroup memory limit file in MB; None when unlimited or unreadable."""
    try:
        raw = path.read_text().strip()
        return None if raw == "max" or int(raw) >= 2**60 else int(raw) / MB
    except (OSError, ValueError):
        return None


def _cgroup_stat(path: Path, key: str) -> float | None:
    """One counter of a cgroup's memory.stat in MB; None when missing."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value) / MB
    except (OSError, ValueError):
        pass
    return None
