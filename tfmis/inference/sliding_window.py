"""Sliding-window inference over 3D volumes (channels last), following MONAI's semantics.

The volume is covered by windows of `roi_size` voxels that start every `int(roi · (1 - overlap))`
voxels along each axis; the last window on an axis is shifted back so it ends flush with the volume.
A volume smaller than the window along an axis is padded symmetrically first and the result is
cropped back. Each window's prediction is weighted by an importance map (all ones, or a gaussian
with sigma = sigma_scale · roi), and the result is Σ(weight · prediction) / Σ(weight) per voxel.

Windows are cut from the volume and blended into the output on `device`; only the windows travel
to `sw_device` for the forward pass, so a large volume can stay in host memory (`device="/CPU:0"`)
while the network runs on the accelerator. As in MONAI, Σ(weight · prediction) is summed with one
in-place add per window and divided once by Σ(weight), which depends only on the window grid: in host
memory with numpy (TensorFlow has no fast in-place add into a strided region on a CPU), elsewhere
with TensorFlow ops on `device`. The next batch of windows is sent to the predictor before the
previous one is blended, so an accelerator keeps computing while the host blends.

Example:
```python
model = keras.models.load_model("model.keras")
probabilities = sliding_window_inference(
    image[None],                   # (1, X, Y, Z, C)
    roi_size=(96, 96, 96), sw_batch_size=4, predictor=model,
    overlap=0.5, mode="gaussian", device="/CPU:0", sw_device="/GPU:0")
```
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfmis.utils.progress import progress_bar

BLEND_MODES = ("constant", "gaussian")
PADDING_MODES = ("constant", "reflect", "replicate", "circular")
SPATIAL_DIMS = 3

# MONAI's floor for importance weights, so far window corners still count and Σ(weight) > 0.
MIN_IMPORTANCE = 1e-3

# ----------------------------------------------------------------------------------------------
# Window geometry (pure Python / numpy: MONAI's formulas)
# ----------------------------------------------------------------------------------------------


def _per_axis(value: Any, name: str) -> tuple:
    """`value` repeated for the three spatial axes, or checked to have one entry per axis."""
    if value is None or np.isscalar(value):
        return (value,) * SPATIAL_DIMS
    values = tuple(value)
    if len(values) != SPATIAL_DIMS:
        raise ValueError(
            f"{name} must be a single value or one per spatial axis (X, Y, Z), got {len(values)} values: {value!r}"
        )
    return values


def resolve_roi_size(roi_size: int | Sequence[int | None], image_size: Sequence[int]) -> tuple[int, ...]:
    """The window size, with None or non-positive entries replaced by the image size (as MONAI).

    Args:
        roi_size: one size for all axes or one per axis (X, Y, Z).
        image_size: spatial size of the volume.

    Example:
        >>> resolve_roi_size((32, -1, None), (64, 50, 40))
        (32, 50, 40)
    """
    sizes = _per_axis(roi_size, "roi_size")
    resolved = []
    for size, image in zip(sizes, image_size):
        if size is not None and not float(size).is_integer():
            raise ValueError(f"roi_size entries must be whole numbers of voxels, got {roi_size!r}")
        resolved.append(int(image) if size is None or size <= 0 else int(size))
    return tuple(resolved)


def scan_intervals(
    image_size: Sequence[int], roi_size: Sequence[int], overlap: float | Sequence[float]
) -> tuple[int, ...]:
    """Step between window starts per axis: `int(roi · (1 - overlap))`, at least 1 (as MONAI).

    An axis the window covers exactly gets a step of the whole roi (one window).

    Args:
        image_size: spatial size of the (padded) volume, never smaller than `roi_size`.
        roi_size: window size per axis.
        overlap: fraction of a window shared with its neighbour, one value or one per axis.

    Example:
        >>> scan_intervals((96, 96, 96), (48, 48, 48), 0.25)
        (36, 36, 36)
    """
    overlaps = _per_axis(overlap, "overlap")
    intervals = []
    for image, roi, axis_overlap in zip(image_size, roi_size, overlaps):
        if roi == image:
            intervals.append(int(roi))
        else:
            intervals.append(max(int(roi * (1 - axis_overlap)), 1))
    return tuple(intervals)


def window_starts(image_size: Sequence[int], roi_size: Sequence[int], scan_interval: Sequence[int]) -> np.ndarray:
    """Start corners of all windows, in MONAI's order (last axis fastest).

    Starts step by `scan_interval`; the last one on each axis is moved back to `image - roi` so the
    windows end flush with the volume and never leave it.

    Args:
        image_size: spatial size of the (padded) volume, never smaller than `roi_size`.
        roi_size: window size per axis.
        scan_interval: step per axis, from `scan_intervals`.

    Returns:
        int32 array (num_windows, 3).

    Example:
        >>> window_starts((10, 4, 4), (4, 4, 4), (3, 4, 4))[:, 0].tolist()
        [0, 3, 6]
    """
    axis_starts = []
    for image, roi, step in zip(image_size, roi_size, scan_interval):
        last_start = image - roi
        # the first window that reaches the end closes the axis (MONAI's scan_num)
        count = -(-last_start // step) + 1 if step > 0 else 1
        axis_starts.append([min(i * step, last_start) for i in range(count)])
    return np.asarray(list(itertools.product(*axis_starts)), np.int32).reshape(-1, SPATIAL_DIMS)


def symmetric_padding(image_size: Sequence[int], roi_size: Sequence[int]) -> list[tuple[int, int]]:
    """(before, after) padding per axis that grows an image smaller than the window to its size.

    Example:
        >>> symmetric_padding((10, 3, 20), (8, 8, 8))
        [(0, 0), (2, 3), (0, 0)]
    """
    padding = []
    for image, roi in zip(image_size, roi_size):
        missing = max(roi - image, 0)
        padding.append((missing // 2, missing - missing // 2))
    return padding


# ----------------------------------------------------------------------------------------------
# Importance map
# ----------------------------------------------------------------------------------------------


def importance_map(
    roi_size: Sequence[int], mode: str = "constant", sigma_scale: float | Sequence[float] = 0.125
) -> tf.Tensor:
    """Weight of each voxel of a window when overlapping predictions are blended.

    Args:
        roi_size: window size per axis (X, Y, Z).
        mode: `constant` (all ones) or `gaussian` (1 at the centre, falling to the edges with
            sigma = sigma_scale · roi per axis).
        sigma_scale: one value or one per axis; gaussian mode only.

    Returns:
        float32 tensor of shape `roi_size`, clipped below at max(min, 1e-3) as MONAI does, so no
        voxel gets zero weight.

    Example:
        >>> weights = importance_map((5, 5, 5), "gaussian")
        >>> float(weights[2, 2, 2]), float(weights[0, 0, 0]) < 0.01
        (1.0, True)
    """
    return tf.constant(_importance_array(roi_size, mode, sigma_scale))


def _importance_array(roi_size: Sequence[int], mode: str, sigma_scale: float | Sequence[float]) -> np.ndarray:
    """`importance_map` as a read-only numpy array, computed once per window size, mode and sigma."""
    mode = _check_choice(mode, BLEND_MODES, "mode")
    roi_size = tuple(int(s) for s in roi_size)
    if mode == "constant":
        return _cached_importance(roi_size, mode, ())
    scales = tuple(_per_axis(sigma_scale, "sigma_scale"))
    if any(scale is None or not scale > 0 for scale in scales):
        raise ValueError(f"sigma_scale must be positive for gaussian mode, got {sigma_scale!r}")
    return _cached_importance(roi_size, mode, tuple(float(scale) for scale in scales))


@functools.lru_cache(maxsize=16)
def _cached_importance(roi_size: tuple[int, ...], mode: str, sigma_scale: tuple[float, ...]) -> np.ndarray:
    if mode == "constant":
        weights = np.ones(roi_size, np.float64)
    else:
        sigmas = [scale * size for scale, size in zip(sigma_scale, roi_size)]
        # separable gaussian: one 1D profile per axis, centred between voxels for even sizes
        profiles = [
            np.exp(-((np.arange(size) - (size - 1) / 2.0) ** 2) / (2 * sigma**2))
            for size, sigma in zip(roi_size, sigmas)
        ]
        weights = profiles[0][:, None, None] * profiles[1][None, :, None] * profiles[2][None, None, :]
    weights = weights.astype(np.float32)
    weights = np.maximum(weights, max(float(weights.min()), MIN_IMPORTANCE))
    weights.flags.writeable = False  # shared by every call with these arguments
    return weights


# ----------------------------------------------------------------------------------------------
# Window extraction and accumulation
# ----------------------------------------------------------------------------------------------


def _on(device: str | None):
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
        return not tf.config.list_logical_devices("GPU")
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


class _HostBlend:
    """Σ(weight · prediction) in one numpy array, added in place window by window, and divided once
    by Σ(weight) at the end (what MONAI does with torch tensors).

    Numpy's in-place add of a window into a strided region of the volume touches each voxel of
    the window once; TensorFlow on a CPU has no such op (a strided-slice assignment is ~20x slower
    per voxel), so host memory is blended with numpy. Windows and the result reach TensorFlow
    without a copy (`_host_tensor`).
    """

    def __init__(
        self,
        volume: tf.Tensor | np.ndarray,
        roi_size: tuple[int, int, int],
        starts: np.ndarray,
        weights: tf.Tensor | np.ndarray,
    ):
        self.volume = np.asarray(volume)  # no copy of a tensor in host memory
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
        self.total = _aligned_empty((*self.volume.shape[:4], shape[-1]), np.float32)
        self.total.fill(0)
        self.scratch = np.empty(shape, np.float32)
        self.weights = np.ascontiguousarray(np.broadcast_to(self.weights[..., None], shape))

    def add(self, prediction: tf.Tensor, origins: np.ndarray) -> None:
        rx, ry, rz = self.roi_size
        prediction = np.asarray(prediction)  # waits for this batch only: the next one is already queued
        for window, (b, x, y, z) in zip(prediction, origins):
            if not self.uniform:
                window = np.multiply(window, self.weights, out=self.scratch)
            self.total[b, x : x + rx, y : y + ry, z : z + rz] += window

    def result(self, device: str | None, crop: tuple[slice, ...] | None) -> tf.Tensor:
        total, self.total = self.total, None
        weights = self.weight_sum[None, ..., None]
        if weights.min() > 0:
            np.divide(total, weights, out=total)
        else:  # starts that leave voxels uncovered: those stay 0
            np.divide(total, weights, out=total, where=weights > 0)
        if crop is not None:
            region = total[(slice(None), *crop)]
            total = _aligned_empty(region.shape, np.float32)
            total[...] = region
        output = _host_tensor(total)
        if device:
            with tf.device(device):
                output = tf.identity(output)
        return output


class _DeviceBlend:
    """Σ(weight · prediction) and Σ(weight) in one TensorFlow variable on `device` (K + 1 channels),
    one scatter-add per window, divided once at the end.

    For buffers in accelerator memory: every op is queued on the device and nothing waits for the
    host until the caller reads the result. The variable is flat, (B·X·Y·Z, K + 1), and a window
    adds its rx·ry·rz rows at precomputed offsets from its corner. A slice read-add-assign would
    not do: TensorFlow copies the whole variable on every read once a slice of it was assigned.
    One scatter per window keeps the indices of each scatter distinct, so the sums are deterministic.
    """

    def __init__(
        self,
        volume: tf.Tensor | np.ndarray,
        roi_size: tuple[int, int, int],
        weights: tf.Tensor | np.ndarray,
        device: str | None,
    ):
        self.device, self.roi_size = device, roi_size
        with _on(device):
            self.volume = tf.identity(volume)
            self.weights = tf.cast(tf.identity(weights), tf.float32)[..., None]
        batch, sx, sy, sz = (int(s) for s in self.volume.shape[:4])
        self.strides = (sx * sy * sz, sy * sz, sz, 1)
        self.index_dtype = tf.int32 if batch * sx * sy * sz < 2**31 else tf.int64
        rx, ry, rz = roi_size
        rows = (np.arange(rx)[:, None, None] * sy + np.arange(ry)[None, :, None]) * sz + np.arange(rz)
        with _on(device):
            self.rows = tf.constant(rows.reshape(-1), self.index_dtype)
        self.total = None

    def windows(self, origins: np.ndarray) -> tf.Tensor:
        rx, ry, rz = self.roi_size
        with _on(self.device):
            return tf.stack([self.volume[b, x : x + rx, y : y + ry, z : z + rz] for b, x, y, z in origins])

    def allocate(self, prediction: tf.Tensor) -> None:
        """The sum buffer, once the first prediction tells the channel count K (before the next forward pass)."""
        with _on(self.device):
            self.total = tf.Variable(
                tf.zeros([self.strides[0] * int(self.volume.shape[0]), prediction.shape[-1] + 1]), trainable=False
            )

    def add(self, prediction: tf.Tensor, origins: np.ndarray) -> None:
        rx, ry, rz = self.roi_size
        with _on(self.device):
            prediction = tf.identity(prediction) if self.device else prediction
            channels = int(prediction.shape[-1]) + 1
            weights = tf.broadcast_to(self.weights, [len(origins), rx, ry, rz, 1])
            values = tf.reshape(tf.concat([prediction * weights, weights], axis=-1), [len(origins), -1, channels])
            for value, origin in zip(tf.unstack(values), origins):
                corner = sum(int(o) * s for o, s in zip(origin, self.strides))
                tf.raw_ops.ResourceScatterAdd(resource=self.total.handle, indices=self.rows + corner, updates=value)

    def result(self, device: str | None, crop: tuple[slice, ...] | None) -> tf.Tensor:
        with _on(self.device):
            total = tf.reshape(self.total.read_value(), [*self.volume.shape[:4], -1])
            self.total = None  # frees the variable before the division allocates the output
            if crop is not None:
                total = total[(slice(None), *crop)]
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


def _predict(predictor: Callable, windows: tf.Tensor, sw_device: str | None) -> tf.Tensor:
    """Runs `predictor` on `sw_device`; its output (float32, checked) stays where it was computed."""
    with _on(sw_device):
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

    Returns:
        float32 (B, X, Y, Z, K) on `device`.

    Example:
        >>> starts = window_starts((8, 8, 8), (4, 4, 4), (4, 4, 4))
        >>> out = aggregate_windows(np.ones((1, 8, 8, 8, 1), np.float32), (4, 4, 4), starts,
        ...                         lambda w: w * 3, importance_map((4, 4, 4)), sw_batch_size=2)
        >>> float(tf.reduce_min(out)), float(tf.reduce_max(out))
        (3.0, 3.0)
    """
    return _aggregate(
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
    )


