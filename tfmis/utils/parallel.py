"""Work shared out to processes: the conversion's cases, the planner's first pass over an MSD folder."""

from __future__ import annotations

import collections
import itertools
import multiprocessing
from concurrent.futures import ProcessPoolExecutor


def map_ordered(fn, tasks: list, workers: int):
    """Yields fn(task) in task order from `workers` spawned processes (in this process when 1), with at most
    2*workers tasks in flight (bounded memory); `fn` must be importable (a module-level function)."""
    if workers == 1 or len(tasks) <= 1:
        yield from map(fn, tasks)
        return
    ctx = multiprocessing.get_context("spawn")  # the parent may have TensorFlow loaded: never fork it
    with ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=ctx) as pool:
        it = iter(tasks)
        queue = collections.deque(pool.submit(fn, t) for t in itertools.islice(it, 2 * workers))
        while queue:
            result = queue.popleft().result()
            nxt = next(it, None)
            if nxt is not None:
                queue.append(pool.submit(fn, nxt))
            yield result
