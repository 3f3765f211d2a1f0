"""Host memory of the sliding-window blend: aligned buffers TensorFlow shares without a copy, the Σ(weight) map
(and a one-entry cache of it), and the threads that split a blend's numpy work into X slabs.

Numpy's in-place add of a window into a strided region of the volume pays a fixed cost per contiguous run
(rz · K values), about four times what the same voxels cost contiguously; torch spreads the same add over its
intra-op threads. `parallel_slabs` does the same for numpy: each thread owns one slab of the volume along X
and handles every window's part in that slab, in the windows' order, so no two threads write the same voxel
and every voxel gets the same additions in the same order as with one thread (bitwise the same result).

Example:
    >>> from tfmis.inference.windows import window_starts
    >>> starts = window_starts((6, 4, 4), (4, 4, 4), (2, 4, 4))
    >>> weight_sum((6, 4, 4), starts, np.ones((4, 4, 4)))[:, 0, 0].tolist()
    [1.0, 1.0, 2.0, 2.0, 1.0, 1.0]
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import threading
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from tfmis.hardware import runnable_tasks, usable_cpu_count
from tfmis.inference.windows import SPATIAL_DIMS

BUFFER_DTYPES = ("float32", "float16")


def check_buffer_dtype(buffer_dtype) -> np.dtype:
    """`buffer_dtype` as a numpy dtype: float32 (the default, MONAI's) or float16 (half the memory)."""
    dtype = np.dtype(buffer_dtype)
    if dtype.name not in BUFFER_DTYPES:
        raise ValueError(f"buffer_dtype must be one of {BUFFER_DTYPES}, got {buffer_dtype!r}")
    return dtype


# TensorFlow takes a numpy array without a copy through DLPack when its data is aligned as Eigen needs.
_ALIGNMENT = 64
_DLPACK_DTYPES = {
    np.dtype(t)
    for t in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
}


def aligned_empty(shape: Sequence[int], dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    try:
        raw = np.empty(size + _ALIGNMENT, np.uint8)
    except MemoryError as e:  # numpy's message, with the shape meant rather than the raw bytes
        raise MemoryError(
            f"Unable to allocate {size / 2**20:.3g} MiB for an array with shape {tuple(shape)} and data type {dtype}"
        ) from e
    offset = -raw.ctypes.data % _ALIGNMENT
    return raw[offset : offset + size].view(dtype).reshape(shape)


def host_tensor(array: np.ndarray) -> tf.Tensor:
    """A CPU tensor of an array from `aligned_empty`, sharing its memory (tf.convert_to_tensor copies)."""
    if array.dtype in _DLPACK_DTYPES and array.flags.c_contiguous and array.ctypes.data % _ALIGNMENT == 0:
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(array)


def is_uniform(weights: np.ndarray) -> bool:
    """True if every weight is the same (constant mode); a gaussian map fails at its first two voxels."""
    first = weights.flat[0]
    return bool(first == weights.flat[weights.size // 2] and (weights == first).all())


# ----------------------------------------------------------------------------------------------
# Σ(weight)
# ----------------------------------------------------------------------------------------------


def weight_sum(image_size: Sequence[int], starts: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Σ(weight) per voxel over all windows: the denominator of the blend (MONAI's count map).

    It depends only on the geometry. When the starts form a grid (as `window_starts` makes them),
    a uniform importance map gives the product of the window counts per axis, and any other is
    summed one axis at a time, shifting the map along X, then the result along Y, then along Z:
    about twice the volume in additions instead of every window's voxels.

    Args:
        image_size: spatial size (X, Y, Z) of the (padded) volume.
        starts: window corners (num_windows, 3), e.g. from `window_starts`; any list works.
        weights: importance map of shape roi_size.

    Returns:
        float32 array `image_size`, a new one (writable); zero where no window reaches.

    Example:
        >>> from tfmis.inference.windows import window_starts
        >>> weight_sum((6, 4, 4), window_starts((6, 4, 4), (4, 4, 4), (2, 4, 4)), np.ones((4, 4, 4)))[:, 0, 0].tolist()
        [1.0, 1.0, 2.0, 2.0, 1.0, 1.0]
    """
    weights = np.asarray(weights, np.float32)
    starts = np.asarray(starts, np.int64).reshape(-1, SPATIAL_DIMS)
    (rx, ry, rz), (sx, sy, sz) = weights.shape, tuple(int(s) for s in image_size)
    axes = [np.unique(starts[:, axis]) for axis in range(SPATIAL_DIMS)]
    grid = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, SPATIAL_DIMS)
    if grid.shape != starts.shape or not np.array_equal(
        np.sort(grid.view("i8,i8,i8"), axis=0), np.sort(starts.view("i8,i8,i8"), axis=0)
    ):
        total = np.zeros((sx, sy, sz), np.float32)  # not a grid: window by window
        for x, y, z in starts:
            total[x : x + rx, y : y + ry, z : z + rz] += weights
        return total
    if is_uniform(weights):  # e.g. constant mode: windows per voxel, times the weight
        counts = []
        for size, roi, axis_starts in zip((sx, sy, sz), weights.shape, axes):
            count = np.zeros(size, np.float32)
            for start in axis_starts:
                count[start : start + roi] += 1
            counts.append(count)
        return (counts[0][:, None, None] * counts[1][None, :, None]) * (counts[2] * weights.flat[0])[None, None, :]
    total = weights
    for axis, (size, axis_starts) in enumerate(zip((sx, sy, sz), axes)):
        # shift the partial sum along this axis to every start: (X, ry, rz), then (X, Y, rz), then (X, Y, Z)
        roi = total.shape[axis]
        if len(axis_starts) == 1 and axis_starts[0] == 0 and roi == size:
            continue  # one window covering the axis: nothing to shift
        shifted = np.zeros(total.shape[:axis] + (size,) + total.shape[axis + 1 :], np.float32)
        for start in axis_starts:
            shifted[(slice(None),) * axis + (slice(start, start + roi),)] += total
        total = shifted
    return np.array(total) if total is weights else total  # the weights may be shared: a copy


# Σ(weight) maps up to this size are kept for the next call with the same geometry (4 Mi voxels, e.g. 160³).
WEIGHT_SUM_CACHE_BYTES = 16 * 2**20
_weight_sum_lock = threading.Lock()
_weight_sum_entry: tuple | None = None  # (image_size, starts bytes, weights, Σ(weight), every voxel covered)


def cached_weight_sum(image_size: Sequence[int], starts: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, bool]:
    """`weight_sum`, read-only, and whether every voxel has a positive Σ(weight); the last one is kept.

    A call with the same spatial size, the same window corners and the same importance map object gets the
    kept array back (`importance_array` hands out one read-only array per window size, mode and sigma, so
    the key is that object, not its values). Only one map is kept, at most `WEIGHT_SUM_CACHE_BYTES`, and only
    for a read-only `weights` that owns its memory (one that cannot change under the key, and not a view made
    anew per call, such as a tensor's, which would never be looked up again); a map of another geometry is dropped
    before the new one is computed, so a blend never holds two.

    Returns:
        (float32 array `image_size`, read-only; True if no voxel has Σ(weight) == 0).
    """
    global _weight_sum_entry
    image_size = tuple(int(s) for s in image_size)
    starts = np.ascontiguousarray(starts, np.int32).reshape(-1, SPATIAL_DIMS)
    key = (image_size, starts.tobytes())
    with _weight_sum_lock:
        entry = _weight_sum_entry
        if entry is not None and entry[0:2] == key and entry[2] is weights:
            return entry[3], entry[4]
        _weight_sum_entry = entry = None  # the old map goes before the new one is allocated
    total = weight_sum(image_size, starts, weights)
    covered = bool(total.min() > 0)
    total.flags.writeable = False
    keep = (
        isinstance(weights, np.ndarray)
        and weights.base is None  # owns its memory: not a view of a tensor or of another array, made anew per call
        and not weights.flags.writeable
        and total.nbytes <= WEIGHT_SUM_CACHE_BYTES
    )
    if keep:
        with _weight_sum_lock:
            _weight_sum_entry = (*key, weights, total, covered)
    return total, covered


def clear_weight_sum_cache() -> None:
    """Drops the kept Σ(weight) map (`cached_weight_sum`)."""
    global _weight_sum_entry
    with _weight_sum_lock:
        _weight_sum_entry = None


# ----------------------------------------------------------------------------------------------
# Threads
# ----------------------------------------------------------------------------------------------

# at most this many threads blend; fewer when a window holds fewer than MIN_VALUES_PER_THREAD values per thread
MAX_BLEND_THREADS = 8
MIN_VALUES_PER_THREAD = 2**15


@functools.lru_cache(maxsize=1)
def _usable_cpus() -> int:
    return usable_cpu_count()


def blend_threads(values_per_window: int, runnable: int | None = None) -> int:
    """Threads for a host blend whose windows hold `values_per_window` values (rx·ry·rz·K).

    The CPUs this process may use (`usable_cpu_count`), no more than TensorFlow's intra-op threads when those
    are set, at most `MAX_BLEND_THREADS`; 1 for windows too small to share (under `MIN_VALUES_PER_THREAD`
    values per thread, a thread's hand-off costs more than it saves); and no more than the CPUs not running
    anything right now with one left for the rest of the machine (CPUs - `runnable`, where `runnable`, by
    default `runnable_tasks()`, counts this thread): on a machine busy with other work a second thread waits
    for a CPU at every hand-off, which made a blend slower, not faster (docs/benchmarks.md). The result does
    not depend on the count, only the time.

    Example:
        >>> blend_threads(8 * 8 * 8)
        1
    """
    threads = min(_usable_cpus(), MAX_BLEND_THREADS, int(values_per_window) // MIN_VALUES_PER_THREAD)
    if threads <= 1:
        return 1
    intra_op = tf.config.threading.get_intra_op_parallelism_threads()
    if intra_op > 0:
        threads = min(threads, intra_op)
    runnable = runnable_tasks() if runnable is None else runnable
    if runnable is not None:
        threads = min(threads, _usable_cpus() - runnable)
    return max(1, threads)


_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(MAX_BLEND_THREADS - 1, thread_name_prefix="tfmis-blend")
        return _pool


def run_parallel(work: Callable[[int], None], parts: int) -> None:
    """Calls `work(0)`, ..., `work(parts - 1)` once each and returns when all are done; the first exception
    raised is raised here.

    This thread and up to `parts - 1` threads of a shared pool claim the parts one at a time, so a pool
    thread that is slow to start (a busy machine) leaves its part to this one instead of holding it up:
    never much slower than one thread. `work` must be safe to run for different parts at the same time.
    """
    if parts <= 1:
        work(0)
        return
    claims = itertools.count()
    done = [threading.Event() for _ in range(parts)]
    errors: list[BaseException] = []

    def claim_and_work() -> None:
        while (part := next(claims)) < parts:  # next() on itertools.count is atomic under the GIL
            try:
                work(part)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                errors.append(e)
            finally:
                done[part].set()

    pool = _executor()
    for _ in range(parts - 1):
        pool.submit(claim_and_work)
    claim_and_work()
    for event in done:
        event.wait()
    if errors:
        raise errors[0]


def balanced_slabs(size: int, starts: np.ndarray, roi: int, parts: int) -> list[tuple[int, int]]:
    """`parts` consecutive ranges [lo, hi) covering 0..size along one axis, with about as many window rows each.

    A voxel row at position p is covered by as many windows as there are starts s with s <= p < s + roi;
    the split points balance the sum of that count, which is what the threads of a blend add.

    Example:
        >>> balanced_slabs(10, np.array([0, 6]), 4, 2)
        [(0, 4), (4, 10)]
    """
    coverage = np.zeros(size + 1, np.int64)
    for start in np.unique(np.asarray(starts).reshape(-1)):
        coverage[start] += 1
        coverage[min(start + roi, size)] -= 1
    cumulative = np.cumsum(np.cumsum(coverage)[:size])
    targets = cumulative[-1] * np.arange(1, parts) / parts
    cuts = [0, *(int(c) + 1 for c in np.searchsorted(cumulative, targets)), size]
    cuts = [min(max(c, 0), size) for c in cuts]
    return [(lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:]) if hi > lo] or [(0, size)]
