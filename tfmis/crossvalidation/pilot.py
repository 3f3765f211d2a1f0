"""A pilot: the plan's candidates compared by short trainings, the best trained with the time left.

`tfmis-train --source-dir D --set training.max_minutes=M --pilot` replaces two of the planner's rules by a
measurement on the dataset itself: full against low resolution (`planning.stages`' recommendation) and, on a CPU,
the patch's voxel target (48^3, `CPU_PATCH_VOXELS`, against 64^3).

- **Candidates**: the planner's single-stage candidates (full resolution; low resolution where it is one) at the
  CPU patch target and, on a CPU, at `LARGER_CPU_PATCH_VOXELS` too (a larger patch also moves the low-resolution
  spacing, or leaves no low-resolution candidate); identical configs once. The cascade is not piloted: its fine
  stage needs a trained coarse stage (compare it with `tfmis-crossval`).
- **Successive halving** (halving at each rung) within `share` of M (default `PILOT_SHARE`): rung r trains its
  candidates from scratch, each for t x 2^r seconds of training loop (a trainer fits its learning-rate schedule
  to its budget, so every pilot run is a complete short training), scores each one's final weights on the plan's
  validation cases (from the original scans, on their original grid: what `tfmis-predict` gives; Dice per
  structure as nnU-Net's, the mean over structures, then cases) and keeps the better half, ties going to the
  planner's recommendation. t is set before each rung from the pilot time left and the time each run spent
  outside its loop (measured; `RUN_OVERHEAD_SECONDS` assumed before the first).
- **The choice**: the last candidate is planned again as the recommendation, with the pilot's table in its
  plan.yaml header and `summary.pilot`, and trained with what is left of M (the command's budget counts from its
  start, `tfmis.run_plans.PlanBudget`, so the pilot's cost is in it). Too small a budget (a candidate's loop under
  `LEAST_RUNG_SECONDS`) or one candidate: the pilot says so and the planner's rule stands.
- Pilot runs train in `<output.dir>/pilot/r<rung>-<candidate>/`; `pilot.json` there records each scored run as
  it ends and the choice. `--resume` after the choice trains the chosen plan; before it, the pilot goes on, its
  scored runs reused (`pilot_choice`).

This is not yet measured against the rules it replaces on the planner zoo (docs/benchmarks.md): it is opt-in.

Example:
```python
stages, planned = plan_source("data/zoo/brain_1mm_seed0", ["training.max_minutes=20"])
stages, planned = run_pilot(planned, StageRunner(backend, gpu_fit=None))
```
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import textwrap
import time
from pathlib import Path

from tfmis.errors import UsageError
from tfmis.utils.io import atomic_write_json

PILOT_SHARE = 0.3  # of the command's budget, for the pilot
LEAST_RUNG_SECONDS = 30.0  # a candidate's shortest pilot loop: shorter, the first epochs' tracing is most of it
RUN_OVERHEAD_SECONDS = 25.0  # a run's time outside its loop (build, trace, final weights, scoring), until measured
LARGER_CPU_PATCH_VOXELS = 64**3
PILOT_FILE = "pilot.json"


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclasses.dataclass
class Candidate:
    """One configuration the pilot trains: its name (e.g. "fullres 64x64x64"), the planner's configuration and
    CPU patch target that plan it, whether it is the planner's own recommendation, and its stage plan."""

    name: str
    configuration: str
    cpu_patch_voxels: int
    recommended: bool
    plan: object  # tfmis.planning.Plan

    @property
    def folder_name(self) -> str:
        return self.name.replace(" ", "-")


def rung_sizes(n: int) -> list[int]:
    """The candidates each rung of successive halving trains: n, then ceil(n / 2), ... down to the last rung of two
    (the rung that leaves one)."""
    sizes = []
    while n > 1:
        sizes.append(n)
        n = math.ceil(n / 2)
    return sizes


def rung_seconds(pilot_seconds: float, sizes: list[int], overhead: float) -> float:
    """The loop seconds t of the first of the rungs `sizes` left, rung r training t x 2^r a candidate, so that the
    rungs' loops and each run's `overhead` fill `pilot_seconds`: t = (P - runs x overhead) / sum(n_r x 2^r)."""
    runs = sum(sizes)
    units = sum(n * 2**r for r, n in enumerate(sizes))
    return (pilot_seconds - runs * overhead) / units


