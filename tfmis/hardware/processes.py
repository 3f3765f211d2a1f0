"""What a process holds and may use, as the kernel reports it (/proc, Linux): the GPU-fit trials' memory, the
predictor's per-case peak, the HPO workers' pinning check and the resource monitor's process tree."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tfmis.hardware.memory import MB


def process_status_mb(pid: int | str, field: str) -> float | None:
    """A memory line of /proc/<pid>/status (`VmRSS`, `VmHWM`, ...) in MiB; None once the process is gone, or
    without /proc.

    Example:
        >>> process_status_mb("self", "VmRSS") > 0 if Path("/proc/self/status").exists() else True
        True
    """
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_rss() -> bool:
    """Resets the kernel's high-water mark of this process's resident memory to its current RSS (Linux
    /proc/self/clear_refs 5), so that the next `peak_rss_mb` is the peak since now.

    Returns False where that is not possible (not Linux, or not allowed); `peak_rss_mb` then counts from the
    start of the process.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float | None:
    """This process's peak resident memory (`VmHWM`, since the start or the last `reset_peak_rss`) in MiB; on macOS
    since the start (`ru_maxrss`); None elsewhere."""
    peak = process_status_mb("self", "VmHWM")
    if peak is None and sys.platform == "darwin":  # ru_maxrss: bytes on macOS; no reset
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / MB
    return peak


def parse_cpus(text: str) -> list[int]:
    """The kernel's CPU list format (taskset's, /proc's `Cpus_allowed_list`) as core numbers.

    Example:
        >>> parse_cpus("0-2,5")
        [0, 1, 2, 5]
    """
    values = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        values.extend(range(int(lo), int(hi or lo) + 1))
    return values


def allowed_cpus(pid: int) -> list[int] | None:
    """The cores process `pid` may run on, as the kernel reports them (/proc/<pid>/status `Cpus_allowed_list`);
    None once the process is gone, or without /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return parse_cpus(line.split(":", 1)[1])
    except OSError:
        pass
    return None


def process_tree_usage(pid: int) -> tuple[float, int] | None:
    """(CPU seconds, resident bytes) of process `pid` and all its descendants now (Linux /proc); None when the
    process is gone.

    The CPU seconds are, over the tree's live members, utime + stime + cutime + cstime: when a member exits and its
    parent (a member too) reaps it, its time moves into the parent's cutime/cstime, so the total neither drops
    nor counts it twice, and differences of totals are the tree's CPU use. The resident bytes are summed over the
    members (pages shared between them count once per member). An exited child that is not reaped yet (a zombie)
    still counts.

    Raises:
        RuntimeError: this system has no /proc (not Linux).
    """
    if not os.path.isdir("/proc/self"):
        raise RuntimeError("process CPU time and memory are read from /proc (Linux); this system has none")
    stats = {}
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _proc_stat(entry)
            if fields is not None:
                stats[int(entry)] = fields
                children.setdefault(int(fields[1]), []).append(int(entry))
    if pid not in stats:
        return None
    ticks = pages = 0
    todo = [pid]
    while todo:
        member = todo.pop()
        fields = stats[member]
        ticks += int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
        pages += int(fields[21])
        todo.extend(children.get(member, ()))
    return ticks / os.sysconf("SC_CLK_TCK"), pages * os.sysconf("SC_PAGE_SIZE")


def _proc_stat(pid: int | str) -> list[bytes] | None:
    """Fields after `(comm)` of /proc/<pid>/stat: [0] state, [1] ppid, [11] utime, [12] stime, [13] cutime,
    [14] cstime, [21] rss (pages); None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rfind(b")") + 2 :].split()


def prefer_oom_kill(score: int = 1000) -> None:
    """Makes this process the kernel's first choice when memory runs out (/proc/self/oom_score_adj, up to 1000;
    raising it needs no privilege): a case worker's initializer, so that the OOM killer takes a worker, which its
    pool reports and retries, rather than the parent that holds the finished work. Nothing where that is not
    possible (not Linux)."""
    try:
        Path("/proc/self/oom_score_adj").write_text(str(int(score)))
    except OSError:
        pass


def open_files() -> tuple[int, int | None] | None:
    """(file descriptors this process holds now, its soft open-file limit; None when unlimited), or None where
    /proc or the rlimit cannot be read (not Linux)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        held = len(os.listdir("/proc/self/fd"))
    except (ImportError, OSError):
        return None
    return held, None if soft == resource.RLIM_INFINITY else int(soft)
