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

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfmis.inference.blending import aggregate, aggregates_on_host, device_scope
from tfmis.inference.windows import (
    BLEND_MODES,
    SPATIAL_DIMS,
    check_choice,
    importance_array,
    per_axis,
    resolve_roi_size,
    scan_intervals,
    symmetric_padding,
    window_starts,
)

PADDING_MODES = ("constant", "reflect", "replicate", "circular")


def _check_arguments(shape: Sequence[int], sw_batch_size: int, overlap, mode: str, padding_mode: str) -> None:
    if len(shape) != 2 + SPATIAL_DIMS:
        raise ValueError(f"inputs must be (B, X, Y, Z, C) (channels last), got shape {tuple(shape)}")
    if isinstance(sw_batch_size, bool) or not isinstance(sw_batch_size, (int, np.integer)) or sw_batch_size < 1:
        raise ValueError(f"sw_batch_size must be an integer >= 1, got {sw_batch_size!r}")
    for axis_overlap in per_axis(overlap, "overlap"):
        if axis_overlap is None or not 0 <= axis_overlap < 1:
            raise ValueError(f"overlap must be in [0, 1), got {overlap!r}")
    check_choice(mode, BLEND_MODES, "mode")
    check_choice(padding_mode, PADDING_MODES, "padding_mode")


_NUMPY_PADDING = {"constant": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}


def pad_volume(
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
    buffer_dtype: str = "float32",
    output: str = "tensor",
    windows_as: str = "tensor",
) -> tf.Tensor | np.ndarray:
    """Predicts a whole volume window by window and blends the overlapping predictions.

    The channels-last TensorFlow counterpart of `monai.inferers.sliding_window_inference`.

    Args:
        inputs: (B, X, Y, Z, C) tensor or array, channels last.
        roi_size: window size (rx, ry, rz), or one int for all axes; None or non-positive entries
            use the volume's size on that axis.
        sw_batch_size: windows per predictor call (>= 1).
        predictor: callable (a Keras model, a tf.function, an inference engine, ...) mapping
            (N, rx, ry, rz, C) with N <= sw_batch_size to (N, rx, ry, rz, K); a one-element list or
            dict also works. It gets a tf.Tensor, or with `windows_as="numpy"` a numpy array, and may
            return either (a numpy result is blended before the next call, so an engine may reuse its
            output buffer). It is called eagerly once per batch; wrapping a model as
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
        buffer_dtype: dtype of the whole-volume sum buffer and of the result: `float32` (default,
            as MONAI) or `float16`, half the memory for B·X·Y·Z·K values. With float16, in host
            memory and on a device alike, each window is divided by the (float32) sum of weights over
            its voxels before it is added, so the buffer holds the mean itself (rounding about 1e-3
            relative) and both give the same values.

        output: `tensor`, or `numpy` for a writable numpy array: the host buffer itself when the blend ran in
            host memory (a tensor's `.numpy()` would copy the whole volume's predictions once more), else the
            device's result copied to the host.
        windows_as: what the predictor gets: `tensor` (default) or `numpy`, a new C-contiguous array per call in
            the volume's dtype (for a numpy-in, numpy-out engine such as ONNX Runtime or OpenVINO; in host
            memory neither is a copy of the other).

    Returns:
        (B, X, Y, Z, K) in `buffer_dtype` (float32 by default): a tensor on `device`, or a numpy array.

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
    if output not in ("tensor", "numpy"):
        raise ValueError(f"output must be 'tensor' or 'numpy', got {output!r}")
    if windows_as not in ("tensor", "numpy"):
        raise ValueError(f"windows_as must be 'tensor' or 'numpy', got {windows_as!r}")
    return infer_windows(
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
        buffer_dtype=buffer_dtype,
        as_numpy=output == "numpy",
        windows_as=windows_as,
    )


def infer_windows(
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
    buffer_dtype: str = "float32",
    as_numpy: bool = False,
    windows_as: str = "tensor",
    threads: int | None = None,
):
    """`sliding_window_inference` with the blend chosen by `on_host` (numpy) or not (TensorFlow on `device`), and
    `threads` for the host blend (None: `blend_threads`)."""
    if not hasattr(inputs, "shape"):
        inputs = np.asarray(inputs)
    shape = tuple(inputs.shape)
    _check_arguments(shape, sw_batch_size, overlap, mode, padding_mode)
    original_size = shape[1:4]
    roi_size = resolve_roi_size(roi_size, original_size)
    padding = symmetric_padding(original_size, roi_size)
    image_size = tuple(size + before + after for size, (before, after) in zip(original_size, padding))
    starts = window_starts(image_size, roi_size, scan_intervals(image_size, roi_size, overlap))
    weights = importance_array(roi_size, mode, sigma_scale)

    volume = np.asarray(inputs) if on_host else inputs  # copied to `device` by the TensorFlow blend
    crop = None
    if any(before or after for before, after in padding):
        with device_scope(device):
            volume = pad_volume(
                volume if on_host else tf.convert_to_tensor(volume), padding, padding_mode.lower(), cval
            )
        crop = tuple(slice(before, before + size) for (before, _), size in zip(padding, original_size))
    return aggregate(
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
        buffer_dtype=buffer_dtype,
        as_numpy=as_numpy,
        windows_as=windows_as,
        threads=threads,
    )
