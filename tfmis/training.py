"""Training a config or a plan of stages: the API under `tfmis-train`.

- `plan_source`: plans an MSD folder on this machine (the candidates full resolution, low resolution, a cascade)
  and writes the recommended one's plan and the candidates file; with `resume` an existing plan is kept;
- `load_stages`: the stages of a config file or of a plan of stages, with `--set` overrides;
- `StageRunner`: trains the stages one after another on one backend: a finished stage is skipped on resume, the
  stages share the plan's time budget (each stage's `training.max_minutes`, or, with `--set training.max_minutes`
  on a plan, the command's wall time split over the stages as they start: `PlanBudget`), every stage gets the
  GPU-fit search's cached measurement for its own config, and the workers leave together (`backend.finish`) after
  a failure too.

The overrides of a plan as a whole (`STAGE_PLAN_KEYS`) reach every stage: `output.dir` becomes the parent of the
stages' run folders (`<dir>/<stage>`, a cascade's `cascade.coarse_run` following its coarse stage), `data.dataset_dir`
replaces the part of the stages' conversion folders they share (`X`, `X_lowres`, `X_roi`), `training.max_minutes`
is the whole command's wall time (`PlanBudget`). None is dropped: one that cannot apply is refused in one line.

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
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tfmis.config import Config, ConfigError, apply_override, load_config
from tfmis.config import load_stages as read_stage_list
from tfmis.engine.time_budget import SAFETY_SHARE, budget_epoch_bound
from tfmis.errors import TrainingFailed, UsageError

# the overrides that belong to the plan as a whole: where the stages convert and train, and the budget they share
STAGE_PLAN_KEYS = ("data.dataset_dir", "output.dir", "training.max_minutes")
# a plan's budget (`PlanBudget`): a stage's time outside its training loop (building the trainer, restoring, the
# final weights, summary, plots and preview), assumed until the first stage of the process has measured it...
STAGE_OVERHEAD_SECONDS = 10.0
# ...and the process's own end after the last stage (the workers' barrier, TensorFlow's teardown)
EXIT_SECONDS = 2.0
LEAST_STAGE_SECONDS = 15.0  # a stage's training loop shorter than this is refused before it starts
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
    parser.add_argument(
        "--cpu-patch",
        type=int,
        default=None,
        metavar="EDGE",
        help=f"{when}a CPU plan's patch voxel target as a cube's edge (default 48: 48^3 voxels; 64 plans larger "
        "patches; a GPU plan's patch comes from the GPU's memory)",
    )


def cpu_patch_voxels(edge: int | None) -> int | None:
    """`--cpu-patch EDGE` as the planner's voxel target (None: the planner's default), refusing an edge under 16."""
    if edge is None:
        return None
    if edge < 16:
        raise UsageError(f"--cpu-patch {edge}: the patch cube's edge in voxels, at least 16, e.g. --cpu-patch 64")
    return int(edge) ** 3


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
class PlanBudget:
    """`--set training.max_minutes=M` on a plan (a stages file, or `--source-dir`): the whole command's wall time,
    planning, converting and every stage's start and end included, split over the stages.

    Each stage's share of the training time is its weight: in proportion to the stages' own planned
    `training.max_minutes` when every stage has one (the planner's split of a budget: a cascade's coarse stage 0.3),
    else equal. The split is made when a stage starts (`StageRunner`): the time left to the deadline, less the
    time each stage left spends outside its training loop (measured on the stages before, `STAGE_OVERHEAD_SECONDS`
    assumed before the first), goes to the stages left by weight, so that the command ends at its budget; the
    stage's `training.max_minutes` (in its config.yaml and `summary.json`'s `time_budget`) is its share, to which it
    fits its learning-rate schedule. `training.epochs` of the stages only bounds it when given with `--set` too
    (else it is raised to `budget_epoch_bound`). With `--resume` the budget is again the command's: the stages left
    share it, and an interrupted stage keeps its earlier training time besides.

    Attributes:
        minutes: M.
        weights: each stage's weight (stage name -> share of the training time, summing to 1).
        how: the split in words (the log line's).
    """

    minutes: float
    weights: dict[str, float]
    how: str

    def line(self) -> str:
        if len(self.weights) == 1:
            return (
                f"Plan budget: training.max_minutes={self.minutes:g} is the whole command's wall time (planning, "
                "converting, the start and end included): the training loop gets what is left when it starts"
            )
        split = ", ".join(f"{name} {w:.0%}" for name, w in self.weights.items())
        return (
            f"Plan budget: training.max_minutes={self.minutes:g} is the whole command's wall time (planning, "
            f"converting, every stage's start and end included), split over the stages {self.how} ({split}); each "
            "stage's training.max_minutes is set when it starts, from the time left"
        )


@dataclasses.dataclass
class Stage:
    """One run of a plan: its name ("" for a plain config), its config file, the config loaded from it, and the
    plan's budget when one is split over the stages (`PlanBudget`)."""

    name: str
    path: Path
    config: Config
    budget: PlanBudget | None = None


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


def load_stages(path: str | Path, overrides=(), plan: bool = False) -> list[Stage]:
    """The stages of a plan of stages (`stages:` list), or the config at `path` as one stage named "".

    The overrides of `STAGE_PLAN_KEYS` apply to a plan as a whole (`apply_plan_overrides`); `plan`: `path` is a
    plan `plan_source` wrote, whose `training.max_minutes` override is the command's budget (`PlanBudget`) even
    when it is one plain config. Other overrides go into every stage.

    Raises:
        ConfigError: an override that cannot apply (one line naming it and the fix).
    """
    listed = read_stage_list(path)
    if listed is None:
        stages = [Stage("", Path(path), load_config(path, list(overrides)))]
        given, _ = split_overrides(overrides)
        if plan and (given.get("training") or {}).get("max_minutes") is not None:
            minutes = _minutes(given["training"]["max_minutes"])
            stages[0].budget = PlanBudget(minutes, {"": 1.0}, "(one stage)")
            _bound_epochs(stages, minutes, overrides)
        return stages
    given, rest = split_overrides(overrides)
    stages = [Stage(name, Path(p), load_config(p, rest)) for name, p in listed]
    apply_plan_overrides(stages, given, overrides)
    return stages


def _minutes(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"--set training.max_minutes={value}: a number of minutes > 0, e.g. training.max_minutes=30")
    return float(value)


def _bound_epochs(stages: list[Stage], minutes: float, overrides) -> None:
    """Raises the stages' `training.epochs` so that only the budget decides their schedules, unless it was given
    with `--set` too (then it stays the bound it is in any config)."""
    if any(o.split("=", 1)[0].strip() == "training.epochs" for o in overrides):
        return
    for stage in stages:
        stage.config.training.epochs = max(stage.config.training.epochs, budget_epoch_bound(minutes))


def apply_plan_overrides(stages: list[Stage], given: dict, overrides=()) -> None:
    """Applies the plan's overrides (`split_overrides`' first part) to the stages of a plan:

    - `output.dir=X`: each stage trains in `X/<stage name>`; a cascade's `cascade.coarse_run` naming an earlier
      stage's run folder follows it there.
    - `data.dataset_dir=X`: X replaces the part the stages' conversion folders share (a plan's `D`, `D_lowres` and
      `D_roi` become `X`, `X_lowres` and `X_roi`; stages sharing one conversion all convert to X).
    - `training.max_minutes=M`: the command's wall time, split over the stages (`PlanBudget`); each stage's
      `training.max_minutes` is its planned share until `StageRunner` sets it from the time left.

    Raises:
        ConfigError: a stage name that cannot be a folder, or conversion folders with nothing in common.
    """
    output = (given.get("output") or {}).get("dir")
    if output is not None:
        names = [s.name for s in stages]
        for name in names:
            if not name or name in (".", "..") or "/" in name or names.count(name) > 1:
                raise ConfigError(
                    f"--set output.dir={output}: stage name {name!r} cannot name its folder under it; give the "
                    "stages distinct names without '/' in the plan"
                )
        moved = {str(Path(s.config.output.dir).resolve()): str(Path(output) / s.name) for s in stages}
        for stage in stages:
            stage.config.output.dir = str(Path(output) / stage.name)
            coarse = stage.config.cascade.coarse_run
            if coarse and str(Path(coarse).resolve()) in moved:
                stage.config.cascade.coarse_run = moved[str(Path(coarse).resolve())]
    dataset = (given.get("data") or {}).get("dataset_dir")
    if dataset is not None:
        mapping = plan_dataset_dirs([s.config.data.dataset_dir for s in stages], str(dataset))
        for stage in stages:
            stage.config.data.dataset_dir = mapping[stage.config.data.dataset_dir]
    minutes = (given.get("training") or {}).get("max_minutes")
    if minutes is not None:
        minutes = _minutes(minutes)
        planned = [s.config.training.max_minutes for s in stages]
        if len(stages) > 1 and all(p is not None and p > 0 for p in planned):
            total = sum(planned)
            weights = {s.name: p / total for s, p in zip(stages, planned)}
            how = "in proportion to their planned training.max_minutes"
        else:
            weights = {s.name: 1.0 / len(stages) for s in stages}
            how = "equally" if len(stages) > 1 else "(one stage)"
        budget = PlanBudget(minutes, weights, how)
        for stage in stages:
            stage.budget = budget
            stage.config.training.max_minutes = round(minutes * weights[stage.name], 2) or 0.01
        _bound_epochs(stages, minutes, overrides)


def plan_dataset_dirs(folders: list[str], target: str) -> dict[str, str]:
    """Each stage's conversion folder with `target` in place of the part they share (see `apply_plan_overrides`)."""
    distinct = sorted(set(folders))
    if len(distinct) == 1:
        return {distinct[0]: target}
    prefix = os.path.commonprefix(distinct)
    while prefix and not all(len(d) == len(prefix) or d[len(prefix)] in "_-./" for d in distinct):
        prefix = prefix[:-1]
    if not prefix.strip("/."):
        raise ConfigError(
            f"--set data.dataset_dir={target}: the stages convert into unrelated folders ({', '.join(distinct)}), so "
            "one folder cannot replace them; set data.dataset_dir in each stage's config instead"
        )
    base = target.rstrip("/") or target
    return {d: base + d[len(prefix) :] for d in distinct}


def plan_source(
    source_dir: str | Path,
    overrides=(),
    *,
    resume: bool = False,
    configuration: str | None = None,
    hardware=None,
    log=log,
    cpu_patch: int | None = None,
) -> tuple[list[Stage], PlannedRun]:
    """Plans the MSD folder `source_dir` for this machine (or for `hardware`, a `Hardware.target`) and writes the
    plan: the recommended configuration at `<output.dir>/plan.yaml` (with several candidates, a stages file naming
    its stages' `<output.dir>/<stage>/plan.yaml`) and every candidate in `<output.dir>/candidates.yaml`; with
    `resume` and a plan there, that plan is kept. `cpu_patch`: `--cpu-patch`'s edge (a CPU plan's patch target).

    The overrides' `data.dataset_dir`, `output.dir` and `training.max_minutes` (a budget the stages share) are
    the plan's; the other overrides go into every stage's config.

    Raises:
        DatasetNotFound: `source_dir` holds no dataset.json (exit 2).
        UsageError: `configuration` makes no sense for this dataset.
        DataError: the dataset is unusable.
    """
    from tfmis.data.msd import DatasetNotFound
    from tfmis.planning import plan_dataset_stages

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
    existing = planned_output_dir(source, overrides) / "plan.yaml"
    if resume and existing.is_file():
        kept = " (the target machine's options apply to a new plan only)" if hardware is not None else ""
        log(f"Resuming with the plan in {existing}{kept}")
        return load_stages(existing, overrides, plan=True), PlannedRun(existing, list(overrides))
    voxels = cpu_patch_voxels(cpu_patch)
    patch_args = {} if voxels is None else {"cpu_patch_voxels": voxels}
    staged, fingerprint = plan_dataset_stages(
        source, target, output, max_minutes=minutes, configuration=configuration, hardware=hardware, **patch_args
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
    plan_args.update(patch_args)
    planned = PlannedRun(path, list(overrides), fingerprint, staged.configuration, plan_args, hardware)
    return load_stages(path, overrides, plan=True), planned


def planned_output_dir(source_dir: str | Path, overrides=()) -> Path:
    """The folder `plan_source` writes the plan of `source_dir` into: `--set output.dir`, else the default run
    folder of the dataset."""
    from tfmis.planning import default_output_dir

    output = (split_overrides(overrides)[0].get("output") or {}).get("dir")
    return Path(output or default_output_dir(Path(source_dir)))


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
    reloaded = load_stages(planned.path, planned.overrides, plan=True)
    for stage in reloaded:
        stage.config.training.precision = precision.get(stage.name, stage.config.training.precision)
    return reloaded


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
