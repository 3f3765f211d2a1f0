"""Sliding-window inference: exact for pointwise predictors, MONAI's window grid, blending, devices."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmis.data.demos.anatomy import smooth_random_field
from tfmis.inference import importance_map, number_of_windows, sliding_window_inference, window_starts
from tfmis.inference.blending import aggregate, aggregates_on_host
from tfmis.inference.buffers import weight_sum
from tfmis.inference.sliding_window import infer_windows, pad_volume

ROI = (12, 8, 8)  # anisotropic, so swapped axes show; at overlap 0.75 the steps are (3, 2, 2)
# divisible by the roi, odd and non-divisible, even and non-divisible, smaller than the roi on
# one axis, smaller on all axes
SHAPES = [(24, 16, 8), (15, 11, 13), (14, 10, 12), (7, 13, 10), (5, 4, 3)]
OVERLAPS = [0.0, 0.25, 0.5, 0.75]
MODES = ["constant", "gaussian"]
SW_BATCH_SIZES = [1, 3, 8]
BATCH = 2


# -- independent reference: MONAI's formulas (monai/inferers/utils.py, monai/data/utils.py) --------


def monai_scan_interval(image, roi, overlap):
    return roi if roi == image else max(int(roi * (1 - overlap)), 1)


def monai_axis_starts(image, roi, overlap):
    """MONAI's dense_patch_slices on one axis of an image already padded to >= roi."""
    interval = monai_scan_interval(image, roi, overlap)
    num = int(math.ceil(float(image) / interval))
    scan_dim = next((d for d in range(num) if d * interval + roi >= image), None)
    count = scan_dim + 1 if scan_dim is not None else 1
    starts = []
    for idx in range(count):
        start = idx * interval
        starts.append(start - max(start + roi - image, 0))
    return starts


def monai_starts(shape, roi, overlap):
    padded = [max(s, r) for s, r in zip(shape, roi)]
    return list(itertools.product(*(monai_axis_starts(s, r, overlap) for s, r in zip(padded, roi))))


def monai_gaussian(roi, sigma_scale=0.125):
    profiles = []
    for size in roi:
        x = np.arange(-(size - 1) / 2.0, (size - 1) / 2.0 + 1)
        profiles.append(np.exp(x**2 / (-2 * (sigma_scale * size) ** 2)))
    weights = np.einsum("i,j,k->ijk", *profiles)
    return np.maximum(weights, max(weights.min(), 1e-3))


def reference_blend(volume, roi, overlap, weights, predictor):
    """Σ(weight · prediction) / Σ(weight) with numpy loops, for a volume at least roi-sized."""
    total, weight_sum = None, np.zeros(volume.shape[1:4] + (1,))
    for start in monai_starts(volume.shape[1:4], roi, overlap):
        region = tuple(slice(s, s + r) for s, r in zip(start, roi))
        prediction = np.asarray(predictor(volume[(slice(None), *region)]), np.float64)
        if total is None:
            total = np.zeros(volume.shape[:4] + prediction.shape[-1:])
        total[(slice(None), *region)] += weights[None, ..., None] * prediction
        weight_sum[region] += weights[..., None]
    return total / weight_sum


def double_plus_one(windows):
    return 2 * windows + 1


def with_negated_channels(windows):
    return tf.concat([windows, -windows], axis=-1)


def plus_window_mean(windows):
    """Not pointwise: every voxel sees its window's mean, so overlapping windows disagree."""
    return windows + tf.reduce_mean(windows, axis=(1, 2, 3), keepdims=True)


def random_volume(shape, channels=2, seed=0):
    return np.random.default_rng(seed).normal(size=(BATCH, *shape, channels)).astype(np.float32)


