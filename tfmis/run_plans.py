"""The stages a training runs, and its plan: the API under `tfmis-train --config` and `--source-dir`.

- `plan_source`: plans a dataset folder on this machine (the candidates full resolution, low resolution, a cascade)
  and writes the recommended one's plan and the candidates file; with `resume` an existing plan is kept;
- `load_stages`: the stages of a config file or of a plan of stages, with `--set` overrides;
- `PlanBudget`: `--set training.max_minutes` on a plan, the whole command's wall time its stages share;
- `cached_gpu_fit`: the stages planned again with the GPU-fit search's cached measurement.

The overrides of a plan as a whole (`STAGE_PLAN_KEYS`) reach every stage: `output.dir` becomes the parent of the
stages' run folders (`<dir>/<stage>`, a cascade's `cascade.coarse_run` following its coarse stage), `data.dataset_dir`
replaces the part of the stages' conversion folders they share (`X`, `X_lowres`, `X_roi`), `training.max_minutes`
is the whole command's wall time (`PlanBudget`). None is dropped: one that cannot apply is refused in one line.
`tfmis.stage_runner.StageRunner` trains what this module gives.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from tfmis.config import Config, ConfigError, apply_override, load_config
from tfmis.config import load_stages as read_stage_list
from tfmis.engine.time_budget import budget_epoch_bound

# the overrides that belong to the plan as a whole: where the stages convert and train, and the budget they share
STAGE_PLAN_KEYS = ("data.dataset_dir", "output.dir", "training.max_minutes")
# a plan's budget (`PlanBudget`): a stage's time outside its training loop (building the trainer, restoring, the
# final weights, summary, plots and preview), assumed until the first stage of the process has measured it
STAGE_OVERHEAD_SECONDS = 10.0


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
    from tfmis.data.sources.errors import DatasetNotFound
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
    from tfmis.planning.inputs import cpu_patch_voxels

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
