"""The GPU-fit trial runner: real subprocesses measuring real (tiny) trainers on this CPU.

Every trial here is a fresh `python -m tfmis.tuning.fit.trial` process with the real Trainer, its
compiled training step and sliding-window inference. Out-of-memory failures are real: TensorFlow's
CPU allocator is made a BFC allocator with a hard cap (TF_CPU_ALLOCATOR_USE_BFC /
TF_CPU_BFC_MEM_LIMIT_IN_MB), so going over it raises a genuine ResourceExhaustedError. (An OOM
costs a trial ~10 s: the BFC allocator waits for memory to be freed before it gives up. Caps far
below the step's need, <= 32 MB here, can crash TensorFlow 2.21 with a segfault instead.)
"""

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from conftest import tiny_config

from tfmis.config import to_dict
from tfmis.data.pipeline import build_train_dataset, synthetic_train_batches
from tfmis.hardware import accelerators, host_memory, usable_cpu_count
from tfmis.inference.windows import number_of_windows
from tfmis.transforms.augment import train_crop_size
from tfmis.tuning.fit.trial import (
    PROGRESS_FILE,
    RESULT_FILE,
    RESULT_KEYS,
    ChildTrial,
    check_budgets,
    run_trial,
    trial_device,
)
from tfmis.utils.out_of_memory import error_line, is_out_of_memory

PATCH_48 = "pipeline.patch_size=[48,48,48]"  # large enough that 8 images take clearly more memory than 1
VOLUME = [40, 40, 40]


def request(config, volume_shape=VOLUME, warmup_steps=1, timed_steps=2) -> dict:
    return {
        "config": to_dict(config),
        "volume_shape": volume_shape,
        "warmup_steps": warmup_steps,
        "timed_steps": timed_steps,
    }


