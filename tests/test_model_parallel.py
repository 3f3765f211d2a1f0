"""Model parallelism (tfmis.networks.parallel): a U-Net split over logical CPU devices by space (halo exchange) and
by layers (pipeline) computes what one device computes.

The comparisons run in fresh processes (tests/model_parallel_cases.py: the logical devices must exist before
TensorFlow initialises its devices), from the same initial weights and batch. Tolerances:
- float64: every output and the BatchNorm moving statistics agree to 1e-10 relative (the float32 loss to 1e-6), and
  so does every gradient of the pipeline: the split computes the same arithmetic, only summed in another order.
  The losses are float32 (Keras'), and the spatial split sums them slab by slab (`partial_sums`), so its gradients
  agree to that float32 rounding: 2e-5 of each variable's largest gradient (measured 2e-6).
- float32 (oneDNN's kernels, the default on x86-64 with AVX2, or Eigen's with oneDNN off): outputs within 1e-5 of
  their largest |value|, the loss within 1e-6 relative, every gradient within 5e-3 of the model's largest |gradient|
  for the spatial split and 1e-5 for the pipeline (each layer computed whole on one device).
  Measured for the demo U-Net's spatial split: 2.2e-3 (its decoder0 upsampling kernel: 4.2e-5 against 0.019) with
  oneDNN on an AMD EPYC (Zen 4) and with Eigen's kernels on an Intel Xeon (AVX-512, AMX), 6e-9 with Eigen's on the
  EPYC; one device is within 1e-6 of float64 and the float64 split within 2e-6, so it is float32 rounding that the
  kernels' summation order amplifies, not the split's arithmetic. Bisected on the EPYC: it appears with a single
  slab too (no exchange), and only when the first encoder's instance norm is the slab-wise one (Keras' layer there
  instead removes it; statistics in float64 do not). The pipeline of the same net: 6.8e-7 (Xeon, Eigen).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tfmis.networks.pipeline_stages import balanced_cuts
from tfmis.networks.slab_geometry import slab_bounds
from tfmis.networks.slabs import same_padding

TESTS = Path(__file__).parent

# the default suite's share (one process: float64, float32 with oneDNN and mixed_float16 of the demo U-Net split in
# 2 slabs); the slow marker adds the rest (the deep net, pipelines, 4 devices, recompute, the ablations). Each mode
# x net x device count is compared once: the demo's 2-stage pipeline runs in the Eigen test and as
# demo:pipeline:2:data2:f64, the deep net's 2 slabs as deep:spatial:2:batch:f64 (NORM_CASES), its 2-stage pipeline
# in float64 as deep:pipeline:2:recompute:f64 (and in float32), so they are not repeated here; 4 devices are compared
# on the deep net only (more cuts of the same layers; the demo net's 4-device cases added ~50 s to the slow step's
# longest fixture, 274 s for 10 cases on an Intel Xeon)
FLOAT64_CASES = ["demo:spatial:2:f64"]
FLOAT64_SLOW = [
    "deep:spatial:4:axis2:f64",
    "deep:pipeline:4:f64",
    "demo:spatial:2:recompute:f64",
    "deep:pipeline:2:recompute:f64",
]
FLOAT32_CASES = ["demo:spatial:2"]
MIXED_CASES = ["demo:spatial:2:mixed"]
FLOAT32_SLOW = ["deep:spatial:4", "deep:pipeline:2"]
ABLATIONS = ["demo:spatial:2:nohalo", "demo:spatial:2:nostats"]
NORM_CASES = ["deep:spatial:2:batch:f64", "deep:spatial:2:batch:data2:f64", "demo:pipeline:2:data2:f64"]


def run_cases(cases: list[str], out: Path, onednn: bool = True) -> dict:
    """The cases in one fresh process without Grappler's passes: the same ops on both
    sides of each comparison, 5-9 s less a case on an Intel Xeon, and every figure within the same tolerance (the 8
    slow cases: 133 s against 163 s on an AMD EPYC). The training command, Grappler's passes on as a run has them,
    runs split in test_train_spatial_then_resume_on_one_device_then_pipeline_and_predict_on_one_device."""
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1" if onednn else "0"}
    env["TFMIS_TEST_GRAPH_OPTIMIZER"] = "0"
    env.pop("TFMIS_ONEDNN_DECIDED", None)  # the value set here is the user's, not one tfmis decided
    result = subprocess.run(
        [sys.executable, str(TESTS / "model_parallel_cases.py"), str(out), *cases],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def equality(tmp_path_factory):
    cases = FLOAT64_CASES + FLOAT32_CASES + MIXED_CASES
    return run_cases(cases, tmp_path_factory.mktemp("mp") / "cases.json")


@pytest.fixture(scope="module")
def equality_slow(tmp_path_factory):
    cases = FLOAT64_SLOW + FLOAT32_SLOW + ABLATIONS
    return run_cases(cases, tmp_path_factory.mktemp("mp") / "slow_cases.json")


def float64_gradient_tolerance(case: str) -> float:
    """Spatial: the float32 loss summed slab by slab; pipeline: the same loss on the joined batch."""
    return 2e-5 if ":spatial:" in case else 1e-10


def assert_equal_to_one_device(result: dict, output_tol: float, loss_tol: float, gradient_tol: float, own_scale: bool):
    scale = max(result["output_scale"])
    assert max(result["outputs"]) <= output_tol * scale, result["outputs"]
    one, many = result["loss"]
    assert abs(one - many) <= loss_tol * abs(one), result["loss"]
    if own_scale:  # each gradient against its own largest value
        assert max(result["gradients"]) <= gradient_tol, result["gradients"]
    else:  # against the model's largest gradient value
        assert max(result["gradient_abs"]) <= gradient_tol * result["gradient_scale"], result["gradient_abs"]
    assert max(result["state"] or [0.0]) <= 1e-6


@pytest.mark.parametrize("case", FLOAT64_CASES)
def test_model_parallel_equals_one_device_in_float64(equality, case):
    """The demo U-Net (strides (2, 2, 2, 1), transposed-convolution output with the image's convolution, deep
    supervision) split in 2 slabs: every inference output, the deep-supervision loss and all gradients equal one
    device's (float64 tolerances of the module docstring). The slow test below adds 4 slabs, pipelines of 2 and 4
    stages (2 micro-batches) and a 5-level anisotropic net (strides (2, 2, 1), instance norm) also cut along its odd
    side of 13."""
    result = equality[case]
    assert result["gradient_count"] > 50
    assert_equal_to_one_device(result, 1e-10, 1e-6, float64_gradient_tolerance(case), own_scale=True)


@pytest.mark.parametrize("case", FLOAT32_CASES)
def test_model_parallel_equals_one_device_in_float32_with_onednn(equality, case):
    """The same in float32 with oneDNN's kernels, within the tolerances of the module docstring."""
    assert_equal_to_one_device(equality[case], 1e-5, 1e-6, 5e-3, own_scale=False)


