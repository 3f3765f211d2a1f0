"""The cross-validation folder: its configurations, its folds and the training job of each (configuration, fold).

    <cv>/crossval_definition.json   what the command was asked (configurations, folds), written once
    <cv>/splits_final.json          the folds (nnU-Net's format), the same for every configuration
    <cv>/<name>.yaml                each configuration's config before the folds
    <cv>/<name>/fold_<k>.yaml       the config that trains fold k (`python -m tfmis.train --config`)
    <cv>/<name>/fold_<k>/           its run folder; validation/ holds its out-of-fold predictions and scores.json
    <cv>/ensembles/<a>+<b>/fold_<k>/validation/   the out-of-fold predictions of two configurations averaged
    <cv>/jobs.jsonl                 one line per job started and ended, appended by the workers
    <cv>/logs/                      each training's and each out-of-fold prediction's output
    <cv>/crossval.json, crossval.md, crossval_dice.png, plan.yaml    the result (`tfmis.crossvalidation.selection`)

Every file a worker reads is written before the workers start; a worker writes only its own folds' folders and
appends whole lines to jobs.jsonl, so workers on several nodes need nothing but a shared folder.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

from tfmis.config import (
    Config,
    ConfigError,
    PostprocessingConfig,
    folds_dataset_dir,
    from_dict,
    load_config,
    load_stages,
    parse_config,
    save_config,
    to_dict,
)
from tfmis.engine.time_budget import budget_epoch_bound
from tfmis.errors import UsageError
from tfmis.utils.io import append_json_line, read_json_lines

DEFINITION_FILE = "crossval_definition.json"
RESULTS_FILE = "crossval.json"
SPLITS_FILE = "splits_final.json"
JOBS_LOG = "jobs.jsonl"
LOGS_DIR = "logs"
ENSEMBLES_DIR = "ensembles"
VALIDATION_DIR = "validation"
SCORES_FILE = "scores.json"
VERSION = 1


@dataclasses.dataclass
class Configuration:
    """One configuration to cross-validate: its name, its config (a dict, before the folds) and, for a cascade's
    fine stage, the configuration whose fold k is its coarse stage."""

    name: str
    config: dict
    coarse: str | None = None


# the keys each fold's config sets itself (`job_config`): a `--set` of one of them would be dropped, so it is refused
FOLD_KEYS = {
    "output.dir": "each fold trains into <output>/<configuration>/fold_<k>: give --output instead",
    "data.split": "the folds come from --folds and --splits-file",
    "data.train_split": "a fold trains on the other folds",
    "data.val_split": "a fold validates on its held-out fold",
    "data.conversion.split": "the folds replace the train/val/test fractions",
    "training.target_dice": "stopping at a Dice measured on the held-out fold would let that fold choose the weights",
    "postprocessing": "cross-validation chooses the postprocessing from the out-of-fold Dice",
}


def check_overrides(overrides) -> None:
    """Refuses (one line) a `--set` that the fold configs would drop (`FOLD_KEYS`), and `training.epochs` with a
    time budget (`training.max_minutes`): under a budget each fold's schedule is fitted to its time, so the
    configurations compared get the same time, and an epoch count would cap some of them."""
    keys = [o.split("=", 1)[0].strip() for o in overrides]
    for key in keys:
        for fixed, why in FOLD_KEYS.items():
            if key == fixed or key.startswith(fixed + "."):
                raise ConfigError(f"--set {key}: cross-validation sets it for every fold ({why}); leave it out")
    if "training.epochs" in keys and "training.max_minutes" in keys:
        raise ConfigError(
            "--set training.epochs with training.max_minutes: under a time budget each fold's schedule is fitted to "
            "its time (the configurations compared get the same time); give one of them"
        )


def parse_configurations(specs: list[str], overrides=()) -> list[Configuration]:
    """The configurations of `--config` values: `PATH` (named after the file) or `NAME=PATH`; a plan of stages
    (a plan.yaml that lists `stages:`) gives each of its stages, named as in the plan, a cascade's fine stage
    pointing at its coarse stage. `overrides` (`--set`) apply to every configuration; for a plan of stages,
    `data.dataset_dir` replaces the part its stages' conversion folders share (`tfmis.run_plans.plan_dataset_dirs`).

    Raises:
        ConfigError: an override the folds would drop (`check_overrides`), or a bad config (named)."""
    from tfmis.run_plans import plan_dataset_dirs

    check_overrides(overrides)
    out: list[Configuration] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = "", spec
        stages = load_stages(path)
        if stages:
            runs = {}
            dataset = [o for o in overrides if o.split("=", 1)[0].strip() == "data.dataset_dir"]
            per_stage = [o for o in overrides if o not in dataset]
            configs = [load_config(stage_path, per_stage) for _, stage_path in stages]
            if dataset:
                target = load_config(None, dataset[-1:]).data.dataset_dir
                mapping = plan_dataset_dirs([c.data.dataset_dir for c in configs], target)
                for c in configs:
                    c.data.dataset_dir = mapping[c.data.dataset_dir]
            for (stage_name, stage_path), config in zip(stages, configs):
                full_name = f"{name}{'_' if name else ''}{stage_name}"
                runs[str(Path(config.output.dir).resolve())] = full_name
                coarse = config.cascade.coarse_run
                coarse_name = runs.get(str(Path(coarse).resolve())) if coarse else None
                if coarse and coarse_name is None:
                    raise ConfigError(
                        f"{stage_path}: cascade.coarse_run {coarse} is none of the plan's earlier stages; "
                        "cross-validate the coarse stage in the same command"
                    )
                out.append(Configuration(full_name, to_dict(config), coarse_name))
            continue
        config = load_config(path, overrides)
        if config.cascade.coarse_run:
            raise ConfigError(
                f"{path}: a cascade's fine stage (cascade.coarse_run set) is cross-validated with its coarse stage: "
                "give the plan of stages (the plan.yaml that lists both) as --config"
            )
        out.append(Configuration(name or Path(path).stem, to_dict(config)))
    names = [c.name for c in out]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"--config: two configurations are named {name!r}: name them, e.g. --config a=PATH")
        if not name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"--config: configuration name {name!r}: use letters, digits, - and _ only")
    return out


def fold_dataset_dir(config: Config, folds: int) -> str:
    """Where the configuration's K-fold conversion goes: its own dataset_dir when it already asks for these folds,
    else `folds_dataset_dir` (`<dataset_dir>-folds<K>`, where `tfmis-train --set data.split.folds=K` reads too)."""
    if config.data.split is not None or config.data.conversion.folds == folds:
        return config.data.dataset_dir
    return folds_dataset_dir(config.data.dataset_dir, folds)


def fold_run_dir(cv_dir: str | Path, name: str, fold: int) -> Path:
    return Path(cv_dir) / name / f"fold_{fold}"


def job_config_path(cv_dir: str | Path, name: str, fold: int) -> Path:
    return Path(cv_dir) / name / f"fold_{fold}.yaml"


def job_config(cv_dir, configuration: Configuration, fold: int, folds: int, splits_file: str | None) -> Config:
    """The config that trains `fold` of `configuration`: trains on the other folds, validates on this one, writes
    its run folder in the CV folder; a cascade's fine stage finds its regions with the same fold's coarse stage."""
    config = from_dict(Config, json.loads(json.dumps(configuration.config)))
    data = to_dict(config)
    data["data"]["dataset_dir"] = fold_dataset_dir(config, folds)
    data["data"]["split"] = {"folds": folds, "fold": fold, "file": splits_file}
    data["data"]["conversion"]["split"] = None  # the folds replace a plan's train/val/test fractions
    data["data"]["train_split"], data["data"]["val_split"] = "train", "val"  # derived from the folds
    data["output"]["dir"] = str(fold_run_dir(cv_dir, configuration.name, fold))
    data["output"]["progress"] = False  # the CV command shows every fold's progress in one table
    data["postprocessing"] = to_dict(PostprocessingConfig())  # the out-of-fold maps as predicted: the CV decides it
    # stopping at a Dice measured on the held-out fold would let that fold choose the weights
    data["training"]["target_dice"] = None
    if config.training.max_minutes is not None:
        # under a time budget the budget alone sets the schedule's length: the plan's epoch count (made for its step
        # budget) would end folds whose epochs run faster than its estimate long before their share
        data["training"]["epochs"] = max(config.training.epochs, budget_epoch_bound(config.training.max_minutes))
    if configuration.coarse:
        data["cascade"]["coarse_run"] = str(fold_run_dir(cv_dir, configuration.coarse, fold))
    try:
        return parse_config(data, source=f"{configuration.name} fold {fold}")
    except ConfigError as e:
        raise ConfigError(f"configuration {configuration.name}, fold {fold}: {e}") from None


@dataclasses.dataclass
class Definition:
    """What a cross-validation runs: the configurations (in training order: a coarse stage before its cascade),
    the number of folds, the folds to run, the splits file (None: the conversion's stratified folds), and which
    weights of each fold predict its held-out cases: "final" (the weights training ended with: the held-out fold
    chooses nothing, nnU-Net's rule) or "best" (`--val-best`: the epoch with the best Dice on the held-out fold
    itself, an optimistic score)."""

    configurations: list[Configuration]
    folds: int
    run_folds: list[int]
    splits_file: str | None = None
    weights: str = "final"

    def to_json(self) -> dict:
        return {
            "version": VERSION,
            "configurations": [dataclasses.asdict(c) for c in self.configurations],
            "folds": self.folds,
            "run_folds": self.run_folds,
            "splits_file": self.splits_file,
            "weights": self.weights,
        }

    @classmethod
    def from_json(cls, data: dict) -> Definition:
        return cls(
            [Configuration(**c) for c in data["configurations"]],
            data["folds"],
            data["run_folds"],
            data["splits_file"],
            data.get("weights", "best"),  # written before the choice existed: scored with the best weights
        )

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.configurations]

    def configuration(self, name: str) -> Configuration:
        return next(c for c in self.configurations if c.name == name)

    def identity(self) -> dict:
        """What must match for a rerun to continue this cross-validation (and not start another in its folder)."""
        return {k: v for k, v in self.to_json().items() if k != "run_folds"}


def read_definition(cv_dir: str | Path) -> Definition:
    path = Path(cv_dir) / DEFINITION_FILE
    if not path.is_file():
        raise UsageError(f"{cv_dir}: no {DEFINITION_FILE}: not a cross-validation folder (tfmis-crossval)")
    return Definition.from_json(json.loads(path.read_text()))


def write_job_configs(cv_dir: str | Path, definition: Definition) -> None:
    """Every (configuration, fold)'s config file, and each configuration's base config (`<cv>/<name>.yaml`)."""
    for configuration in definition.configurations:
        save_config(from_dict(Config, configuration.config), Path(cv_dir) / f"{configuration.name}.yaml")
        for fold in definition.run_folds:
            config = job_config(cv_dir, configuration, fold, definition.folds, definition.splits_file)
            save_config(config, job_config_path(cv_dir, configuration.name, fold))


def append_job_event(cv_dir: str | Path, event: dict) -> None:
    """One line in jobs.jsonl (concurrent workers' lines stay whole)."""
    append_json_line(Path(cv_dir) / JOBS_LOG, event)


def read_job_events(cv_dir: str | Path, jobs: bool = True) -> list[dict]:
    """The lines of jobs.jsonl: the jobs' starts and ends (`jobs`), or the launch ranks' `worker_end` lines."""
    return [event for event in read_json_lines(Path(cv_dir) / JOBS_LOG) if ("job" in event) == jobs]


def pair_name(a: str, b: str) -> str:
    return f"{a}+{b}"


def averaging_pairs(definition: Definition) -> list[tuple[str, str]]:
    """The pairs of configurations whose out-of-fold probabilities are averaged and scored: both predict the classes,
    or both the same regions in the same painting order (classes and regions do not average)."""

    def outputs(configuration: Configuration) -> str:
        if configuration.config["model"].get("output", "classes") != "regions":
            return "classes"
        return json.dumps(list(configuration.config["validation"]["regions"].items()))

    return [
        (a.name, b.name) for a, b in itertools.combinations(definition.configurations, 2) if outputs(a) == outputs(b)
    ]


def candidate_dir(cv_dir: str | Path, candidate: str, fold: int) -> Path:
    """The out-of-fold predictions of a configuration, or of two configurations averaged ("a+b")."""
    if "+" in candidate:
        return Path(cv_dir) / ENSEMBLES_DIR / candidate / f"fold_{fold}" / VALIDATION_DIR
    return fold_run_dir(cv_dir, candidate, fold) / VALIDATION_DIR