def capped_cpu_allocator(megabytes: int) -> dict:
    """Environment making TensorFlow's CPU allocator a BFC allocator that cannot grow past `megabytes`."""
    return {"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(megabytes)}


@pytest.fixture(scope="module")
def measured(converted_dataset, tmp_path_factory) -> dict:
    """Two real trials, batch 1 and batch 8, of the tiny U-Net on 48³ patches (no budget)."""
    root = tmp_path_factory.mktemp("trials")
    return {
        batch: run_trial(
            request(
                tiny_config(converted_dataset, root / "unused", PATCH_48, f"pipeline.num_images_per_batch={batch}")
            ),
            workdir=root / f"batch{batch}",
        )
        for batch in (1, 8)
    }


def test_trial_measures_speed_and_memory(measured):
    """A trial reports throughput, step times, a timed sliding-window pass and per-phase peak RSS."""
    for batch, result in measured.items():
        assert set(RESULT_KEYS) <= set(result)
        assert result["status"] == "ok", result["reason"]
        assert result["reason"] is None and result["failed_phase"] is None and result["out_of_memory"] is False
        assert result["batch_size"] == batch and result["steps_per_loop"] == 1  # the config's default
        assert len(result["step_seconds_all"]) == 2 and len(result["warmup_seconds_all"]) == 1
        assert result["step_seconds"] == pytest.approx(float(np.median(result["step_seconds_all"])))
        assert result["images_per_second"] == pytest.approx(batch / result["step_seconds"])
        assert result["sw_seconds"] > 0 and result["sw_first_seconds"] > 0
        assert result["sw_windows"] == number_of_windows(VOLUME, (48, 48, 48), 0.25)
        assert result["validation_device"] == "/CPU:0"
        assert 0 < result["setup_peak_mb"] <= result["rss_peak_mb"]
        assert 0 < result["train_peak_mb"] <= result["rss_peak_mb"]
        assert 0 < result["validation_peak_mb"] <= result["rss_peak_mb"]
        assert result["peak_mb"] == result["rss_peak_mb"]  # a CPU trial: the process's peak is what counts
        assert (
            set(result["rss_peak_mb_by_phase"])
            == set(result["rss_start_mb_by_phase"])
            == {"setup", "training", "validation"}
        )
        for phase, start in result["rss_start_mb_by_phase"].items():
            assert 0 < start <= result["rss_peak_mb_by_phase"][phase]
        assert result["device"]["kind"] == "cpu" and result["device"]["total_mb"] > 0
        assert result["tf_version"] == tf.__version__
        assert result["import_seconds"] > 0 and result["build_seconds"] > 0
        assert result["wall_seconds"] > result["import_seconds"] + result["build_seconds"]
        assert result["exit_code"] == 0 and Path(result["log"]).is_file()


def test_training_peak_grows_with_the_batch_size(measured):
    """Batch 8 of 48³ patches needs clearly more memory in training than batch 1 (measured, both runs)."""
    small, large = measured[1], measured[8]
    assert large["train_peak_mb"] - small["train_peak_mb"] > 50, (small["train_peak_mb"], large["train_peak_mb"])
    # setup (TensorFlow, the model, the optimizer) does not depend on the batch
    assert abs(large["setup_peak_mb"] - small["setup_peak_mb"]) < 30


def test_trial_times_whole_loops_of_steps_per_loop_steps(converted_dataset, tmp_path):
    """training.steps_per_loop=3 (6 steps per epoch): the trial times calls of the 3-step loop fit runs, warm-up
    and timed steps rounded up to whole loops (1 -> one loop, 4 -> two loops), and reports per-step seconds
    (a timed loop's seconds / 3); the warm-up loop, which traced the loop, took longer than a timed loop."""
    config = tiny_config(
        converted_dataset, tmp_path / "unused", "training.steps_per_epoch=6", "training.steps_per_loop=3"
    )
    result = run_trial(request(config, warmup_steps=1, timed_steps=4), workdir=tmp_path / "trial")
    assert result["status"] == "ok", result["reason"]
    assert result["steps_per_loop"] == 3
    assert len(result["warmup_seconds_all"]) == 1 and len(result["step_seconds_all"]) == 2
    assert all(np.isfinite(result["step_seconds_all"])) and min(result["step_seconds_all"]) > 0
    assert result["step_seconds"] == pytest.approx(float(np.median(result["step_seconds_all"])))
    assert result["images_per_second"] == pytest.approx(2 / result["step_seconds"])
    assert result["warmup_seconds_all"][0] > 3 * max(result["step_seconds_all"])


@pytest.mark.slow
def test_trial_with_step_augmentation_trains_on_crops_and_seeds(converted_dataset, tmp_path):
    """pipeline.augment.placement=step with rotations (crops larger than the patch): the trial's batches carry
    the un-augmented crops and their seeds, as the training stream's do, and the step augments them."""
    config = tiny_config(
        converted_dataset,
        tmp_path / "unused",
        "pipeline.augment.placement=step",
        "pipeline.augment.rotate_prob=0.2",
        "training.steps_per_loop=2",
    )
    assert train_crop_size(config.pipeline) != list(config.pipeline.patch_size)
    result = run_trial(request(config), workdir=tmp_path / "trial")
    assert result["status"] == "ok", result["reason"]
    assert result["steps_per_loop"] == 2 and result["images_per_second"] > 0


@pytest.mark.parametrize(
    "overrides",
    [
        ["training.accumulation_steps=2"],
        ["pipeline.augment.placement=step", "pipeline.augment.rotate_prob=0.2"],
    ],
    ids=["pipeline", "step"],
)
def test_synthetic_batches_have_the_training_streams_element_spec(converted_dataset, tmp_path, overrides):
    """The trial's stream has exactly the element spec (shapes, dtypes) of build_train_dataset's: patches and
    labels (a batch of num_images_per_batch x accumulation_steps), or with placement=step crops, labels and seeds."""
    config = tiny_config(converted_dataset, tmp_path / "run", *overrides)
    synthetic = synthetic_train_batches(config, in_channels=2, num_classes=3)
    assert synthetic.element_spec == build_train_dataset(config).element_spec
    assert len(synthetic.element_spec) == (3 if config.pipeline.augment.placement == "step" else 2)


def test_fit_runs_the_loop_graph_the_trial_timed(converted_dataset, tmp_path):
    """The trial's own code (`ChildTrial.run`, in this process) with training.steps_per_loop=2, then `fit` on the
    trainer it timed (4 steps per epoch: loops of 2 only): the loop function was traced once, by the trial's
    warm-up, and fit ran that traced graph on the real training stream."""
    config = tiny_config(
        converted_dataset,
        tmp_path / "unused",
        "training.steps_per_epoch=4",
        "training.steps_per_loop=2",
        "training.epochs=1",
    )
    workdir = tmp_path / "trial"
    workdir.mkdir()
    (workdir / "request.json").write_text(json.dumps(request(config, warmup_steps=1, timed_steps=2)))
    child = ChildTrial(workdir / "request.json", workdir / RESULT_FILE, gpus=None, memory_budget_mb=None)
    assert child.run() == 0, json.loads((workdir / RESULT_FILE).read_text())["reason"]
    result = json.loads((workdir / RESULT_FILE).read_text())
    assert result["steps_per_loop"] == 2 and len(result["step_seconds_all"]) == 1
    trainer = child.trainer
    assert trainer.steps.loop_function.experimental_get_tracing_count() == 1
    iterations = int(trainer.optimizer.iterations.numpy())
    assert iterations == 4  # one warm-up loop and one timed loop of 2 steps
    summary = trainer.fit()
    assert summary["epochs"] == 1 and int(trainer.optimizer.iterations.numpy()) == iterations + 4
    assert trainer.steps.loop_function.experimental_get_tracing_count() == 1


@pytest.mark.slow
def test_real_out_of_memory_in_training_fails_the_trial_with_its_phase(converted_dataset, tmp_path):
    """The capped allocator raises a genuine ResourceExhaustedError in the training step."""
    config = tiny_config(converted_dataset, tmp_path / "unused", PATCH_48, "pipeline.num_images_per_batch=8")
    result = run_trial(request(config), workdir=tmp_path / "trial", extra_env=capped_cpu_allocator(64))
    assert result["status"] == "failed" and result["failed_phase"] == "training" and result["out_of_memory"]
    assert result["reason"].startswith("out of memory in training: ResourceExhaustedError: OOM when allocating ")
    assert "bfc_cpu_allocator" in result["reason"] and "\n" not in result["reason"]
    assert result["images_per_second"] is None and result["sw_seconds"] is None
    assert result["import_seconds"] > 0 and result["train_peak_mb"] > 0  # measured before the failure
    assert "ResourceExhaustedError" in Path(result["log"]).read_text()  # the whole traceback for the user


@pytest.mark.slow
def test_real_out_of_memory_in_validation_keeps_the_training_numbers(converted_dataset, tmp_path):
    """Training (16³ crops) fits under the cap; the forward pass of 16 windows of 48³ does not.

    The sliding window blends in numpy on the host, outside TensorFlow's allocator, so what the cap
    catches in validation is the network's activations for one window batch (16·48³·4 float32 = 28 MB
    per tensor of the first level; measured: 8 windows already fail under this cap, 16 leave margin)."""
    config = tiny_config(
        converted_dataset, tmp_path / "unused", "validation.roi_size=[48,48,48]", "validation.num_sw_batch_size=16"
    )
    result = run_trial(
        request(config, volume_shape=[96, 96, 96]), workdir=tmp_path / "trial", extra_env=capped_cpu_allocator(64)
    )
    assert result["status"] == "failed" and result["failed_phase"] == "validation" and result["out_of_memory"], result[
        "reason"
    ]
    assert result["reason"].startswith("out of memory in validation: ResourceExhaustedError: OOM when allocating ")
    assert result["images_per_second"] > 0 and result["train_peak_mb"] > 0 and len(result["step_seconds_all"]) == 2
    assert result["sw_seconds"] is None


def test_rss_over_the_budget_kills_the_trial_and_names_the_budget(measured, converted_dataset, tmp_path):
    """A budget between the measured setup and training peaks: killed while training, reason names both."""
    reference = measured[8]
    budget = (reference["setup_peak_mb"] + reference["train_peak_mb"]) / 2
    config = tiny_config(converted_dataset, tmp_path / "unused", PATCH_48, "pipeline.num_images_per_batch=8")
    result = run_trial(request(config), workdir=tmp_path / "trial", memory_budget_mb=budget)
    assert result["status"] == "failed" and result["failed_phase"] == "training" and result["out_of_memory"]
    assert result["reason"].startswith("peak RSS ")
    assert result["reason"].endswith(f" MB > budget {budget:.0f} MB (stopped during training)")
    assert result["exit_code"] == -signal.SIGKILL
    assert result["rss_peak_mb"] > budget and result["budget_mb"] == budget
    assert result["import_seconds"] > 0 and result["setup_peak_mb"] > 0  # from the child's progress file


def test_finished_trial_over_the_budget_fails_naming_the_phase_of_its_peak(measured):
    """After the child exits, its own peak (VmHWM, exact; the parent samples RSS only every 50 ms)
    is compared with the budget: here a real measured trial against a budget 1 MB under its peak."""
    result = dict(measured[8])
    budget = result["rss_peak_mb"] - 1
    check_budgets(result, budget, budget, on_gpu=False)
    phase = max(result["rss_peak_mb_by_phase"], key=result["rss_peak_mb_by_phase"].get)
    assert result["status"] == "failed" and result["failed_phase"] == phase and result["out_of_memory"]
    assert result["reason"] == f"peak RSS {result['rss_peak_mb']:.0f} MB > budget {budget:.0f} MB (in {phase})"
    within = dict(measured[8])
    check_budgets(within, within["rss_peak_mb"] + 1, within["rss_peak_mb"] + 1, on_gpu=False)
    assert within["status"] == "ok"
    # a GPU trial's numbers (written out: this machine has no GPU): the allocator peaks count
    gpu = {
        "status": "ok",
        "setup_peak_mb": 300.0,
        "train_peak_mb": 7000.0,
        "validation_peak_mb": 9000.0,
        "peak_mb": 9000.0,
        "rss_peak_mb": 2500.0,
        "rss_peak_mb_by_phase": {"setup": 2000.0, "training": 2500.0},
    }
    check_budgets(gpu, 8000.0, None, on_gpu=True)
    assert gpu["reason"] == "peak GPU memory 9000 MB > budget 8000 MB (in validation)"


def test_timeout_fails_the_trial(converted_dataset, tmp_path):
    result = run_trial(
        request(tiny_config(converted_dataset, tmp_path / "unused")), workdir=tmp_path / "trial", timeout_s=1
    )
    assert result["status"] == "failed" and not result["out_of_memory"]
    assert result["reason"] == "timed out after 1 s during setup" and result["failed_phase"] == "setup"
    assert result["wall_seconds"] < 5


def test_config_error_fails_the_trial_with_the_message(converted_dataset, tmp_path):
    config = to_dict(tiny_config(converted_dataset, tmp_path / "unused"))
    config["pipeline"]["patch_sise"] = config["pipeline"].pop("patch_size")
    result = run_trial({"config": config, "volume_shape": VOLUME}, workdir=tmp_path / "trial")
    assert result["status"] == "failed" and result["failed_phase"] == "setup" and not result["out_of_memory"]
    assert result["reason"] == (
        "ConfigError in setup: unknown config key 'pipeline.patch_sise'; did you mean 'pipeline.patch_size'?"
    )
    assert result["exit_code"] == 1


def test_a_patch_the_model_cannot_take_fails_in_setup(converted_dataset, tmp_path):
    """The trainer's own check (patch sides multiples of the stride product) reaches the reason."""
    config = tiny_config(converted_dataset, tmp_path / "unused", "pipeline.patch_size=[17,16,16]")
    result = run_trial(request(config), workdir=tmp_path / "trial")
    assert result["status"] == "failed" and result["failed_phase"] == "setup"
    assert result["reason"].startswith("ConfigError in setup: patch size (17, 16, 16) does not fit strides (1, 2)")


def test_killed_child_is_a_failed_trial_with_its_phase_and_partial_numbers(converted_dataset, tmp_path):
    """The child is SIGKILLed from outside while it trains (as the kernel's OOM killer would)."""
    config = tiny_config(converted_dataset, tmp_path / "unused", PATCH_48, "pipeline.num_images_per_batch=8")
    workdir = tmp_path / "trial"

    def kill_when_training():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                progress = json.loads((workdir / PROGRESS_FILE).read_text())
            except (OSError, ValueError):
                progress = {}
            if progress.get("phase") == "training":
                os.kill(progress["pid"], signal.SIGKILL)
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_when_training)
    killer.start()
    result = run_trial(request(config, timed_steps=50), workdir=workdir)
    killer.join()
    assert result["status"] == "failed" and result["failed_phase"] == "training"
    assert result["reason"].startswith(
        "exit code -9 (SIGKILL: probably the kernel's out-of-memory killer) during training: "
    )
    assert result["out_of_memory"] and result["import_seconds"] > 0 and result["setup_peak_mb"] > 0
    assert result["images_per_second"] is None


