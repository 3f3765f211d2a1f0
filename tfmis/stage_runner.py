"""Training a config or a plan of stages: the API under `tfmis-train`.

`StageRunner` trains the stages (`tfmis.run_plans`: read from a config or a plan of stages with their overrides, or
planned from a source folder) one after another on one backend: a finished stage is skipped on resume, the stages
share the plan's time budget (each stage's `training.max_minutes`, or, with `--set training.max_minutes` on a plan,
the command's wall time split over the stages as they start: `run_plans.PlanBudget`, spent by `_PlanClock`), every
stage gets the GPU-fit search's cached measurement for its own config, and the workers leave together
(`backend.finish`) after a failure too.

Errors are `tfmis.errors` types; the command turns them into one line and an exit code.

Example:
```python
from tfmis.engine.distribution import make_backend
from tfmis.run_plans import plan_source
from tfmis.stage_runner import StageRunner

stages, planned = plan_source("data/Task09_Spleen")
backend = make_backend(stages[0].config.runtime, output_dir=stages[0].config.output.dir)
summaries = StageRunner(backend).run(stages, planned)
```
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

from tfmis.config import Config
from tfmis.engine.time_budget import SAFETY_SHARE
from tfmis.errors import TrainingFailed, UsageError
from tfmis.run_plans import STAGE_OVERHEAD_SECONDS, PlanBudget, PlannedRun, Stage, cached_gpu_fit, log

# the process's own end after the last stage of a budgeted plan (the workers' barrier, TensorFlow's teardown)
EXIT_SECONDS = 2.0
LEAST_STAGE_SECONDS = 15.0  # a stage's training loop shorter than this is refused before it starts
SUMMARY_FILE = "summary.json"  # a finished run's last write (tfmis.engine.trainer)
FAILED_BARRIER_S = 120.0  # after a failure, how long a worker waits for the others at the finish barrier


@dataclasses.dataclass(frozen=True)
class TrainedStage:
    """A stage `StageRunner` trained: its config as trained and its global batch."""

    config: Config
    global_batch: int


STAGES_INDEX_NOTE = "the stages trained into this folder (--set output.dir)"


def index_stages(stages: list[Stage]) -> Path | None:
    """After `--set output.dir=X` moved a plan's stages to `X/<stage>`: writes `X/plan.yaml`, a stages file naming
    the trained stages' configs, so that `X` is the plan's folder for `tfmis-predict --checkpoint X` (which predicts
    with its last stage) and `tfmis-export`. Only when every stage sits in `X/<its name>` and `X` holds no plan of
    its own (a plan's folder, where its stages train without the override, keeps its plan.yaml). Returns the file
    written, or None."""
    from tfmis.config.files import write_stages

    names = [s.name for s in stages]
    if not names or not all(names):
        return None
    folder = Path(stages[0].config.output.dir).parent
    if any(Path(s.config.output.dir) != folder / s.name for s in stages):
        return None
    index = folder / "plan.yaml"
    if index.is_file() and STAGES_INDEX_NOTE not in index.read_text()[:1000]:
        return None  # the plan's own file
    return write_stages(index, [(s.name, folder / s.name / "config.yaml") for s in stages], [STAGES_INDEX_NOTE])


class StageRunner:
    """Trains stages one after another on one backend (one process, or every worker of a launch).

    Args:
        backend: `tfmis.engine.distribution.make_backend`'s backend (all stages share it).
        resume: continue each stage from its last checkpoint; a stage with a summary.json is skipped.
        gpu_fit: `(stages, planned) -> stages` with the GPU-fit search's cached measurement, applied to each stage
            once its data is converted (default `cached_gpu_fit`); None: the configs as planned.
        customize: `config -> config` run before a stage trains (the GPU-fit search of `--gpu-customization`).
        on_stage_end: `(trainer, summary)` called on the chief after each stage trained (the command's report).
        log: where progress lines go (the chief's only).
        started: when the command started (`time.time()`), from which a plan's budget (`PlanBudget`) counts;
            default: when `run` is called.
    """

    def __init__(
        self,
        backend,
        *,
        resume: bool = False,
        gpu_fit: Callable | None = cached_gpu_fit,
        customize: Callable[[Config], Config] | None = None,
        on_stage_end: Callable | None = None,
        log=log,
        started: float | None = None,
    ):
        self.backend, self.resume, self.gpu_fit, self.customize = backend, resume, gpu_fit, customize
        self.on_stage_end, self._log, self.started = on_stage_end, log, started
        self._clock: _PlanClock | None = None  # the plan's budget as it is spent, while `run` trains a budgeted plan
        # what each stage trained in this call was (its config and global batch), in order; not the trainers, which
        # are let go after their stage with their datasets (a memory cache holds the decoded training set) and model
        self.trained: list[TrainedStage] = []

    def log(self, line: str) -> None:
        if self.backend.is_chief:
            self._log(line)

    def run(self, stages: list[Stage], planned: PlannedRun | None = None, exit_status: int | None = 0) -> list:
        """Trains `stages` in order; returns each stage's summary (None for a stage skipped on resume).

        The workers leave together at the end (`backend.finish(exit_status)`; a multi-worker strategy may end the
        process there with `exit_status`) and after a failure too (without ending the process, at most
        `FAILED_BARRIER_S` waiting: `backend.leave_after_failure`), so no worker waits for one that stopped.
        """
        try:
            summaries = self._run_stages(stages, planned)
        except BaseException:
            self.backend.leave_after_failure(FAILED_BARRIER_S)
            raise
        self._finish(exit_status)
        return summaries

    def _run_stages(self, stages: list[Stage], planned: PlannedRun | None) -> list:
        from tfmis.data.prepare import check_data_source
        from tfmis.engine.bookkeeping import run_folder_lock

        summaries = []
        # one process trains a planned run: the measurement applies (several workers take the plan as it is)
        fit = self.gpu_fit is not None and planned is not None and self.backend.size == 1 and self.customize is None
        skipped = [
            len(stages) > 1 and self.resume and (Path(s.config.output.dir) / SUMMARY_FILE).is_file() for s in stages
        ]
        budget = next((s.budget for s in stages if s.budget is not None), None)
        prepared: set[int] = set()
        if budget is not None:
            # the whole command's wall time: every stage's data are converted first, so the split knows their time
            self._clock = _PlanClock(budget, self.started if self.started is not None else time.time())
            self.log(budget.line())
            for i, stage in enumerate(stages):
                if not skipped[i]:
                    self.warn(stage.config, stage.path)
                    check_data_source(stage.config.data)  # before the lock: a run that cannot start leaves no folder
                    with run_folder_lock(self.backend, stage.config.output.dir):
                        self.prepare(stage.config)
                    prepared.add(i)
        try:
            for i, stage in enumerate(stages):
                if len(stages) > 1:
                    if skipped[i]:
                        done = Path(stage.config.output.dir) / SUMMARY_FILE
                        self.log(f"Stage {i + 1}/{len(stages)} ({stage.name}): finished earlier ({done}), skipped")
                        summaries.append(None)
                        continue
                    self.log(f"Stage {i + 1}/{len(stages)} ({stage.name}): {stage.config.output.dir}")
                if self._clock is not None:
                    self._clock.begin_stage([s.name for s, skip in zip(stages[i:], skipped[i:]) if not skip])
                if i not in prepared:
                    self.warn(stage.config, stage.path)
                    check_data_source(stage.config.data)  # before the lock: a run that cannot start leaves no folder
                # the run folder is held from before the conversion: a second run into it stops before converting
                with run_folder_lock(self.backend, stage.config.output.dir):
                    if i not in prepared:
                        self.prepare(stage.config)
                    if fit:  # after this stage's conversion: the search's cache is keyed by the converted data
                        stages[i:] = self.gpu_fit(stages, planned)[i:]
                        stage = stages[i]
                    summaries.append(self.train_stage(stage.config))
                if self._clock is not None:
                    self._clock.end_stage(summaries[-1])
                if self.backend.is_chief:
                    index_stages(stages[: i + 1])
        finally:
            self._clock = None
        return summaries

    def warn(self, config: Config, path: str | Path | None = None) -> None:
        """On the chief, before any data is converted: one line when the config was planned for more GPUs, larger
        ones, or GPUs where this machine has none (or for a CPU where this machine has GPUs: `planned_for_warning`),
        and one warning per setting this machine runs badly (mixed_float16 or jit_compile on a CPU, oneDNN off,
        more threads than usable CPUs), naming the faster choice."""
        from tfmis.hardware import hardware_warnings

        planned = planned_for_warning(config, path)
        for line in ([planned] if planned else []) + hardware_warnings(config.training):
            self.log(f"warning: {line}")

    def prepare(self, config: Config) -> None:
        """The chief converts the stage's data (when the config names an MSD folder) while the other workers
        wait; every worker raises when the chief failed."""
        from tfmis.data.prepare import prepare_dataset

        ok, error = 1.0, None
        if self.backend.is_chief:
            try:
                prepare_dataset(config.data, progress=config.output.progress)
                self.prepare_input(config)
            except Exception as e:
                if self.backend.size == 1:
                    raise
                ok, error = 0.0, e
        if self.backend.size > 1 and not self.backend.broadcast([ok])[0]:  # every worker waits for the chief
            if error is not None:
                raise error
            raise TrainingFailed(f"worker {self.backend.rank}: the chief could not prepare the data (see its log)")

    def prepare_input(self, config: Config) -> None:
        """Says what the training input will hold in memory against its budget (refusing a `memory` cache above
        it), and with `pipeline.cache: patches` writes or completes the patch-read arrays of the training cases."""
        from tfmis.data.memory_budget import check_input_memory
        from tfmis.data.patch_layout import training_cases, write_patch_layout
        from tfmis.data.records import load_index

        index = load_index(config.data.dataset_dir)
        held = check_input_memory(config, index, self.backend.size)
        self.log(held["line"])
        if config.pipeline.cache == "patches":
            cases = training_cases(config.data.dataset_dir, config.data.train_split)
            done = write_patch_layout(
                config.data.dataset_dir,
                cases,
                len(index["source"]["labels"]),
                config.pipeline.max_foreground_indices,
                config.training.seed,
                progress=config.output.progress,
            )
            self.log(
                f"Patch-read arrays: {done['cases']} training cases, {done['bytes'] / 2**30:.2f} GB on disk in "
                f"{config.data.dataset_dir}/arrays ({done['written']} written, {done['shared']} shared with another "
                f"conversion, {done['relocated']} re-indexed, "
                f"{done['seconds']:.0f} s)"
            )

    def train_stage(self, config: Config) -> dict:
        """Trains one config in its run folder (holding the folder's lock on the chief); its summary.

        `training.precision: auto` becomes this machine's best precision; a setting this machine runs badly
        (mixed_float16 or jit_compile on a CPU) gets one warning naming the faster choice."""
        from tfmis.engine.bookkeeping import run_folder_lock
        from tfmis.hardware import resolve_precision

        config.training.precision = resolve_precision(config.training.precision)
        with run_folder_lock(self.backend, config.output.dir):
            if self.customize is not None:
                if self.backend.size > 1:
                    raise UsageError(
                        "--gpu-customization runs one search per machine: run python -m tfmis.tune fit "
                        "first, then launch the workers with its fit.yaml"
                    )
                config = self.customize(config)
            summary = self._fit(self.make_trainer(config), config)
        gc.collect()  # the trainer, gone with `_fit`, is in a cycle (its callbacks and traced functions refer to it)
        return summary

    def _fit(self, trainer, config: Config) -> dict:
        """Trains `config` with `trainer` and reports its stage; keeps what it trained, not the trainer."""
        self.trained.append(TrainedStage(trainer.config, trainer.global_batch))
        if self._clock is not None:  # the plan's budget: this stage's share of the time left, set as its loop starts
            minutes, line = self._clock.stage_minutes(trainer.config)
            trainer.config.training.max_minutes = minutes
            self.log(line)
        summary = _lost_workers_as_error(lambda: trainer.fit(resume=self.resume), self.backend, config)
        if self.backend.is_chief and self.on_stage_end is not None:
            self.on_stage_end(trainer, summary)
        return summary

    def make_trainer(self, config: Config):
        """The stage's trainer; on the chief, the lines that say what will train where."""
        from tfmis.engine.trainer import Trainer
        from tfmis.hardware import detect_hardware

        trainer = Trainer(config, backend=self.backend)
        if self.backend.is_chief:  # after the trainer: a config or data error stays one line
            backend = self.backend
            self.log(f"Hardware: {detect_hardware().describe()}")
            lr = (
                ""
                if config.optimizer.lr_scaling == "none"
                else f", learning rate {trainer.learning_rate:.3g} ({config.optimizer.lr_scaling} scaling)"
            )
            self.log(
                f"Training {trainer.model.count_params():,} parameters on {backend.num_replicas} replica(s) "
                f"({backend.name}, {backend.size} worker process(es)), global batch {trainer.global_batch}, "
                f"{trainer.steps_per_epoch} steps/epoch, precision {config.training.precision}{lr}; "
                f"results in {config.output.dir}"
            )
            if trainer.parallel is not None:
                self.log(f"Model parallel: {trainer.parallel.describe()}")
        return trainer

    def _finish(self, exit_status: int | None) -> None:
        import tensorflow as tf

        try:
            self.backend.finish(exit_status=exit_status)
        except tf.errors.OpError as e:  # another worker ended before the barrier (it failed)
            raise TrainingFailed(
                f"worker {self.backend.rank}: another worker ended before the end of the run ({type(e).__name__})"
            ) from e


class _PlanClock:
    """A `PlanBudget` as a run spends it: the deadline (`started` + M minutes), the stages left and their weights,
    and the time each stage spends outside its training loop, measured on the stages this process trained.

    A stage's share when its loop starts (`stage_minutes`): (the seconds to the deadline, less the time outside the
    loop of this stage's end and of each later stage, less `EXIT_SECONDS`) x its weight / the weights of the stages
    left, plus the loop time an interrupted stage already spent in an earlier process (which its trainer counts)."""

    def __init__(self, budget: PlanBudget, started: float):
        self.budget, self.deadline = budget, started + 60.0 * budget.minutes
        self.left: list[str] = []
        self.stage_start = self.loop_start = None
        self.before_now = 0.0  # this stage's seconds from its start to its loop's
        self.earlier = 0.0  # the loop seconds of an interrupted stage's earlier processes
        self.before: list[float] = []  # each trained stage's seconds from its start to its loop's
        self.after: list[float] = []  # ...and from its loop's end to its end

    def begin_stage(self, left: list[str]) -> None:
        self.left, self.stage_start = left, time.time()

    def _estimates(self) -> tuple[float, float]:
        before = sum(self.before) / len(self.before) if self.before else STAGE_OVERHEAD_SECONDS / 2
        after = sum(self.after) / len(self.after) if self.after else STAGE_OVERHEAD_SECONDS / 2
        return before, after

    def stage_minutes(self, config: Config) -> tuple[float, str]:
        """This stage's `training.max_minutes` and the line saying how it was set."""
        now = time.time()
        self.loop_start = now
        self.before_now = now - (self.stage_start or now)
        before, after = self._estimates()
        before = max(before, self.before_now)  # a later stage builds its trainer as this one did
        name, later = self.left[0], len(self.left) - 1
        label = f"stage {name}" if name else "the training"
        outside = after + later * (before + after) + EXIT_SECONDS
        weights = self.budget.weights
        total = sum(weights.get(n, 0.0) for n in self.left) or 1.0
        share = weights.get(name, 0.0) / total
        loop = (self.deadline - now - outside) * share
        self.earlier = _earlier_loop_seconds(Path(config.output.dir))
        if loop < LEAST_STAGE_SECONDS:
            spent = (now - (self.deadline - 60.0 * self.budget.minutes)) / 60
            raise UsageError(
                f"training.max_minutes={self.budget.minutes:g} (the whole plan's): {spent:.1f} min have passed "
                f"(planning, converting, the stages before) and {label} would train "
                f"{max(loop, 0):.0f} s, less than {LEAST_STAGE_SECONDS:g} s; give a larger budget, e.g. "
                f"training.max_minutes={math.ceil(self.budget.minutes + (LEAST_STAGE_SECONDS - loop) / 60 / share):g}"
            )
        # the trainer ends its loop by SAFETY_SHARE of its budget early for what follows its last epoch: that is in
        # `outside` here, so the share is given back to it
        minutes = math.floor((self.earlier + loop / (1.0 - SAFETY_SHARE)) / 60 * 100) / 100
        left = (self.deadline - now) / 60
        line = (
            f"Plan budget: {label}: training.max_minutes={minutes:g} ({share:.0%} of the "
            f"{left:.2f} min left, less {outside:.0f} s outside the training loops of the {later + 1} stage(s) left)"
        )
        if self.earlier:
            line += f", {self.earlier / 60:.2f} of them trained before the resume"
        return minutes, line

    def end_stage(self, summary: dict | None) -> None:
        if summary is None or self.loop_start is None:
            return
        loop = float(summary.get("elapsed_seconds") or 0.0) - self.earlier
        self.before.append(self.before_now)
        self.after.append(max(0.0, time.time() - self.loop_start - loop))
        self.loop_start = None


def _earlier_loop_seconds(run_dir: Path) -> float:
    """The training-loop seconds an interrupted run's earlier processes spent (its history's last record), or 0."""
    try:
        lines = [line for line in (run_dir / "history.jsonl").read_text().splitlines() if line.strip()]
        return float(json.loads(lines[-1]).get("elapsed_seconds") or 0.0) if lines else 0.0
    except (OSError, ValueError):
        return 0.0


def planned_for_warning(config: Config, path: str | Path | None = None, hardware=None) -> str | None:
    """The line (without "warning: ") saying that `config` was planned for other hardware than `hardware` (default
    this machine's) and what that means for its patch and batch, or None: no `planning.planned_for`, or this
    machine has at least the GPUs, and GPU memory, the plan was made for (`tfmis.hardware.planned_hardware_mismatch`).

    Example: "plan.yaml was planned for 8 x 80 GB GPUs (H100-80GB); this machine has no GPU: the patch 128x128x128
    and batch 2 may not fit or may be slow (plan again here, or give tfmis-plan this machine's --gpus/--gpu-memory)".
    """
    from tfmis.hardware import planned_hardware_mismatch

    planned = config.planning.planned_for
    mismatch = planned_hardware_mismatch(dataclasses.asdict(planned) if planned else None, hardware)
    if mismatch is None:
        return None
    patch = "x".join(str(p) for p in config.pipeline.patch_size)
    batch = config.pipeline.num_images_per_batch
    if planned.gpus:
        effect = (
            f"the patch {patch} and batch {batch} may not fit or may be slow (plan again here, or give tfmis-plan "
            "this machine's --gpus/--gpu-memory)"
        )
    else:
        effect = (
            f"the CPU plan's small network, patch {patch} and batch {batch} leave the GPUs mostly idle (plan again "
            "here)"
        )
    return f"{path or 'the config'} {mismatch}: {effect}"


def _lost_workers_as_error(fit, backend, config: Config):
    """`fit()`; with several workers, TensorFlow's errors of a lost peer become one `TrainingFailed` that says how
    to go on."""
    import tensorflow as tf

    lost = (
        tf.errors.UnavailableError,
        tf.errors.CancelledError,
        tf.errors.DeadlineExceededError,
        tf.errors.AbortedError,
        tf.errors.InternalError,
    )
    try:
        return fit()
    except lost as e:
        if backend.size == 1:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TrainingFailed(
            f"worker {backend.rank} lost contact with the other workers ({type(e).__name__}: {first[:300]}). "
            f"A worker died or the network failed; training stopped. The last committed epoch is in "
            f"{Path(config.output.dir) / 'checkpoints'}: restart all workers with --resume."
        ) from e
