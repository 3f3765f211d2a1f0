"""The sliding-window blend in host memory: Σ(weight · prediction) in one numpy array, added in place window by
window, divided once by Σ(weight) (what MONAI does with torch tensors), the work split into X slabs over threads.

`tfmis.inference.blending.aggregate` drives it (and `DeviceBlend`, its TensorFlow twin for accelerator memory).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tfmis.inference.buffers import (
    aligned_empty,
    balanced_slabs,
    blend_threads,
    cached_weight_sum,
    check_buffer_dtype,
    host_tensor,
    is_uniform,
    run_parallel,
)


def _even_parts(size: int, parts: int) -> list[tuple[int, int]]:
    """`parts` consecutive ranges [lo, hi) of about equal length covering 0..size (empty ones left out)."""
    cuts = [size * part // parts for part in range(parts + 1)]
    return [(lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:]) if hi > lo]


class HostBlend:
    """Σ(weight · prediction) in one numpy array, added in place window by window, and divided once
    by Σ(weight) at the end (what MONAI does with torch tensors).

    With a float16 `buffer_dtype` each window is divided by Σ(weight) over its voxels before it is
    added (the weight sum stays float32), so the buffer holds the blended mean itself, in the range
    of the predictions, and no whole-volume division or float32 copy is needed at the end.

    Numpy's in-place add of a window into a strided region of the volume touches each voxel of
    the window once; TensorFlow on a CPU has no such op (a strided-slice assignment is many times
    slower per voxel: docs/benchmarks.md, "First epoch, precision and other costs"), so host memory is
    blended with numpy. Windows and the result reach TensorFlow without a copy (`host_tensor`).

    Cutting windows, adding them and dividing run on `threads` threads (`blend_threads` by default): each
    thread owns an X slab of the volume (of each window, when cutting), so the result is the same bit for bit
    with any number of threads. Σ(weight) comes from `cached_weight_sum` (kept for the next call with the
    same geometry); memory is the sum buffer, that map, one scratch window per thread and the window batches.
    """

    def __init__(
        self,
        volume: tf.Tensor | np.ndarray,
        roi_size: tuple[int, int, int],
        starts: np.ndarray,
        weights: tf.Tensor | np.ndarray,
        buffer_dtype="float32",
        threads: int | None = None,
    ):
        self.volume = np.asarray(volume)  # no copy of a tensor in host memory
        self.buffer_dtype = check_buffer_dtype(buffer_dtype)
        self.normalise_per_window = self.buffer_dtype != np.float32
        self.roi_size = roi_size
        weights = np.asarray(weights, np.float32)  # the same object for a float32 array (the cache's key)
        self.weights = weights
        self.uniform = is_uniform(weights) and bool(weights.flat[0] == 1)  # constant mode: no products
        # the first whole-volume allocation, before any forward pass (a MemoryError here is a clean one)
        self.weight_sum, self.covered = cached_weight_sum(self.volume.shape[1:4], starts, weights)
        rx, ry, rz = roi_size
        self.threads = int(threads) if threads else blend_threads(rx * ry * rz)
        self.rows = _even_parts(rx, self.threads)  # each thread's rows of a window when cutting
        # ... and of the volume when adding
        self.slabs = (
            balanced_slabs(self.volume.shape[1], starts[:, 0], rx, self.threads)
            if self.threads > 1
            else [(0, self.volume.shape[1])]
        )
        self.total = self.scratch = None

    def windows(self, origins: np.ndarray, as_numpy: bool = False) -> tf.Tensor | np.ndarray:
        """The windows at `origins` ([b, x, y, z] each) in a new aligned batch (N, rx, ry, rz, C): a tensor sharing
        its memory, or with `as_numpy` the array itself."""
        rx, ry, rz = self.roi_size
        batch = aligned_empty((len(origins), rx, ry, rz, self.volume.shape[-1]), self.volume.dtype)

        def cut(part: int) -> None:
            lo, hi = self.rows[part]
            for window, (b, x, y, z) in zip(batch, origins):
                window[lo:hi] = self.volume[b, x + lo : x + hi, y : y + ry, z : z + rz]

        run_parallel(cut, len(self.rows))
        return batch if as_numpy else host_tensor(batch)

    def allocate(self, prediction: tf.Tensor | np.ndarray) -> None:
        """The sum buffer, once the first prediction tells the channel count K (before the next forward pass)."""
        shape = tuple(int(s) for s in prediction.shape[1:])
        self.total = aligned_empty((*self.volume.shape[:4], shape[-1]), self.buffer_dtype)
        run_parallel(lambda part: self.total[:, slice(*self.slabs[part])].fill(0), len(self.slabs))
        self.scratch = [np.empty(shape, np.float32) for _ in self.slabs]
        if shape[-1] == 1:
            self.weights = self.weights[..., None]
        else:
            self.weights = np.ascontiguousarray(np.broadcast_to(self.weights[..., None], shape))

    def add(self, prediction: tf.Tensor | np.ndarray, origins: np.ndarray) -> None:
        """Adds weight · prediction of each window at its origin (float16: divided by Σ(weight) first)."""
        prediction = np.asarray(prediction)  # waits for this batch only: the next one is already queued
        if prediction.dtype != np.float32:
            prediction = prediction.astype(np.float32)
        run_parallel(lambda part: self._add_slab(prediction, origins, part), len(self.slabs))

    def _add_slab(self, prediction: np.ndarray, origins: np.ndarray, part: int) -> None:
        """`add` for the voxels of one X slab, window after window."""
        rx, ry, rz = self.roi_size
        lo, hi = self.slabs[part]
        scratch = self.scratch[part]
        for window, (b, x, y, z) in zip(prediction, origins):
            first, last = max(int(x), lo), min(int(x) + rx, hi)
            if first >= last:
                continue
            rows = slice(first - x, last - x)
            window = window[rows]
            if self.normalise_per_window:  # weight / Σ(weight) here, the buffer's precision kept for the mean
                region = self.weight_sum[first:last, y : y + ry, z : z + rz, None]
                if self.uniform:
                    window = np.divide(window, region, out=scratch[rows])
                else:
                    window = np.multiply(window, self.weights[rows], out=scratch[rows])
                    np.divide(window, region, out=window, where=region > 0)
            elif not self.uniform:
                window = np.multiply(window, self.weights[rows], out=scratch[rows])
            target = self.total[b, first:last, y : y + ry, z : z + rz]
            target += window  # in place (the name is rebound to the same view: no copy back)

    def result(self, device: str | None, crop: tuple[slice, ...] | None, as_numpy: bool = False):
        """The blend as a tensor on `device` sharing the host buffer, or with `as_numpy` the writable buffer itself
        (a tensor's numpy view is read-only, and `Tensor.numpy()` copies it)."""
        total, self.total = self.total, None
        weights, self.weight_sum = self.weight_sum, None
        if not self.normalise_per_window:  # float16: divided window by window

            def divide(part: int) -> None:
                slab = slice(*self.slabs[part])
                region, denominator = total[:, slab], weights[None, slab, ..., None]
                if self.covered:
                    np.divide(region, denominator, out=region)
                else:  # starts that leave voxels uncovered: those stay 0
                    np.divide(region, denominator, out=region, where=denominator > 0)

            run_parallel(divide, len(self.slabs))
        weights = None  # released here (a kept Σ(weight) is at most WEIGHT_SUM_CACHE_BYTES)
        if crop is not None:
            total = self._cropped(total, crop)
        if as_numpy:
            return total
        output = host_tensor(total)
        if device:
            with tf.device(device):
                output = tf.identity(output)
        return output

    def _cropped(self, total: np.ndarray, crop: Sequence[slice]) -> np.ndarray:
        """A new aligned array of the spatial `crop` of `total`, copied in X parts over the threads."""
        region = total[(slice(None), *crop)]
        cropped = aligned_empty(region.shape, total.dtype)
        parts = _even_parts(region.shape[1], self.threads)
        run_parallel(
            lambda part: cropped.__setitem__(np.s_[:, slice(*parts[part])], region[:, slice(*parts[part])]), len(parts)
        )
        return cropped
