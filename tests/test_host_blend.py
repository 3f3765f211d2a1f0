"""The host blend's fast paths: numpy predictors (engines), threads, the kept Σ(weight) map; each gives the results of
the plain path (bit for bit, or within float32 rounding where the arithmetic differs)."""

from __future__ import annotations

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmis.hardware import runnable_tasks
from tfmis.inference import buffers, importance_map, sliding_window_inference, window_starts
from tfmis.inference.blending import aggregate
from tfmis.inference.buffers import balanced_slabs, cached_weight_sum, clear_weight_sum_cache, weight_sum
from tfmis.inference.sliding_window import infer_windows
from tfmis.inference.windows import importance_array, scan_intervals

ROI = (12, 8, 8)
BATCH = 2


def random_volume(shape, channels=2, seed=0):
    return np.random.default_rng(seed).normal(size=(BATCH, *shape, channels)).astype(np.float32)


def mean_and_sum(windows):
    """Not pointwise (windows disagree where they overlap), K = C + 1."""
    return tf.concat(
        [
            windows + tf.reduce_mean(windows, axis=(1, 2, 3), keepdims=True),
            tf.reduce_sum(windows, axis=-1, keepdims=True),
        ],
        axis=-1,
    )


def numpy_mean_and_sum(windows):
    """numpy twin of `mean_and_sum`: numpy in, numpy out, as an ONNX or OpenVINO engine."""
    assert isinstance(windows, np.ndarray) and windows.flags.c_contiguous
    return np.concatenate(
        [windows + windows.mean(axis=(1, 2, 3), keepdims=True), windows.sum(axis=-1, keepdims=True)], axis=-1
    )


def infer(volume, predictor, on_host=True, **kwargs):
    arguments = dict(overlap=0.5, mode="gaussian", sigma_scale=0.125, padding_mode="constant", cval=0.0)
    arguments.update({k: kwargs.pop(k) for k in list(kwargs) if k in arguments})
    out = infer_windows(
        volume,
        ROI,
        kwargs.pop("sw_batch_size", 3),
        predictor,
        arguments["overlap"],
        arguments["mode"],
        arguments["sigma_scale"],
        arguments["padding_mode"],
        arguments["cval"],
        None,
        None,
        False,
        on_host=on_host,
        **kwargs,
    )
    return np.asarray(out)


# -- numpy predictors -------------------------------------------------------------------------------


@pytest.mark.parametrize("on_host", [True, False], ids=["numpy_blend", "tensorflow_blend"])
def test_a_keras_model_gives_the_same_blend_as_a_numpy_engine_running_it(on_host):
    """A Keras model given tensors, and the same model behind a numpy-in, numpy-out function (what an exported
    engine is) given numpy windows: the same blend bit for bit, in both blends, gaussian and constant, a volume
    smaller than the window on one axis (padded) and two volumes sharing window batches."""
    inputs = keras.Input((None, None, None, 2))
    model = keras.Model(inputs, keras.layers.Conv3D(3, 3, padding="same")(inputs))
    engine_calls = []

    def engine(windows):
        engine_calls.append(type(windows))
        return np.asarray(model(windows, training=False))

    volume = random_volume((15, 6, 13))
    for mode in ("gaussian", "constant"):
        keras_out = infer(volume, model, on_host, mode=mode)
        engine_out = infer(volume, engine, on_host, mode=mode, windows_as="numpy")
        assert keras_out.shape == engine_out.shape == (*volume.shape[:4], 3)
        np.testing.assert_array_equal(engine_out, keras_out)
    assert set(engine_calls) == {np.ndarray}