# ---------------------------------------------------------------- out-of-memory signatures


@pytest.mark.slow
def test_is_out_of_memory_on_real_tensorflow_errors():
    """Real errors raised here (graph-mode OOMs inside the training step are covered by the trials above).

    Each OOM costs ~10 s (TensorFlow's allocator waits for memory to be freed), so there is one.
    """
    with pytest.raises(tf.errors.ResourceExhaustedError) as eager:
        tf.zeros([2**40])  # 4 TiB
    assert is_out_of_memory(eager.value)
    assert error_line(str(eager.value)).startswith("OOM when allocating tensor with shape[1099511627776]")
    try:  # an error raised while handling an OOM is still an OOM
        raise RuntimeError("validation failed") from eager.value
    except RuntimeError as chained:
        assert is_out_of_memory(chained)

    with pytest.raises(tf.errors.InvalidArgumentError) as invalid:
        tf.reshape(tf.zeros([10]), [7, -1])
    assert not is_out_of_memory(invalid.value)

    with pytest.raises(MemoryError) as numpy_oom:
        np.empty(2**62, np.uint8)
    assert is_out_of_memory(numpy_oom.value)
    assert not is_out_of_memory(ValueError("patch size (17, 16, 16) does not fit strides (1, 2)"))


def test_error_line_picks_the_failure_out_of_tensorflow_wrappings():
    """The shape of a graph-mode error (as TensorFlow 2.21 words it) and of an error in traced user code."""
    graph = (
        "Graph execution error:\n\nDetected at node ones defined at (most recent call last):\n"
        '  File "train.py", line 15, in <module>\n\n  File "train.py", line 13, in g\n\n'
        "OOM when allocating tensor with shape[512,1024,1024] and type float on "
        "/job:localhost/replica:0/task:0/device:CPU:0 by allocator bfc_cpu_allocator_for_gpu\n"
        "\t [[{{node ones}}]]\nHint: If you want to see a list of allocated tensors when OOM happens, add "
        "report_tensor_allocations_upon_oom to RunOptions for current allocation info.\n [Op:__inference_g_18]"
    )
    assert error_line(graph) == (
        "OOM when allocating tensor with shape[512,1024,1024] and type float on "
        "/job:localhost/replica:0/task:0/device:CPU:0 by allocator bfc_cpu_allocator_for_gpu"
    )
    traced = (
        'in user code:\n\n    File "x.py", line 6, in f  *\n        return tf.reshape(x, [7, -1])\n\n'
        "    ValueError: Dimension size must be evenly divisible by 7 but is 10\n"
    )
    assert error_line(traced) == "ValueError: Dimension size must be evenly divisible by 7 but is 10"
    assert len(error_line("x" * 1000)) == 400