def pilot_candidates(fingerprint, hardware, plan_args: dict) -> list[Candidate]:
    """The single-stage candidates of the planner at the CPU patch target and, on a CPU, at
    `LARGER_CPU_PATCH_VOXELS`, identical configs (conversion spacing and patch) once; the planner's recommendation
    first."""
    from tfmis.planning.inputs import CPU_PATCH_VOXELS
    from tfmis.planning.stages import plan_stages

    targets = [CPU_PATCH_VOXELS] + ([] if hardware.has_gpu else [LARGER_CPU_PATCH_VOXELS])
    out: list[Candidate] = []
    seen = set()
    for voxels in targets:
        staged = plan_stages(fingerprint, hardware, cpu_patch_voxels=voxels, **plan_args)
        for configuration, stages in staged.candidates.items():
            if len(stages) != 1:
                continue  # the cascade
            plan = stages[0][1]
            patch = tuple(plan.values["pipeline.patch_size"])
            key = (tuple(plan.values["data.conversion.spacing"]), patch)
            if key in seen:
                continue
            seen.add(key)
            name = f"{configuration} {'x'.join(str(p) for p in patch)}"
            recommended = voxels == CPU_PATCH_VOXELS and configuration == staged.recommended
            out.append(Candidate(name, configuration, voxels, recommended, plan))
    return sorted(out, key=lambda c: not c.recommended)


def validation_dice(config, run_dir: Path) -> tuple[float, int]:
    """(mean Dice of the run's final weights on its validation cases, predicted from the original scans on their
    grid: per case the mean over structures present in either map, then the mean over cases; the cases scored)."""
    import numpy as np

    from tfmis.crossvalidation.oof import prediction_name
    from tfmis.inference.cascade import make_predictor
    from tfmis.inference.inputs import collect_inputs
    from tfmis.postprocessing import case_dice

    predictor = make_predictor(config, run_dir, weights="final")
    source = Path(config.data.source_dir) / "dataset.json"
    cases = collect_inputs(source, f"split:{config.data.val_split}", None, predictor.index)
    if not cases:
        raise UsageError(
            f"--pilot: the plan's validation split {config.data.val_split!r} of {config.data.dataset_dir} has no "
            "case to score the pilot on; give the dataset more cases"
        )
    labels = list(range(1, len(predictor.class_names)))
    regions = dict(config.validation.regions) if predictor.task.paint_labels is not None else None
    out = Path(run_dir) / "validation"
    out.mkdir(parents=True, exist_ok=True)
    means = []
    for case in cases:
        result = predictor.predict_file(case, out)
        if result.status != "ok":
            raise UsageError(f"--pilot: {run_dir}: case {case.case_id} could not be predicted: {result.reason}")
        dice = [v for v in case_dice(out / prediction_name(case), case.label, labels, regions).values()]
        dice = [v for v in dice if not math.isnan(v)]
        means.append(float(np.mean(dice)) if dice else 1.0)
    return float(np.mean(means)), len(cases)


