"""The pools of worker processes that read cases (the planner's fingerprint, the conversion), sized from the usable
memory as well as the CPUs.

What one case needs at its peak is estimated from its files' headers alone: its float32 size (X·Y·Z·C·4 bytes, the
image as a worker decodes it) times the peak factor of the work measured on CT-size cases (the constants below), plus
a worker's baseline. The pool runs as many workers as the CPUs allow and the usable memory holds at the largest case's
need (`tfmis.hardware.size_case_workers`: the host's available memory, lowered to what this process's cgroup limit
leaves), and says so in one line (`Fingerprinting with 1 worker: 2 CPUs, 1.4 GB usable (cgroup limit 1.5 GB) / 928 MB
per case`). A case needing more than the whole usable memory is skipped with one line naming what it needs (its
worker would only be killed). A worker the kernel kills anyway (an estimate too low, other processes growing) is one
line naming the cases it held; those are retried alone, the rest continue with fewer workers, and a case killed even
alone is skipped with its line (`tfmis.utils.parallel.map_ordered`). Workers ask the kernel to kill them before their
parent (`tfmis.hardware.prefer_oom_kill`), which holds the finished work.

Example:
```python
pool = CasePool("Fingerprinting", dataset, FINGERPRINT_PEAK_FACTOR)
print(pool.describe())
for result in pool.run(case_summary, tasks, skipped=lambda case_id, reason: {"case_id": case_id, ...}):
    ...
```
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator

from tfmis.data.sources.cases import Case, SegmentationDataset
from tfmis.data.sources.errors import UnreadableImage
from tfmis.data.sources.image_io import read_shape
from tfmis.hardware import MB, WorkerSizing, prefer_oom_kill, size_case_workers
from tfmis.utils.parallel import map_ordered

# A spawned case worker's resident memory before its case: numpy, scipy, nibabel and tfmis.data imported (77 MB
# fresh; 96 MB with the dicom extra, whose GDCM library pydicom loads when nibabel imports it), up to 44 MB more with
# what its allocator kept from its previous case (docs/benchmarks.md, "Conversion at real size").
WORKER_BASE_MB = 140.0
# Peak resident memory of a worker over its baseline, per MB of the case's float32 size (VmHWM of a fresh process
# around one case, reset before it, over its VmRSS before it: benchmarks/case_memory.py), measured on the CT demo's
# 512 x 512 x 203, 206 and 294 cases (int16 on disk; docs/benchmarks.md "Case workers in a memory limit"):
# - the planner's first pass (`tfmis.planning.fingerprint.case_summary`): 1.75 on all three, the peak of reading the
#   case (the int16 file and the float32 image at once); 2.90-2.95 while it reoriented copies of the image and label,
#   4.53 before that while its CT projections also copied the image and its class counts widened the label to int64
FINGERPRINT_PEAK_FACTOR = 1.9
# - the conversion (`tfmis.data.conversion_cases.process_case`): 1.95-2.42 here, 1.75-2.81 on 512 x 512 x
#   100-600 (the highest for 3 mm slices resampled to 2 mm; docs/benchmarks.md "Conversion at real size"); plus
#   the converted case the parent holds until its shard takes it (its float16 image and uint8 label, and its encoded
#   record): 2 x its size is 0.62-1.08 x the float32 input here, more where the resampling adds slices
CONVERSION_PEAK_FACTOR = 2.9 + 1.1
# - reading a case and sampling its foreground (the CT window pass, `case_foreground_sample`; the labels of stratified
#   folds): 1.75 on all three, as the first pass (the same reading)
LOAD_PEAK_FACTOR = FINGERPRINT_PEAK_FACTOR


def case_float32_mb(case: Case, dataset: SegmentationDataset) -> tuple[float, tuple[int, ...]] | None:
    """(MB, (X, Y, Z, C)) of a case's image as float32, from its files' headers; None when a header cannot be read
    (the worker then reports the case)."""
    if case.problem:
        return None
    try:
        shapes = [read_shape(dataset.resolve(case, p)) for p in case.image_files]
    except (UnreadableImage, OSError):
        return None
    spatial = tuple(shapes[0][:3])
    channels = sum(int(math.prod(s[3:])) for s in shapes)
    return math.prod(spatial) * channels * 4 / MB, (*spatial, channels)


class CasePool:
    """Worker processes for one pass over a dataset's cases, sized from the CPUs and the usable memory.

    Args:
        what: the pass, as its line starts ("Fingerprinting", "Converting").
        dataset: the dataset whose cases the tasks hold.
        factor: the pass's peak factor (`FINGERPRINT_PEAK_FACTOR`, ...).
        cases: the cases the pass reads (default: the training cases).
        asked: the worker count asked for (`--workers`); None for the default (`case_workers()`).
        reserve_mb: memory this process will still take while the pool runs (not yet held).
    """

    def __init__(
        self,
        what: str,
        dataset: SegmentationDataset,
        factor: float,
        cases: list[Case] | None = None,
        asked: int | None = None,
        reserve_mb: float = 0.0,
    ):
        self.what, self.factor = what, factor
        self.sizes = {c.case_id: case_float32_mb(c, dataset) for c in (dataset.training if cases is None else cases)}
        self.needs = {cid: WORKER_BASE_MB + factor * s[0] for cid, s in self.sizes.items() if s is not None}
        self.sizing: WorkerSizing = size_case_workers(
            max(self.needs.values(), default=WORKER_BASE_MB), asked, reserve_mb
        )
        self.too_large = {cid: self._too_large(cid) for cid, need in self.needs.items() if not self.sizing.fits(need)}
        if self.too_large:  # the others decide the count
            fitting = [n for cid, n in self.needs.items() if cid not in self.too_large]
            self.sizing = size_case_workers(max(fitting, default=WORKER_BASE_MB), asked, reserve_mb)

    @property
    def workers(self) -> int:
        return self.sizing.workers

    def describe(self) -> str:
        """`Fingerprinting with 2 workers: 2 CPUs, 1.4 GB usable / 610 MB per case`."""
        return f"{self.what} with {self.sizing.describe()}"

    def _need_text(self, case_id: str) -> str:
        mb, (x, y, z, c) = self.sizes[case_id]
        return (
            f"about {self.needs[case_id]:.0f} MB ({x} x {y} x {z} x {c} voxels, {mb:.0f} MB as float32, "
            f"x {self.factor:.1f} at its peak + a worker's {WORKER_BASE_MB:.0f} MB)"
        )

    def _usable_text(self) -> str:
        limit = self.sizing.limit_mb
        return f"{self.sizing.usable_mb:.0f} MB usable" + (f" (cgroup limit {limit:.0f} MB)" if limit else "")

    def _too_large(self, case_id: str) -> str:
        whole = self.sizing.whole_mb
        where = f"the cgroup limit of {whole:.0f} MB" if self.sizing.limit_mb is not None else f"the {whole:.0f} MB RAM"
        return (
            f"needs {self._need_text(case_id)}, more than {where}: not read; give the command more memory "
            "(a larger limit) to include it"
        )

    def _lost(self, case_id: str) -> str:
        need = self._need_text(case_id) if case_id in self.needs else "an unknown amount (its header is unreadable)"
        return (
            f"its worker was killed by the kernel (out of memory), with other cases and again alone: it needs "
            f"{need}, {self._usable_text()}; give the command more memory and rerun"
        )

    def run(self, fn, tasks: list, skipped: Callable[[str, str], object], say=None) -> Iterator:
        """Yields fn(task) in task order (each task a tuple whose first item is its `Case`); a case too large for
        the memory, or killed twice, yields `skipped(case_id, reason)` instead. `say` takes the line about a killed
        worker (default: standard error)."""
        say = say or (lambda line: print(line, file=sys.stderr))
        todo = [t for t in tasks if t[0].case_id not in self.too_large]
        # a worker process even for 1 worker when the memory decides: a case the kernel kills then takes its worker,
        # not this process and the finished work
        tight = self.sizing.memory_bound or 2 * self.sizing.per_case_mb > self.sizing.usable_mb
        results = map_ordered(
            fn,
            todo,
            self.workers,
            isolate=tight,
            ahead=self.workers if tight else None,  # the unfinished are the cases in flight; fewer results held here
            initializer=prefer_oom_kill,
            on_lost=lambda task: skipped(task[0].case_id, self._lost(task[0].case_id)),
            say=say,
            name=lambda task: f"{task[0].case_id} ({self.needs.get(task[0].case_id, 0):.0f} MB)",
        )
        for task in tasks:
            cid = task[0].case_id
            yield skipped(cid, self.too_large[cid]) if cid in self.too_large else next(results)
