"""Sliding-window inference over 3D volumes (channels last), following MONAI's semantics.

The volume is covered by windows of `roi_size` voxels that start every `int(roi · (1 - overlap))`
voxels along each axis; the last window on an axis is shifted back so it ends flush with the volume.
A volume smaller than the window along an axis is padded symmetrically first and the result is
cropped back. Each window's prediction is weighted by an importance map (all ones, or a gaussian
with sigma = sigma_scale · roi), and the result is Σ(weight · prediction) / Σ(weight) per voxel.

Windows are cut from the volume and blended into the output on `device`; only the windows travel
to `sw_device` for the forward pass, so a large volume can stay in host memory (`device="/CPU:0"`)
while the network runs on the accelerator. The blend is kept as a running weighted mean, which is
the same ratio of sums but does not lose precision as overlapping windows pile up.

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
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

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
        raise ValueError(f"{name} must be a single value or one per spatial axis (X, Y, Z), "
                         f"got {len(values)} values: {value!r}")
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


def scan_intervals(image_size: Sequence[int], roi_size: Sequence[int],
                   overlap: float | Sequence[float]) -> tuple[int, ...]:
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


def window_starts(image_size: Sequence[int], roi_size: Sequence[int],
                  scan_interval: Sequence[int]) -> np.ndarray:
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

def importance_map(roi_size: Sequence[int], mode: str = "constant",
                   sigma_scale: float | Sequence[float] = 0.125) -> tf.Tensor:
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
    mode = _check_choice(mode, BLEND_MODES, "mode")
    roi_size = tuple(int(s) for s in roi_size)
    if mode == "constant":
        weights = np.ones(roi_size, np.float64)
    else:
        sigmas = [scale * size for scale, size in zip(_per_axis(sigma_scale, "sigma_scale"), roi_size)]
        if min(sigmas) <= 0:
            raise ValueError(f"sigma_scale must be positive for gaussian mode, got {sigma_scale!r}")
        # separable gaussian: one 1D profile per axis, centred between voxels for even sizes
        profiles = [np.exp(-((np.arange(size) - (size - 1) / 2.0) ** 2) / (2 * sigma ** 2))
                    for size, sigma in zip(roi_size, sigmas)]
        weights = profiles[0][:, None, None] * profiles[1][None, :, None] * profiles[2][None, None, :]
    weights = weights.astype(np.float32)
    return tf.constant(np.maximum(weights, max(float(weights.min()), MIN_IMPORTANCE)))


# ----------------------------------------------------------------------------------------------
# Window extraction and accumulation (TF ops on `device`)
# ----------------------------------------------------------------------------------------------

def _on(device: str | None):
    """A device scope, or no scope for None (TensorFlow's default placement)."""
    return tf.device(device) if device else contextlib.nullcontext()


@tf.function(reduce_retracing=True)
def _gather_windows(volume: tf.Tensor, origins: tf.Tensor, roi_size: tuple[int, int, int]) -> tf.Tensor:
    """Windows (N, rx, ry, rz, C) cut from `volume` at `origins` (N, 4) = [batch, x, y, z].

    Runs on the device of the caller's scope, like any tf.function.
    """
    size = tf.constant([1, *roi_size, -1], tf.int32)

    def cut(origin):
        return tf.slice(volume, tf.concat([origin, [0]], axis=0), size)[0]

    return tf.map_fn(cut, origins, fn_output_signature=tf.TensorSpec([*roi_size, None], volume.dtype))


@tf.function(reduce_retracing=True)
def _blend_windows(mean: tf.Variable, weight_sum: tf.Variable, predictions: tf.Tensor, origins: tf.Tensor,
                   weights: tf.Tensor) -> None:
    """Folds windows into the running weighted mean: mean = Σ(weight · prediction) / Σ(weight).

    For each origin i = [b, x, y, z] and its region R = [b, x:x+rx, y:y+ry, z:z+rz]:
    weight_sum[R] += weights; mean[R] += weights / weight_sum[R] · (predictions[i] - mean[R]).
    The running mean equals the ratio of sums, but its rounding error does not grow with the
    number of overlapping windows, and identical predictions are reproduced bit for bit.
    In-place slice updates touch only the windows, and the loop applies them in order, so windows
    overlapping within one batch are folded in correctly.

    Args:
        mean: (B, X, Y, Z, K) float32 buffer, zeros before the first window.
        weight_sum: (B, X, Y, Z, 1) float32 buffer, zeros before the first window.
        predictions: (N, rx, ry, rz, K) float32.
        origins: (N, 4) int32.
        weights: (rx, ry, rz, 1) float32 importance map.
    """
    roi = tf.shape(predictions)  # dynamic: reduce_retracing generalises the window shape
    rx, ry, rz = roi[1], roi[2], roi[3]
    for i in tf.range(tf.shape(origins)[0]):
        b, x, y, z = origins[i, 0], origins[i, 1], origins[i, 2], origins[i, 3]
        region = (b, slice(x, x + rx), slice(y, y + ry), slice(z, z + rz), slice(None))
        new_weight_sum = weight_sum[region] + weights
        weight_sum[region].assign(new_weight_sum)
        current = mean[region]
        mean[region].assign(current + weights / new_weight_sum * (predictions[i] - current))


def _prediction_tensor(output: Any, num_windows: int, roi_size: Sequence[int]) -> tf.Tensor:
    """The predictor's output as one float32 tensor (N, rx, ry, rz, K), checked.

    Keras models may return a one-element list or dict; several outputs are ambiguous here.
    """
    if isinstance(output, Mapping) or isinstance(output, (list, tuple)):
        outputs = list(output.values()) if isinstance(output, Mapping) else list(output)
        if len(outputs) != 1:
            raise ValueError(f"predictor returned {len(outputs)} outputs; sliding_window_inference "
                             "blends one, e.g. pass `lambda w: model(w)[0]`")
        output = outputs[0]
    prediction = tf.cast(tf.convert_to_tensor(output), tf.float32)
    expected = (num_windows, *roi_size)
    if prediction.shape.rank != 5 or tuple(prediction.shape[:4]) != expected:
        raise ValueError(f"predictor must return shape (N, rx, ry, rz, K) = ({', '.join(map(str, expected))}, K) "
                         f"for {num_windows} windows of roi_size {tuple(roi_size)}, got {tuple(prediction.shape)}")
    return prediction


def _predict(predictor: Callable, windows: tf.Tensor, sw_device: str | None,
             device: str | None) -> tf.Tensor:
    """Runs `predictor` on `sw_device` and brings its output back to `device`."""
    with _on(sw_device):
        output = predictor(tf.identity(windows) if sw_device else windows)
    prediction = _prediction_tensor(output, int(windows.shape[0]), windows.shape[1:4])
    with _on(device):
        return tf.identity(prediction) if device else prediction


def _window_origins(batch_size: int, starts: np.ndarray) -> np.ndarray:
    """[b, x, y, z] per window in MONAI's order: all windows of image 0, then image 1, ..."""
    image_index = np.repeat(np.arange(batch_size, dtype=np.int32), len(starts))
    return np.concatenate([image_index[:, None], np.tile(starts, (batch_size, 1))], axis=1)


def aggregate_windows(volume: tf.Tensor | np.ndarray, roi_size: Sequence[int], starts: np.ndarray,
                      predictor: Callable, weights: tf.Tensor, sw_batch_size: int,
                      device: str | None = None, sw_device: str | None = None,
                      progress: bool = False) -> tf.Tensor:
    """Σ(weight · prediction) / Σ(weight) over the windows of a volume at least roi-sized.

    Everything except the forward pass happens on `device`: the volume is copied there, windows
    are cut there, and the blending buffers (running mean and weight sum, together about
    B·X·Y·Z·(K+1) floats) live there. Calling again with `device="/CPU:0"` is the way out when
    the accelerator cannot hold them.

    Args:
        volume: (B, X, Y, Z, C), X, Y, Z >= roi_size.
        roi_size: window size (rx, ry, rz).
        starts: window corners (num_windows, 3) from `window_starts`.
        predictor: maps (N, rx, ry, rz, C) with N <= sw_batch_size to (N, rx, ry, rz, K).
        weights: importance map of shape roi_size, from `importance_map`.
        sw_batch_size: windows per predictor call; one call may hold windows of two images.
        device: where the volume and buffers live; None is TensorFlow's default placement.
        sw_device: where the predictor runs; None is TensorFlow's default placement.
        progress: show a tqdm bar over the predictor calls.

    Returns:
        float32 (B, X, Y, Z, K) on `device`.

    Example:
        >>> starts = window_starts((8, 8, 8), (4, 4, 4), (4, 4, 4))
        >>> out = aggregate_windows(np.ones((1, 8, 8, 8, 1), np.float32), (4, 4, 4), starts,
        ...                         lambda w: w * 3, importance_map((4, 4, 4)), sw_batch_size=2)
        >>> float(tf.reduce_min(out)), float(tf.reduce_max(out))
        (3.0, 3.0)
    """
    roi_size = tuple(int(s) for s in roi_size)
    with _on(device):
        volume = tf.identity(volume)
        weights = tf.identity(weights)[..., None]
    batch_size, image_size = int(volume.shape[0]), tuple(int(s) for s in volume.shape[1:4])
    origins = _window_origins(batch_size, starts)
    mean = weight_sum = None
    batches = range(0, len(origins), sw_batch_size)
    if progress:
        from tqdm.auto import tqdm
        batches = tqdm(batches, desc="sliding window", unit="batch")
    for first in batches:
        batch_origins = tf.constant(origins[first:first + sw_batch_size])
        with _on(device):
            windows = _gather_windows(volume, batch_origins, roi_size)
        prediction = _predict(predictor, windows, sw_device, device)  # outside `device`'s scope
        with _on(device):
            if mean is None:  # the channel count K is known after the first call
                mean = tf.Variable(tf.zeros([batch_size, *image_size, prediction.shape[-1]]), trainable=False)
                weight_sum = tf.Variable(tf.zeros([batch_size, *image_size, 1]), trainable=False)
            _blend_windows(mean, weight_sum, prediction, batch_origins, weights)
    with _on(device):
        return tf.identity(mean)


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


def _pad_volume(volume: tf.Tensor, padding: Sequence[tuple[int, int]], mode: str, cval: float) -> tf.Tensor:
    """Pads the spatial axes of (B, X, Y, Z, C) with torch's modes (constant/reflect/replicate/circular)."""
    if mode == "constant":
        return tf.pad(volume, [(0, 0), *padding, (0, 0)], constant_values=tf.cast(cval, volume.dtype))
    if mode == "reflect":
        for axis, (before, after) in enumerate(padding, start=1):
            if max(before, after) >= volume.shape[axis]:  # torch and tf.pad both refuse this
                raise ValueError(f"padding_mode 'reflect' cannot pad an axis of size {volume.shape[axis]} "
                                 f"by {max(before, after)}; use 'replicate' or 'constant'")
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
                raise ValueError(f"padding_mode 'circular' cannot pad an axis of size {size} "
                                 f"by {max(before, after)}; use 'replicate' or 'constant'")
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
        progress: show a tqdm progress bar over the predictor calls.

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
        raise RuntimeError("sliding_window_inference loops over window batches in Python; "
                           "call it eagerly, not inside a tf.function")
    if not hasattr(inputs, "shape"):
        inputs = np.asarray(inputs)
    shape = tuple(inputs.shape)
    _check_arguments(shape, sw_batch_size, overlap, mode, padding_mode)
    original_size = shape[1:4]
    roi_size = resolve_roi_size(roi_size, original_size)
    padding = symmetric_padding(original_size, roi_size)
    image_size = tuple(size + before + after for size, (before, after) in zip(original_size, padding))
    starts = window_starts(image_size, roi_size, scan_intervals(image_size, roi_size, overlap))
    weights = importance_map(roi_size, mode, sigma_scale)

    with _on(device):
        volume = tf.identity(inputs)
        if any(before or after for before, after in padding):
            volume = _pad_volume(volume, padding, padding_mode.lower(), cval)
    output = aggregate_windows(volume, roi_size, starts, predictor, weights, int(sw_batch_size),
                               device=device, sw_device=sw_device, progress=progress)
    if volume.shape[1:4] == tuple(original_size):
        return output
    with _on(device):  # crop the padding back off
        return output[:, padding[0][0]:padding[0][0] + original_size[0],
                      padding[1][0]:padding[1][0] + original_size[1],
                      padding[2][0]:padding[2][0] + original_size[2], :]


def number_of_windows(image_size: Sequence[int], roi_size: int | Sequence[int],
                      overlap: float | Sequence[float] = 0.25) -> int:
    """How many windows cover one image (the predictor sees batch × this many in total).

    Example:
        >>> number_of_windows((96, 96, 96), 48, 0.25)
        27
    """
    roi = resolve_roi_size(roi_size, image_size)
    padded = tuple(max(i, r) for i, r in zip(image_size, roi))
    return len(window_starts(padded, roi, scan_intervals(padded, roi, overlap)))