class Pilot:
    """Successive halving over `candidates` for `pilot_seconds`, in `folder` (see the module)."""

    def __init__(self, candidates: list[Candidate], pilot_seconds: float, folder: Path, runner, overrides=(), log=log):
        self.candidates, self.pilot_seconds, self.folder = candidates, pilot_seconds, Path(folder)
        self.runner, self.overrides, self.log = runner, list(overrides), log
        self.record_path = self.folder / PILOT_FILE
        self.record = self._read()
        self.overheads: list[float] = []

    def _read(self) -> dict:
        try:
            record = json.loads(self.record_path.read_text())
            return record if isinstance(record, dict) else {}
        except (OSError, ValueError):
            return {}

    def _write(self) -> None:
        atomic_write_json(self.record_path, self.record)

    def record_choice(self, chosen: Candidate, plan_path: Path, seconds: float) -> None:
        """Writes the choice into `pilot.json` (after the chosen plan is written: `pilot_choice` then finds both)."""
        self.record.update({"chosen": chosen.name, "plan": str(plan_path), "seconds": round(seconds, 1)})
        self._write()

    def run(self) -> tuple[Candidate, list[dict]]:
        """(the chosen candidate, every run's record: rung, candidate, loop seconds, Dice, seconds)."""
        started = time.time()
        sizes = rung_sizes(len(self.candidates))
        alive = list(self.candidates)
        runs: list[dict] = []
        for r in range(len(sizes)):
            spent = time.time() - started
            overhead = (sum(self.overheads) / len(self.overheads)) if self.overheads else RUN_OVERHEAD_SECONDS
            unit = rung_seconds(self.pilot_seconds - spent, sizes[r:], overhead)
            loop = max(unit, LEAST_RUNG_SECONDS)
            self.log(
                f"Pilot rung {r + 1}/{len(sizes)}: {len(alive)} candidates ({', '.join(c.name for c in alive)}), "
                f"{loop:.0f} s of training each, scored on the validation cases"
            )
            scored = []
            for candidate in alive:
                run = self.train_and_score(r, candidate, loop)
                runs.append(run)
                scored.append((run["dice"], candidate.recommended, -alive.index(candidate), candidate))
                self.log(f"Pilot rung {r + 1}: {candidate.name}: validation mean Dice {run['dice']:.4f}")
            scored.sort(key=lambda s: s[:3], reverse=True)
            alive = [s[3] for s in scored[: math.ceil(len(alive) / 2)]]
        return alive[0], runs

    def train_and_score(self, rung: int, candidate: Candidate, loop_seconds: float) -> dict:
        """Trains `candidate` for `loop_seconds` in its rung's folder (or reuses a run scored before) and scores it."""
        from tfmis.engine.bookkeeping import run_folder_lock
        from tfmis.engine.time_budget import budget_epoch_bound

        key = f"r{rung + 1}-{candidate.folder_name}"
        kept = self.record.get("runs", {}).get(key)
        run_dir = self.folder / key
        if kept and (run_dir / "summary.json").is_file():
            return kept
        if run_dir.exists():
            shutil.rmtree(run_dir)  # an interrupted pilot run: trained again
        start = time.time()
        config = candidate.plan.config(self.overrides)
        config.output.dir = str(run_dir)
        config.training.max_minutes = math.floor(loop_seconds / 60 * 100) / 100 or 0.01
        config.training.epochs = max(config.training.epochs, budget_epoch_bound(config.training.max_minutes))
        with run_folder_lock(self.runner.backend, config.output.dir):
            self.runner.prepare(config)
        summary = self.runner.train_stage(config)
        dice, cases = validation_dice(config, run_dir)
        seconds = time.time() - start
        trained = float(summary.get("elapsed_seconds") or 0.0)
        self.overheads.append(max(0.0, seconds - trained))
        run = {
            "rung": rung + 1,
            "candidate": candidate.name,
            "loop_seconds": round(trained, 1),
            "seconds": round(seconds, 1),
            "epochs": summary.get("epochs"),
            "dice": dice,
            "validation_cases": cases,
        }
        self.record.setdefault("runs", {})[key] = run
        self._write()
        return run


