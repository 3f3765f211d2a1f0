"""Training a config or a plan of stages: the API under `tfmis-train`.

- `plan_source`: plans an MSD folder on this machine (the candidates full resolution, low resolution, a cascade)
  and writes the recommended one's plan and the candidates file; with `resume` an existing plan is kept;
- `load_stages`: the stages of a config file or of a plan of stages, with `--set` overrides;
- `StageRunner`: trains the stages one after another on one backend: a finished stage is skipped on resume, the
  stages share the plan's time budget (each stage's `training.max_minutes`), every stage gets the GPU-fit
  search's cached measurement for its own config, and the workers leave together (`backend.finish`) after a
  failure too.

Errors are `tfmis.errors` types; the command turns them into one line and an exit code.

Example:
```python
from tfmis.engine.distribution import make_backend
from tfmis.training import StageRunner, plan_source

stages, planned = plan_source("data/Task09_Spleen")
backend = make_backend(stages[0].config.runtime, output_dir=stages[0].config.output.dir)
summaries = StageRunner(backend).run(stages, planned)
```
"""

from __future__ import annotations

import dataclasses
import gc
import sys
from collections.abc import Callable
from pathlib import Path

from tfmis.config import Config, apply_override, load_config
from tfmis.config import load_stages as read_stage_list
from tfmis.errors import TrainingFailed, UsageError

# the overrides that belong to the plan as a whole: where the stages convert and train, and the budget they share
STAGE_PLAN_KEYS = ("data.dataset_dir", "output.dir", "training.max_minutes")
SUMMARY_FILE = "summary.json"  # a finished run's last write (tfmis.engine.trainer)
FAILED_BARRIER_S = 120.0  # after a failure, how long a worker waits for the others at the finish barrier


def add_configuration_argument(parser, when: str = "") -> None:
    """The `--configuration fullres|lowres|cascade` option of the commands that plan (`tfmis-plan`, `tfmis-train
    --source-dir`); `when` prefixes its help (e.g. "with --source-dir: ")."""
    parser.add_argument(
        "--configuration",
        choices=("fullres", "lowres", "cascade"),
        default=None,
        help=f"{when}force one stage at full resolution, one at low resolution, or a coarse-to-fine cascade "
        "(default: chosen from the fingerprint and the affordable patch; refused when it makes no sense for the "
        "dataset; docs/planning.md)",
    )


TARGET_FLAGS = ("gpus", "gpu_memory", "gpu", "cpus", "host_memory")


def add_target_arguments(parser, when: str = "") -> None:
    """The options of the commands that plan (`tfmis-plan`, `tfmis-train --source-dir`) that describe the machine
    the training will run on when it is not this one (`target_hardware` reads them); `when` prefixes the group's
    description."""
    from tfmis.hardware import GPU_MODELS

    g = parser.add_argument_group(
        "target machine",
        f"{when}plan for the machine the training will run on instead of this one, e.g. on a CPU login node for "
        "8 x 80 GB GPU nodes: --gpus 8 --gpu-memory 80GB, or --gpus 8 --gpu H100-80GB (the plan's header names the "
        "target; training on a machine with less warns in one line). The host's cores and RAM stay this "
        "machine's unless --cpus / --host-memory are given",
    )
    g.add_argument("--gpus", metavar="N", default=None, help="GPUs per machine (default 1 with --gpu or --gpu-memory)")
    g.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        default=None,
        help="each GPU's memory: 80GB, 80G, 81920MB or 81920 (MB); default: the --gpu model's",
    )
    g.add_argument(
        "--gpu",
        metavar="NAME",
        default=None,
        help=f"the GPU model, for its memory and precision: {', '.join(GPU_MODELS)} (without it: float32, as for "
        "a GPU of unknown compute capability)",
    )
    g.add_argument(
        "--cpus", metavar="N", default=None, help="the target's CPU cores (optional; default this machine's)"
    )
    g.add_argument(
        "--host-memory",
        metavar="SIZE",
        default=None,
        help="the target's RAM, e.g. 512GB (optional; default this machine's)",
    )


