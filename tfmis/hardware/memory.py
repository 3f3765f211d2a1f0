"""Memory: sizes in MB (`MB`, `parse_memory_mb`) and the host's RAM as this process may use it (`host_memory`:
/proc/meminfo, lowered to a cgroup memory limit)."""

from __future__ import annotations

import os
from pathlib import Path

from tfmis.hardware.cpu import cpu_name, usable_cpu_count

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


def _gb(mb: float) -> str:
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
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            raw = Path(limit_file).read_text().strip()
            if raw == "max" or int(raw) >= 2**60:  # unlimited
                break
            limit = int(raw) / MB
            available = min(available, limit - int(Path(usage_file).read_text()) / MB)
            break
        except (OSError, ValueError):
            continue
    return {
        "total_mb": total,
        "available_mb": max(available, 0.0),
        "cgroup_limit_mb": limit,
        "cpu_name": cpu_name(),
        "cpu_count": usable_cpu_count(),
    }