@pytest.mark.parametrize("buffer_dtype", ["float32", "float16"])
@pytest.mark.parametrize("on_host", [True, False], ids=["numpy_blend", "tensorflow_blend"])
def test_a_numpy_function_equals_its_tensorflow_twin_within_float32_rounding(on_host, buffer_dtype):
    """numpy windows and numpy results against tensor windows and tensor results of the same (non-pointwise)
    function: equal within float32 rounding (the two frameworks sum the window means in their own order)."""
    volume = random_volume((15, 11, 13))
    for overlap, sw_batch_size in itertools.product([0.25, 0.5], [1, 4]):
        expected = infer(volume, mean_and_sum, on_host, overlap=overlap, sw_batch_size=sw_batch_size,
                         buffer_dtype=buffer_dtype)  # fmt: skip
        out = infer(volume, numpy_mean_and_sum, on_host, overlap=overlap, sw_batch_size=sw_batch_size,
                    windows_as="numpy", buffer_dtype=buffer_dtype)  # fmt: skip
        assert out.dtype == expected.dtype == buffer_dtype
        tolerance = 1e-5 if buffer_dtype == "float32" else 2e-3
        np.testing.assert_allclose(out, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("on_host", [True, False], ids=["numpy_blend", "tensorflow_blend"])
def test_an_engine_that_reuses_its_output_buffer_is_blended_before_its_next_call(on_host):
    """An engine returning the same output array on every call (OpenVINO's infer request does) is blended right
    after each call: the result equals the one of a function returning new arrays."""
    volume = random_volume((15, 11, 13))
    buffer = {}

    def reusing(windows):
        result = numpy_mean_and_sum(windows)
        out = buffer.setdefault(result.shape, np.empty_like(result))
        out[...] = result
        return out

    expected = infer(volume, numpy_mean_and_sum, on_host, windows_as="numpy")
    np.testing.assert_array_equal(infer(volume, reusing, on_host, windows_as="numpy"), expected)


def test_numpy_windows_are_new_arrays_of_the_volume_voxels():
    """The numpy windows a predictor gets hold the voxels of their corners and are new arrays on every call,
    so a predictor may keep them."""
    volume = random_volume((15, 11, 13))
    kept = []

    def keeping(windows):
        kept.append(windows)
        return windows * 2

    out = infer(volume, keeping, windows_as="numpy", overlap=0.5)
    np.testing.assert_allclose(out, 2 * volume, rtol=1e-6)
    starts = window_starts((15, 11, 13), ROI, scan_intervals((15, 11, 13), ROI, 0.5))
    corners = [(b, *start) for b in range(BATCH) for start in starts]
    windows = np.concatenate(kept)
    assert len({w.ctypes.data for w in kept}) == len(kept) and windows.dtype == np.float32
    for window, (b, x, y, z) in zip(windows, corners):
        np.testing.assert_array_equal(window, volume[b, x : x + ROI[0], y : y + ROI[1], z : z + ROI[2]])


def test_bad_windows_as_is_named():
    with pytest.raises(ValueError, match="windows_as"):
        sliding_window_inference(random_volume((9, 9, 9)), ROI, 2, lambda w: w, windows_as="list")


# -- threads ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("buffer_dtype", ["float32", "float16"])
@pytest.mark.parametrize("shape", [(40, 11, 13), (7, 13, 10)], ids=["long_x", "x_below_roi"])
def test_any_number_of_threads_gives_the_same_blend_bit_for_bit(shape, buffer_dtype):
    """Threads own X slabs of the volume and add every window's part in the windows' order: 2, 3 and 5 threads
    give one thread's result exactly, for both modes, padded volumes and the float16 running mean."""
    volume = random_volume(shape, seed=3)
    for mode in ("gaussian", "constant"):
        expected = infer(volume, mean_and_sum, mode=mode, overlap=0.75, threads=1, buffer_dtype=buffer_dtype)
        for threads in (2, 3, 5):
            out = infer(volume, mean_and_sum, mode=mode, overlap=0.75, threads=threads, buffer_dtype=buffer_dtype)
            np.testing.assert_array_equal(out, expected, err_msg=f"mode={mode} threads={threads}")


@pytest.mark.parametrize("buffer_dtype", ["float32", "float16"])
def test_threads_with_windows_off_a_grid_and_uncovered_voxels(buffer_dtype):
    """Corners that are no grid (one repeated, some voxels uncovered): 3 threads give one thread's result."""
    volume = random_volume((20, 14, 12))
    starts = np.array([[0, 0, 0], [5, 3, 2], [5, 3, 2], [8, 6, 4], [0, 6, 4]], np.int32)
    weights = importance_array(ROI, "gaussian", 0.125)
    one, three = (
        aggregate(
            volume,
            ROI,
            starts,
            mean_and_sum,
            weights,
            2,
            None,
            None,
            False,
            on_host=True,
            buffer_dtype=buffer_dtype,
            threads=threads,
        ).numpy()  # fmt: skip
        for threads in (1, 3)
    )
    np.testing.assert_array_equal(three, one)
    covered = weight_sum(volume.shape[1:4], starts, weights) > 0
    assert not covered.all() and np.all(one[:, ~covered] == 0) and np.all(one[:, covered] != 0)


def test_balanced_slabs_cover_the_axis_in_order():
    for size, roi, step, parts in [(99, 64, 32, 2), (40, 12, 3, 3), (12, 12, 12, 4), (7, 12, 1, 2)]:
        starts = window_starts((max(size, roi), 8, 8), (roi, 8, 8), (step, 8, 8))[:, 0]
        slabs = balanced_slabs(max(size, roi), starts, roi, parts)
        assert slabs[0][0] == 0 and slabs[-1][1] == max(size, roi) and len(slabs) <= parts
        assert all(lo < hi for lo, hi in slabs) and all(a[1] == b[0] for a, b in zip(slabs, slabs[1:]))


def test_blend_threads_follow_the_window_size_and_tensorflow_threads(monkeypatch):
    """No more threads than CPUs or TensorFlow's intra-op threads, one for small windows, and no more than the CPUs
    not running anything (runnable tasks from /proc/loadavg, this one included) with one left for the machine."""
    monkeypatch.setattr(buffers, "_usable_cpus", lambda: 6)
    monkeypatch.setattr(tf.config.threading, "get_intra_op_parallelism_threads", lambda: 0)
    assert buffers.blend_threads(8 * 8 * 8, runnable=1) == 1
    assert buffers.blend_threads(64**3, runnable=1) == 5
    assert buffers.blend_threads(64**3, runnable=3) == 3
    assert buffers.blend_threads(64**3, runnable=9) == 1
    monkeypatch.setattr(tf.config.threading, "get_intra_op_parallelism_threads", lambda: 2)
    assert buffers.blend_threads(64**3, runnable=1) == 2
    monkeypatch.setattr(buffers, "_usable_cpus", lambda: 2)
    assert buffers.blend_threads(64**3, runnable=1) == 1  # an idle 2-core machine: TensorFlow's threads and this


def test_runnable_tasks_reads_loadavg(tmp_path):
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("7.12 6.43 5.46 7/152 16289\n")
    assert runnable_tasks(loadavg) == 7
    assert runnable_tasks(tmp_path / "missing") is None


# -- the kept Σ(weight) ------------------------------------------------------------------------------


def test_the_weight_sum_is_kept_for_the_same_geometry_and_recomputed_for_another():
    """Same size, corners and importance map: the same read-only array; another roi, overlap or mode: another map,
    each equal to `weight_sum`; a writable importance map (which could change under the key) is never kept."""
    clear_weight_sum_cache()
    image = (40, 30, 20)

    def geometry(roi, overlap, mode):
        starts = window_starts(image, roi, scan_intervals(image, roi, overlap))
        return starts, importance_array(roi, mode, 0.125)

    starts, weights = geometry(ROI, 0.5, "gaussian")
    first, covered = cached_weight_sum(image, starts, weights)
    again, _ = cached_weight_sum(image, starts.copy(), importance_array(ROI, "gaussian", 0.125))
    assert again is first and covered and not first.flags.writeable
    np.testing.assert_array_equal(first, weight_sum(image, starts, weights))
    for roi, overlap, mode in [((8, 8, 8), 0.5, "gaussian"), (ROI, 0.25, "gaussian"), (ROI, 0.5, "constant")]:
        other_starts, other_weights = geometry(roi, overlap, mode)
        other, _ = cached_weight_sum(image, other_starts, other_weights)
        assert other is not first and not np.array_equal(other, first)
        np.testing.assert_array_equal(other, weight_sum(image, other_starts, other_weights))
        assert cached_weight_sum(image, other_starts, other_weights)[0] is other
    writable = np.array(weights)
    assert cached_weight_sum(image, starts, writable)[0] is not cached_weight_sum(image, starts, writable)[0]
    view = np.asarray(tf.constant(weights))  # read-only, a view of the tensor's memory
    assert (
        not view.flags.writeable
        and cached_weight_sum(image, starts, view)[0] is not cached_weight_sum(image, starts, view)[0]
    )
    assert cached_weight_sum((41, 30, 20), starts, weights)[0].shape == (41, 30, 20)
    clear_weight_sum_cache()


def test_large_weight_sums_are_not_kept(monkeypatch):
    clear_weight_sum_cache()
    monkeypatch.setattr(buffers, "WEIGHT_SUM_CACHE_BYTES", 40 * 30 * 20 * 4 - 1)
    image = (40, 30, 20)
    starts = window_starts(image, ROI, scan_intervals(image, ROI, 0.5))
    weights = importance_array(ROI, "gaussian", 0.125)
    assert cached_weight_sum(image, starts, weights)[0] is not cached_weight_sum(image, starts, weights)[0]


def test_repeated_calls_give_the_same_result_with_the_kept_weight_sum():
    """A second call with the same geometry (the kept Σ(weight)) equals the first, and the first call's result is
    not touched by the second; the importance map handed out stays read-only."""
    volume = random_volume((15, 11, 13))
    clear_weight_sum_cache()
    first = infer(volume, mean_and_sum)
    first_copy = first.copy()
    second = infer(volume, mean_and_sum)
    np.testing.assert_array_equal(second, first_copy)
    np.testing.assert_array_equal(first, first_copy)
    assert not importance_array(ROI, "gaussian", 0.125).flags.writeable
    np.testing.assert_array_equal(importance_map(ROI, "gaussian").numpy(), importance_array(ROI, "gaussian", 0.125))


def traced_peaks(threads: int) -> list:
    """The tracemalloc peaks of two calls in a row (the first computes Σ(weight), the second reuses it) with
    `threads` blend threads, and the bound each must stay under: (peak, sum buffer bytes, bound) per call."""
    import tracemalloc

    volume = random_volume((48, 40, 36))
    sums, weights_bytes = volume[..., :1].size * 3 * 4, np.prod(volume.shape[1:4]) * 4
    batch_bytes = 4 * np.prod(ROI) * 3 * 4
    windows = BATCH * len(window_starts((48, 40, 36), ROI, scan_intervals((48, 40, 36), ROI, 0.75)))
    clear_weight_sum_cache()
    peaks = []
    for _ in range(2):
        tracemalloc.start()
        try:
            out = infer(volume, mean_and_sum, overlap=0.75, sw_batch_size=4, threads=threads)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert out.shape == volume.shape[:4] + (3,)
        peaks.append((int(peak), int(sums), int(sums + weights_bytes + (4 + threads) * batch_bytes + 256 * windows)))
        del out
    clear_weight_sum_cache()
    return peaks


@pytest.mark.slow  # a fresh interpreter (about 14 s); test_sliding_window's memory test bounds the default blend
def test_one_or_three_threads_and_the_kept_weight_sum_hold_the_memory_bound():
    """Traced allocations of a call (the bound of test_sliding_window's memory test): the sum buffer, one Σ(weight),
    a few window batches and a scratch window per thread; a second call with the kept Σ(weight) holds no more.
    Measured in a fresh interpreter: tracemalloc counts every thread's allocations, and a thread another test left
    running in this process would count as the blend's."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    code = "import json, test_host_blend as t; print(json.dumps(t.traced_peaks(1) + t.traced_peaks(3)))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for peak, sums, bound in json.loads(done.stdout.strip().splitlines()[-1]):
        assert sums < peak <= bound, (peak, sums, bound)
