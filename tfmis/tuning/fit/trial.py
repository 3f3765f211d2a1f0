"""One GPU-fit trial: a fresh subprocess measures the memory and speed of one training configuration.

A TensorFlow process never gives device memory back, and an out-of-memory error can leave it
broken, so every configuration the search tries runs in a process of its own (`run_trial`), pinned
to one device (with `runtime.model_parallel`, to the N GPUs the model runs over; on a machine
without GPUs to N logical CPU devices, which `make_backend` sets up before TensorFlow initialises).
The child (`python -m tfmis.tuning.fit.trial REQUEST RESULT`) builds the real `Trainer` from the
config (model, loss, optimizer, loss scaling, precision, jit_compile), runs the compiled loop of
`training.steps_per_loop` steps that `Trainer.fit` runs (`Trainer.train_loop`) over a stream of a synthetic
batch with the training stream's shapes and dtypes (`tfmis.data.pipeline.synthetic_train_batches`; warm-up
loops, then timed loops), then runs sliding-window inference as `Trainer.validate` does on a volume of the dataset's
99.5th-percentile shape (one pass to trace, one timed pass).

Memory is measured per phase (setup, training, validation): on a GPU, TensorFlow's allocator peak
(`get_memory_info(...)["peak"]` after `reset_memory_stats`; over several GPUs the largest device's,
since the budget is per device) and NVML's view of the device; on a CPU, the peak resident set
size (VmHWM, reset per phase through /proc/self/clear_refs; logical CPU devices share it). The parent
watches the child's RSS, its clock and its exit: an out-of-memory error, any other error, a crash,
a timeout or a peak over the budget is a failed result with a one-line reason and the phase, never
an exception, so the search goes on. Numbers measured before a failure are kept.

Files in the trial's workdir: `request.json`, `result.json`, `progress.json` (the child's current
phase and numbers so far, for when it is killed), `trial.log` (the child's stdout and stderr) and
`run/` (the trainer's output.dir).

Example:
```python
from pathlib import Path

from tfmis.config import load_config, to_dict
from tfmis.hardware import accelerators, host_memory
from tfmis.tuning.fit.trial import run_trial, trial_device

gpu = trial_device(accelerators())
config = load_config("configs/demo.yaml", ["pipeline.num_images_per_batch=4"])
budget = gpu["total_mb"] * 0.9 if gpu else host_memory()["available_mb"]
result = run_trial({"config": to_dict(config), "volume_shape": [60, 75, 62]}, workdir=Path("tune/trial_000"),
                   memory_budget_mb=budget, gpu=gpu["index"] if gpu else None)
print(result["status"], result["images_per_second"], result["peak_mb"], result["reason"])
```
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

# No TensorFlow at module level: the child sets its environment and GPU options before the import,
# and the parent (the search) must never initialise a GPU.
from tfmis.hardware import detect_hardware, host_memory, nvml_device, physical_gpus, process_status_mb, reset_peak_rss
from tfmis.utils.cli import start_tensorflow_without_sklearn
from tfmis.utils.io import atomic_write_json, log_tail
from tfmis.utils.out_of_memory import error_line, is_out_of_memory

REQUEST_FILE = "request.json"
RESULT_FILE = "result.json"
PROGRESS_FILE = "progress.json"
LOG_FILE = "trial.log"
RUN_DIR = "run"
PHASES = ("setup", "training", "validation")
POLL_SECONDS = 0.05  # how often the parent samples the child's RSS
MB = 2.0**20

# Every key a result has, so that a trial that failed early reads like one that did not.
RESULT_KEYS = (
    "status",
    "reason",
    "failed_phase",
    "out_of_memory",
    "batch_size",
    "steps_per_loop",
    "images_per_second",
    "step_seconds",
    "step_seconds_all",
    "warmup_seconds_all",
    "sw_seconds",
    "sw_first_seconds",
    "sw_windows",
    "validation_device",
    "setup_peak_mb",
    "train_peak_mb",
    "validation_peak_mb",
    "peak_mb",
    "peak_mb_by_device",
    "model_devices",
    "rss_peak_mb",
    "rss_peak_mb_by_phase",
    "rss_start_mb_by_phase",
    "budget_mb",
    "device",
    "tf_version",
    "import_seconds",
    "build_seconds",
    "wall_seconds",
    "exit_code",
    "log",
)


def failure_reason(error: BaseException, phase: str) -> str:
    """ "out of memory in training: ResourceExhaustedError: OOM when ..." or "ConfigError in setup: ..."."""
    line = error_line(str(error))
    name = type(error).__name__
    if is_out_of_memory(error):
        return f"out of memory in {phase}: {name}: {line}"
    return f"{name} in {phase}: {line}"


# ---------------------------------------------------------------- the trial's device (parent side)


def trial_device(accelerators: list[dict]) -> dict | None:
    """The GPU trials run on: the one with the least total memory (one GPU's plan applies per replica).

    Example:
        >>> trial_device([{"index": 0, "total_mb": 81559.0}, {"index": 1, "total_mb": 40960.0}])["index"]
        1
        >>> trial_device([]) is None
        True
    """
    return min(accelerators, key=lambda a: (a["total_mb"], a["index"])) if accelerators else None


# ---------------------------------------------------------------- parent side


def run_trial(
    request: dict,
    *,
    workdir: Path,
    memory_budget_mb: float | None = None,
    timeout_s: float = 600,
    gpu: int | Sequence[int] | None = None,
    extra_env: dict | None = None,
    host_memory_budget_mb: float | None = None,
) -> dict:
    """Runs `python -m tfmis.tuning.fit.trial REQUEST RESULT` in a fresh subprocess and returns its result.

    Never raises for a failed trial: the result's `status` is "failed", `reason` says why in one
    line and `failed_phase` where ("setup", "training" or "validation"); what the child measured
    before the failure is kept. The child's output is kept in `workdir/trial.log`.

    Args:
        request: {"config": `tfmis.config.to_dict(config)` with the trial's values set,
            "volume_shape": [x, y, z] (the sliding-window volume, the fingerprint's `shape_p99_5`),
            "warmup_steps": 2, "timed_steps": 3, "seed": 0 (optional)}.
        workdir: this trial's folder (created; a previous result in it is replaced).
        memory_budget_mb: the most memory the trial may use. GPU trial: TensorFlow's GPU memory
            is limited to it (going over is a real OOM) and an allocator peak above it fails the
            trial. CPU trial: the child is killed as soon as its RSS exceeds it, and a peak RSS
            above it fails the trial. None: no budget.
        timeout_s: the child is killed after this many seconds.
        gpu: NVML index of the GPU to run on (see `trial_device`), or the indices of the GPUs a
            model-parallel config runs over (the child sees exactly these, as GPU:0, GPU:1, ... in this
            order; the memory budget applies to each); None runs on the CPU with every GPU hidden.
        extra_env: environment variables added for the child.
        host_memory_budget_mb: GPU trial only: the child's RSS limit on the host (e.g. for
            validation_data_device=cpu), enforced like a CPU trial's budget; None: no limit.

    Returns:
        A dict with every key of `RESULT_KEYS` (None where not measured):

        - status "ok" | "failed", reason (one line), failed_phase, out_of_memory (an OOM error, a
          peak over the budget, or a crash that looks like one);
        - batch_size (images per step), steps_per_loop (the steps of each timed call of the training
          loop, as in `fit`), images_per_second, step_seconds (the median of step_seconds_all),
          step_seconds_all (per timed loop: its seconds / steps_per_loop), warmup_seconds_all (per
          warm-up loop, its seconds; the first one traces the loop). The request's warmup_steps and
          timed_steps are rounded up to whole loops;
        - sw_seconds (the timed sliding-window pass), sw_first_seconds (the pass that traced),
          sw_windows, validation_device (where the volume and its buffers lived);
        - setup/train/validation_peak_mb (per phase: the GPU allocator's peak, the largest of the
          model's GPUs', or on a CPU the peak RSS, which includes what earlier phases left allocated,
          logical CPU devices included), peak_mb (compared with the budget: the largest GPU phase peak,
          or the process's peak RSS), peak_mb_by_device (GPU: {phase: {"GPU:i": MB}}), model_devices
          (the devices the model ran over, e.g. ["/CPU:0", "/CPU:1"]), rss_peak_mb,
          rss_peak_mb_by_phase, rss_start_mb_by_phase (host RSS as each phase began), budget_mb;
        - device ({"kind": "gpu" | "cpu", "name", "total_mb", "nvml_used_mb" (GPU)}), tf_version,
          import_seconds (importing TensorFlow, Keras, the trainer), build_seconds (the trainer),
          wall_seconds (the whole subprocess), exit_code, log (and log_tail after a crash).

    Example:
    ```python
    result = run_trial({"config": to_dict(config), "volume_shape": [60, 75, 62]}, workdir=Path("trials/0"))
    ```
    """
    request_path, result_path, progress_path, log_path = _prepare_workdir(Path(workdir), request)
    gpus = None if gpu is None else ([int(g) for g in gpu] if isinstance(gpu, Sequence) else [int(gpu)])
    gpu = gpus or None  # below: None for a CPU trial, else the list of the trial's GPUs
    rss_budget = memory_budget_mb if gpu is None else host_memory_budget_mb
    command = _trial_command(request_path, result_path, gpus, memory_budget_mb)

    start = time.monotonic()
    with open(log_path, "wb") as log:
        try:
            child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_child_env(gpu, extra_env))
        except OSError as e:
            return _finish(_not_started(e, log_path))
        killed, rss_seen, exit_code = _watch(child, rss_budget, start + timeout_s)
    wall = time.monotonic() - start

    result, phase, reported = _collect_result(progress_path, result_path, killed)
    result.update(wall_seconds=wall, exit_code=exit_code, log=str(log_path), budget_mb=memory_budget_mb)
    if gpu is None:  # a CPU trial's peak is the process's: the child's VmHWM, or what the parent saw
        result["rss_peak_mb"] = max(result.get("rss_peak_mb") or 0.0, rss_seen) or None
        result["peak_mb"] = result["rss_peak_mb"]

    if killed == "budget":
        _fail(
            result,
            f"peak RSS {rss_seen:.0f} MB > budget {rss_budget:.0f} MB (stopped during {phase})",
            phase,
            out_of_memory=True,
        )
    elif killed == "timeout":
        _fail(result, f"timed out after {timeout_s:g} s during {phase}", phase)
    elif not reported:
        _fail_crash(result, log_path, exit_code, phase)
    elif result.get("status") == "ok":
        check_budgets(result, memory_budget_mb, rss_budget, gpu is not None)
    return _finish(result)


def _prepare_workdir(workdir: Path, request: dict) -> tuple[Path, Path, Path, Path]:
    """Creates the trial's folder, removes an earlier trial's result and progress, writes the request; returns
    the request, result, progress and log paths."""
    workdir.mkdir(parents=True, exist_ok=True)
    paths = workdir / REQUEST_FILE, workdir / RESULT_FILE, workdir / PROGRESS_FILE, workdir / LOG_FILE
    for stale in paths[1:3]:
        stale.unlink(missing_ok=True)
    atomic_write_json(paths[0], request)
    return paths


def _trial_command(request_path: Path, result_path: Path, gpus: list[int] | None, memory_budget_mb) -> list[str]:
    """The child's command line: `python -m tfmis.tuning.fit.trial REQUEST RESULT [--gpu i,j] [--memory-budget-mb]`."""
    command = [sys.executable, "-m", "tfmis.tuning.fit.trial", str(request_path), str(result_path)]
    if gpus:
        command += ["--gpu", ",".join(map(str, gpus))]
    if memory_budget_mb is not None:
        command += ["--memory-budget-mb", str(memory_budget_mb)]
    return command


def _not_started(error: OSError, log_path: Path) -> dict:
    """The failed result of a trial whose process could not be started."""
    reason = f"cannot start the trial process: {error}"
    return {"status": "failed", "reason": reason, "failed_phase": "setup", "log": str(log_path), "wall_seconds": 0.0}


def _collect_result(progress_path: Path, result_path: Path, killed: str | None) -> tuple[dict, str, bool]:
    """What the child left: its progress (the numbers so far) overlaid with its result (unless it was killed), the
    phase it reached (a known one; "done" counts as validation), and whether it wrote a result."""
    progress = _read_json(progress_path) or {}
    progress.pop("pid", None)
    phase = progress.pop("phase", "setup")
    phase = phase if phase in PHASES else "validation"  # "done": finished validating
    reported = None if killed else _read_json(result_path)
    return {**progress, **(reported or {})}, phase, reported is not None


def _watch(child: subprocess.Popen, rss_budget: float | None, deadline: float) -> tuple[str | None, float, int]:
    """Waits for the trial process, sampling its RSS; kills it over the RSS budget or past the deadline.

    Returns:
        (why it was killed: "budget", "timeout" or None, the largest RSS seen in MB, its exit code).
    """
    rss_seen = 0.0
    while True:
        try:
            return None, rss_seen, child.wait(timeout=POLL_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        rss = process_status_mb(child.pid, "VmRSS") or 0.0
        rss_seen = max(rss_seen, rss)
        killed = (
            "budget"
            if rss_budget is not None and rss > rss_budget
            else ("timeout" if time.monotonic() > deadline else None)
        )
        if killed:
            child.kill()
            return killed, rss_seen, child.wait()


def _fail_crash(result: dict, log_path: Path, exit_code: int, phase: str) -> None:
    """Fails a trial whose process died without a result: the log's last lines say what happened."""
    lines = log_tail(log_path)
    # faulthandler's "Fatal Python error: Segmentation fault" says more than the stack after it
    last = next(
        (line for line in reversed(lines) if line.startswith("Fatal Python error")), lines[-1] if lines else None
    )
    # a SIGKILL we did not send is, on Linux, almost always the kernel's out-of-memory killer
    how = " (SIGKILL: probably the kernel's out-of-memory killer)" if exit_code == -9 else ""
    _fail(
        result,
        f"exit code {exit_code}{how} during {phase}: {last or '(no error output)'}",
        phase,
        out_of_memory=exit_code == -9 or any(is_out_of_memory(line) for line in lines),
    )
    result["log_tail"] = lines[-12:]


def _child_env(gpus: list[int] | None, extra_env: dict | None) -> dict:
    env = dict(os.environ)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's device numbers = NVML's (nvidia-smi's)
    # the trial's GPU(s), named by UUID where NVML knows them; "-1" hides every GPU from a CPU trial
    names = []
    for index in gpus or []:
        device = nvml_device(index)
        names.append(device["uuid"] if device else str(index))
    env["CUDA_VISIBLE_DEVICES"] = ",".join(names) if names else "-1"
    # the child imports this copy of tfmis, wherever the caller runs from
    package_root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
    env.update({str(k): str(v) for k, v in (extra_env or {}).items()})
    return env


def check_budgets(result: dict, memory_budget_mb, rss_budget, on_gpu: bool) -> None:
    """Fails a finished trial whose measured peak is over its budget, naming the phase of the peak."""
    by_phase = result.get("rss_peak_mb_by_phase") or {}
    if on_gpu and memory_budget_mb is not None and (result.get("peak_mb") or 0) > memory_budget_mb:
        peaks = {
            p: result.get(k) or 0
            for p, k in (
                ("setup", "setup_peak_mb"),
                ("training", "train_peak_mb"),
                ("validation", "validation_peak_mb"),
            )
        }
        phase = max(peaks, key=peaks.get)
        _fail(
            result,
            f"peak GPU memory {result['peak_mb']:.0f} MB > budget {memory_budget_mb:.0f} MB (in {phase})",
            phase,
            out_of_memory=True,
        )
    elif rss_budget is not None and (result.get("rss_peak_mb") or 0) > rss_budget:
        phase = max(by_phase, key=by_phase.get) if by_phase else "setup"
        _fail(
            result,
            f"peak RSS {result['rss_peak_mb']:.0f} MB > budget {rss_budget:.0f} MB (in {phase})",
            phase,
            out_of_memory=True,
        )


def _fail(result: dict, reason: str, phase: str, out_of_memory: bool = False) -> None:
    result.update(status="failed", reason=reason, failed_phase=phase, out_of_memory=out_of_memory)


def _finish(result: dict) -> dict:
    return {**{key: None for key in RESULT_KEYS}, **result}


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- child side


class ChildTrial:
    """The measurements of one trial, in the child process; `progress.json` follows them."""

    def __init__(self, request_path: Path, result_path: Path, gpus: list[int] | None, memory_budget_mb: float | None):
        self.request_path, self.result_path = request_path, result_path
        self.progress_path = result_path.with_name(PROGRESS_FILE)
        # NVML indices of the trial's GPUs (TensorFlow's GPU:0, GPU:1, ... in this order); None: a CPU trial
        self.gpus, self.memory_budget_mb = gpus or None, memory_budget_mb
        self.gpu = self.gpus[0] if self.gpus else None
        self.gpu_names: list[str] = []  # "GPU:0", ...: the devices whose allocator peaks are measured
        self.phase = "setup"
        self.measured: dict = {"rss_peak_mb_by_phase": {}, "rss_start_mb_by_phase": {}}
        self.tf = None
        self.on_gpu = False  # set once TensorFlow is imported with the trial's GPU
        self.trainer = None

    def run(self) -> int:
        status, reason, failed_phase, out_of_memory = "ok", None, None, False
        try:
            for phase, body in (("setup", self._setup), ("training", self._train), ("validation", self._validate)):
                self._enter(phase)
                try:
                    body()
                finally:  # the peaks up to a failure are measurements too
                    self._measure_memory(phase)
        except Exception as error:  # noqa: BLE001 - every failure is a result (MemoryError included)
            traceback.print_exc()  # the whole story goes to the trial log
            status, reason, failed_phase = "failed", failure_reason(error, self.phase), self.phase
            out_of_memory = is_out_of_memory(error)
        self.phase = "done"
        self._write_progress()
        atomic_write_json(
            self.result_path,
            {
                "status": status,
                "reason": reason,
                "failed_phase": failed_phase,
                "out_of_memory": out_of_memory,
                **self.measured,
            },
        )
        return 0 if status == "ok" else 1

    # -------------------------------------------------------- phases

    def _setup(self) -> None:
        import dataclasses

        from tfmis.config import Config, from_dict, validate

        request = json.loads(self.request_path.read_text())
        self.warmup_steps = int(request.get("warmup_steps", 2))
        self.timed_steps = int(request.get("timed_steps", 3))
        self.seed = int(request.get("seed", 0))
        self.volume_shape = [int(s) for s in request["volume_shape"]]
        if len(self.volume_shape) != 3 or min(self.volume_shape) < 1 or self.warmup_steps < 0 or self.timed_steps < 1:
            raise ValueError(
                f"trial request: volume_shape must be 3 positive sizes (got {request['volume_shape']}), "
                f"warmup_steps >= 0 (got {self.warmup_steps}), timed_steps >= 1 (got {self.timed_steps})"
            )
        config = from_dict(Config, request["config"])
        validate(config)
        config.output.dir = str(self.result_path.parent / RUN_DIR)
        self.config = config

        start = time.perf_counter()
        tf = self._import_tensorflow()
        from tfmis.engine.distribution import make_backend  # Keras and the trainer's modules
        from tfmis.engine.trainer import Trainer
        from tfmis.hardware import accelerator_device

        self.measured.update(
            import_seconds=time.perf_counter() - start, tf_version=tf.__version__, device=self._device_info()
        )
        self._write_progress()
        start = time.perf_counter()
        # one process: runtime.distribution none; with runtime.model_parallel, make_backend sets up its devices
        # (on a CPU the logical devices) here, before anything touches a device
        backend = make_backend(dataclasses.replace(config.runtime, distribution="none", devices=None))
        self.trainer = Trainer(config, backend=backend)
        self.measured["build_seconds"] = time.perf_counter() - start
        parallel = self.trainer.parallel
        self.measured["model_devices"] = (
            [d for group in parallel.devices for d in group] if parallel is not None else [accelerator_device()]
        )

    def _import_tensorflow(self):
        """Imports TensorFlow with the trial's device set up before it initialises."""
        import tensorflow as tf

        gpus = physical_gpus()
        if self.gpu is None:
            if gpus:  # a CPU trial measures the CPU, even if the environment left a GPU visible
                tf.config.set_visible_devices([], "GPU")
        elif not gpus:
            raise RuntimeError(
                f"no GPU visible to TensorFlow {tf.__version__} (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); is it built with CUDA?"
            )
        elif len(gpus) < len(self.gpus):
            raise RuntimeError(
                f"the trial runs over {len(self.gpus)} GPUs but TensorFlow sees {len(gpus)} (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
            )
        else:
            used = gpus[: len(self.gpus)]
            tf.config.set_visible_devices(used, "GPU")
            for device in used:  # the budget is per device: each one's allocator is capped at it
                if self.memory_budget_mb is not None:  # going over the budget is then a real OOM
                    tf.config.set_logical_device_configuration(
                        device, [tf.config.LogicalDeviceConfiguration(memory_limit=int(self.memory_budget_mb))]
                    )
                else:
                    tf.config.experimental.set_memory_growth(device, True)
            self.gpu_names = [f"GPU:{i}" for i in range(len(used))]
            self.on_gpu = True
        self.tf = tf
        return tf

    def _train(self) -> None:
        import math

        from tfmis.data.pipeline import synthetic_train_batches

        tf, trainer, config = self.tf, self.trainer, self.config
        batch_size = config.pipeline.num_images_per_batch * config.training.accumulation_steps
        per_loop = trainer.steps_per_loop  # the loop fit runs (at most an epoch of the trial's dataset)
        self.measured.update(batch_size=batch_size, steps_per_loop=per_loop)
        with tf.device("/CPU:0"):  # the batch lives in host memory, as tf.data delivers it
            batches = synthetic_train_batches(config, trainer.in_channels, len(trainer.class_names), self.seed)
        # distributed as fit distributes its stream: the same iterator type and element spec, so the same graph
        iterator = iter(trainer.backend.distribute_dataset(lambda _: batches))

        def loop() -> float:
            start = time.perf_counter()
            trainer.train_loop(iterator, per_loop)  # returns once the loop's results are on the host
            return time.perf_counter() - start

        warmup = []
        for _ in range(math.ceil(self.warmup_steps / per_loop)):
            warmup.append(loop())
            self.measured["warmup_seconds_all"] = warmup
            self._write_progress()
        timed = [loop() / per_loop for _ in range(math.ceil(self.timed_steps / per_loop))]
        median = statistics.median(timed)
        self.measured.update(step_seconds=median, step_seconds_all=timed, images_per_second=batch_size / median)

    def _validate(self) -> None:
        import numpy as np

        from tfmis.hardware import CPU, accelerator_device
        from tfmis.inference import number_of_windows, sliding_window_inference

        tf, trainer = self.tf, self.trainer
        v = self.config.validation
        roi = tuple(v.roi_size or self.config.pipeline.patch_size)
        # the placement's first choice, with this sw batch: no out-of-memory fallback may hide what is measured
        # ("auto" starts on the accelerator; see tfmis.inference.placement)
        device = CPU if v.validation_data_device == "cpu" else accelerator_device()
        self.measured["validation_device"] = device
        rng = np.random.default_rng(self.seed + 1)
        with tf.device(CPU):  # a validation volume as tf.data delivers it
            volume = tf.constant(rng.standard_normal((1, *self.volume_shape, trainer.in_channels), dtype=np.float32))
        self.measured["sw_windows"] = number_of_windows(self.volume_shape, roi, v.overlap)

        def one_pass() -> float:
            start = time.perf_counter()
            logits = sliding_window_inference(
                volume,
                roi,
                v.num_sw_batch_size,
                trainer.predict_windows,
                overlap=v.overlap,
                mode=v.mode,
                sw_device=accelerator_device(),
                device=device,
            )
            with tf.device(device):  # the label map as validation makes it; numpy() waits for the pass
                trainer.task.label_map(logits)[0].numpy()
            return time.perf_counter() - start

        self.measured["sw_first_seconds"] = one_pass()  # traces the predictor for this window batch
        self._write_progress()
        self.measured["sw_seconds"] = one_pass()

    # -------------------------------------------------------- memory and progress

    def _enter(self, phase: str) -> None:
        self.phase = phase
        if phase != "setup":  # setup's peaks count from the process start
            reset_peak_rss()  # where not allowed, later phase peaks include the earlier phases
            for name in self.gpu_names:
                self.tf.config.experimental.reset_memory_stats(name)
        # what the process holds when the phase starts (on a CPU, the phase's own need is its peak minus this)
        self.measured["rss_start_mb_by_phase"][phase] = process_status_mb("self", "VmRSS")
        self._write_progress()

    def _measure_memory(self, phase: str) -> None:
        """This phase's peaks: host RSS always; on GPUs the allocator's (and NVML's), the largest of the devices.

        The trial's process sees exactly the GPUs the model runs over (GPU:0, or GPU:0..N-1 with
        `runtime.model_parallel`), so the phase's peak is the largest `get_memory_info("GPU:i")["peak"]`
        over them: the memory budget is per device. On a CPU (logical devices included: they share the
        process's memory) the peak is the process's resident set, as measured above."""
        m = self.measured
        rss = process_status_mb("self", "VmHWM")
        start = m["rss_start_mb_by_phase"].get(phase)
        if rss is not None and start is not None:
            # the kernel's RSS counters are cached per thread (up to 64 pages behind), so a VmHWM read after the
            # reset can fall a fraction of a MB below the VmRSS read at the phase start; the phase held at least that
            rss = max(rss, start)
        if rss is not None:
            m["rss_peak_mb_by_phase"][phase] = rss
            m["rss_peak_mb"] = max(m["rss_peak_mb_by_phase"].values())
        key = {"setup": "setup_peak_mb", "training": "train_peak_mb", "validation": "validation_peak_mb"}[phase]
        if self.on_gpu:
            try:  # after an OOM the runtime may refuse; the failure itself is what matters then
                by_device = {
                    name: self.tf.config.experimental.get_memory_info(name)["peak"] / MB for name in self.gpu_names
                }
                m.setdefault("peak_mb_by_device", {})[phase] = by_device
                m[key] = max(by_device.values())
                for index in self.gpus:
                    nvml = nvml_device(index)
                    if nvml is not None and m.get("device"):
                        m["device"]["nvml_used_mb"] = max(m["device"].get("nvml_used_mb") or 0.0, nvml["used_mb"])
            except Exception:  # noqa: BLE001
                traceback.print_exc()
            peaks = [m.get(k) for k in ("setup_peak_mb", "train_peak_mb", "validation_peak_mb")]
            m["peak_mb"] = max((p for p in peaks if p is not None), default=None)
        else:  # a CPU trial: the process's RSS (one memory, whatever the number of logical devices)
            m[key] = rss
            m["peak_mb"] = m.get("rss_peak_mb")
        self._write_progress()

    def _device_info(self) -> dict:
        if self.on_gpu:
            info = {
                "kind": "gpu",
                "index": self.gpu,
                "indices": self.gpus,
                "name": None,
                "total_mb": None,
                "nvml_used_mb": None,
                "memory_limit_mb": self.memory_budget_mb,
            }
            nvml = nvml_device(self.gpu)
            if nvml is not None:
                info.update(name=nvml["name"], total_mb=nvml["total_mb"])
            else:  # NVML is extra information, the allocator peak is the measurement
                info["name"] = detect_hardware().gpus[0]["name"]
            return info
        host = host_memory()
        return {
            "kind": "cpu",
            "name": host["cpu_name"],
            "total_mb": host["total_mb"],
            "available_mb": host["available_mb"],
            "cpu_count": host["cpu_count"],
        }

    def _write_progress(self) -> None:
        atomic_write_json(self.progress_path, {"phase": self.phase, "pid": os.getpid(), **self.measured})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tfmis.tuning.fit.trial",
        description="Measure one GPU-fit trial (started by tfmis.tuning.fit.trial.run_trial).",
    )
    p.add_argument("request", help="request JSON: config, volume_shape, warmup_steps, timed_steps")
    p.add_argument("result", help="result JSON to write (progress.json is written next to it)")
    p.add_argument(
        "--gpu",
        type=lambda text: [int(i) for i in text.split(",")],
        default=None,
        help="NVML index of the GPU, or comma-separated indices of the model's GPUs (CUDA_VISIBLE_DEVICES set to them)",
    )
    p.add_argument(
        "--memory-budget-mb",
        type=float,
        default=None,
        help="GPU: TensorFlow's memory limit on each device (instead of memory growth)",
    )
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported
    if argv is None:  # the trial's own process: TensorFlow starts without scikit-learn, as a command's does
        start_tensorflow_without_sklearn()
    faulthandler.enable()  # a crash (e.g. a failed allocation in native code) leaves its Python stack in the log
    return ChildTrial(Path(args.request), Path(args.result), args.gpu, args.memory_budget_mb).run()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the result is written; skip TensorFlow's teardown, which can hang or crash after an OOM
