"""The placement policy of whole volumes in sliding-window inference (tfmis.inference.placement), shared by
training's validation and tfmis.predict: modes, the out-of-memory fallback ladder, what it remembers, seeding.

Real out-of-memory errors come from TensorFlow's own allocator in a subprocess started with
`TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=<cap>`: the CPU allocator is then a BFC
allocator with a hard cap, and a tensor over it fails with `ResourceExhaustedError: OOM when
allocating tensor ... by allocator bfc_cpu_allocator_for_gpu`. GPUs are hidden there, so the
"accelerator" is the CPU itself, as on a machine without one: step (1) of the ladder (the volume in
host memory, same sliding-window batch) frees nothing, and halving the batch is what makes it fit.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from conftest import make_msd_dataset, tiny_config

from tfmis.config import load_config, save_config
from tfmis.hardware import CPU
from tfmis.inference.placement import (
    AFTER_OUT_OF_MEMORY,
    KNOWN_NOT_TO_FIT,
    OVER_BUDGET,
    VolumeOutOfMemory,
    VolumePlacement,
    aggregation_bytes,
)
from tfmis.inference.sliding_window import sliding_window_inference
from tfmis.utils.out_of_memory import is_out_of_memory

REPO = Path(__file__).resolve().parents[1]


def capped_environment(cap_mb: int) -> dict:
    """A subprocess environment whose TensorFlow CPU allocator fails over `cap_mb` MiB, with no GPU."""
    return {
        **os.environ,
        "TF_CPU_ALLOCATOR_USE_BFC": "true",
        "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(cap_mb),
        "CUDA_VISIBLE_DEVICES": "",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONPATH": str(REPO),
    }


# ------------------------------------------------------------------ the ladder on real out-of-memory errors

# Measured under BFC (TF 2.21, 2 cores) for the U-Net below (filters 4, 8), 32^3 windows, overlap 0.75 (125
# windows on a 64^3 volume). The host blend keeps the window batches, the sums and the weight
# sum in numpy memory, outside TensorFlow's allocator: only the forward pass counts against the cap. BFC's cap
# is not a clean threshold (a large tensor needs a contiguous chunk of its regions): 64 windows fail with caps
# of 140-200 MiB most of the time (a fresh-clone CI run once fitted them at 170, then failed a second pass of
# the same size) and fit at 215 after one failed attempt; after two failed attempts 32 windows fit with a cap of
# 140 MiB and not 120. So the policy starts at 128 windows per pass (all 125 windows of a big volume at once,
# about twice the memory of 64: never fits under 170 MiB) and the test accepts the batch it settles on (64 or
# less); the direct run it is compared with uses one window per pass, which always fits. Every OOM costs
# TensorFlow's BFC allocator 10 s (it waits for memory to be freed before giving up): the script meets three or
# four of them (~45 s).
LADDER_CAP_MB = 170
LADDER_SCRIPT = r"""
import json
import sys

import numpy as np
import tensorflow as tf

from tfmis.inference.placement import VolumePlacement
from tfmis.inference.sliding_window import sliding_window_inference
from tfmis.networks.unet import UNetConfig

ROI, SW_BATCH = (32, 32, 32), 128
model = UNetConfig(2, 3, filters=(4, 8), strides=(1, 2), num_res_units=0, norm="instance").build()
forward = tf.function(lambda w: model(w, training=False), reduce_retracing=True)
rng = np.random.default_rng(0)
volumes = {name: tf.constant(rng.normal(size=(1, *shape, 2)).astype(np.float32)) for name, shape in
           {"small": (32, 32, 32), "big": (64, 64, 64), "bigger": (64, 64, 66)}.items()}


def logits(name, device, sw_batch_size):
    return sliding_window_inference(volumes[name], ROI, sw_batch_size, forward, overlap=0.75, sw_device="/CPU:0",
                                    device=device).numpy()


def run(policy, name):
    # calls: which (device, sw batch) the policy asked for, in order; a real forward pass and aggregation each
    calls = []

    def infer(device, sw_batch_size):
        calls.append([device, sw_batch_size])
        return logits(name, device, sw_batch_size)

    events = len(policy.events)
    voxels = int(np.prod(volumes[name].shape[1:4]))
    out, placement = policy.run(infer, voxels, case_id=name)
    return {"volume": name, "voxels": voxels, "calls": calls, "placement": str(placement),
            "sw_batch_size": placement.sw_batch_size, "fallback": placement.is_fallback,
            # a direct run, one window per forward pass (it always fits; a window's logits do not depend on the batch,
            # up to float32 rounding: oneDNN picks its convolution kernel by batch size and sums in another order,
            # which once gave a difference above 1e-6 at batch 32 in 1 of 4 CI runs)
            "equals_direct": bool(np.allclose(out, logits(name, "/CPU:0", 1), rtol=1e-5, atol=1e-5)),
            "new_events": [{"case_id": e.case_id, "voxels": e.voxels, "failed": list(e.failed),
                            "succeeded": e.succeeded} for e in policy.events[events:]],
            "cpu_from_voxels": policy.cpu_from_voxels, "reduced_sw_batch": dict(policy.reduced_sw_batch)}