def _aggregate(
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
) -> tf.Tensor:
    """`aggregate_windows` with the blend chosen by `on_host` (numpy) or not (TensorFlow on `device`), and the
    result cropped to the spatial `crop` (the padding of a volume smaller than the window)."""
    roi_size = tuple(int(s) for s in roi_size)
    starts = np.asarray(starts, np.int32).reshape(-1, SPATIAL_DIMS)
    blend = (
        _HostBlend(volume, roi_size, starts, weights) if on_host else _DeviceBlend(volume, roi_size, weights, device)
    )
    origins = _window_origins(int(volume.shape[0]), starts)
    bar = progress_bar(-(-len(origins) // sw_batch_size), "sliding window", "batch") if progress else None
    pending = None
    try:
        for first in range(0, len(origins), sw_batch_size):
            batch = origins[first : first + sw_batch_size]
            prediction = _predict(predictor, blend.windows(batch), sw_device)
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
    return blend.result(device, crop)


# ----------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------


def _check_choice(value: str, choices: Sequence[str], name: str) -> str:
    lowered = str(value).lower()
    if lowered not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return lowered


def _check_arguments(shape: Sequence[int], sw_batch_size: int, overlap, mode: str, padding_mode: str) -> None:
    if len(shape) != 2 + SPATIAL_DIMS:
        raise ValueError(f"inputs must be (B, X, Y, Z, C) (channels last), got shape {tuple(shape)}")
    if isinstance(sw_batch_size, bool) or not isinstance(sw_batch_size, (int, np.integer)) or sw_batch_size < 1:
        raise ValueError(f"sw_batch_size must be an integer >= 1, got {sw_batch_size!r}")
    for axis_overlap in _per_axis(overlap, "overlap"):
        if axis_overlap is None or not 0 <= axis_overlap < 1:
            raise ValueError(f"overlap must be in [0, 1), got {overlap!r}")
    _check_choice(mode, BLEND_MODES, "mode")
    _check_choice(padding_mode, PADDING_MODES, "padding_mode")


_NUMPY_PADDING = {"constant": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}


def _pad_volume(
    volume: tf.Tensor | np.ndarray, padding: Sequence[tuple[int, int]], mode: str, cval: float
) -> tf.Tensor | np.ndarray:
    """Pads the spatial axes of (B, X, Y, Z, C) with torch's modes (constant/reflect/replicate/circular).

    A numpy array is padded with numpy (for the host blend), a tensor with TensorFlow ops.
    """
    if isinstance(volume, np.ndarray):
        for axis, (before, after) in enumerate(padding, start=1):
            if mode == "reflect" and max(before, after) >= volume.shape[axis]:
                raise ValueError(
                    f"padding_mode 'reflect' cannot pad an axis of size {volume.shape[axis]} "
                    f"by {max(before, after)}; use 'replicate' or 'constant'"
                )
            if mode == "circular" and max(before, after) > volume.shape[axis]:
                raise ValueError(
                    f"padding_mode 'circular' cannot pad an axis of size {volume.shape[axis]} "
                    f"by {max(before, after)}; use 'replicate' or 'constant'"
                )
        return np.pad(
            volume,
            [(0, 0), *padding, (0, 0)],
            mode=_NUMPY_PADDING[mode],
            **({"constant_values": cval} if mode == "constant" else {}),
        )
    if mode == "constant":
        return tf.pad(volume, [(0, 0), *padding, (0, 0)], constant_values=tf.cast(cval, volume.dtype))
    if mode == "reflect":
        for axis, (before, after) in enumerate(padding, start=1):
            if max(before, after) >= volume.shape[axis]:  # torch and tf.pad both refuse this
                raise ValueError(
                    f"padding_mode 'reflect' cannot pad an axis of size {volume.shape[axis]} "
                    f"by {max(before, after)}; use 'replicate' or 'constant'"
                )
        return tf.pad(volume, [(0, 0), *padding, (0, 0)], mode="REFLECT")
    for axis, (before, after) in enumerate(padding, start=1):
        if before == after == 0:
            continue
        size = volume.shape[axis]
        if mode == "replicate":
            head = tf.repeat(tf.gather(volume, [0], axis=axis), before, axis=axis)
            tail = tf.repeat(tf.gather(volume, [size - 1], axis=axis), after, axis=axis)
        else:  # circular: wrap around, as torch, which needs the padding <= size
            if max(before, after) > size:
                raise ValueError(
                    f"padding_mode 'circular' cannot pad an axis of size {size} "
                    f"by {max(before, after)}; use 'replicate' or 'constant'"
                )
            head = tf.gather(volume, tf.range(size - before, size), axis=axis)
            tail = tf.gather(volume, tf.range(after), axis=axis)
        volume = tf.concat([head, volume, tail], axis=axis)
    return volume


def sliding_window_inference(
    inputs: tf.Tensor | np.ndarray,
    roi_size: int | Sequence[int],
    sw_batch_size: int,
    predictor: Callable[[tf.Tensor], Any],
    overlap: float | Sequence[float] = 0.25,
    mode: str = "constant",
    sigma_scale: float | Sequence[float] = 0.125,
    padding_mode: str = "constant",
    cval: float = 0.0,
    sw_device: str | None = None,
    device: str | None = None,
    progress: bool = False,
) -> tf.Tensor:
    """Predicts a whole volume window by window and blends the overlapping predictions.

    The channels-last TensorFlow counterpart of `monai.inferers.sliding_window_inference`.

    Args:
        inputs: (B, X, Y, Z, C) tensor or array, channels last.
        roi_size: window size (rx, ry, rz), or one int for all axes; None or non-positive entries
            use the volume's size on that axis.
        sw_batch_size: windows per predictor call (>= 1).
        predictor: callable (a Keras model, a tf.function, ...) mapping (N, rx, ry, rz, C) with
            N <= sw_batch_size to (N, rx, ry, rz, K); a one-element list or dict also works.
            It is called eagerly once per batch; wrapping a model as
            `tf.function(lambda w: model(w, training=False))` saves Keras' per-call overhead.
        overlap: fraction of a window shared with its neighbour, in [0, 1); one value or one per axis.
        mode: `constant` (plain mean of overlapping predictions) or `gaussian` (window centres
            weigh more).
        sigma_scale: gaussian sigma as a fraction of roi_size (one value or one per axis).
        padding_mode: how a volume smaller than the window is padded: `constant`, `reflect`,
            `replicate` or `circular` (torch's names, as MONAI).
        cval: fill value for `constant` padding.
        sw_device: TF device for the forward pass, e.g. "/GPU:0"; None is default placement.
        device: TF device holding the volume and the aggregation buffers, e.g. "/CPU:0" to keep a
            big volume off the accelerator (the training config's `validation_data_device`);
            None is default placement (unlike MONAI, which uses the inputs' device: TF tensors
            and numpy arrays usually sit in host memory even when the GPU is meant to do the work).
        progress: show progress over the predictor calls (`tfmis.utils.progress.progress_bar`: a
            bar on a terminal, plain lines in a log).

    Returns:
        float32 tensor (B, X, Y, Z, K) on `device`.

    Raises:
        ValueError: a bad argument (the message names it) or a predictor output of the wrong shape.
        RuntimeError: when called inside a tf.function (the window loop is eager Python).

    Example:
        >>> volume = np.random.rand(1, 20, 17, 9, 1).astype("float32")
        >>> out = sliding_window_inference(volume, (8, 8, 8), 4, lambda w: 2 * w + 1, overlap=0.5)
        >>> bool(np.allclose(out, 2 * volume + 1))
        True
    """
    if not tf.executing_eagerly():
        raise RuntimeError(
            "sliding_window_inference loops over window batches in Python; call it eagerly, not inside a tf.function"
        )
    return _infer(
        inputs,
        roi_size,
        sw_batch_size,
        predictor,
        overlap,
        mode,
        sigma_scale,
        padding_mode,
        cval,
        sw_device,
        device,
        progress,
        on_host=aggregates_on_host(device),
    )


def _infer(
    inputs,
    roi_size,
    sw_batch_size,
    predictor,
    overlap,
    mode,
    sigma_scale,
    padding_mode,
    cval,
    sw_device,
    device,
    progress,
    on_host: bool,
) -> tf.Tensor:
    """`sliding_window_inference` with the blend chosen by `on_host` (numpy) or not (TensorFlow on `device`)."""
    if not hasattr(inputs, "shape"):
        inputs = np.asarray(inputs)
    shape = tuple(inputs.shape)
    _check_arguments(shape, sw_batch_size, overlap, mode, padding_mode)
    original_size = shape[1:4]
    roi_size = resolve_roi_size(roi_size, original_size)
    padding = symmetric_padding(original_size, roi_size)
    image_size = tuple(size + before + after for size, (before, after) in zip(original_size, padding))
    starts = window_starts(image_size, roi_size, scan_intervals(image_size, roi_size, overlap))
    weights = _importance_array(roi_size, mode, sigma_scale)

    volume = np.asarray(inputs) if on_host else inputs  # copied to `device` by the TensorFlow blend
    crop = None
    if any(before or after for before, after in padding):
        with _on(device):
            volume = _pad_volume(
                volume if on_host else tf.convert_to_tensor(volume), padding, padding_mode.lower(), cval
            )
        crop = tuple(slice(before, before + size) for (before, _), size in zip(padding, original_size))
    return _aggregate(
        volume,
        roi_size,
        starts,
        predictor,
        weights,
        int(sw_batch_size),
        device,
        sw_device,
        progress,
        on_host=on_host,
        crop=crop,
    )


def number_of_windows(
    image_size: Sequence[int], roi_size: int | Sequence[int], overlap: float | Sequence[float] = 0.25
) -> int:
    """How many windows cover one image (the predictor sees batch × this many in total).

    Example:
        >>> number_of_windows((96, 96, 96), 48, 0.25)
        27
    """
    roi = resolve_roi_size(roi_size, image_size)
    padded = tuple(max(i, r) for i, r in zip(image_size, roi))
    return len(window_starts(padded, roi, scan_intervals(padded, roi, overlap)))
