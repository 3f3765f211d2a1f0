"""The search folder `<DIR>` of a hyperparameter search: what is in it, and how the chief, the workers and the
report read and append to it.

    hpo_search.json    the search's definition (config, space, objective, strategy, seed, trials, workers)
    base.yaml          the config every trial starts from (`tfmis.train --config`)
    trial_runs.jsonl   one line per training process started and ended, appended by the workers
    oracle/            Keras Tuner's project folder (the oracle's state, one folder per trial)
    trials/<id>/       each trial's run folder
    logs/              the chief's and the workers' output
    hpo_report.json, hpo_dice.png, best.yaml    the report
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tfmis.config import Config, from_dict
from tfmis.tuning.hpo.space import Objective, SearchSpace, parse_space
from tfmis.utils.io import append_json_line, read_json_lines

REPORT_FILE = "hpo_report.json"
PLOT_FILE = "hpo_dice.png"
BEST_FILE = "best.yaml"
SEARCH_FILE = "hpo_search.json"  # what the chief and the workers run: the search's definition
BASE_FILE = "base.yaml"  # the config every trial starts from (--config of tfmis.train)
RUNS_LOG = "trial_runs.jsonl"  # one line per training process started and ended, appended by the workers
ORACLE_PROJECT = "oracle"  # Keras Tuner's project folder: <DIR>/oracle
TRIALS_DIR = "trials"
LOGS_DIR = "logs"
SEARCH_VERSION = 1


def definition_fingerprint(definition: dict) -> str:
    """What makes two definitions the same search (a resumed search must match it)."""
    identity = {k: definition[k] for k in ("config", "space", "objective", "strategy", "seed")}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def read_definition(output_dir: Path) -> tuple[dict, Config, SearchSpace, Objective]:
    """The search in `output_dir`: (definition, base config, space, objective)."""
    definition = json.loads((Path(output_dir) / SEARCH_FILE).read_text())
    config = from_dict(Config, definition["config"])
    space = parse_space(definition["space"], config, definition.get("space_file", "space"))
    return definition, config, space, Objective.parse(definition["objective"])


def append_event(output_dir: Path, event: dict) -> None:
    """One JSON line in the runs log (concurrent workers' lines stay whole)."""
    append_json_line(Path(output_dir) / RUNS_LOG, event)


def read_events(output_dir: Path) -> list[dict]:
    """Every complete line of the runs log."""
    return read_json_lines(Path(output_dir) / RUNS_LOG)


def new_events(output_dir: Path, offset: int) -> tuple[int, list[dict]]:
    """The complete lines appended to the runs log since byte `offset`, and the new offset."""
    try:
        with open(Path(output_dir) / RUNS_LOG, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return offset, []
    end = data.rfind(b"\n") + 1
    events = []
    for line in data[:end].decode(errors="replace").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return offset + end, events


def oracle_trials(output_dir: Path) -> dict[str, dict]:
    """The trials the oracle saved, by trial id: {"status", "values", "score", "message"}."""
    from tfmis.tuning.kt import saved_trials

    return saved_trials(Path(output_dir) / ORACLE_PROJECT)
