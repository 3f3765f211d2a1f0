"""How many case workers fit: the usable CPUs (`case_workers`) and the usable memory (`host_memory`: what the host
has available, lowered to what this process's cgroup limit leaves after what the cgroup's processes hold), over what
one case needs at its peak (its caller's estimate from the cases' headers).

Example:
```python
sizing = size_case_workers(610.0)  # MB one case needs
print(sizing.describe())  # "2 workers: 2 CPUs, 1.4 GB usable (cgroup limit 1.5 GB) / 610 MB per case"
```
"""

from __future__ import annotations

import dataclasses

from tfmis.hardware.cpu import case_workers
from tfmis.hardware.memory import host_memory


@dataclasses.dataclass(frozen=True)
class WorkerSizing:
    """A case pool's size and why.

    Attributes:
        workers: processes to run (at least 1).
        cpus: the workers the CPUs allow (`case_workers()`, or the count asked for).
        usable_mb: the memory the workers may use (MB).
        per_case_mb: what the largest case needs at its peak (MB).
        limit_mb: the cgroup memory limit (MB), None without one.
        asked: the worker count the user asked for, None for the default.
        whole_mb: all the memory there is: the cgroup limit, else the host's RAM (MB).
    """

    workers: int
    cpus: int
    usable_mb: float
    per_case_mb: float
    limit_mb: float | None = None
    asked: int | None = None
    whole_mb: float = float("inf")

    @property
    def memory_bound(self) -> bool:
        """Whether the memory, not the CPUs, decided the count."""
        return self.workers < self.cpus

    def fits(self, need_mb: float) -> bool:
        """Whether a case needing `need_mb` can fit at all: within the whole memory (`whole_mb`). One needing more
        than `usable_mb` but less than that runs alone in 1 worker: the estimate has a margin, and a worker the
        kernel kills is reported and retried (`tfmis.utils.parallel.map_ordered`)."""
        return need_mb <= self.whole_mb

    def describe(self) -> str:
        """`2 workers: 2 CPUs, 1.4 GB usable (cgroup limit 1.5 GB) / 610 MB per case`."""
        cpus = f"{self.asked} asked" if self.asked is not None else f"{self.cpus} CPU{'s' * (self.cpus != 1)}"
        limit = f" (cgroup limit {_size(self.limit_mb)})" if self.limit_mb is not None else ""
        over = " (more than usable: one case at a time, within the limit)" if self.per_case_mb > self.usable_mb else ""
        return (
            f"{self.workers} worker{'s' * (self.workers != 1)}: {cpus}, {_size(self.usable_mb)} usable{limit} / "
            f"{_size(self.per_case_mb)} per case{over}"
        )


def _size(mb: float) -> str:
    return f"{mb / 1024:.1f} GB" if mb >= 1024 else f"{mb:.0f} MB"


def size_case_workers(per_case_mb: float, asked: int | None = None, reserve_mb: float = 0.0) -> WorkerSizing:
    """The case workers that fit: at most the CPUs' count (`case_workers()`, or `asked`), at most as many cases as
    the usable memory holds at `per_case_mb` each (after `reserve_mb` that this process will still take), at least
    1 (a case larger than the memory is its caller's to skip: `WorkerSizing.fits`)."""
    host = host_memory()
    cpus = asked if asked is not None else case_workers()
    usable = max(host["available_mb"] - reserve_mb, 0.0)
    fit = int(usable // per_case_mb) if per_case_mb > 0 else cpus
    limit = host["cgroup_limit_mb"]
    whole = limit if limit is not None else host["total_mb"]
    return WorkerSizing(max(1, min(cpus, fit)), cpus, usable, per_case_mb, limit, asked, whole)