learning = VolumePlacement("auto", SW_BATCH)
report = {"auto": [run(learning, name) for name in ("small", "big", "bigger", "small")],
          "seeded": [run(VolumePlacement("auto", SW_BATCH, cpu_from_voxels=32 ** 3), "small")]}
with open(sys.argv[1], "w") as f:
    json.dump(report, f)
"""


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    """Runs LADDER_SCRIPT once under the memory cap; its report of every policy call (~30 s)."""
    folder = tmp_path_factory.mktemp("ladder")
    script, out = folder / "ladder.py", folder / "report.json"
    script.write_text(LADDER_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=capped_environment(LADDER_CAP_MB),
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def real_oom(text: str) -> bool:
    return "ResourceExhaustedError: OOM when allocating" in text and "bfc_cpu_allocator" in text


@pytest.mark.slow
def test_auto_walks_the_ladder_on_a_real_oom_and_remembers_what_failed(ladder):
    """`auto`, 128 windows per forward pass, real OOM errors from the capped allocator: a small
    volume runs on the accelerator (here the CPU); a big one fails there and with the volume on the
    CPU at the same batch (which frees nothing on a CPU-only machine), and fits with the batch
    halved (once or more); the result equals a direct run. Then a larger volume goes to the CPU with
    the reduced batch straight away (no accelerator attempt; should that batch, at the edge of the cap,
    run out of memory this time, the ladder goes on from it), and the small one is still tried on the
    accelerator first.
    """
    small, big, bigger, small_again = ladder["auto"]
    assert small["placement"] == "cpu:0" and small["calls"] == [["/CPU:0", 128]] and not small["new_events"]

    batch = big["sw_batch_size"]
    assert 1 <= batch <= 64 and big["placement"] == f"cpu, sw batch {batch} ({AFTER_OUT_OF_MEMORY})"
    halvings = [b for b in (64, 32, 16, 8, 4, 2, 1) if b >= batch]
    assert big["calls"] == [["/CPU:0", 128], ["/CPU:0", 128]] + [["/CPU:0", b] for b in halvings]
    assert big["equals_direct"]
    (event,) = big["new_events"]
    assert event["case_id"] == "big" and event["voxels"] == 64**3 and event["succeeded"] == big["placement"]
    assert [f.split(": ")[0] for f in event["failed"]] == ["cpu:0, sw batch 128", "cpu, sw batch 128"] + [
        f"cpu, sw batch {b}" for b in halvings[:-1]
    ]
    assert all(real_oom(f) for f in event["failed"]), event["failed"]
    assert big["cpu_from_voxels"] == 64**3 and big["reduced_sw_batch"] == {str(64**3): batch}

    assert bigger["voxels"] > big["voxels"] and bigger["calls"][0] == ["/CPU:0", batch] and bigger["equals_direct"]
    if bigger["new_events"]:  # the remembered batch ran out of memory this time: halved from there
        assert all(call[1] < batch for call in bigger["calls"][1:])
        assert bigger["placement"] == f"cpu, sw batch {bigger['sw_batch_size']} ({AFTER_OUT_OF_MEMORY})"
    else:
        assert bigger["calls"] == [["/CPU:0", batch]]
        assert bigger["placement"] == f"cpu, sw batch {batch} ({KNOWN_NOT_TO_FIT})"
    assert small_again["placement"] == "cpu:0" and small_again["calls"] == [["/CPU:0", 128]]


@pytest.mark.slow
def test_cpu_from_voxels_seeds_what_goes_to_the_cpu(ladder):
    """A policy seeded with `cpu_from_voxels` at the small volume's size sends it to the CPU
    straight away (it fits there): the description says the size is known not to fit."""
    (small,) = ladder["seeded"]
    assert small["placement"] == f"cpu ({KNOWN_NOT_TO_FIT})" and small["calls"] == [["/CPU:0", 128]]
    assert small["fallback"] and not small["new_events"] and small["equals_direct"]


# ------------------------------------------------------------------ real MemoryErrors, in this process


def impossible_volume(calls: list):
    """`infer` for a volume no machine can hold: it allocates the blending buffers of 2^50 voxels
    with numpy, a real MemoryError ("Unable to allocate 16.0 PiB") at every attempt. It records
    which (device, sw batch) the policy asked for; the devices are only names here."""

    def infer(device, sw_batch_size):
        calls.append((device, sw_batch_size))
        return np.zeros((2**50, 4), np.float32)

    return infer


@pytest.mark.parametrize(
    "mode, attempts",
    [
        ("auto", [("/GPU:0", 4), (CPU, 4), (CPU, 2), (CPU, 1)]),
        ("cpu", [(CPU, 4), (CPU, 2), (CPU, 1)]),
    ],
)
def test_a_volume_that_fits_nowhere_is_a_clear_error(mode, attempts):
    """Every rung of the ladder fails with a real MemoryError: `auto` tries the accelerator, then the
    CPU with 4, 2, 1 windows per forward pass; `cpu` only the CPU. The error names the case and each
    attempt. `auto` remembers the size: the next such volume skips the accelerator."""
    calls = []
    policy = VolumePlacement(mode, 4, accelerator="/GPU:0")
    with pytest.raises(
        VolumeOutOfMemory,
        match=r"case huge \(1,125,899,906,842,624 voxels\) does not fit in memory "
        r"even with its volume on the CPU and one window",
    ) as caught:
        policy.run(impossible_volume(calls), 2**50, case_id="huge")
    assert calls == attempts
    assert str(caught.value).count("MemoryError: Unable to allocate 16.0 PiB") == len(attempts)
    assert isinstance(caught.value.__cause__, MemoryError) and policy.events == []
    if mode == "auto":
        assert policy.cpu_from_voxels == 2**50
        calls.clear()
        with pytest.raises(VolumeOutOfMemory):
            policy.run(impossible_volume(calls), 2**50 + 1, case_id="larger")
        assert calls == attempts[1:]


def test_accelerator_mode_stops_at_the_first_out_of_memory_naming_the_fix():
    """`accelerator`: a real MemoryError there is an error naming the case and the two settings that
    avoid it; nothing else is tried."""
    calls = []
    with pytest.raises(VolumeOutOfMemory) as caught:
        VolumePlacement("accelerator", 4, accelerator="/GPU:0").run(impossible_volume(calls), 2**50, case_id="huge")
    assert calls == [("/GPU:0", 4)]
    message = str(caught.value)
    assert message.startswith(
        "case huge (1,125,899,906,842,624 voxels): out of memory with the volume and its "
        "blending buffers on gpu:0 (validation.validation_data_device: accelerator, sw batch 4)"
    )
    assert "Set validation.validation_data_device: auto" in message
    assert "or cpu (volumes always in host memory)" in message


def test_seeded_auto_never_tries_the_accelerator_for_large_volumes():
    """`cpu_from_voxels` (validation.cpu_from_voxels): a volume at least that large starts on the CPU;
    a smaller one starts on the accelerator (real MemoryErrors, as above)."""
    calls = []
    policy = VolumePlacement("auto", 2, accelerator="/GPU:0", cpu_from_voxels=2**50)
    with pytest.raises(VolumeOutOfMemory):
        policy.run(impossible_volume(calls), 2**50, case_id="seeded")
    assert calls == [(CPU, 2), (CPU, 1)]
    calls.clear()
    with pytest.raises(VolumeOutOfMemory):
        policy.run(impossible_volume(calls), 2**50 - 1, case_id="smaller")
    assert calls == [("/GPU:0", 2), (CPU, 2), (CPU, 1)] and policy.cpu_from_voxels == 2**50 - 1


# ------------------------------------------------------------------ without an out-of-memory error


def test_out_of_memory_errors_are_recognised():
    """Which errors start the ladder: ResourceExhaustedError, a real MemoryError from numpy, and GPU
    allocation failures TensorFlow reports as InternalError/UnknownError (recognised by their
    message; built here, as no GPU is at hand). Other errors are not out-of-memory."""
    try:
        np.empty(2**62, np.uint8)
    except MemoryError as e:
        numpy_error = e
    assert is_out_of_memory(numpy_error)
    assert is_out_of_memory(tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor"))
    for cls, message in [
        (tf.errors.InternalError, "cuDNN launch failure: CUDNN_STATUS_ALLOC_FAILED"),
        (tf.errors.InternalError, "Blas GEMM launch failed: CUBLAS_STATUS_ALLOC_FAILED"),
        (tf.errors.UnknownError, "failed to allocate 2.00G (2147483648 bytes) from device"),
        (tf.errors.InternalError, "Dst tensor is not initialized. OOM when allocating"),
    ]:
        assert is_out_of_memory(cls(None, None, message)), message
    assert not is_out_of_memory(tf.errors.InternalError(None, None, "cuDNN launch failure: bad parameter"))
    assert not is_out_of_memory(tf.errors.InvalidArgumentError(None, None, "out of range"))
    assert not is_out_of_memory(ValueError("shape mismatch"))


def test_other_errors_are_raised_unchanged_without_a_retry():
    """A predictor bug (wrong output shape: a real ValueError of sliding_window_inference) is not an
    out-of-memory error: it propagates at the first attempt, nothing is learned."""
    policy = VolumePlacement("auto", 4)
    calls = []

    def infer(device, sw_batch_size):
        calls.append(device)
        return sliding_window_inference(
            np.ones((1, 8, 8, 8, 1), np.float32), (4, 4, 4), sw_batch_size, lambda w: w[:, :2], device=device
        ).numpy()

    with pytest.raises(ValueError, match="predictor must return shape"):
        policy.run(infer, 512, case_id="c")
    assert len(calls) == 1 and policy.events == [] and policy.cpu_from_voxels is None


def test_memory_budget_is_a_pre_check_that_allocates_nothing():
    """`accelerator_memory_mb` (tfmis.predict --accelerator-memory-mb): a volume whose whole-volume
    tensors are over the budget is not tried on the accelerator at all (no allocation fails; the
    event says it was the pre-check); one within the budget is. In `accelerator` mode it is an error."""
    volume = np.ones((1, 16, 16, 16, 2), np.float32)
    needed = aggregation_bytes(volume.shape[1:4], 2, 3)
    assert needed == 16**3 * (2 + 3 + 1) * 4
    calls = []

    def infer(device, sw_batch_size):
        calls.append(device)
        return sliding_window_inference(
            volume, (8, 8, 8), sw_batch_size, lambda w: tf.concat([w, w[..., :1]], -1), device=device
        ).numpy()

    budget = needed / 2**20 * 0.99
    policy = VolumePlacement("auto", 4, accelerator="/GPU:0", accelerator_memory_mb=budget)
    out, placement = policy.run(infer, 16**3, case_id="over", buffer_bytes=needed)
    assert calls == [CPU] and str(placement) == f"cpu ({OVER_BUDGET})" and out.shape == (1, 16, 16, 16, 3)
    (event,) = policy.events
    assert event.case_id == "over" and event.failed[0].startswith("pre-check: the whole-volume buffers need 0.1 MiB")
    assert policy.cpu_from_voxels is None  # a pre-check is not an out-of-memory error: nothing learned
    within = VolumePlacement("auto", 4, accelerator=CPU, accelerator_memory_mb=needed / 2**20 * 1.01)
    assert str(within.run(infer, 16**3, buffer_bytes=needed)[1]) == "cpu:0" and not within.events
    strict = VolumePlacement("accelerator", 4, accelerator="/GPU:0", accelerator_memory_mb=budget)
    with pytest.raises(VolumeOutOfMemory, match="pre-check.*validation.validation_data_device: auto"):
        strict.run(infer, 16**3, case_id="over", buffer_bytes=needed)
    assert calls == [CPU, CPU]  # the strict policy called nothing


def test_validation_config_defaults_to_auto_and_seeds_the_policy():
    """`validation.validation_data_device` defaults to auto; `validation.cpu_from_voxels` seeds the
    policy; the shipped configs still load (the demo keeps cpu); bad values name the key."""
    config = load_config(None, ["validation.cpu_from_voxels=1000000", "validation.num_sw_batch_size=6"])
    assert config.validation.validation_data_device == "auto"
    policy = VolumePlacement.for_validation(config.validation)
    assert (policy.mode, policy.sw_batch_size, policy.cpu_from_voxels) == ("auto", 6, 1000000)
    assert load_config(None).validation.cpu_from_voxels is None
    assert load_config(REPO / "configs" / "demo.yaml").validation.validation_data_device == "cpu"
    for name in ("brats", "spleen"):
        assert load_config(REPO / "configs" / f"{name}.yaml").validation.validation_data_device == "auto"
    from tfmis.config import ConfigError

    with pytest.raises(ConfigError, match="validation: cpu_from_voxels must be a voxel count >= 1"):
        load_config(None, ["validation.cpu_from_voxels=0"])
    with pytest.raises(ConfigError, match="validation.validation_data_device: 'gpu' is not one of"):
        load_config(None, ["validation.validation_data_device=gpu"])


# ------------------------------------------------------------------ a real training run

# Measured with get_memory_info under BFC (TF 2.21, 2 cores) in this run's process: the training steps (tiny
# U-Net, 16^3 crops, training cache included) peak at about 7 MiB; validating one 64^3 volume with 32^3 windows
# at overlap 0.75 (125 windows) at about 194 MiB with 64 windows per forward pass, 110 with 32, 69 with 16: the
# same sliding window as LADDER_SCRIPT's, whose 170 MiB cap therefore makes 64 windows fail and 32 fit. On this
# CPU-only process, moving the volume to the CPU (step 1 of the ladder) frees nothing; halving the batch does.
TRAINING_CAP_MB = LADDER_CAP_MB
VALIDATION = ["validation.roi_size=[32,32,32]", "validation.overlap=0.75", "validation.num_sw_batch_size=64"]


@pytest.fixture(scope="module")
def large_volume_dataset(tmp_path_factory):
    """A converted dataset of 4 cases of 64^3 voxels after the foreground crop: 2 train, 2 val."""
    from tfmis.data.conversion_options import ConversionConfig
    from tfmis.data.convert import convert

    root = tmp_path_factory.mktemp("large")
    source = make_msd_dataset(root / "Task99_Large", num_cases=4, shape=(68, 68, 68))
    convert(
        ConversionConfig(str(source), str(root / "tfrecords"), split=(0.5, 0.5), shards=1, workers=1, progress=False)
    )
    return root / "tfrecords"


def train_capped(dataset, folder: Path, device: str) -> subprocess.CompletedProcess:
    config = tiny_config(dataset, folder / "run", *VALIDATION, f"validation.validation_data_device={device}")
    save_config(config, folder / "config.yaml")
    return subprocess.run(
        [sys.executable, "-m", "tfmis.train", "--config", str(folder / "config.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=capped_environment(TRAINING_CAP_MB),
    )


@pytest.mark.slow
def test_training_survives_a_real_validation_oom(large_volume_dataset, tmp_path):
    """`python -m tfmis.train` with `validation_data_device: auto` in a process whose memory is
    capped so that the training steps fit but validating a whole volume with 64 windows per
    forward pass does not (see TRAINING_CAP_MB). The first validation case runs out of memory
    for real, falls back (CPU, then a halved batch) and the run goes on: exit 0, every epoch in
    history.jsonl with a finite Dice and `val_fallbacks`. The policy lives as long as the Trainer:
    the second case and the next epoch (and the preview) start from what it learned: the first
    choice (the accelerator's device string, sw batch 64) fails once, and any later fallback (the
    capped allocator's fragmentation can make a later pass need a smaller batch still) starts from
    the placement the previous one ended on and only lowers the batch.
    """
    result = train_capped(large_volume_dataset, tmp_path, "auto")
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]
    for r in records:
        assert math.isfinite(r["val_mean_dice"]) and r["val_fallbacks"] == 2  # both validation cases
    logged = [line for line in result.stderr.splitlines() if line.startswith("validation: case ")]
    assert logged, result.stderr[-4000:]
    assert "(262,144 voxels): cpu:0, sw batch 64: ResourceExhaustedError: OOM when allocating" in logged[0]
    batches = []
    for i, line in enumerate(logged):
        assert "; ran on cpu, sw batch " in line and line.endswith(f"({AFTER_OUT_OF_MEMORY})"), line
        batches.append(int(line.split("; ran on cpu, sw batch ")[1].split()[0]))
        if i:  # learned, not relearned: it starts where the previous fallback ended
            assert "sw batch 64:" not in line and f": cpu, sw batch {batches[i - 1]}: " in line, logged
    assert batches == sorted(batches, reverse=True) and len(set(batches)) == len(batches), logged
    case_ids = json.loads((large_volume_dataset / "index.json").read_text())["splits"]["val"]["cases"]
    assert logged[0].split()[2] in case_ids
    assert (tmp_path / "run" / "validation_preview.png").is_file()


@pytest.mark.slow
def test_training_with_accelerator_placement_stops_at_a_real_oom_naming_the_fix(large_volume_dataset, tmp_path):
    """The same capped run with `validation_data_device: accelerator`: the real OOM at the first
    validation ends the run with a message naming the case and `validation_data_device: auto` or `cpu`."""
    result = train_capped(large_volume_dataset, tmp_path, "accelerator")
    assert result.returncode != 0
    assert "(262,144 voxels): out of memory with the volume and its blending buffers on cpu:0" in result.stderr
    assert "Set validation.validation_data_device: auto" in result.stderr and "or cpu (" in result.stderr
    assert real_oom(result.stderr)
    assert (
        not (tmp_path / "run" / "history.jsonl").is_file()
        or not (tmp_path / "run" / "history.jsonl").read_text().strip()
    )