@pytest.mark.slow
def test_model_parallel_equals_one_device_on_the_other_device_counts(equality_slow):
    """The remaining combinations of net x mode x 2 / 4 devices, in float64 (1e-10) and float32 (oneDNN)."""
    for case in FLOAT64_SLOW:
        assert_equal_to_one_device(equality_slow[case], 1e-10, 1e-6, float64_gradient_tolerance(case), own_scale=True)
    for case in FLOAT32_SLOW:
        assert_equal_to_one_device(equality_slow[case], 1e-5, 1e-6, 5e-3, own_scale=False)


def test_spatial_split_under_mixed_float16_stays_within_half_precision_of_one_device(equality):
    """Under mixed_float16 (float16 convolutions, float32 statistics, loss and weights) the spatial split of the
    demo U-Net gives outputs within 1e-2 of their largest |value|, the loss within 1e-3 and gradients within 5e-2
    of the model's largest gradient of one device's, float16's rounding (2^-11) amplified through the network."""
    assert_equal_to_one_device(equality["demo:spatial:2:mixed"], 1e-2, 1e-3, 5e-2, own_scale=False)


@pytest.mark.slow
def test_model_parallel_equals_one_device_in_float32_with_eigen_kernels(tmp_path):
    """With oneDNN off (Eigen's float32 kernels), the spatial split of the demo U-Net equals one device's within 5e-3
    and its pipeline within 1e-5 of the model's largest gradient (the float32 tolerances of the module docstring)."""
    results = run_cases(["demo:spatial:2", "demo:pipeline:2"], tmp_path / "eigen.json", onednn=False)
    assert_equal_to_one_device(results["demo:spatial:2"], 1e-5, 1e-6, 5e-3, own_scale=False)
    assert_equal_to_one_device(results["demo:pipeline:2"], 1e-5, 1e-6, 1e-5, own_scale=False)


@pytest.mark.slow
def test_spatial_split_differs_without_the_halo_exchange_or_the_cross_slab_statistics(equality_slow):
    """Taking the halo exchange out (each slab sees zeros past its own rows) or the cross-slab normalisation
    statistics (each slab normalised by its own) makes outputs and gradients differ from one device's by far more
    than the tolerances: the equality above depends on both."""
    for case in ABLATIONS:
        result = equality_slow[case]
        assert max(result["outputs"]) > 0.05 * max(result["output_scale"]), case
        assert max(result["gradients"]) > 0.1, case


