"""Work shared out to processes: the conversion's cases, the planner's first pass over an MSD folder.

A worker the kernel kills (out of memory: SIGKILL from the OOM killer) breaks a `ProcessPoolExecutor`: every
unfinished task fails with `BrokenProcessPool`. With `on_lost`, `map_ordered` survives that: the tasks that were in
flight are retried one at a time, each alone in a fresh worker, a task killed again alone comes back as
`on_lost(task)`, and the rest continue with half the workers. The finished results are never lost.

A worker killed while it writes its result is the one case the executor never notices: the result pipe is left
half-written (its reader waits for the rest for ever) and the queue's write lock held (every other worker waits for
it). `map_ordered` therefore waits for a result in short polls, and a worker dead for `STUCK_AFTER_S` without the
pool breaking is taken as that case: the remaining workers are killed and the parent's end of the pipe closed, so
the reader meets the end of the pipe and the pool breaks as it would have.
"""

from __future__ import annotations

import collections
import itertools
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

# how often a wait for a result looks at the workers, and how long one may have been dead without the pool breaking
# before it is taken as killed while it wrote its result (the pool breaks within milliseconds in every other case)
POLL_S = 0.5
STUCK_AFTER_S = 10.0


def map_ordered(
    fn,
    tasks: list,
    workers: int,
    *,
    isolate: bool = False,
    ahead: int | None = None,
    initializer: Callable | None = None,
    on_lost: Callable | None = None,
    say: Callable[[str], None] | None = None,
    name: Callable | None = None,
):
    """Yields fn(task) in task order from `workers` spawned processes (in this process when 1, unless `isolate`),
    with at most `ahead` (default 2*workers) tasks submitted at once (bounded memory); `fn` must be importable (a
    module-level function).

    Args:
        isolate: run the tasks in a spawned process even with 1 worker (a task the kernel kills then does not take
            this process with it).
        ahead: tasks submitted at once; with `ahead == workers`, the unfinished ones are exactly those in flight.
        initializer: run once in each worker process (e.g. `tfmis.hardware.prefer_oom_kill`).
        on_lost: `task -> result` for a task whose worker was killed twice (with others, then alone); without it,
            a killed worker raises `BrokenProcessPool` as before.
        say: where the one line about a killed worker goes (default: nowhere).
        name: `task -> str` naming a task in that line (default `str`).
    """
    if not tasks:
        return
    if workers == 1 and not isolate or len(tasks) == 1 and not isolate:
        yield from map(fn, tasks)
        return
    workers = max(1, min(workers, len(tasks)))
    ahead = max(ahead or 2 * workers, workers)
    ctx = multiprocessing.get_context("spawn")  # the parent may have TensorFlow loaded: never fork it
    lost = []
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=initializer) as pool:
        it = iter(enumerate(tasks))
        queue = collections.deque((i, pool.submit(fn, t)) for i, t in itertools.islice(it, ahead))
        while queue:
            i, future = queue[0]
            try:
                result = _result(future, pool)
            except BrokenProcessPool:
                if on_lost is None:
                    raise
                lost = [i for i, f in queue if not (f.done() and f.exception() is None)]
                break
            queue.popleft()
            nxt = next(it, None)
            if nxt is not None:
                queue.append((nxt[0], pool.submit(fn, nxt[1])))
            yield result
    if not lost:
        return
    # what finished before the break, in order, then the lost tasks alone, then the rest with fewer workers
    finished = {i: f.result() for i, f in queue if f.done() and f.exception() is None}
    fewer = max(1, workers // 2)
    label = name or str
    if say is not None:
        say(
            f"a worker process was killed (by the kernel: out of memory?) with "
            f"{', '.join(label(tasks[i]) for i in lost)} unfinished: retrying each alone, then {fewer} worker(s)"
        )
    for i, _ in queue:
        yield finished[i] if i in finished else _alone(fn, tasks[i], ctx, initializer, on_lost)
    rest = tasks[queue[-1][0] + 1 :]
    yield from map_ordered(
        fn, rest, fewer, isolate=True, ahead=fewer, initializer=initializer, on_lost=on_lost, say=say, name=name
    )


def _alone(fn, task, ctx, initializer, on_lost):
    """fn(task) alone in a fresh worker process; `on_lost(task)` when the kernel kills that one too."""
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx, initializer=initializer) as pool:
        try:
            return _result(pool.submit(fn, task), pool)
        except BrokenProcessPool:
            return on_lost(task)


def _result(future, pool: ProcessPoolExecutor):
    """`future.result()`, or `BrokenProcessPool` when a worker of `pool` has been dead for `STUCK_AFTER_S` without
    the pool breaking (killed while it wrote its result: module docstring)."""
    dead_since = None
    while True:
        try:
            return future.result(timeout=POLL_S)
        except FutureTimeout:
            pass
        processes = list((getattr(pool, "_processes", None) or {}).values())
        if not any(p.exitcode is not None for p in processes):
            dead_since = None
            continue
        dead_since = dead_since or time.monotonic()
        if time.monotonic() - dead_since >= STUCK_AFTER_S:
            _break(pool, processes)


def _break(pool: ProcessPoolExecutor, processes: list) -> None:
    """Ends a pool stuck on a half-written result: its workers killed, then the parent's write end of the result pipe
    closed, so that the executor's reader gets end-of-file and breaks the pool (every unfinished future then raises
    `BrokenProcessPool`). CPython's executor internals: `_processes`, `_result_queue._writer`."""
    for process in processes:
        if process.exitcode is None:
            process.kill()
    for process in processes:
        process.join(timeout=5)
    writer = getattr(getattr(pool, "_result_queue", None), "_writer", None)
    if writer is not None:
        writer.close()