def target_hardware(args, here=None):
    """The `Hardware` to plan for from `add_target_arguments`' options (`Hardware.target`), or None when none is
    given (plan for this machine).

    Raises:
        UsageError: a bad value (one line naming the option and an example).
    """
    from tfmis.hardware import GPU_MODELS, Hardware, gpu_model, parse_memory_mb

    given = {name: getattr(args, name, None) for name in TARGET_FLAGS}
    if all(value is None for value in given.values()):
        return None

    def count(flag: str, text: str, least: int, example: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise UsageError(f"{flag} {text}: a whole number >= {least}, e.g. {flag} {example}")
        return value

    def memory(flag: str, text: str, example: str, least_mb: float) -> float:
        try:
            mb = parse_memory_mb(text)
        except ValueError:
            raise UsageError(
                f"{flag} {text}: not a memory size; give e.g. {flag} {example} (or {example[:-1]}, "
                f"{int(parse_memory_mb(example))}MB, or plain MB)"
            ) from None
        if mb < least_mb:
            number = text.strip()
            if number.replace(".", "", 1).isdigit():  # a plain number is MB: likely meant as GB
                raise UsageError(f"{flag} {text}: that is {mb:g} MB; did you mean {flag} {number}GB?")
            raise UsageError(
                f"{flag} {text}: {mb:g} MB is less than the {least_mb / 1024:g} GB a target needs to be planned for; "
                f"give at least {flag} {least_mb / 1024:g}GB"
            )
        return mb

    if given["gpu"] is not None and gpu_model(given["gpu"]) is None:
        raise UsageError(
            f"--gpu {given['gpu']}: not a GPU tfmis knows ({', '.join(GPU_MODELS)}); for another, give its memory, "
            "e.g. --gpu-memory 80GB"
        )
    gpu_memory = None if given["gpu_memory"] is None else memory("--gpu-memory", given["gpu_memory"], "80GB", 1024)
    host_memory = None if given["host_memory"] is None else memory("--host-memory", given["host_memory"], "512GB", 1024)
    cpus = None if given["cpus"] is None else count("--cpus", given["cpus"], 1, "64")
    described = given["gpu"] is not None or gpu_memory is not None
    gpus = (1 if described else 0) if given["gpus"] is None else count("--gpus", given["gpus"], 0, "8")
    if gpus and not described:
        raise UsageError(
            f"--gpus {gpus}: give the GPUs' memory too, e.g. --gpu-memory 80GB, or their model, e.g. --gpu H100-80GB"
        )
    if not gpus and described:
        raise UsageError(
            "--gpus 0 plans for a machine without GPUs: drop --gpu / --gpu-memory, or give --gpus 1 or more"
        )
    flags = "/".join(f"--{name.replace('_', '-')}" for name, value in given.items() if value is not None)
    return Hardware.target(
        gpus=gpus,
        gpu_memory_mb=gpu_memory,
        name=given["gpu"],
        cpus=cpus,
        host_memory_mb=host_memory,
        here=here,
        given=flags,
    )


def log(line: str) -> None:
    print(line, file=sys.stderr)


@dataclasses.dataclass
class Stage:
    """One run of a plan: its name ("" for a plain config), its config file and the config loaded from it."""

    name: str
    path: Path
    config: Config


@dataclasses.dataclass
class PlannedRun:
    """What `plan_source` planned: the plan file, the fingerprint and planner arguments that made it (None when
    an existing plan was resumed), and the overrides given."""

    path: Path
    overrides: list[str]
    fingerprint: object | None = None
    configuration: str | None = None
    plan_args: dict = dataclasses.field(default_factory=dict)
    hardware: object | None = None  # the `Hardware` planned for (None: this machine, or a resumed plan)


def split_overrides(overrides) -> tuple[dict, list[str]]:
    """(the overrides of `STAGE_PLAN_KEYS`, as a nested dict; the others, which every stage takes)."""
    given: dict = {}
    rest = []
    for override in overrides:
        if override.split("=", 1)[0].strip() in STAGE_PLAN_KEYS:
            apply_override(given, override)
        else:
            rest.append(override)
    return given, rest


def stage_overrides(overrides, stages_file: bool) -> list[str]:
    """The overrides each stage's config takes: all of them for a plain config; for the stages of a stages file
    (one or several), all but the plan's (each stage keeps its run folder and its share of the budget)."""
    return split_overrides(overrides)[1] if stages_file else list(overrides)


def load_stages(path: str | Path, overrides=()) -> list[Stage]:
    """The stages of a plan of stages (`stages:` list), or the config at `path` as one stage named ""."""
    listed = read_stage_list(path)
    per_stage = stage_overrides(overrides, listed is not None)
    return [Stage(name, Path(p), load_config(p, per_stage)) for name, p in listed or [("", Path(path))]]


def plan_source(
    source_dir: str | Path,
    overrides=(),
    *,
    resume: bool = False,
    configuration: str | None = None,
    hardware=None,
    log=log,
) -> tuple[list[Stage], PlannedRun]:
    """Plans the MSD folder `source_dir` for this machine (or for `hardware`, a `Hardware.target`) and writes the
    plan: the recommended configuration at `<output.dir>/plan.yaml` (with several candidates, a stages file naming
    its stages' `<output.dir>/<stage>/plan.yaml`) and every candidate in `<output.dir>/candidates.yaml`; with
    `resume` and a plan there, that plan is kept.

    The overrides' `data.dataset_dir`, `output.dir` and `training.max_minutes` (a budget the stages share) are
    the plan's; the other overrides go into every stage's config.

    Raises:
        DatasetNotFound: `source_dir` holds no dataset.json (exit 2).
        UsageError: `configuration` makes no sense for this dataset.
        DataError: the dataset is unusable.
    """
    from tfmis.data.msd import DatasetNotFound
    from tfmis.planning import default_output_dir, plan_dataset_stages

    source = Path(source_dir)
    if not (source / "dataset.json").is_file():
        raise DatasetNotFound(
            f"--source-dir {source}: no dataset.json there; give the dataset folder (MSD or nnU-Net v2 raw) that "
            "holds dataset.json, imagesTr and labelsTr"
        )
    given, _ = split_overrides(overrides)
    target = (given.get("data") or {}).get("dataset_dir")
    output = (given.get("output") or {}).get("dir")
    minutes = (given.get("training") or {}).get("max_minutes")
    existing = Path(output or default_output_dir(source)) / "plan.yaml"
    if resume and existing.is_file():
        kept = " (the target machine's options apply to a new plan only)" if hardware is not None else ""
        log(f"Resuming with the plan in {existing}{kept}")
        return load_stages(existing, overrides), PlannedRun(existing, list(overrides))
    staged, fingerprint = plan_dataset_stages(
        source, target, output, max_minutes=minutes, configuration=configuration, hardware=hardware
    )
    for stages in staged.candidates.values():
        for _, plan in stages:  # a bad override fails here, before writing
            plan.config(stage_overrides(overrides, not staged.single))
    path = staged.write()
    log(f"Plan for {fingerprint.name} ({staged.final.summary['hardware']}):\n{staged.table()}")
    log(f"Plan written to {path} (every value with its reason): edit it and rerun with --config {path}")
    if not staged.single:
        log(
            f"Every candidate in {staged.candidates_path()}: compare them with tfmis-crossval --config "
            f"{staged.candidates_path()}"
        )
    plan_args = {"source_dir": str(source), "dataset_dir": target, "output_dir": output, "max_minutes": minutes}
    planned = PlannedRun(path, list(overrides), fingerprint, staged.configuration, plan_args, hardware)
    return load_stages(path, overrides), planned


def cached_gpu_fit(stages: list[Stage], planned: PlannedRun, log=log, hardware=None, lookup=None) -> list[Stage]:
    """The stages planned again with the GPU-fit search's cached measurement of each stage's own config (batch
    size, sliding-window batch size, placement) and the plan files rewritten; the stages unchanged without a GPU,
    without the planner's inputs (a resumed plan keeps its values), or without a cached measurement.

    Args:
        hardware: default `detect_hardware()`.
        lookup: `config -> measured values or None` (default: the search's cache).
    """
    from tfmis.hardware import detect_hardware
    from tfmis.planning import replan_with_cached_gpu_fit

    hardware = hardware or detect_hardware()
    if not hardware.has_gpu or planned.fingerprint is None or planned.hardware is not None:
        return stages  # planned.hardware: planned for another machine, which this one's measurements do not fit
    staged = replan_with_cached_gpu_fit(
        planned.fingerprint, hardware, configuration=planned.configuration, lookup=lookup, **planned.plan_args
    )
    if staged is None:
        log(
            "GPU-fit search: no cached result for this plan; batch sizes are estimates (add --gpu-customization "
            "to measure them; later plans reuse the measurement)"
        )
        return stages
    staged.write()
    log("GPU-fit search: the cached measurement of each stage's config is in the plan")
    precision = {s.name: s.config.training.precision for s in stages}
    reloaded = load_stages(planned.path, planned.overrides)
    for stage in reloaded:
        stage.config.training.precision = precision.get(stage.name, stage.config.training.precision)
    return reloaded


@dataclasses.dataclass(frozen=True)
class TrainedStage:
    """A stage `StageRunner` trained: its config as trained and its global batch."""

    config: Config
    global_batch: int


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
    ):
        self.backend, self.resume, self.gpu_fit, self.customize = backend, resume, gpu_fit, customize
        self.on_stage_end, self._log = on_stage_end, log
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
        from tfmis.engine.bookkeeping import run_folder_lock

        summaries = []
        # one process trains a planned run: the measurement applies (several workers take the plan as it is)
        fit = self.gpu_fit is not None and planned is not None and self.backend.size == 1 and self.customize is None
        for i, stage in enumerate(stages):
            if len(stages) > 1:
                done = Path(stage.config.output.dir) / SUMMARY_FILE
                if self.resume and done.is_file():
                    self.log(f"Stage {i + 1}/{len(stages)} ({stage.name}): finished earlier ({done}), skipped")
                    summaries.append(None)
                    continue
                self.log(f"Stage {i + 1}/{len(stages)} ({stage.name}): {stage.config.output.dir}")
            self.warn(stage.config, stage.path)
            # the run folder is held from before the conversion: a second run into it stops before converting
            with run_folder_lock(self.backend, stage.config.output.dir):
                self.prepare(stage.config)
                if fit:  # after this stage's conversion: the search's cache is keyed by the converted data
                    stages[i:] = self.gpu_fit(stages, planned)[i:]
                    stage = stages[i]
                summaries.append(self.train_stage(stage.config))
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
        from tfmis.data.budget import check_input_memory
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
                f"{config.data.dataset_dir}/arrays ({done['written']} written, {done['relocated']} re-indexed, "
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