def pilot_choice(output_dir: str | Path) -> str | None:
    """The candidate a finished pilot of the plan in `output_dir` chose (its `pilot.json`), or None: no pilot, or one
    interrupted before it chose (a rerun continues it, reusing its scored runs)."""
    try:
        record = json.loads((Path(output_dir) / "pilot" / PILOT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record.get("chosen") if isinstance(record, dict) else None


def pilot_lines(chosen: Candidate, runs: list[dict], seconds: float, share: float) -> list[str]:
    """The plan.yaml header lines: what the pilot trained, each run's Dice, and the choice."""
    lines = textwrap.wrap(
        f"Pilot (tfmis.crossvalidation.pilot, {seconds:.0f} s of the {share:.0%} of the budget it may take): "
        "successive halving, each run trained from scratch, its final weights scored on the validation cases "
        "(original grid, mean Dice):",
        114,
        subsequent_indent="  ",
    )
    for run in runs:
        lines.append(
            f"  rung {run['rung']}: {run['candidate']}: {run['dice']:.4f} ({run['loop_seconds']:.0f} s training, "
            f"{run['epochs']} epochs)"
        )
    lines.append(f"  chosen: {chosen.name}")
    return lines


def check_pilot(share: float, minutes) -> None:
    """Refuses (`UsageError`, one line) a pilot without a budget to take its time from or with a share outside
    (0, 1); `tfmis-train` calls it before planning, `run_pilot` again."""
    if minutes is None:
        raise UsageError(
            "--pilot trains the candidates within the command's time budget: add --set training.max_minutes=M (e.g. 30)"
        )
    if not 0 < share < 1:
        raise UsageError(f"--pilot {share:g}: the share of the budget the pilot takes, between 0 and 1, e.g. 0.3")


def run_pilot(planned, runner, *, share: float = PILOT_SHARE, log=log):
    """Pilots the candidates of the plan `planned` (a `tfmis.run_plans.PlannedRun` that `plan_source` made, with its
    fingerprint) and plans the chosen one again as the recommendation; returns (stages, planned) to train, the
    plan's unchanged when the pilot does not run (one candidate, or too little time: one line says why).

    Raises:
        UsageError: no `training.max_minutes` to take the pilot's time from, a share outside (0, 1), several worker
            processes, or a plan resumed without its planner inputs.
    """
    from tfmis.planning.stages import plan_stages
    from tfmis.run_plans import PlannedRun, load_stages

    minutes = (planned.plan_args or {}).get("max_minutes")
    check_pilot(share, minutes)
    if runner.backend.size > 1:
        raise UsageError("--pilot runs in one process: run it without a launcher, then train its plan.yaml on many")
    if planned.fingerprint is None:  # a plan kept on --resume: a finished pilot's (`pilot_choice`)
        chosen = pilot_choice(Path(planned.path).parent)
        if chosen is None:
            raise UsageError(f"--pilot with --resume: {planned.path} was kept, but no pilot chose it; remove it")
        log(f"Pilot: chose {chosen} before ({Path(planned.path).parent / 'pilot' / PILOT_FILE}): training its plan")
        return load_stages(planned.path, planned.overrides, plan=True), planned
    if planned.hardware is not None:
        raise UsageError("--pilot trains here: plan for this machine (without --gpus/--gpu-memory/--gpu/--cpus)")
    from tfmis.hardware import detect_hardware

    hardware = detect_hardware()
    args = {k: planned.plan_args.get(k) for k in ("source_dir", "dataset_dir", "output_dir")}
    candidates = pilot_candidates(planned.fingerprint, hardware, args)
    pilot_seconds = share * float(minutes) * 60.0
    folder = Path(Path(planned.path).parent) / "pilot"
    if len(candidates) < 2:
        log(f"Pilot: one candidate ({candidates[0].name if candidates else 'none'}), nothing to choose")
        return load_stages(planned.path, planned.overrides, plan=True), planned
    sizes = rung_sizes(len(candidates))
    least = rung_seconds(pilot_seconds, sizes, RUN_OVERHEAD_SECONDS)
    if least < LEAST_RUNG_SECONDS:
        units = sum(n * 2**r for r, n in enumerate(sizes))
        need = (LEAST_RUNG_SECONDS * units + sum(sizes) * RUN_OVERHEAD_SECONDS) / share / 60
        log(
            f"Pilot skipped: {len(candidates)} candidates ({', '.join(c.name for c in candidates)}) need "
            f"training.max_minutes >= {math.ceil(need)} for {LEAST_RUNG_SECONDS:g} s of training each in "
            f"{share:.0%} of the budget; the planner's recommendation stands"
        )
        return load_stages(planned.path, planned.overrides, plan=True), planned
    pilot_start = time.time()
    from tfmis.run_plans import split_overrides

    log(
        f"Pilot: {len(candidates)} candidates ({', '.join(c.name for c in candidates)}), successive halving in "
        f"{pilot_seconds / 60:.1f} of the {float(minutes):g} minutes, in {folder}"
    )
    _, rest = split_overrides(planned.overrides)
    pilot = Pilot(candidates, pilot_seconds, folder, runner, rest, log)
    chosen, runs = pilot.run()
    seconds = time.time() - pilot_start
    lines = pilot_lines(chosen, runs, seconds, share)
    best = max(r["dice"] for r in runs if r["candidate"] == chosen.name)
    why = f"the pilot's choice ({chosen.name}, validation mean Dice {best:.4f})"
    staged = plan_stages(
        planned.fingerprint,
        hardware,
        configuration=chosen.configuration,
        configuration_reason=why,
        cpu_patch_voxels=chosen.cpu_patch_voxels,
        max_minutes=minutes,
        **args,
    )
    for _, plan in staged.stages:
        plan.header.extend([""] + lines)
        plan.summary["pilot"] = {"chosen": chosen.name, "runs": runs, "seconds": round(seconds, 1)}
    path = staged.write()
    pilot.record_choice(chosen, path, seconds)
    log("\n".join(lines))
    log(f"Plan written to {path} (the pilot's choice)")
    replanned = PlannedRun(
        path, planned.overrides, planned.fingerprint, chosen.configuration, planned.plan_args, planned.hardware
    )
    return load_stages(path, planned.overrides, plan=True), replanned