@pytest.mark.slow
def test_batch_norm_and_data_groups_equal_one_device(tmp_path):
    """Spatial BatchNorm reduces over every slab (and every data group: synchronised), so outputs, gradients and
    the moving statistics after one step equal one device's on the whole batch; a 2 x 2 mesh (2 data groups of 2
    devices) equals one device's mean of the two halves' losses, pipeline and spatial."""
    results = run_cases(NORM_CASES, tmp_path / "norm.json")
    for case in NORM_CASES:
        result = results[case]
        if "batch" in case:
            assert result["state_count"] > 10
        assert_equal_to_one_device(result, 1e-10, 1e-6, float64_gradient_tolerance(case), own_scale=True)


def test_slab_bounds_align_to_the_strides_and_reject_a_side_too_short():
    """Slabs are multiples of the strides' product, as equal as can be, and a side with fewer units than devices is
    an error naming the fix."""
    assert slab_bounds(48, 8, 2) == [(0, 24), (24, 48)]
    assert slab_bounds(48, 8, 4) == [(0, 16), (16, 32), (32, 40), (40, 48)]
    assert slab_bounds(13, 1, 4) == [(0, 4), (4, 7), (7, 10), (10, 13)]
    with pytest.raises(ValueError, match="multiple of 16 of at least 64"):
        slab_bounds(48, 16, 4)