@pytest.mark.parametrize(
    "message",
    [
        "Could not create cudnn handle: CUDNN_STATUS_NOT_INITIALIZED",
        "Could not create cudnn handle: CUDNN_STATUS_ALLOC_FAILED",
        "failed to create cublas handle: CUBLAS_STATUS_NOT_INITIALIZED",
        "CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)",
        "failed to allocate 2.00G (2147483648 bytes) from device: CUDA_ERROR_OUT_OF_MEMORY: out of memory",
        "Dst tensor is not initialized.",
        "OOM when allocating tensor with shape[8,32,96,96,96] and type half on "
        "/job:localhost/replica:0/task:0/device:GPU:0",
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4294967296 bytes.",
    ],
)
def test_is_out_of_memory_on_gpu_message_signatures(message):
    """Messages TensorFlow reports on a GPU (not producible on this CPU-only machine), as text and as the
    InternalError/UnknownError TensorFlow raises them with."""
    assert is_out_of_memory(message)
    assert is_out_of_memory(tf.errors.InternalError(None, None, message))
    assert is_out_of_memory(tf.errors.UnknownError(None, None, message))


@pytest.mark.parametrize(
    "message",
    ["Could not create cudnn handle: CUDNN_STATUS_BAD_PARAM", "Incompatible shapes: [2,16,16,16,3] vs. [2,16,16,16,4]"],
)
def test_other_gpu_errors_are_not_out_of_memory(message):
    assert not is_out_of_memory(message)
    assert not is_out_of_memory(tf.errors.InternalError(None, None, message))


# ---------------------------------------------------------------- devices


def test_device_helpers_on_this_machine():
    gpus = accelerators()
    assert (gpus == []) == (not tf.config.list_physical_devices("GPU"))
    assert trial_device(gpus) == (min(gpus, key=lambda g: g["total_mb"]) if gpus else None)
    assert (
        trial_device(
            [{"index": 0, "total_mb": 81559.0}, {"index": 1, "total_mb": 40960.0}, {"index": 2, "total_mb": 40960.0}]
        )["index"]
        == 1
    )
    host = host_memory()
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    assert host["total_mb"] == pytest.approx(int(meminfo["MemTotal"].split()[0]) / 1024)
    assert 0 < host["available_mb"] <= host["total_mb"]
    assert host["cpu_name"] and 1 <= host["cpu_count"] == usable_cpu_count() <= os.cpu_count()
