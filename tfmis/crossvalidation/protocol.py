"""nnU-Net's protocol in one call (`tfmis-auto`): plan the candidate configurations, cross-validate them, choose.

1. **Plan** (`tfmis.run_plans.plan_source`) into `<output>/plan/`: every candidate configuration in `candidates.yaml`
   (full resolution always; low resolution and a cascade where the low-resolution stage saves at least 2x the
   voxels), the recommended one in `plan.yaml`. A rerun keeps the plan.
2. **The configurations**: every candidate, or those `configurations` names. A cascade brings its coarse stage,
   which is the low-resolution configuration, so it is scored too.
3. **The budget** (`max_minutes`, optional, counted from the command's start): the data are converted into the
   folds first; the time left, less `CHOICE_SHARE` for the choice at the end, is each worker's lane for its
   trainings (K folds times the stages, `workers` at a time) and its folds' out-of-fold predictions: the trainings
   of a fold get one share each, the same for every configuration (`training.max_minutes`, to which each fits its
   learning-rate schedule, the plan's `training.epochs` raised so that it does not cap it), set when the fold
   starts from what is left, the start-up time the trainings before it took and the out-of-fold predictions left
   (`tfmis.crossvalidation.jobs.training_minutes`). The split is written to `<output>/protocol.json` and kept by
   a rerun, which then continues the same cross-validation instead of starting another.
4. **Cross-validation** (`tfmis-crossval`) into `<output>/cv`: the folds as parallel experiments, each held-out
   fold predicted with the weights its training ended with, the configuration or pair of configurations and the
   postprocessing chosen by the out-of-fold Dice.
5. `tfmis-predict --checkpoint <output>/cv` predicts with what was chosen.

Example:
```python
protocol = Protocol("data/Task09_Spleen", "runs/spleen_auto", folds=5, max_minutes=600, workers=2)
code = protocol.run()      # 0: <output>/cv/crossval.json holds the choice
```
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from tfmis.crossvalidation.jobs import FIRST_OVERHEAD_SECONDS, TRAINING_BUDGET_FILE
from tfmis.errors import UsageError
from tfmis.utils.io import atomic_write_json

PROTOCOL_FILE = "protocol.json"
# of the time left after the conversion: what the out-of-fold predictions (and pairs) are assumed to take until a
# worker has measured one (each worker's trainings then share what its measured predictions leave)...
OOF_SHARE = 0.15
# ...and, kept outside the workers' lanes, the choice at the end (scores, pairs, postprocessing, the result files)
CHOICE_SHARE = 0.02
MIN_TRAINING_MINUTES = 0.5  # a training loop shorter than this learns nothing worth comparing
CONFIGURATION_STAGES = {"fullres": ["fullres"], "lowres": ["lowres"], "cascade": ["lowres", "cascade"]}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclasses.dataclass
class Protocol:
    """The protocol for the MSD folder `source_dir` into `output` (see the module docstring).

    Args:
        source_dir: the MSD folder (dataset.json, imagesTr, labelsTr).
        output: the protocol's folder: plan/, cv/, protocol.json.
        folds: K.
        configurations: the candidates to cross-validate (None: every candidate of the plan).
        max_minutes: the wall-clock budget of the whole protocol (None: each training's planned length).
        workers: folds trained at once on this machine (`tfmis-crossval --workers`).
        overrides: `KEY=VALUE` for every configuration (`--set`).
        hardware: a `Hardware.target` to plan for (None: this machine).
        started: when the command started (`time.time()`), from which the budget counts (None: now).
    """

    source_dir: str | Path
    output: str | Path
    folds: int = 5
    configurations: list[str] | None = None
    max_minutes: float | None = None
    workers: int = 1
    overrides: list[str] = dataclasses.field(default_factory=list)
    hardware: object = None
    started: float | None = None

    def __post_init__(self):
        self.output = Path(self.output)
        self.plan_dir, self.cv_dir = self.output / "plan", self.output / "cv"
        self.start = self.started if self.started is not None else time.time()  # this invocation's

    def run(self) -> int:
        """Plans, converts, splits the budget, cross-validates and chooses; the cross-validation's exit status."""
        from tfmis.crossvalidation.driver import cross_validate, make_definition
        from tfmis.utils.cli import run_command, writing

        self.output.mkdir(parents=True, exist_ok=True)
        record = self.read_record()
        names, paths = self.plan()
        stages_file = self.write_configurations(names, paths)
        if record is None:
            record = self.split_budget(stages_file, names)
            atomic_write_json(self.output / PROTOCOL_FILE, record)
        else:
            log(f"Continuing the protocol in {self.output} ({PROTOCOL_FILE}): {record['summary']}")
        if record.get("lane_seconds"):
            self.cv_dir.mkdir(parents=True, exist_ok=True)
            lane = {k: record[k] for k in ("lane_seconds", "oof_seconds") if k in record}
            atomic_write_json(self.cv_dir / TRAINING_BUDGET_FILE, lane)
        overrides = [*self.overrides, *record["overrides"]]

        def cross_validation(_argv) -> int:  # its errors one line each and its exit status, as tfmis-crossval's
            definition = make_definition([str(stages_file)], self.folds, overrides)
            writing(self.cv_dir)
            return cross_validate(self.cv_dir, definition, self.workers)

        code = run_command(cross_validation)
        wall = record.get("wall_seconds", 0.0) + time.time() - self.start  # every invocation's time
        record["wall_seconds"] = wall
        atomic_write_json(self.output / PROTOCOL_FILE, record)
        budget = f" of the {self.max_minutes:g}-minute budget" if self.max_minutes else ""
        log(f"Protocol: {wall / 60:.1f} min{budget}. Predict with: tfmis-predict --checkpoint {self.cv_dir} ...")
        return code

    # ------------------------------------------------------------------ the steps

    def read_record(self) -> dict | None:
        path = self.output / PROTOCOL_FILE
        if not path.is_file():
            return None
        record = json.loads(path.read_text())
        asked = self.identity()
        if record.get("identity") != asked:
            raise UsageError(
                f"{self.output} holds a protocol run with other settings ({record.get('identity')}); give another "
                f"--output, or the same --folds, --configurations, --max-minutes and --set to continue it"
            )
        return record

    def identity(self) -> dict:
        return {
            "source_dir": str(Path(self.source_dir).resolve()),
            "folds": self.folds,
            "configurations": self.configurations,
            "max_minutes": self.max_minutes,
            "overrides": list(self.overrides),
        }

    def plan(self) -> tuple[list[str], dict[str, Path]]:
        """The plan (kept on a rerun): the configurations to cross-validate and every candidate stage's plan file."""
        from tfmis.config import load_stages
        from tfmis.run_plans import plan_source

        overrides = [*self.overrides, f"output.dir={self.plan_dir}"]
        plan_source(self.source_dir, overrides, resume=True, hardware=self.hardware)
        candidates = self.plan_dir / "candidates.yaml"
        if candidates.is_file():
            paths = {name: Path(path) for name, path in load_stages(candidates)}
        else:  # a plan of one candidate: plan.yaml is the full-resolution config itself
            paths = {"fullres": self.plan_dir / "plan.yaml"}
        offered = [c for c, stages in CONFIGURATION_STAGES.items() if all(s in paths for s in stages)]
        names = offered if self.configurations is None else list(self.configurations)
        missing = [n for n in names if n not in offered]
        if missing:
            raise UsageError(
                f"--configurations {','.join(names)}: the plan offers {', '.join(offered)} for this dataset, not "
                f"{', '.join(missing)} (a low-resolution stage must save at least 2x the voxels; "
                f"{self.plan_dir / 'plan.yaml'} says why)"
            )
        return names, paths

    def write_configurations(self, names: list[str], paths: dict[str, Path]) -> Path:
        """A stages file of the stages the configurations need, in training order (a coarse stage before its
        cascade): what `tfmis-crossval --config` cross-validates."""
        from tfmis.config import write_stages

        stages = list(dict.fromkeys(s for name in names for s in CONFIGURATION_STAGES[name]))
        stages.sort(key=["fullres", "lowres", "cascade"].index)
        path = self.output / "configurations.yaml"
        write_stages(path, [(s, paths[s]) for s in stages], [f"tfmis-auto: cross-validates {', '.join(names)}"])
        return path

    def split_budget(self, stages_file: Path, names: list[str]) -> dict:
        """Converts the folds (so their time is known), then splits the time left over the trainings; the record
        kept in protocol.json."""
        from tfmis.config import load_stages

        stages = load_stages(stages_file)
        trainings = self.folds * len(stages)
        record = {"identity": self.identity(), "configurations": names, "trainings": trainings, "overrides": []}
        if self.max_minutes is None:
            record["summary"] = (
                f"{len(names)} configuration(s) ({', '.join(names)}) x {self.folds} folds = {trainings} trainings of "
                "their planned length, no time budget"
            )
            log(f"Protocol: {record['summary']}")
            return record
        self.convert(stages_file)
        spent = (time.time() - self.start) / 60
        left = self.max_minutes - spent
        rounds = math.ceil(trainings / self.workers)
        fold_rounds = math.ceil(self.folds / self.workers)  # a worker's folds, each with its out-of-fold prediction
        lane = left * (1 - CHOICE_SHARE)  # each worker's jobs: its trainings and its folds' out-of-fold predictions
        oof = left * OOF_SHARE / fold_rounds  # one out-of-fold prediction, until one has been measured
        each = (lane - oof * fold_rounds) / rounds
        startup = FIRST_OVERHEAD_SECONDS / 60  # each training process's time outside its training loop, at least
        if each - startup < MIN_TRAINING_MINUTES:
            need = spent + (MIN_TRAINING_MINUTES + startup) * rounds / (1 - CHOICE_SHARE - OOF_SHARE)
            raise UsageError(
                f"--max-minutes {self.max_minutes:g}: after planning and converting ({spent:.1f} min), {trainings} "
                f"trainings ({len(stages)} stage(s) x {self.folds} folds, {self.workers} at a time) would get "
                f"{each:.2f} min each, {each - startup:.2f} of it training after their start-up; give at least "
                f"{math.ceil(need):.0f} minutes, fewer --folds or fewer --configurations"
            )
        each = math.floor(each * 100) / 100
        record["overrides"] = [f"training.max_minutes={each:g}"]
        record["lane_seconds"] = lane * 60  # each worker's jobs, start-ups and out-of-fold predictions included
        record["oof_seconds"] = oof * 60
        record["summary"] = (
            f"{self.max_minutes:g} min: {spent:.1f} planning and converting, {trainings} trainings ("
            f"{', '.join(n for n, _ in stages)} x {self.folds} folds) of about {each:g} min each (start-ups "
            f"included; the trainings of one fold get the same share, set when the fold starts from what is left), "
            f"{self.workers} at a time, the out-of-fold predictions in the same time ({OOF_SHARE:.0%} of it assumed "
            f"until one is measured), {CHOICE_SHARE:.0%} kept for the choice"
        )
        log(f"Protocol budget: {record['summary']}")
        return record

    def convert(self, stages_file: Path) -> None:
        """Each configuration's data into the K folds (what `tfmis-crossval` would convert first; it then finds them
        finished)."""
        from tfmis.crossvalidation.experiment import job_config, parse_configurations
        from tfmis.data.prepare import prepare_dataset

        for configuration in parse_configurations([str(stages_file)], self.overrides):
            config = job_config(self.cv_dir, configuration, 0, self.folds, None)
            log(f"Data of {configuration.name}: {config.data.dataset_dir} ({self.folds} folds)")
            prepare_dataset(config.data, progress=True)
