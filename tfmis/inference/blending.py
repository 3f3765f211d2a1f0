"""Blending the windows' predictions into the volume: Σ(weight · prediction) / Σ(weight), with one in-place add
per window, in host memory (numpy) or on a TensorFlow device.

`sliding_window_inference` (`tfmis.inference.sliding_window`) cuts a volume into windows (`tfmis.inference.windows`)
and hands them here: the windows are cut and blended on `device`, only they travel to `sw_device` for the forward
pass, and the next batch goes to the predictor before the previous one is blended.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfmis.hardware import CPU, accelerator_device
from tfmis.inference.windows import SPATIAL_DIMS
from tfmis.utils.progress import progress_bar


def device_scope(device: str | None):
    """A device scope, or no scope for None (TensorFlow's default placement)."""
    return tf.device(device) if device else contextlib.nullcontext()


def aggregates_on_host(device: str | None) -> bool:
    """True if `device` (the one holding the volume and the blending buffers) is host memory.

    A CPU device string, or None on a machine without a GPU (TensorFlow's default placement is then
    the CPU). There the windows are cut and blended with numpy's in-place adds; elsewhere with
    TensorFlow ops on `device`.

    Example:
        >>> aggregates_on_host("/CPU:0"), aggregates_on_host("/job:localhost/replica:0/task:0/device:GPU:1")
        (True, False)
    """
    if not device:
        return accelerator_device() == CPU
    return (tf.DeviceSpec.from_string(device).device_type or "").upper() == "CPU"


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
        float32 array `image_size`; zero where no window reaches.

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
    if weights.min() == weights.max():  # e.g. constant mode: windows per voxel, times the weight
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


# TensorFlow takes a numpy array without a copy through DLPack when its data is aligned as Eigen needs.
_ALIGNMENT = 64
_DLPACK_DTYPES = {
    np.dtype(t)
    for t in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
}


def _aligned_empty(shape: Sequence[int], dtype) -> np.ndarray:
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


def _host_tensor(array: np.ndarray) -> tf.Tensor:
    """A CPU tensor of an array from `_aligned_empty`, sharing its memory (tf.convert_to_tensor copies)."""
    if array.dtype in _DLPACK_DTYPES and array.flags.c_contiguous and array.ctypes.data % _ALIGNMENT == 0:
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(array)


BUFFER_DTYPES = ("float32", "float16")


def check_buffer_dtype(buffer_dtype) -> np.dtype:
    """`buffer_dtype` as a numpy dtype: float32 (the default, MONAI's) or float16 (half the memory)."""
    dtype = np.dtype(buffer_dtype)
    if dtype.name not in BUFFER_DTYPES:
        raise ValueError(f"buffer_dtype must be one of {BUFFER_DTYPES}, got {buffer_dtype!r}")
    return dtype


class HostBlend:
    """Σ(weight · prediction) in one numpy array, added in place window by window, and divided once
    by Σ(weight) at the end (what MONAI does with torch tensors).

    With a float16 `buffer_dtype` each window is divided by Σ(weight) over its voxels before it is
    added (the weight sum stays float32), so the buffer holds the blended mean itself, in the range
    of the predictions, and no whole-volume division or float32 copy is needed at the end.

    Numpy's in-place add of a window into a strided region of the volume touches each voxel of
    the window once; TensorFlow on a CPU has no such op (a strided-slice assignment is many times
    slower per voxel: docs/benchmarks.md, "First epoch, precision and other costs"), so host memory is
    blended with numpy. Windows and the result reach TensorFlow
    without a copy (`_host_tensor`).
    """

    def __init__(
        self,
        volume: tf.Tensor | np.ndarray,
        roi_size: tuple[int, int, int],
        starts: np.ndarray,
        weights: tf.Tensor | np.ndarray,
        buffer_dtype="float32",
    ):
        self.volume = np.asarray(volume)  # no copy of a tensor in host memory
        self.buffer_dtype = check_buffer_dtype(buffer_dtype)
        self.normalise_per_window = self.buffer_dtype != np.float32
        self.roi_size = roi_size
        self.weights = np.asarray(weights, np.float32)
        self.uniform = bool(self.weights.min() == self.weights.max() == 1)  # constant mode: no products
        # the first whole-volume allocation, before any forward pass (a MemoryError here is a clean one)
        self.weight_sum = weight_sum(self.volume.shape[1:4], starts, self.weights)
        self.total = self.scratch = None

    def windows(self, origins: np.ndarray) -> tf.Tensor:
        rx, ry, rz = self.roi_size
        batch = _aligned_empty((len(origins), rx, ry, rz, self.volume.shape[-1]), self.volume.dtype)
        for window, (b, x, y, z) in zip(batch, origins):
            window[...] = self.volume[b, x : x + rx, y : y + ry, z : z + rz]
        return _host_tensor(batch)

    def allocate(self, prediction: tf.Tensor) -> None:
        """The sum buffer, once the first prediction tells the channel count K (before the next forward pass)."""
        shape = tuple(prediction.shape[1:])
        self.total = _aligned_empty((*self.volume.shape[:4], shape[-1]), self.buffer_dtype)
        self.total.fill(0)
        self.scratch = np.empty(shape, np.float32)
        self.weights = np.ascontiguousarray(np.broadcast_to(self.weights[..., None], shape))

    def add(self, prediction: tf.Tensor, origins: np.ndarray) -> None:
        rx, ry, rz = self.roi_size
        prediction = np.asarray(prediction)  # waits for this batch only: the next one is already queued
        for window, (b, x, y, z) in zip(prediction, origins):
            if self.normalise_per_window:  # weight / Σ(weight) here, the buffer's precision kept for the mean
                region = self.weight_sum[x : x + rx, y : y + ry, z : z + rz, None]
                if self.uniform:
                    window = np.divide(window, region, out=self.scratch)
                else:
                    window = np.multiply(window, self.weights, out=self.scratch)
                    np.divide(window, region, out=window, where=region > 0)
            elif not self.uniform:
                window = np.multiply(window, self.weights, out=self.scratch)
            self.total[b, x : x + rx, y : y + ry, z : z + rz] += window

    def result(self, device: str | None, crop: tuple[slice, ...] | None, as_numpy: bool = False):
        """The blend as a tensor on `device` sharing the host buffer, or with `as_numpy` the writable buffer itself
        (a tensor's numpy view is read-only, and `Tensor.numpy()` copies it)."""
        total, self.total = self.total, None
        weights, self.weight_sum = self.weight_sum[None, ..., None], None
        if self.normalise_per_window:
            pass  # divided window by window
        elif weights.min() > 0:
            np.divide(total, weights, out=total)
        else:  # starts that leave voxels uncovered: those stay 0
            np.divide(total, weights, out=total, where=weights > 0)
        del weights
        if crop is not None:
            region = total[(slice(None), *crop)]
            total = _aligned_empty(region.shape, total.dtype)
            total[...] = region
            del region
        if as_numpy:
            return total
        output = _host_tensor(total)
        if device:
            with tf.device(device):
                output = tf.identity(output)
        return output


class DeviceBlend:
    """The blend in one TensorFlow variable on `device`, one sparse update per window.

    float32 (MONAI's): Σ(weight · prediction) and Σ(weight) in K + 1 float32 channels, one scatter-add
    per window, divided once at the end.

    float16 (half the memory for the K classes), normalised per window as `HostBlend` does, so a device run
    and its host fallback give the same result: Σ(weight) is computed first (`weight_sum`, float32, from the
    window corners and the importance map), and each window's weight · prediction / Σ(weight) is added in
    float32 to the running mean read from the buffer, then rounded once to float16 and written back (what
    numpy's in-place float16 += float32 does). The buffer holds the blended mean itself, in the range of the
    predictions: no final division. Summing raw weighted logits in float16 instead would round them at the
    step of the sums (0.125 between 128 and 256) and could change labels against the host.

    Memory on `device` besides the volume, for B images of X·Y·Z voxels and K classes: float32, B·X·Y·Z·(K + 1)
    float32; float16, B·X·Y·Z·K float16 plus X·Y·Z float32 for Σ(weight) (2K + 4 bytes per voxel of one
    image, against 2K + 2 when both sums were float16; the Σ(weight) map is released before the result is
    read, which needs no division buffer).

    For buffers in accelerator memory: every op is queued on the device and nothing waits for the
    host until the caller reads the result. The variable is flat, (B·X·Y·Z, channels), and a window
    touches its rx·ry·rz rows at precomputed offsets from its corner. A slice read-add-assign would
    not do: TensorFlow copies the whole variable on every read once a slice of it was assigned.
    One scatter per window keeps the indices of each scatter distinct, so the sums are deterministic.
    """

    def __init__(
        self,
        volume: tf.Tensor | np.ndarray,
        roi_size: tuple[int, int, int],
        starts: np.ndarray,
        weights: tf.Tensor | np.ndarray,
        device: str | None,
        buffer_dtype="float32",
    ):
        self.device, self.roi_size = device, roi_size
        self.buffer_dtype = tf.as_dtype(check_buffer_dtype(buffer_dtype))
        self.normalise_per_window = self.buffer_dtype != tf.float32
        weights = np.asarray(weights, np.float32)
        self.uniform = bool(weights.min() == weights.max() == 1)  # constant mode: no products
        with device_scope(device):
            self.volume = tf.identity(volume)
            self.weights = tf.identity(tf.constant(weights[..., None]))
        batch, sx, sy, sz = (int(s) for s in self.volume.shape[:4])
        self.strides = (sx * sy * sz, sy * sz, sz, 1)
        self.index_dtype = tf.int32 if batch * sx * sy * sz < 2**31 else tf.int64
        rx, ry, rz = roi_size
        rows = (np.arange(rx)[:, None, None] * sy + np.arange(ry)[None, :, None]) * sz + np.arange(rz)
        with device_scope(device):
            self.rows = tf.constant(rows.reshape(-1), self.index_dtype)
            # the whole-volume Σ(weight) of the float16 blend (X·Y·Z rows, float32), before any forward pass
            self.weight_sum = (
                tf.identity(tf.constant(weight_sum((sx, sy, sz), starts, weights).reshape(-1, 1)))
                if self.normalise_per_window
                else None
            )
        self.total = None

    def windows(self, origins: np.ndarray) -> tf.Tensor:
        rx, ry, rz = self.roi_size
        with device_scope(self.device):
            return tf.stack([self.volume[b, x : x + rx, y : y + ry, z : z + rz] for b, x, y, z in origins])

    def allocate(self, prediction: tf.Tensor) -> None:
        """The buffer, once the first prediction tells the channel count K (before the next forward pass):
        K + 1 channels (the sums) in float32, K (the running mean) in float16."""
        channels = int(prediction.shape[-1]) + (0 if self.normalise_per_window else 1)
        with device_scope(self.device):
            self.total = tf.Variable(
                tf.zeros([self.strides[0] * int(self.volume.shape[0]), channels], self.buffer_dtype),
                trainable=False,
            )

    def add(self, prediction: tf.Tensor, origins: np.ndarray) -> None:
        rx, ry, rz = self.roi_size
        with device_scope(self.device):
            prediction = tf.identity(prediction) if self.device else prediction
            if self.normalise_per_window:
                self._add_normalised(prediction, origins)
                return
            channels = int(prediction.shape[-1]) + 1
            weights = tf.broadcast_to(self.weights, [len(origins), rx, ry, rz, 1])
            values = tf.reshape(tf.concat([prediction * weights, weights], axis=-1), [len(origins), -1, channels])
            values = tf.cast(values, self.buffer_dtype)
            for value, origin in zip(tf.unstack(values), origins):
                corner = sum(int(o) * s for o, s in zip(origin, self.strides))
                tf.raw_ops.ResourceScatterAdd(resource=self.total.handle, indices=self.rows + corner, updates=value)

    def _add_normalised(self, prediction: tf.Tensor, origins: np.ndarray) -> None:
        """mean[window] = float16(float32(mean[window]) + weight · prediction / Σ(weight)), window by window:
        the float32 values and the single rounding of `HostBlend`'s float16 add."""
        values = tf.reshape(prediction, [len(origins), -1, int(prediction.shape[-1])])
        if not self.uniform:
            values = values * tf.reshape(self.weights, [1, -1, 1])
        for value, (b, x, y, z) in zip(tf.unstack(values), origins):
            rows = self.rows + (int(x) * self.strides[1] + int(y) * self.strides[2] + int(z))
            value = tf.math.divide_no_nan(value, tf.gather(self.weight_sum, rows))
            rows = rows + int(b) * self.strides[0]
            mean = tf.cast(self.total.sparse_read(rows), tf.float32) + value
            tf.raw_ops.ResourceScatterUpdate(
                resource=self.total.handle, indices=rows, updates=tf.cast(mean, self.buffer_dtype)
            )

    def result(self, device: str | None, crop: tuple[slice, ...] | None, as_numpy: bool = False):
        """The blend as a tensor on the device, or with `as_numpy` copied to a numpy array."""
        output = self._result(crop)
        return output.numpy() if as_numpy else output

    def _result(self, crop: tuple[slice, ...] | None) -> tf.Tensor:
        self.weight_sum = None
        with device_scope(self.device):
            total = tf.reshape(self.total.read_value(), [*self.volume.shape[:4], -1])
            self.total = None  # frees the variable before the division (or the crop) allocates the output
            if crop is not None:
                total = total[(slice(None), *crop)]
            if self.normalise_per_window:
                return total  # the mean already
            return tf.math.divide_no_nan(total[..., :-1], total[..., -1:])


def _prediction_tensor(output: Any, num_windows: int, roi_size: Sequence[int]) -> tf.Tensor:
    """The predictor's output as one float32 tensor (N, rx, ry, rz, K), checked.

    Keras models may return a one-element list or dict; several outputs are ambiguous here.
    """
    if isinstance(output, Mapping) or isinstance(output, (list, tuple)):
        outputs = list(output.values()) if isinstance(output, Mapping) else list(output)
        if len(outputs) != 1:
            raise ValueError(
                f"predictor returned {len(outputs)} outputs; sliding_window_inference "
                "blends one, e.g. pass `lambda w: model(w)[0]`"
            )
        output = outputs[0]
    if not (isinstance(output, tf.Tensor) and output.dtype == tf.float32):
        output = tf.cast(tf.convert_to_tensor(output), tf.float32)
    prediction = output
    expected = (num_windows, *roi_size)
    if prediction.shape.rank != 5 or tuple(prediction.shape[:4]) != expected:
        raise ValueError(
            f"predictor must return shape (N, rx, ry, rz, K) = ({', '.join(map(str, expected))}, K) "
            f"for {num_windows} windows of roi_size {tuple(roi_size)}, got {tuple(prediction.shape)}"
        )
    return prediction


def run_predictor(predictor: Callable, windows: tf.Tensor, sw_device: str | None) -> tf.Tensor:
    """Runs `predictor` on `sw_device`; its output (float32, checked) stays where it was computed."""
    with device_scope(sw_device):
        output = predictor(tf.identity(windows) if sw_device else windows)
    return _prediction_tensor(output, int(windows.shape[0]), windows.shape[1:4])


def _window_origins(batch_size: int, starts: np.ndarray) -> np.ndarray:
    """[b, x, y, z] per window in MONAI's order: all windows of image 0, then image 1, ..."""
    image_index = np.repeat(np.arange(batch_size, dtype=np.int32), len(starts))
    return np.concatenate([image_index[:, None], np.tile(starts, (batch_size, 1))], axis=1)


def aggregate_windows(
    volume: tf.Tensor | np.ndarray,
    roi_size: Sequence[int],
    starts: np.ndarray,
    predictor: Callable,
    weights: tf.Tensor,
    sw_batch_size: int,
    device: str | None = None,
    sw_device: str | None = None,
    progress: bool = False,
    buffer_dtype="float32",
) -> tf.Tensor:
    """Σ(weight · prediction) / Σ(weight) over the windows of a volume at least roi-sized.

    Everything except the forward pass happens on `device`: the volume is copied there, windows
    are cut there, and the sum of weighted predictions (B·X·Y·Z·K floats, plus X·Y·Z for the sum
    of weights) lives there. In host memory (`aggregates_on_host`) numpy adds each window in place;
    on an accelerator TensorFlow ops do, queued without waiting for the host. Calling again with
    `device="/CPU:0"` is the way out when the accelerator cannot hold the buffers. The next batch
    of windows goes to the predictor before the previous batch is blended, so an accelerator
    computes while the host blends.

    Args:
        volume: (B, X, Y, Z, C), X, Y, Z >= roi_size.
        roi_size: window size (rx, ry, rz).
        starts: window corners (num_windows, 3) from `window_starts`.
        predictor: maps (N, rx, ry, rz, C) with N <= sw_batch_size to (N, rx, ry, rz, K).
        weights: importance map of shape roi_size, from `importance_map`.
        sw_batch_size: windows per predictor call; one call may hold windows of two images.
        device: where the volume and buffers live; None is TensorFlow's default placement.
        sw_device: where the predictor runs; None is TensorFlow's default placement.
        progress: show progress over the predictor calls (a bar on a terminal, else plain lines).
        buffer_dtype: dtype of the sum buffer and of the result: float32, or float16 (half the memory).

    Returns:
        (B, X, Y, Z, K) in `buffer_dtype` on `device`.

    Example:
        >>> from tfmis.inference.windows import importance_map, window_starts
        >>> starts = window_starts((8, 8, 8), (4, 4, 4), (4, 4, 4))
        >>> out = aggregate_windows(np.ones((1, 8, 8, 8, 1), np.float32), (4, 4, 4), starts,
        ...                         lambda w: w * 3, importance_map((4, 4, 4)), sw_batch_size=2)
        >>> float(tf.reduce_min(out)), float(tf.reduce_max(out))
        (3.0, 3.0)
    """
    return aggregate(
        volume,
        roi_size,
        starts,
        predictor,
        weights,
        sw_batch_size,
        device,
        sw_device,
        progress,
        on_host=aggregates_on_host(device),
        buffer_dtype=buffer_dtype,
    )


def aggregate(
    volume,
    roi_size,
    starts,
    predictor,
    weights,
    sw_batch_size,
    device,
    sw_device,
    progress,
    on_host: bool,
    crop: tuple[slice, ...] | None = None,
    buffer_dtype="float32",
    as_numpy: bool = False,
):
    """`aggregate_windows` with the blend chosen by `on_host` (numpy) or not (TensorFlow on `device`), and the
    result cropped to the spatial `crop` (the padding of a volume smaller than the window). With `as_numpy` the
    result is a writable numpy array: the host buffer itself (no copy), or the device result copied to the host."""
    roi_size = tuple(int(s) for s in roi_size)
    starts = np.asarray(starts, np.int32).reshape(-1, SPATIAL_DIMS)
    blend = (
        HostBlend(volume, roi_size, starts, weights, buffer_dtype)
        if on_host
        else DeviceBlend(volume, roi_size, starts, weights, device, buffer_dtype)
    )
    origins = _window_origins(int(volume.shape[0]), starts)
    bar = progress_bar(-(-len(origins) // sw_batch_size), "sliding window", "batch") if progress else None
    pending = None
    try:
        for first in range(0, len(origins), sw_batch_size):
            batch = origins[first : first + sw_batch_size]
            prediction = run_predictor(predictor, blend.windows(batch), sw_device)
            if pending is None:
                blend.allocate(prediction)
            else:  # the previous batch, while this one may still be computing
                blend.add(*pending)
            pending = prediction, batch
            if bar is not None:
                bar.update(1)
        blend.add(*pending)
    finally:
        if bar is not None:
            bar.close()
    return blend.result(device, crop, as_numpy)