# -- window grid ---------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", OVERLAPS + [0.9])
def test_window_starts_match_monai(overlap):
    for shape in SHAPES + ([(96, 96, 96), (97, 50, 9)] if overlap < 0.9 else []):
        padded = tuple(max(s, r) for s, r in zip(shape, ROI))
        intervals = [monai_scan_interval(s, r, overlap) for s, r in zip(padded, ROI)]
        ours = [tuple(start) for start in window_starts(padded, ROI, intervals)]
        assert ours == monai_starts(shape, ROI, overlap), (shape, overlap)
        assert number_of_windows(shape, ROI, overlap) == len(ours)


def test_windows_are_flush_with_the_end_and_cover_the_volume():
    starts = window_starts((20, 10, 9), (8, 8, 6), (6, 6, 4))
    assert sorted(set(starts[:, 0])) == [0, 6, 12]  # 12 = 20 - 8: flush with the end
    assert sorted(set(starts[:, 1])) == [0, 2]
    assert sorted(set(starts[:, 2])) == [0, 3]


# -- pointwise predictors are reproduced exactly --------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("overlap", OVERLAPS)
def test_pointwise_predictor_is_reproduced(shape, mode, overlap):
    volume = random_volume(shape)
    for sw_batch_size, predictor in itertools.product(SW_BATCH_SIZES, [double_plus_one, with_negated_channels]):
        out = sliding_window_inference(volume, ROI, sw_batch_size, predictor, overlap=overlap, mode=mode)
        expected = predictor(volume).numpy() if predictor is with_negated_channels else predictor(volume)
        assert out.dtype == tf.float32
        assert out.shape == expected.shape
        np.testing.assert_allclose(
            out.numpy(), expected, rtol=1e-6, atol=0, err_msg=f"sw_batch_size={sw_batch_size} {predictor.__name__}"
        )


@pytest.mark.parametrize("sw_batch_size", SW_BATCH_SIZES)
@pytest.mark.parametrize("shape, overlap", [((15, 11, 13), 0.5), ((24, 16, 8), 0.25), ((5, 4, 3), 0.75)])
def test_predictor_calls_and_window_batches(shape, overlap, sw_batch_size):
    batch_sizes = []

    def counting(windows):
        assert tuple(windows.shape[1:4]) == ROI
        batch_sizes.append(int(windows.shape[0]))
        return windows

    sliding_window_inference(random_volume(shape), ROI, sw_batch_size, counting, overlap=overlap)
    total_windows = BATCH * len(monai_starts(shape, ROI, overlap))
    assert len(batch_sizes) == math.ceil(total_windows / sw_batch_size)
    assert sum(batch_sizes) == total_windows
    assert max(batch_sizes) <= sw_batch_size


def test_integer_roi_size_and_whole_axis_roi():
    volume = random_volume((9, 7, 6))
    out = sliding_window_inference(volume, 4, 3, double_plus_one)
    np.testing.assert_allclose(out.numpy(), 2 * volume + 1, rtol=1e-6)
    calls = []
    sliding_window_inference(volume, (4, -1, None), 50, lambda w: calls.append(w.shape) or w, overlap=0.0)
    assert calls == [(2 * 3, 4, 7, 6, 2)]  # windows 0, 4, 5 on X; whole Y and Z