def test_same_padding_matches_tensorflows_convolution_output():
    """`same_padding` is TensorFlow's: a valid convolution of the input padded by it has the "same" output, equal
    to TensorFlow's own, for odd and even sizes, kernels 1 and 3, strides 1 and 2."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    for length in (7, 8, 13):
        for kernel, stride in ((3, 1), (3, 2), (1, 1), (2, 2)):
            x = tf.constant(rng.normal(size=(1, length, 1)).astype("float32"))
            k = tf.constant(rng.normal(size=(kernel, 1, 1)).astype("float32"))
            before, after = same_padding(length, kernel, stride)
            padded = tf.pad(x, [[0, 0], [before, after], [0, 0]])
            ours = tf.nn.conv1d(padded, k, stride, "VALID")
            np.testing.assert_allclose(ours.numpy(), tf.nn.conv1d(x, k, stride, "SAME").numpy(), atol=1e-6)


def test_balanced_cuts_minimise_the_largest_stage():
    """Contiguous stages whose largest sum is the smallest possible (checked against every cut of 6 items in 3)."""
    import itertools

    costs = [5.0, 1.0, 1.0, 3.0, 2.0, 6.0]
    stages = balanced_cuts(costs, 3)
    assert stages == sorted(stages) and set(stages) == {0, 1, 2}
    largest = max(sum(c for c, s in zip(costs, stages) if s == k) for k in range(3))
    best = min(
        max(sum(costs[a:b]) for a, b in zip((0, i, j), (i, j, 6))) for i, j in itertools.combinations(range(1, 6), 2)
    )
    assert largest == best == 6.0  # [5, 1] [1, 3, 2] [6]


def _train(config_path: Path, *overrides: str, resume: bool = False) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tfmis.train", "--config", str(config_path)]
    for override in overrides:
        command += ["--set", override]
    result = subprocess.run(command + (["--resume"] if resume else []), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Traceback" not in result.stderr and "E0000" not in result.stderr, result.stderr[-4000:]
    return result


@pytest.mark.slow
def test_train_spatial_then_resume_on_one_device_then_pipeline_and_predict_on_one_device(converted_dataset, tmp_path):
    """The training command on 2 logical devices in spatial mode (with recompute, gradient accumulation, deep
    supervision and validation on 2 devices), resumed from its checkpoint on one device, then resumed again in
    pipeline mode (2 stages, 2 micro-batches); the run's best weights then predict on one device with the Dice
    validation reported. Checkpoints are the model's variables whatever the placement, so the modes interchange."""
    import json

    from conftest import tiny_config

    from tfmis.config import save_config

    config = tiny_config(
        converted_dataset,
        tmp_path / "run",
        "model.filters=[4,8,16]",
        "model.strides=[1,2,2]",
        "model.deep_supervision=1",
        "model.recompute=true",
        "training.accumulation_steps=2",
        "training.epochs=2",
    )
    save_config(config, tmp_path / "config.yaml")
    spatial = _train(tmp_path / "config.yaml", "runtime.model_parallel.mode=spatial")
    assert "Model parallel: spatial partitioning over 2 devices (axis 0" in spatial.stderr
    one = _train(tmp_path / "config.yaml", "training.epochs=3", resume=True)
    assert "Resuming from" in one.stderr and "Model parallel" not in one.stderr
    pipeline = _train(
        tmp_path / "config.yaml", "training.epochs=4", "runtime.model_parallel.mode=pipeline", resume=True
    )
    assert "Resuming from" in pipeline.stderr and "pipeline over 2 devices x 2 micro-batches" in pipeline.stderr
    history = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history] == [1, 2, 3, 4]
    assert all(np.isfinite(h["train_loss"]) for h in history)
    source = converted_dataset.parent / "Task99_Test"

    def predict(output: str, *flags: str) -> str:
        command = [sys.executable, "-m", "tfmis.predict", "--config", str(tmp_path / "config.yaml"), "--checkpoint"]
        command += [str(tmp_path / "run"), "--input", str(source / "imagesTr"), "--output", str(tmp_path / output)]
        result = subprocess.run(
            command + ["--label-dir", str(source / "labelsTr"), *flags], capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    assert "mean Dice over 8 case(s)" in predict("one_device")
    # the same windows cut into 2 slabs on 2 devices: the same labels; then windows twice as long along axis 0
    predict("spatial", "--model-parallel", "spatial:2")
    predict("spatial_large", "--model-parallel", "spatial:2", "--roi-size", "32,16,16")
    import nibabel as nib

    for case in sorted((tmp_path / "one_device").glob("*.nii.gz")):
        one = np.asarray(nib.load(case).dataobj)
        assert np.mean(one == np.asarray(nib.load(tmp_path / "spatial" / case.name).dataobj)) > 0.999
        assert (tmp_path / "spatial_large" / case.name).is_file()


def _gpus(count: int, memory_mb: float):
    from tfmis.hardware import Hardware

    gpu = {"name": "g", "compute_capability": (8, 0), "memory_mb": memory_mb}
    return Hardware(gpus=(gpu,) * count, cpu_count=16, host_memory_mb=256000, host_available_mb=200000)


def test_planner_splits_nnunets_default_target_patch_over_the_fewest_gpus_only_when_one_cannot_hold_it():
    """A CT fingerprint (192x160x128 at 1 mm) on 4 GPUs of 8 GB, whose budget (85% of 7 GB) cannot hold nnU-Net's
    patch at its default 8 GB target (`smallest_sensible_patch`): the plan keeps that patch, cut along the planned
    axis into the fewest slabs (N) whose busiest GPU's estimate - the weights and 1.4x the largest aligned slab's
    activations (gathered inputs and halos; no whole-patch logits, the loss being summed slab by slab) - fits, N/2
    GPUs not fitting; the reason gives both sides in numbers. On one such GPU the patch shrinks and the reason says
    why there is no split; on 4 GPUs of 80 GB one GPU holds the whole median image and nothing is split; on the CPU
    neither."""
    from test_plan import _fingerprint

    from tfmis.networks.slab_geometry import slab_bounds
    from tfmis.planning import make_plan
    from tfmis.planning.planner import ExperimentPlanner
    from tfmis.planning.rules import training_memory_mb
    from tfmis.planning.topology import GPU_MEMORY_TARGET_MB

    fp = _fingerprint([[1.0, 1.0, 1.0]] * 10, [[192, 160, 128]] * 10)
    plan = make_plan(fp, _gpus(4, 8192))
    config = plan.config()
    mp = config.runtime.model_parallel
    patch, strides = list(config.pipeline.patch_size), config.model.strides
    planner = ExperimentPlanner(fp, _gpus(4, 8192))
    sensible = planner.topology.smallest_sensible_patch(planner.determine_data())[0]
    assert mp.mode == "spatial" and patch == sensible
    budget = 0.85 * (8192 - 1024)
    memory = training_memory_mb(patch, strides, config.model.filters, 2, 1, 3, 2, "mixed_float16")
    assert budget < memory["total_mb"] <= GPU_MEMORY_TARGET_MB
    divisor = [int(np.prod([s if isinstance(s, int) else s[a] for s in strides])) for a in range(3)]

    def per_gpu(n):
        if n == 1:
            return memory["total_mb"]
        slab = list(patch)
        slab[mp.axis] = max(b - a for a, b in slab_bounds(patch[mp.axis], divisor[mp.axis], n))
        slab_mb = training_memory_mb(slab, strides, config.model.filters, 2, 1, 3, 2, "mixed_float16")["total_mb"]
        return memory["fixed_mb"] + 1.4 * (slab_mb - memory["fixed_mb"])

    assert per_gpu(mp.devices) <= budget < per_gpu(mp.devices // 2)
    reason = plan.reasons["runtime.model_parallel.mode"]
    assert f"~{memory['total_mb'] / 1024:.1f} GB" in reason and f"needs ~{per_gpu(mp.devices) / 1024:.1f} GB" in reason
    assert config.runtime.distribution == "none" and config.pipeline.num_images_per_batch == 2 * mp.data

    one = make_plan(fp, _gpus(1, 8192))
    assert (
        one.config().runtime.model_parallel.mode == "none" and "one GPU" in one.reasons["runtime.model_parallel.mode"]
    )
    assert np.prod(one.config().pipeline.patch_size) < np.prod(patch)
    large = make_plan(fp, _gpus(4, 81920)).config()
    assert large.runtime.model_parallel.mode == "none" and list(large.pipeline.patch_size) == [192, 192, 128]
    from test_plan import CPU

    cpu = make_plan(fp, CPU)
    assert "no GPU" in cpu.reasons["runtime.model_parallel.mode"]


def test_planner_says_what_a_split_would_give_when_even_all_gpus_cannot_hold_the_sensible_patch():
    """A 512x512x400 CT at 1 mm on 8 GPUs of 4 GB: nnU-Net's 8 GB-target patch fits neither one GPU nor a split
    over all 8 (its sides hold too few aligned slabs, or the busiest GPU's slab is too large): no split, and the
    reason names the larger patch a split would allow, over how many GPUs, and its voxel ratio to the planned one."""
    from test_plan import _fingerprint

    from tfmis.planning import make_plan

    plan = make_plan(_fingerprint([[1.0, 1.0, 1.0]] * 10, [[512, 512, 400]] * 10), _gpus(8, 4096))
    reason = plan.reasons["runtime.model_parallel.mode"]
    assert plan.config().runtime.model_parallel.mode == "none"
    assert "does not fit even when split over this machine's 8 GPUs; split over" in reason
    assert "it could be" in reason and "runtime.model_parallel.devices=" in reason


@pytest.mark.parametrize(
    "name, options",
    [
        ("dice", {}),
        ("dice_ce", {"include_background": False}),
        ("dice_ce", {"batch": True, "squared_pred": True}),
        ("dice_ce", {"activation": "sigmoid", "regions": [[1, 2], [2]]}),
    ],
)
def test_loss_summed_part_by_part_equals_the_loss_of_the_whole_patch(name, options):
    """`from_sums` of the totals of `partial_sums` over three uneven parts along an axis equals the loss of the
    whole patch (float64 logits; the losses compute in float32): Dice's per-class sums, the cross-entropy's mean,
    batch Dice, squared denominators, sigmoid regions, and deep supervision over them (parts aligned to the heads'
    factors); the focal loss does not claim to split."""
    import tensorflow as tf

    from tfmis.losses import DeepSupervisionLoss, build_loss

    rng = np.random.default_rng(3)
    loss = build_loss(name, **options)
    channels = len(options["regions"]) if "regions" in options else 3
    labels = tf.constant(rng.integers(0, 3, size=(2, 12, 6, 5)), tf.int32)
    logits = tf.constant(rng.normal(size=(2, 12, 6, 5, channels)) * 3)
    bounds = [(0, 4), (4, 8), (8, 12)]

    def total(fn, y, out):
        sums = [
            fn.partial_sums(y[:, a:b], tf.nest.map_structure(lambda o, a=a, b=b: o[:, a:b], out)) for a, b in bounds
        ]
        return float(fn.from_sums(tf.nest.map_structure(lambda *xs: tf.add_n(list(xs)), *sums)))

    assert loss.supports_partial_sums
    assert total(loss, labels, logits) == pytest.approx(float(loss(labels, logits)), rel=1e-6)
    supervised = DeepSupervisionLoss(loss, [(2, 2, 1)])
    head = tf.constant(rng.normal(size=(2, 6, 3, 5, channels)) * 3)
    bounds = [(0, 4), (4, 12)]  # multiples of the head's factor 2 along the cut axis
    whole = float(supervised(labels, [logits, head]))

    def total_supervised(y, outputs):
        sums = []
        for a, b in bounds:
            parts = [outputs[0][:, a:b], outputs[1][:, a // 2 : b // 2]]
            sums.append(supervised.partial_sums(y[:, a:b], parts))
        return float(supervised.from_sums(tf.nest.map_structure(lambda *xs: tf.add_n(list(xs)), *sums)))

    assert total_supervised(labels, [logits, head]) == pytest.approx(whole, rel=1e-6)
    assert not build_loss("dice_focal").supports_partial_sums
