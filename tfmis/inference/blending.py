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
from tfmis.inference.buffers import BUFFER_DTYPES, check_buffer_dtype, weight_sum
from tfmis.inference.host_blend import HostBlend
from tfmis.inference.windows import SPATIAL_DIMS
from tfmis.utils.progress import progress_bar

__all__ = [
    "BUFFER_DTYPES",
    "DeviceBlend",
    "HostBlend",
    "aggregate",
    "aggregate_windows",
    "aggregates_on_host",
    "check_buffer_dtype",
    "device_scope",
    "run_predictor",
    "weight_sum",
]


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

    def windows(self, origins: np.ndarray, as_numpy: bool = False) -> tf.Tensor | np.ndarray:
        """The windows at `origins` ([b, x, y, z] each) stacked on the device, or with `as_numpy` copied to the host."""
        rx, ry, rz = self.roi_size
        with device_scope(self.device):
            batch = tf.stack([self.volume[b, x : x + rx, y : y + ry, z : z + rz] for b, x, y, z in origins])
        return batch.numpy() if as_numpy else batch

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


def _single_output(output: Any) -> Any:
    """The one output of a predictor: Keras models may return a one-element list or dict; several are ambiguous."""
    if isinstance(output, Mapping) or isinstance(output, (list, tuple)):
        outputs = list(output.values()) if isinstance(output, Mapping) else list(output)
        if len(outputs) != 1:
            raise ValueError(
                f"predictor returned {len(outputs)} outputs; sliding_window_inference "
                "blends one, e.g. pass `lambda w: model(w)[0]`"
            )
        output = outputs[0]
    return output


def prediction_output(
    output: Any, num_windows: int, roi_size: Sequence[int], as_tensor: bool
) -> tf.Tensor | np.ndarray:
    """The predictor's output (N, rx, ry, rz, K), its shape checked: with `as_tensor` (the TensorFlow blend) a float32
    tensor; else a tensor stays a tensor (read by numpy when it is blended, so an accelerator can still be computing
    it) and anything else becomes a numpy array, without a copy when it is one already.

    Raises:
        ValueError: several outputs, or not (N, rx, ry, rz, K).
    """
    output = _single_output(output)
    if as_tensor:
        if not (isinstance(output, tf.Tensor) and output.dtype == tf.float32):
            output = tf.cast(tf.convert_to_tensor(output), tf.float32)
    elif not isinstance(output, (tf.Tensor, np.ndarray)):
        output = np.asarray(output)
    shape = tuple(output.shape)
    expected = (num_windows, *roi_size)
    if len(shape) != 5 or shape[:4] != expected:
        raise ValueError(
            f"predictor must return shape (N, rx, ry, rz, K) = ({', '.join(map(str, expected))}, K) "
            f"for {num_windows} windows of roi_size {tuple(roi_size)}, got {shape}"
        )
    return output


def run_predictor(
    predictor: Callable, windows: tf.Tensor | np.ndarray, sw_device: str | None, as_tensor: bool = True
) -> tf.Tensor | np.ndarray:
    """Runs `predictor` on `sw_device` (a tensor batch is copied there first); its output, checked by
    `prediction_output`, stays where it was computed."""
    with device_scope(sw_device):
        output = predictor(tf.identity(windows) if sw_device and isinstance(windows, tf.Tensor) else windows)
    return prediction_output(output, int(windows.shape[0]), tuple(int(s) for s in windows.shape[1:4]), as_tensor)


WINDOW_TYPES = ("tensor", "numpy")


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
    windows_as: str = "tensor",
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
        predictor: maps (N, rx, ry, rz, C) with N <= sw_batch_size to (N, rx, ry, rz, K): a tensor, or
            a numpy array (blended before the next call, so the predictor may reuse its output memory).
        weights: importance map of shape roi_size, from `importance_map` (or `importance_array`, whose
            read-only array lets the host blend keep Σ(weight) for the next call of the same geometry).
        sw_batch_size: windows per predictor call; one call may hold windows of two images.
        device: where the volume and buffers live; None is TensorFlow's default placement.
        sw_device: where the predictor runs; None is TensorFlow's default placement.
        progress: show progress over the predictor calls (a bar on a terminal, else plain lines).
        buffer_dtype: dtype of the sum buffer and of the result: float32, or float16 (half the memory).
        windows_as: what the predictor gets: `tensor` (a tf.Tensor) or `numpy` (a new float32 array per
            call, e.g. for an ONNX or OpenVINO engine).

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
        windows_as=windows_as,
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
    windows_as: str = "tensor",
    threads: int | None = None,
):
    """`aggregate_windows` with the blend chosen by `on_host` (numpy) or not (TensorFlow on `device`), and the
    result cropped to the spatial `crop` (the padding of a volume smaller than the window). With `as_numpy` the
    result is a writable numpy array: the host buffer itself (no copy), or the device result copied to the host.
    `windows_as` is what the predictor gets (`tensor` or `numpy`); `threads` those of the host blend (None:
    `blend_threads`).

    A prediction that is a tensor is blended after the next batch went to the predictor (an accelerator may
    still be computing it); any other (numpy) is blended before the predictor is called again, so an engine
    may reuse its output buffer from call to call."""
    if windows_as not in WINDOW_TYPES:
        raise ValueError(f"windows_as must be one of {WINDOW_TYPES}, got {windows_as!r}")
    roi_size = tuple(int(s) for s in roi_size)
    starts = np.asarray(starts, np.int32).reshape(-1, SPATIAL_DIMS)
    blend = (
        HostBlend(volume, roi_size, starts, weights, buffer_dtype, threads)
        if on_host
        else DeviceBlend(volume, roi_size, starts, weights, device, buffer_dtype)
    )
    origins = _window_origins(int(volume.shape[0]), starts)
    numpy_windows = windows_as == "numpy"
    bar = progress_bar(-(-len(origins) // sw_batch_size), "sliding window", "batch") if progress else None
    pending = None
    try:
        for first in range(0, len(origins), sw_batch_size):
            batch = origins[first : first + sw_batch_size]
            prediction = run_predictor(predictor, blend.windows(batch, numpy_windows), sw_device, not on_host)
            if first == 0:
                blend.allocate(prediction)
            if pending is not None:  # the previous batch, while this one may still be computing
                blend.add(*pending)
                pending = None
            if isinstance(prediction, tf.Tensor):
                pending = prediction, batch
            else:  # computed already, and the predictor may reuse its memory on the next call
                blend.add(prediction, batch)
            if bar is not None:
                bar.update(1)
        if pending is not None:
            blend.add(*pending)
    finally:
        if bar is not None:
            bar.close()
    return blend.result(device, crop, as_numpy)