# -- blending ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, overlap", [((15, 11, 13), 0.5), ((24, 16, 8), 0.25), ((7, 13, 10), 0.75)])
def test_blending_matches_a_numpy_reference(shape, overlap):
    volume = random_volume(shape)
    padded = np.pad(
        volume,
        [(0, 0)]
        + [((r - min(s, r)) // 2, r - min(s, r) - (r - min(s, r)) // 2) for s, r in zip(shape, ROI)]
        + [(0, 0)],
    )
    crop = tuple(slice((r - min(s, r)) // 2, (r - min(s, r)) // 2 + s) for s, r in zip(shape, ROI))

    def numpy_mean(windows):
        return windows + windows.mean(axis=(1, 2, 3), keepdims=True)

    # sw_batch_size 8 puts overlapping windows into one batch: they must still add up in order
    for (mode, weights), sw_batch_size in itertools.product(
        [("constant", np.ones(ROI)), ("gaussian", monai_gaussian(ROI))], [1, 8]
    ):
        expected = reference_blend(padded, ROI, overlap, weights, numpy_mean)[(slice(None), *crop)]
        out = sliding_window_inference(volume, ROI, sw_batch_size, plus_window_mean, overlap=overlap, mode=mode)
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5, err_msg=f"{mode} {sw_batch_size}")


def test_constant_and_gaussian_blending_differ_for_a_non_pointwise_predictor():
    volume = random_volume((15, 11, 13))
    constant = sliding_window_inference(volume, ROI, 4, plus_window_mean, overlap=0.5, mode="constant")
    gaussian = sliding_window_inference(volume, ROI, 4, plus_window_mean, overlap=0.5, mode="gaussian")
    assert np.abs(constant.numpy() - gaussian.numpy()).max() > 1e-3
    # windows that tile the volume without overlap give every voxel one window: the weights cancel
    tiled = random_volume((24, 16, 8))
    constant = sliding_window_inference(tiled, ROI, 4, plus_window_mean, overlap=0.0)
    gaussian = sliding_window_inference(tiled, ROI, 4, plus_window_mean, overlap=0.0, mode="gaussian")
    np.testing.assert_allclose(constant.numpy(), gaussian.numpy(), rtol=1e-6)


@pytest.mark.parametrize("roi", [(9, 9, 9), ROI, (7, 10, 5)])
def test_gaussian_importance_map_is_symmetric_with_max_at_centre(roi):
    weights = importance_map(roi, "gaussian").numpy()
    assert weights.shape == roi and weights.dtype == np.float32
    for axis in range(3):
        np.testing.assert_array_equal(weights, np.flip(weights, axis))
    centre = tuple(slice((r - 1) // 2, r // 2 + 1) for r in roi)  # 1 voxel (odd) or 2 (even) per axis
    assert np.all(weights[centre] == weights.max())
    if all(r % 2 for r in roi):
        assert weights.max() == pytest.approx(1.0)
    np.testing.assert_allclose(weights, monai_gaussian(roi), rtol=1e-6)


def test_importance_map_modes_and_clipping():
    np.testing.assert_array_equal(importance_map((3, 4, 5), "constant").numpy(), np.ones((3, 4, 5)))
    sharp = importance_map((9, 9, 9), "gaussian", sigma_scale=0.02).numpy()
    assert sharp.min() == pytest.approx(1e-3)  # far voxels keep a little weight
    stretched = importance_map((9, 9, 9), "gaussian", sigma_scale=(10.0, 0.125, 0.125)).numpy()
    assert stretched[0, 4, 4] > 0.99  # nearly flat along X


# -- padding -------------------------------------------------------------------------------------


@pytest.mark.parametrize("as_tensor", [True, False], ids=["tensorflow", "numpy"])
@pytest.mark.parametrize(
    "mode, numpy_mode", [("constant", "constant"), ("reflect", "reflect"), ("replicate", "edge"), ("circular", "wrap")]
)
def test_padding_modes_match_numpy(mode, numpy_mode, as_tensor):
    """torch's padding modes on a tensor (TensorFlow ops, for the accelerator blend) and on an array (numpy,
    for the host blend) equal numpy's corresponding mode; torch's limits hold for both."""
    volume = random_volume((5, 4, 3))
    padding = [(1, 2), (0, 3), (2, 2)]
    ours = np.asarray(pad_volume(tf.constant(volume) if as_tensor else volume, padding, mode, 0.0))
    np.testing.assert_array_equal(ours, np.pad(volume, [(0, 0), *padding, (0, 0)], mode=numpy_mode))
    if mode in ("reflect", "circular"):
        with pytest.raises(ValueError, match=f"padding_mode '{mode}' cannot pad an axis of size 3 by 4"):
            pad_volume(tf.constant(volume) if as_tensor else volume, [(0, 0), (0, 0), (4, 4)], mode, 0.0)


def test_padding_mode_and_cval_reach_the_predictor():
    volume = random_volume((5, 4, 3))
    seen = []
    sliding_window_inference(volume, ROI, 2, lambda w: seen.append(w.numpy()) or w, cval=7.0)
    assert seen[0][0, 0, 0, 0, 0] == 7.0  # X is padded by (3, 4)
    outputs = [
        sliding_window_inference(volume, ROI, 2, plus_window_mean, padding_mode=m).numpy()
        for m in ("constant", "replicate")
    ]
    assert np.abs(outputs[0] - outputs[1]).max() > 1e-3


# -- predictor outputs, devices, arguments ---------------------------------------------------------


def test_keras_model_and_wrapped_outputs():
    inputs = keras.Input((None, None, None, 2))
    model = keras.Model(inputs, keras.layers.Conv3D(3, 1, name="pointwise")(inputs))
    volume = random_volume((15, 11, 13))
    expected = model(volume).numpy()
    out = sliding_window_inference(volume, ROI, 4, model, overlap=0.5, mode="gaussian")
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-6)
    for wrap in (lambda w: [model(w)], lambda w: {"segmentation": model(w)}, lambda w: model(w).numpy()):
        out = sliding_window_inference(volume, ROI, 4, wrap, overlap=0.5)
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_float16_predictor_output_is_returned_as_float32():
    volume = random_volume((9, 9, 7))
    out = sliding_window_inference(tf.constant(volume), ROI, 2, lambda w: tf.cast(w, tf.float16))
    assert out.dtype == tf.float32
    np.testing.assert_allclose(out.numpy(), volume.astype(np.float16), rtol=1e-6)


def test_output_lives_on_the_requested_device():
    volume = random_volume((9, 9, 7))
    out = sliding_window_inference(volume, ROI, 2, double_plus_one, device="/CPU:0", sw_device="/CPU:0")
    assert out.device.endswith("CPU:0")
    np.testing.assert_allclose(out.numpy(), 2 * volume + 1, rtol=1e-6)


def test_windows_travel_to_sw_device_and_back_to_device():
    """Two logical CPUs stand in for host and accelerator (they must be set before TF starts). Both
    blends, the numpy one of the public function and the TensorFlow one (`infer_windows(on_host=False)`, what a
    GPU `device` gets), with a volume smaller than the roi on one axis (padded and cropped back)."""
    script = textwrap.dedent("""
        import numpy as np, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        from tfmis.inference import sliding_window_inference
        from tfmis.inference.sliding_window import infer_windows
        volume = np.random.default_rng(0).normal(size=(2, 15, 7, 13, 2)).astype(np.float32)
        for device, sw_device in [("/CPU:1", "/CPU:0"), ("/CPU:0", "/CPU:1")]:
            for blend in ("numpy", "tensorflow"):
                seen = []
                def predictor(windows):
                    seen.append(windows.device)
                    return 2 * windows + 1
                if blend == "numpy":
                    out = sliding_window_inference(volume, (12, 8, 8), 3, predictor, overlap=0.5, mode="gaussian",
                                                   device=device, sw_device=sw_device)
                else:
                    out = infer_windows(volume, (12, 8, 8), 3, predictor, 0.5, "gaussian", 0.125, "replicate", 0.0,
                                 sw_device, device, False, on_host=False)
                assert out.device.endswith(device[1:]), (blend, out.device, device)
                assert seen and all(d.endswith(sw_device[1:]) for d in seen), (blend, seen, sw_device)
                assert np.allclose(out.numpy(), 2 * volume + 1, rtol=1e-6, atol=0), blend
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.ci_may_skip("CI machines have no GPU")
@pytest.mark.skipif(not tf.config.list_physical_devices("GPU"), reason="needs a GPU")
def test_windows_run_on_the_accelerator_while_the_volume_stays_on_the_host():
    volume = random_volume((20, 18, 13))
    devices = []

    def predictor(windows):
        devices.append(windows.device)
        return 2 * windows + 1

    out = sliding_window_inference(
        volume, ROI, 4, predictor, overlap=0.5, mode="gaussian", device="/CPU:0", sw_device="/GPU:0"
    )
    assert out.device.endswith("CPU:0")
    assert devices and all(d.endswith("GPU:0") for d in devices)
    np.testing.assert_allclose(out.numpy(), 2 * volume + 1, rtol=1e-6)


@pytest.mark.ci_may_skip("CI machines have no GPU")
@pytest.mark.skipif(not tf.config.list_physical_devices("GPU"), reason="needs a GPU")
def test_the_tensorflow_blend_keeps_volume_and_sums_on_the_accelerator():
    """`device="/GPU:0"`: the TensorFlow blend (a scatter-add per window into a variable on the GPU) gives
    the reference result, on the GPU."""
    volume = random_volume((20, 18, 13))
    out = sliding_window_inference(
        volume, ROI, 4, mean_and_sum, overlap=0.5, mode="gaussian", device="/GPU:0", sw_device="/GPU:0"
    )
    assert out.device.endswith("GPU:0")
    np.testing.assert_allclose(out.numpy(), reference_inference(volume, 0.5, "gaussian"), rtol=1e-5, atol=1e-5)


def test_progress_is_reported_in_plain_lines_off_a_terminal(capsys):
    """`progress=True` goes through tfmis.utils.progress: captured stderr is no terminal, so a plain
    line counts the predictor calls (here 2 volumes x 2 windows in batches of 2) and no tqdm frames."""
    volume = random_volume((9, 9, 7))
    sliding_window_inference(volume, ROI, 2, double_plus_one, progress=True)
    err = capsys.readouterr().err
    assert "sliding window: 2/2 batch" in err and "\r" not in err


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(roi_size=(8, 8)), "roi_size"),
        (dict(roi_size=(8, 8, 6, 1)), "roi_size"),
        (dict(overlap=1.0), "overlap"),
        (dict(overlap=-0.1), "overlap"),
        (dict(overlap=(0.5, 0.5)), "overlap"),
        (dict(sw_batch_size=0), "sw_batch_size"),
        (dict(sw_batch_size=2.5), "sw_batch_size"),
        (dict(mode="linear"), "mode"),
        (dict(padding_mode="wrap"), "padding_mode"),
        (dict(inputs=np.zeros((2, 3, 9, 9, 1), np.float32), padding_mode="reflect"), "padding_mode"),
        (dict(inputs=np.zeros((2, 3, 9, 9, 1), np.float32), padding_mode="circular"), "padding_mode"),
        (dict(mode="gaussian", sigma_scale=0.0), "sigma_scale"),
        (dict(inputs=np.zeros((9, 9, 7, 2), np.float32)), "inputs"),
        (dict(predictor=lambda w: w[..., 0]), "predictor"),
        (dict(predictor=lambda w: w[:, ::2]), "predictor"),
        (dict(predictor=lambda w: (w, w)), "predictor"),
    ],
)
def test_bad_arguments_are_named(kwargs, argument):
    arguments = dict(inputs=random_volume((9, 9, 7)), roi_size=ROI, sw_batch_size=2, predictor=double_plus_one)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=argument):
        sliding_window_inference(**arguments)


def test_calling_inside_tf_function_is_refused():
    @tf.function
    def traced(volume):
        return sliding_window_inference(volume, ROI, 2, double_plus_one)

    with pytest.raises(RuntimeError, match="eagerly"):
        traced(tf.zeros((1, 9, 9, 7, 1)))


# -- the two blends against an independent reference ------------------------------------------------


def numpy_mean_and_sum(windows):
    """numpy twin of `mean_and_sum`."""
    return np.concatenate(
        [windows + windows.mean(axis=(1, 2, 3), keepdims=True), windows.sum(axis=-1, keepdims=True)], axis=-1
    )


def mean_and_sum(windows):
    """Not pointwise, and K = C + 1 classes: the blend weights matter and the output has its own channels."""
    return tf.concat(
        [
            windows + tf.reduce_mean(windows, axis=(1, 2, 3), keepdims=True),
            tf.reduce_sum(windows, axis=-1, keepdims=True),
        ],
        axis=-1,
    )


def reference_inference(volume, overlap, mode):
    """MONAI's algorithm in numpy (float64): symmetric zero padding up to the roi, MONAI's window grid and
    gaussian, Σ w·p / Σ w over all windows, padding cropped off."""
    shape = volume.shape[1:4]
    pads = [((r - min(s, r)) // 2, r - min(s, r) - (r - min(s, r)) // 2) for s, r in zip(shape, ROI)]
    padded = np.pad(volume, [(0, 0), *pads, (0, 0)])
    weights = np.ones(ROI) if mode == "constant" else monai_gaussian(ROI)
    out = reference_blend(padded, ROI, overlap, weights, numpy_mean_and_sum)
    return out[(slice(None), *(slice(before, before + s) for (before, _), s in zip(pads, shape)))]


@pytest.mark.parametrize("on_host", [True, False], ids=["numpy_blend", "tensorflow_blend"])
@pytest.mark.parametrize("shape", [(15, 11, 13), (7, 13, 10), (5, 4, 3)], ids=["odd", "x_below_roi", "all_below_roi"])
def test_both_blends_match_an_independent_numpy_reference(shape, on_host):
    """Odd sizes and volumes smaller than the roi, overlap 0.25 and 0.5, constant and gaussian, 1 and 3
    windows per predictor call, 2 volumes in one call (windows of both share batches): the numpy blend
    (host memory) and the TensorFlow one (accelerator memory; run here on the CPU) both equal
    `reference_inference` within 1e-5, for a predictor whose windows disagree where they overlap."""
    volume = random_volume(shape, seed=sum(shape))
    for overlap, mode, sw_batch_size in itertools.product([0.25, 0.5], MODES, [1, 3]):
        expected = reference_inference(volume, overlap, mode)
        out = infer_windows(
            volume,
            ROI,
            sw_batch_size,
            mean_and_sum,
            overlap,
            mode,
            0.125,
            "constant",
            0.0,
            None,
            None,
            False,
            on_host=on_host,
        )
        assert out.dtype == tf.float32 and out.shape == expected.shape
        np.testing.assert_allclose(
            out.numpy(),
            expected,
            rtol=1e-5,
            atol=1e-5,
            err_msg=f"overlap={overlap} mode={mode} sw_batch_size={sw_batch_size}",
        )


DEMO_SHAPE = (60, 75, 62)  # a preprocessed demo case (configs/demo.yaml: "about 60 x 75 x 62 voxels")
DEMO_ROI = (48, 48, 48)  # the demo's patch size, its validation roi; at overlap 0.25, 2 x 2 x 2 windows


def logits_in_the_hundreds(shape, classes, seed=0):
    """(1, X, Y, Z, K) smooth random logits around 200 (about 100-310): float16's step there is 0.125 or 0.25."""
    rng = np.random.default_rng(seed)
    return np.stack([200 + smooth_random_field(rng, shape, nodes=4, std=30.0) for _ in range(classes)], axis=-1)[None]


def plus_tenth_of_window_mean(windows):
    """Not pointwise: every class score moves by a tenth of its window mean, so overlapping windows disagree."""
    return windows + 0.1 * tf.reduce_mean(windows, axis=(1, 2, 3), keepdims=True)


def numpy_plus_tenth_of_window_mean(windows):
    """numpy twin of `plus_tenth_of_window_mean`."""
    return windows + 0.1 * windows.mean(axis=(1, 2, 3), keepdims=True)


@pytest.mark.parametrize("mode", MODES)
def test_float16_blends_on_device_and_host_give_the_same_labels_for_logits_in_the_hundreds(mode):
    """float16 buffers, 4 classes of logits around 100-310 on a demo-case-sized volume with the demo's roi and overlap
    (8 windows that disagree where they overlap): the TensorFlow blend (what a GPU `device` gets, run here on the CPU)
    gives the numpy blend's (host memory) argmax at every voxel, and its float16 values bit for bit (both add
    weight · prediction / Σ(weight) window by window, rounding once per add). Both are within 8 windows' float16
    rounding of a float64 Σ w·p / Σ w, and where a label differs from that reference's, the two classes are within
    twice that rounding there (a near-tie). Summing the raw weighted logits in float16 on the device, as before,
    changed 0.1-0.2% of the labels against the host."""
    volume = logits_in_the_hundreds(DEMO_SHAPE, 4)
    weights = np.ones(DEMO_ROI) if mode == "constant" else monai_gaussian(DEMO_ROI)
    expected = reference_blend(volume.astype(np.float64), DEMO_ROI, 0.25, weights, numpy_plus_tenth_of_window_mean)
    host, device = (
        infer_windows(
            volume,
            DEMO_ROI,
            4,
            plus_tenth_of_window_mean,
            0.25,
            mode,
            0.125,
            "constant",
            0.0,
            None,
            None,
            False,
            on_host=on_host,
            buffer_dtype="float16",
        ).numpy()
        for on_host in (True, False)
    )
    assert host.dtype == device.dtype == np.float16 and device.shape == expected.shape
    np.testing.assert_array_equal(device.argmax(-1), host.argmax(-1))
    np.testing.assert_array_equal(device, host)
    windows = len(monai_starts(DEMO_SHAPE, DEMO_ROI, 0.25))
    rounding = windows * np.spacing(np.float16(expected.max())).astype(np.float64) / 2
    assert np.abs(device - expected).max() <= rounding
    labels, best = device.argmax(-1), expected.max(-1)
    differs = labels != expected.argmax(-1)
    assert differs.mean() < 0.01
    assert np.all(np.take_along_axis(expected, labels[..., None], -1)[..., 0][differs] >= best[differs] - 2 * rounding)


def test_the_public_function_blends_in_host_memory_on_a_cpu():
    """On a CPU `device` (or None without a GPU) the numpy blend runs; another device gets TensorFlow's."""
    assert aggregates_on_host("/CPU:0") and aggregates_on_host("/job:localhost/replica:0/task:0/device:CPU:0")
    assert not aggregates_on_host("/GPU:0")
    assert aggregates_on_host(None) == (not tf.config.list_physical_devices("GPU"))


@pytest.mark.parametrize("buffer_dtype, tolerance", [("float32", 1e-5), ("float16", 2e-3)])
@pytest.mark.parametrize("on_host", [True, False], ids=["numpy_blend", "tensorflow_blend"])
def test_windows_off_a_grid_and_voxels_no_window_reaches(on_host, buffer_dtype, tolerance):
    """`aggregate_windows` with corners that are no grid (one repeated, some voxels uncovered): Σ w·p / Σ w
    window by window (within 1e-5 in float32, within float16 rounding in float16, whose Σ w then comes from
    the corners themselves), and 0 where no window reaches, in both blends."""
    volume = random_volume((20, 14, 12))
    starts = np.array([[0, 0, 0], [5, 3, 2], [5, 3, 2], [8, 6, 4], [0, 6, 4]], np.int32)
    weights = monai_gaussian(ROI)
    out = aggregate(
        volume,
        ROI,
        starts,
        mean_and_sum,
        weights.astype(np.float32),
        2,
        None,
        None,
        False,
        on_host=on_host,
        buffer_dtype=buffer_dtype,
    ).numpy()
    assert out.dtype == buffer_dtype
    total = np.zeros(volume.shape[:4] + (3,))
    count = np.zeros(volume.shape[1:4] + (1,))
    for b, (x, y, z) in itertools.product(range(BATCH), starts):
        region = (slice(x, x + ROI[0]), slice(y, y + ROI[1]), slice(z, z + ROI[2]))
        total[(b, *region)] += weights[..., None] * numpy_mean_and_sum(volume[(slice(b, b + 1), *region)])[0]
        if b == 0:  # the weights are the same for every volume
            count[region] += weights[..., None]
    covered = count[..., 0] > 0
    assert not covered.all()
    np.testing.assert_allclose(
        out[:, covered], (total / np.where(count > 0, count, 1))[:, covered], rtol=tolerance, atol=tolerance
    )
    assert np.all(out[:, ~covered] == 0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape, overlap", [((15, 11, 13), 0.5), ((40, 9, 30), 0.75), ((12, 8, 8), 0.0)])
def test_weight_sum_equals_the_sum_over_all_windows(shape, overlap, mode):
    """`weight_sum` (per axis on a grid, product of counts for uniform weights) equals adding the importance
    map at every window corner."""
    intervals = [monai_scan_interval(s, r, overlap) for s, r in zip(shape, ROI)]
    starts = window_starts(shape, ROI, intervals)
    weights = importance_map(ROI, mode).numpy()
    expected = np.zeros(shape)
    for x, y, z in starts:
        expected[x : x + ROI[0], y : y + ROI[1], z : z + ROI[2]] += weights
    ours = weight_sum(shape, starts, weights)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, expected, rtol=1e-6)


@pytest.mark.parametrize("on_host", [True, False], ids=["numpy_blend", "tensorflow_blend"])
def test_window_batches_and_results_are_not_reused_memory(on_host):
    """Windows reach the predictor without a copy, and results leave without one: a predictor that keeps
    every window tensor still holds the right voxels afterwards, and a second call does not change the
    first call's result."""
    volume = random_volume((15, 11, 13))
    kept = []

    def keeping(windows):
        kept.append(windows)
        return double_plus_one(windows)

    first = infer_windows(
        volume, ROI, 3, keeping, 0.5, "gaussian", 0.125, "constant", 0.0, None, None, False, on_host=on_host
    )
    first_copy = first.numpy().copy()
    second = infer_windows(
        volume * 3, ROI, 3, double_plus_one, 0.5, "gaussian", 0.125, "constant", 0.0, None, None, False, on_host=on_host
    )
    np.testing.assert_array_equal(first.numpy(), first_copy)
    np.testing.assert_allclose(second.numpy(), 6 * volume + 1, rtol=1e-6, atol=1e-6)
    corners = [(b, *start) for b in range(BATCH) for start in monai_starts((15, 11, 13), ROI, 0.5)]
    windows = np.concatenate([w.numpy() for w in kept])
    assert len(windows) == len(corners)
    for window, (b, x, y, z) in zip(windows, corners):
        np.testing.assert_array_equal(window, volume[b, x : x + ROI[0], y : y + ROI[1], z : z + ROI[2]])


def test_host_blend_holds_one_sum_buffer_and_one_weight_sum():
    """Memory of the numpy blend (traced Python and numpy allocations): at most the B·X·Y·Z·K float32
    sum, the X·Y·Z weight sum, a few window batches and the window corners (~100 bytes per window) at
    any time; no other buffer of the volume's size (one more K-channel volume would break the bound)."""
    import tracemalloc

    volume = random_volume((48, 40, 36))
    sums, weights_bytes = volume[..., :1].size * 3 * 4, np.prod(volume.shape[1:4]) * 4
    batch_bytes = 4 * np.prod(ROI) * 3 * 4
    windows = BATCH * number_of_windows(volume.shape[1:4], ROI, 0.75)
    assert windows > 1000
    tracemalloc.start()
    try:
        out = sliding_window_inference(volume, ROI, 4, mean_and_sum, overlap=0.75, mode="gaussian", device="/CPU:0")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.shape == volume.shape[:4] + (3,)
    assert sums < peak <= sums + weights_bytes + 4 * batch_bytes + 256 * windows, (peak, sums, weights_bytes)
