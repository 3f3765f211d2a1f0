"""Hyperparameter search with N trials at once: Keras Tuner's distributed mode on one machine (DistMIS's
experiment parallelism, with Keras Tuner in place of Ray Tune).

`python -m tfmis.tune hpo --config X.yaml --space space.yaml --workers N` starts, as subprocesses,

- one **chief** (`KERASTUNER_TUNER_ID=chief`): it holds the oracle (grid, random or Bayesian) and
  serves it over gRPC on loopback (`KERASTUNER_ORACLE_IP=127.0.0.1`, `KERASTUNER_ORACLE_PORT`);
  its state lives in `<DIR>/oracle` (Keras Tuner's project folder, never overwritten);
- N **tuner workers** (`KERASTUNER_TUNER_ID=tuner0..`), each pinned to its share of the machine
  (its GPU(s) through `CUDA_VISIBLE_DEVICES`; its CPU cores through the affinity mask, with
  `TF_NUM_INTRAOP_THREADS` / `TF_NUM_INTEROP_THREADS` / `OMP_NUM_THREADS` to match). A worker
  asks the chief for a trial, trains it with `python -m tfmis.train --config <DIR>/base.yaml --set
  key=value ... --set output.dir=<DIR>/trials/<trial id>` in a child process that inherits the
  pinning, reads the objective from the run's `summary.json` and reports it back.

The objective is `best_mean_dice` (the best validation mean Dice, maximised) or `time_to_dice:T`
(training seconds until the validation mean Dice first reached T, from `thresholds_reached`,
minimised; a run that never reached it scores `NOT_REACHED_SECONDS`). A training run that fails
(non-zero exit) is a failed trial with its last stderr line, and the search goes on.

The space file maps dotted config keys to choices (`{values: [...]}`, or a bare list) or ranges
(`{min, max}` with optional `step` and `sampling: linear|log`; integer keys give integer ranges).
Every key and every value is checked against the config dataclasses before anything runs.

An interrupted search resumes when the same command runs again (or with `--resume`): completed
and failed trials are kept; a trial that was running is rerun from scratch (its partial run folder
is removed). Outputs in DIR: `hpo_report.json`, `hpo_dice.png` (validation mean Dice per epoch of
every trial, the best highlighted), `best.yaml` (the config with the best trial's values),
`trials/<id>/` (each trial's full run folder), `trial_runs.jsonl` (one line per training
process started and ended), `logs/` (chief and workers) and `oracle/` (Keras Tuner's state).

Example:
```python
from tfmis.config import load_config
from tfmis.tune.hpo import HpoSearch, Objective, load_space

config = load_config("configs/demo.yaml")
space = load_space("configs/hpo_space.yaml", config)
report = HpoSearch(config, space, "runs/hpo", workers=2, objective=Objective.parse("best_mean_dice")).run()
print(report["best"]["trial_id"], report["best"]["hyperparameters"])
```
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import datetime
import functools
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tfmis.config import Config, ConfigError, from_dict, load_config, save_config, to_dict, validate
from tfmis.launch import free_ports
from tfmis.utils.io import atomic_write_json, atomic_writer

# Keras Tuner (and with it TensorFlow) is imported only where the chief and the workers need it, so that the
# command checks its arguments and plans the devices without the import.

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
NOT_REACHED_SECONDS = 1.0e6  # time_to_dice of a run that never reached the target
STRATEGIES = ("grid", "random", "bayesian")
SET_PER_TRIAL = ("output.dir",)  # keys the search sets itself
POLL_SECONDS = 0.5
_ENDED = ("COMPLETED", "FAILED")  # Keras Tuner's statuses of a trial that is not run again


# ---------------------------------------------------------------------------------------------- the space

@dataclasses.dataclass
class Param:
    """One searched config key.

    Args:
        key: the dotted config key, e.g. `optimizer.learning_rate`.
        kind: "choice" (a list of values), "int" or "float" (a range).
        values: the choices, as the config holds them (choice only).
        min, max, step, sampling: the range (int/float); `step` is a multiplier under log sampling,
            as in Keras Tuner.
        encoded: the choices are not scalars of one type (lists, null): Keras Tuner sees their JSON text.
    """

    key: str
    kind: str
    values: list | None = None
    min: float | None = None
    max: float | None = None
    step: float | None = None
    sampling: str = "linear"
    encoded: bool = False

    def grid_values(self) -> list | None:
        """Every value of a finite parameter (choices, integer ranges, ranges with a step); None otherwise."""
        if self.kind == "choice":
            return list(self.values)
        if self.step is None and self.kind == "float":
            return None
        step, log = (self.step, self.sampling == "log") if self.step is not None else (1, False)
        values, v, i = [], self.min, 0
        while v <= self.max * (1 + 1e-12) + 1e-12:
            values.append(int(round(v)) if self.kind == "int" else float(f"{v:.12g}"))
            i += 1
            v = self.min * step ** i if log else self.min + step * i
        return values

    def add_to(self, hp) -> None:
        """Declares this parameter in a `keras_tuner.HyperParameters`."""
        if self.kind == "choice":
            hp.Choice(self.key, [json.dumps(v) for v in self.values] if self.encoded else list(self.values))
        elif self.kind == "int":
            hp.Int(self.key, int(self.min), int(self.max), step=int(self.step) if self.step else None,
                   sampling=self.sampling)
        else:
            hp.Float(self.key, self.min, self.max, step=self.step, sampling=self.sampling)

    def decode(self, value):
        """The config value of a value Keras Tuner hands over."""
        if self.encoded:
            return json.loads(value)
        if self.kind == "int":
            return int(round(value))
        if self.kind == "float":
            return float(value)
        return value

    def describe(self) -> str:
        if self.kind == "choice":
            return json.dumps(self.values)
        step = f", step {self.step:g}" if self.step else ""
        return f"[{self.min:g}, {self.max:g}] {self.sampling}{step}" + (" (integers)" if self.kind == "int" else "")

    def to_dict(self) -> dict:
        if self.kind == "choice":
            return {"values": self.values}
        d = {"min": self.min, "max": self.max, "sampling": self.sampling}
        if self.step is not None:
            d["step"] = self.step
        return d


@dataclasses.dataclass
class SearchSpace:
    """The searched config keys, in the space file's order (the grid's first key varies slowest)."""

    params: list[Param]
    source: str = "space"

    @property
    def keys(self) -> list[str]:
        return [p.key for p in self.params]

    def finite(self) -> bool:
        return all(p.grid_values() is not None for p in self.params)

    def grid(self) -> list[dict]:
        """Every combination, first key slowest (as nested loops over the file's keys)."""
        columns = []
        for p in self.params:
            values = p.grid_values()
            if values is None:
                raise ConfigError(f"{self.source}: {p.key} is a continuous range {p.describe()}: a grid needs "
                                  f"`values` or a `step`; or search it with --strategy random or bayesian")
            columns.append(values)
        return [dict(zip(self.keys, combo)) for combo in itertools.product(*columns)]

    def hyperparameters(self):
        """The Keras Tuner search space."""
        import keras_tuner

        hp = keras_tuner.HyperParameters()
        for p in self.params:
            p.add_to(hp)
        return hp

    def to_tuner(self, values: dict) -> dict:
        """Config values → the values Keras Tuner records (JSON text for encoded choices)."""
        return {p.key: json.dumps(values[p.key]) if p.encoded else values[p.key] for p in self.params}

    def decode(self, values: dict) -> dict:
        """Keras Tuner's values → config values, in the space's order."""
        by_key = {p.key: p for p in self.params}
        return {key: by_key[key].decode(values[key]) for key in self.keys if key in values}

    def to_dict(self) -> dict:
        return {p.key: p.to_dict() for p in self.params}


def overrides_for(values: dict) -> list[str]:
    """`key=value` overrides (as `tfmis.train --set` takes them) for a trial's values."""
    return [f"{key}={json.dumps(value)}" for key, value in values.items()]


def set_key(data: dict, key: str, value) -> None:
    """Sets dotted `key` in nested config dicts `data` (sections created on the way, as `--set` does)."""
    node = data
    *path, leaf = key.split(".")
    for part in path:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: '{part}' is not a config section")
    node[leaf] = value


def _config_value(data: dict, key: str, value, source: str):
    """`value` as the config holds it at `key` (checked by `from_dict` and `validate`), or a ConfigError
    naming the key."""
    tree = json.loads(json.dumps(data))
    try:
        set_key(tree, key, value)
        config = from_dict(Config, tree)
        validate(config)
    except ConfigError as e:
        text = str(e)
        raise ConfigError(f"{source}: {key}: {text}" if "unknown config key" in text or "not a config section" in text
                          else f"{source}: {key}={value!r} is not valid: {text}") from e
    result = to_dict(config)
    for part in key.split("."):
        if not isinstance(result, dict) or part not in result:
            raise ConfigError(f"{source}: {key}: not a config value")
        result = result[part]
    if isinstance(result, dict):
        raise ConfigError(f"{source}: {key} is a config section, not a value: name one of its keys, e.g. "
                          f"{key}.{next(iter(result), '...')}")
    return result


def parse_space(data, config: Config, source: str = "space") -> SearchSpace:
    """Checks a space mapping against `config`'s dataclasses and returns the `SearchSpace`.

    Args:
        data: {dotted key: {values: [...]} | [...] | {min, max, step?, sampling?}}.
        config: the base config; every key must be one of its values, every choice and both ends of
            every range must be valid there.
        source: the file name errors start with.

    Raises:
        ConfigError: naming the key (unknown keys suggest the closest valid one).

    Example:
        >>> from tfmis.config import Config
        >>> space = parse_space({"loss.name": {"values": ["dice", "dice_ce"]}}, Config())
        >>> space.grid()
        [{'loss.name': 'dice'}, {'loss.name': 'dice_ce'}]
    """
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{source}: expected a mapping of dotted config keys to choices, e.g. "
                          "'optimizer.learning_rate: {values: [0.001, 0.0003]}'")
    base = to_dict(config)
    params = []
    for key, spec in data.items():
        key = str(key)
        if key in SET_PER_TRIAL:
            raise ConfigError(f"{source}: {key} is set by the search for each trial (<output>/trials/<id>); "
                              "remove it from the space")
        if isinstance(spec, list):
            spec = {"values": spec}
        if not isinstance(spec, dict):
            raise ConfigError(f"{source}: {key}: expected {{values: [...]}} or {{min: ..., max: ...}}, got {spec!r}")
        unknown = set(spec) - {"values", "min", "max", "step", "sampling"}
        if unknown:
            raise ConfigError(f"{source}: {key}: unknown field(s) {sorted(unknown)}; use values, or min, max, step "
                              "and sampling")
        if "values" in spec:
            if set(spec) != {"values"}:
                raise ConfigError(f"{source}: {key}: give either values or a range (min, max), not both")
            raw = spec["values"]
            if not isinstance(raw, list) or not raw:
                raise ConfigError(f"{source}: {key}: values must be a non-empty list, got {raw!r}")
            values = [_config_value(base, key, v, source) for v in raw]
            if len({json.dumps(v) for v in values}) != len(values):
                raise ConfigError(f"{source}: {key}: values repeat: {values}")
            scalar_types = {type(v) for v in values}
            encoded = not (len(scalar_types) == 1 and scalar_types <= {int, float, str, bool})
            params.append(Param(key, "choice", values=values, encoded=encoded))
            continue
        if "min" not in spec or "max" not in spec:
            raise ConfigError(f"{source}: {key}: a range needs min and max (and optionally step, sampling), "
                              f"or give values: [...]")
        lo = _config_value(base, key, spec["min"], source)
        hi = _config_value(base, key, spec["max"], source)
        if isinstance(lo, bool) or not isinstance(lo, (int, float)):
            raise ConfigError(f"{source}: {key} holds {type(lo).__name__} values: a range needs a numeric key; "
                              "give values: [...] instead")
        kind = "int" if isinstance(lo, int) else "float"
        sampling = spec.get("sampling", "linear")
        if sampling not in ("linear", "log"):
            raise ConfigError(f"{source}: {key}: sampling must be linear or log, got {sampling!r}")
        if not lo < hi:
            raise ConfigError(f"{source}: {key}: min ({lo}) must be below max ({hi})")
        if sampling == "log" and lo <= 0:
            raise ConfigError(f"{source}: {key}: log sampling needs min > 0, got {lo}")
        step = spec.get("step")
        if step is not None:
            if isinstance(step, str):
                try:
                    step = float(step)
                except ValueError:
                    pass
            if isinstance(step, bool) or not isinstance(step, (int, float)) or step <= 0 or \
                    (sampling == "log" and step <= 1) or (kind == "int" and step != int(step)):
                need = "a multiplier > 1 under log sampling" if sampling == "log" else \
                    "a positive integer" if kind == "int" else "a positive number"
                raise ConfigError(f"{source}: {key}: step must be {need}, got {spec['step']!r}")
        params.append(Param(key, kind, min=lo, max=hi, step=step, sampling=sampling))
        for value in params[-1].grid_values() or ():  # every grid value of a range is valid too
            _config_value(base, key, value, source)
    return SearchSpace(params, source)


def load_space(path, config: Config) -> SearchSpace:
    """Reads and checks a space file (YAML or JSON); see `parse_space`.

    Example:
    ```python
    space = load_space("configs/hpo_space.yaml", load_config("configs/demo.yaml"))
    print(space.grid())
    ```
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"space file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from e
    return parse_space(data, config, str(path))


# ---------------------------------------------------------------------------------------------- the objective

@dataclasses.dataclass(frozen=True)
class Objective:
    """What a trial scores: `best_mean_dice` (maximised) or `time_to_dice` with a target (minimised).

    Example:
        >>> Objective.parse("time_to_dice:0.9").name
        'time_to_dice_0.90'
        >>> Objective.parse("best_mean_dice").value({"best_mean_dice": 0.8})
        0.8
    """

    kind: str
    target: float | None = None

    @classmethod
    def parse(cls, text: str) -> "Objective":
        text = str(text).strip()
        if text == "best_mean_dice":
            return cls("best_mean_dice")
        if text.startswith("time_to_dice:"):
            raw = text.split(":", 1)[1]
            try:
                target = float(raw)
            except ValueError:
                target = math.nan
            if not 0 < target <= 1:
                raise ConfigError(f"--objective {text}: the target must be a mean Dice in (0, 1], e.g. time_to_dice:0.9")
            if abs(round(target, 2) - target) > 1e-9:
                raise ConfigError(f"--objective {text}: summary.json records thresholds to 2 decimals; give the "
                                  f"target as {round(target, 2)}")
            return cls("time_to_dice", round(target, 2))
        raise ConfigError(f"--objective {text!r}: expected best_mean_dice or time_to_dice:<target>, e.g. "
                          "time_to_dice:0.9")

    @property
    def name(self) -> str:
        """The metric name Keras Tuner records."""
        return self.kind if self.target is None else f"{self.kind}_{self.target:.2f}"

    @property
    def direction(self) -> str:
        return "max" if self.kind == "best_mean_dice" else "min"

    def __str__(self) -> str:
        return self.kind if self.target is None else f"{self.kind}:{self.target:g}"

    def better(self, a: float, b: float) -> bool:
        return a > b if self.direction == "max" else a < b

    def trial_overrides(self, config: Config) -> list[str]:
        """time_to_dice: adds the target to `training.dice_thresholds` when it is not there."""
        if self.target is None:
            return []
        thresholds = [float(t) for t in config.training.dice_thresholds]
        if any(f"{t:.2f}" == f"{self.target:.2f}" for t in thresholds):
            return []
        return [f"training.dice_thresholds={json.dumps(sorted(thresholds + [self.target]))}"]

    def value(self, summary: dict) -> float:
        """The objective of a finished run's `summary.json`.

        Raises:
            ValueError: best_mean_dice of a run that never validated.
        """
        if self.kind == "best_mean_dice":
            if summary.get("best_mean_dice") is None:
                raise ValueError("the run never validated (best_mean_dice is null): make validation.val_interval "
                                 "<= training.epochs")
            return float(summary["best_mean_dice"])
        reached = (summary.get("thresholds_reached") or {}).get(f"{self.target:.2f}")
        return float(reached["elapsed_seconds"]) if reached else NOT_REACHED_SECONDS

    def display(self, value) -> str:
        if value is None:
            return "-"
        if self.kind == "best_mean_dice":
            return f"{value:.4f}"
        return "not reached" if value >= NOT_REACHED_SECONDS else f"{value:.1f} s"


# ---------------------------------------------------------------------------------------------- devices

def _visible_gpus() -> list[dict]:
    """The GPUs trials may use (`tfmis.tune.trial.accelerators`), without importing TensorFlow on a machine
    with no NVIDIA driver."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("-1", ""):
        return []
    if not Path("/proc/driver/nvidia").exists() and not list(Path("/dev").glob("nvidia[0-9]*")):
        return []
    from tfmis.tune.trial import accelerators

    return accelerators()


def assign_devices(workers: int, cpus: list[int], gpus: list[dict]) -> list[dict]:
    """Each worker's share: its GPUs (an equal share; round-robin when there are fewer GPUs than workers)
    and its CPU cores (an equal share of `cpus`; round-robin when there are fewer cores than workers).

    Returns:
        [{"tuner_id": "tuner0", "cpus": [0], "gpus": [{"index", "uuid", "name", ...}], "gpu_shared": False}, ...]

    Example:
        >>> [a["cpus"] for a in assign_devices(2, [0, 1], [])]
        [[0], [1]]
        >>> [a["cpus"] for a in assign_devices(2, [0, 1, 2], [])]
        [[0, 1], [2]]
    """
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    plan = []
    for k in range(workers):
        if len(cpus) >= workers:
            share, extra = divmod(len(cpus), workers)
            start = k * share + min(k, extra)
            mine = cpus[start:start + share + (1 if k < extra else 0)]
        else:
            mine = [cpus[k % len(cpus)]] if cpus else []
        if len(gpus) >= workers:
            per = len(gpus) // workers
            my_gpus = gpus[k * per:(k + 1) * per]
        else:
            my_gpus = [gpus[k % len(gpus)]] if gpus else []
        plan.append({"tuner_id": f"tuner{k}", "cpus": mine, "gpus": my_gpus,
                     "gpu_shared": 0 < len(gpus) < workers})
    return plan


def _describe_plan(plan: list[dict], cpus: list[int]) -> str:
    gpus = {g["index"] for a in plan for g in a["gpus"]}
    where = (f"{len(gpus)} GPU(s) and {len(cpus)} CPU core(s)" if gpus else f"{len(cpus)} CPU core(s), no GPU")
    parts = []
    for a in plan:
        text = f"{a['tuner_id']}: cores {_ranges(a['cpus'])}"
        if a["gpus"]:
            text += f", GPU {','.join(str(g['index']) for g in a['gpus'])}" + (" (shared)" if a["gpu_shared"] else "")
        parts.append(text)
    note = ""
    if len(cpus) < len(plan):
        note += f"; {len(plan)} workers share {len(cpus)} cores"
    if plan and plan[0]["gpu_shared"]:
        note += "; workers share GPUs (memory growth on)"
    return f"{len(plan)} worker(s) on {where}: " + "; ".join(parts) + note


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the affinity list format of taskset and /proc)."""
    out, run = [], []
    for v in sorted(values):
        if run and v == run[-1] + 1:
            run.append(v)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [v]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out) or "-"


def _parse_ranges(text: str) -> list[int]:
    values = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        values.extend(range(int(lo), int(hi or lo) + 1))
    return values


def _allowed_cpus(pid: int) -> list[int] | None:
    """A process's CPU affinity as the kernel reports it (/proc/<pid>/status Cpus_allowed_list)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return _parse_ranges(line.split(":", 1)[1])
    except OSError:
        pass
    return None


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def _dies_with_parent(command: list[str], sig: int) -> list[str]:
    """`command`, started so that it receives `sig` when its parent dies (Linux prctl PR_SET_PDEATHSIG), so
    that killing the search (or a worker) leaves no orphaned training process behind.

    The death signal is set by a tiny Python wrapper that then execs the command (the setting survives
    exec), not by a `preexec_fn`: that would run Python between fork and exec in a process holding gRPC
    (the Keras Tuner client), whose fork handler then aborts the child now and then ("epoll_wait error:
    Bad file descriptor", exit -6, seen in CI). Without a `preexec_fn`, subprocess uses vfork + exec.
    """
    if _libc() is None or not sys.platform.startswith("linux"):
        return list(command)
    wrapper = ("import ctypes, ctypes.util, os, sys; "
               "ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6').prctl(1, int(sys.argv[1])); "
               "os.execvp(sys.argv[2], sys.argv[2:])")
    return [sys.executable, "-c", wrapper, str(int(sig)), *command]


def _package_env(env: dict) -> dict:
    """The child imports this copy of tfmis, wherever the search runs from."""
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def trial_env(assignment: dict, base_env: dict | None = None) -> dict:
    """The environment of a worker's training process: its GPUs (or none) and its thread counts."""
    env = {k: v for k, v in (base_env if base_env is not None else os.environ).items()
           if not k.startswith("KERASTUNER_")}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's device numbers = NVML's
    gpus = assignment["gpus"]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(g.get("uuid") or str(g["index"]) for g in gpus) if gpus else "-1"
    if assignment.get("gpu_shared"):
        env["TF_FORCE_GPU_ALLOW_GROWTH"] = "true"
    cores = len(assignment["cpus"])
    if cores:
        env["TF_NUM_INTRAOP_THREADS"] = str(cores)
        env["TF_NUM_INTEROP_THREADS"] = str(max(2, cores))  # one inter-op thread can starve tf.data
        env["OMP_NUM_THREADS"] = str(cores)
    return _package_env(env)


# ---------------------------------------------------------------------------------------------- the definition

def _fingerprint(definition: dict) -> str:
    identity = {k: definition[k] for k in ("config", "space", "objective", "strategy", "seed")}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def read_definition(output_dir: Path) -> tuple[dict, Config, SearchSpace, Objective]:
    """The search in `output_dir`: (definition, base config, space, objective)."""
    definition = json.loads((Path(output_dir) / SEARCH_FILE).read_text())
    config = from_dict(Config, definition["config"])
    space = parse_space(definition["space"], config, definition.get("space_file", "space"))
    return definition, config, space, Objective.parse(definition["objective"])


# ---------------------------------------------------------------------------------------------- Keras Tuner side

@functools.cache
def _tuner_classes():
    """The oracles and the tuner (defined on first use: they subclass Keras Tuner's, which imports TensorFlow)."""
    import keras_tuner
    from keras_tuner.src.engine import trial as kt_trial

    class _HpoOracle:
        """Oracle mixin: atomic state files (a search killed while the chief saves still resumes); an ended
        trial never rerun on resume; a proposal that repeats a tried or running point replaced by a random
        one (two workers asking before a result arrived would otherwise get the same Bayesian proposal)."""

        def save(self):
            atomic_write_json(self._get_oracle_fname(), self.get_state())

        def _save_trial(self, trial):
            atomic_write_json(os.path.join(self._get_trial_dir(trial.trial_id), "trial.json"), trial.get_state())

        @keras_tuner.synchronized
        def end_trial(self, trial):
            super().end_trial(trial)
            # Keras Tuner saves before it removes the trial from the ongoing ones: the last trial of each
            # worker would stay "ongoing" on disk and be rerun by the next run
            self.save()

        def reload(self):
            super().reload()  # sends the trials that were ongoing to the retry queue
            self._retry_queue = [t for t in self._retry_queue if self.trials[t].status not in _ENDED]

        def populate_space(self, trial_id):
            response = super().populate_space(trial_id)
            if response["status"] == kt_trial.TrialStatus.RUNNING and self._duplicate(response["values"]):
                values = self._random_values()
                response = ({"status": kt_trial.TrialStatus.STOPPED, "values": None} if values is None
                            else {"status": kt_trial.TrialStatus.RUNNING, "values": values})
            return response

    class GridOracle(_HpoOracle, keras_tuner.Oracle):
        """The whole grid, each point once, handed to whichever worker asks first.

        Keras Tuner's GridSearchOracle derives each new point from a finished trial, so with several
        workers it hands out one trial at a time after the first two (the others wait IDLE), and its
        order is not part of its saved state; this one walks a fixed list, skipping the points
        tried or running (`_tried_so_far`, which the oracle saves), so it runs N at once and resumes.
        """

        def __init__(self, grid: list[dict], **kwargs):
            super().__init__(**kwargs)
            self.grid = grid

        def populate_space(self, trial_id):
            for values in self.grid:
                if not self._duplicate(values):
                    return {"status": kt_trial.TrialStatus.RUNNING, "values": dict(values)}
            return {"status": kt_trial.TrialStatus.STOPPED, "values": None}

    class RandomOracle(_HpoOracle, keras_tuner.oracles.RandomSearchOracle):
        pass

    class BayesianOracle(_HpoOracle, keras_tuner.oracles.BayesianOptimizationOracle):
        pass

    class TrainTuner(keras_tuner.Tuner):
        """A worker's tuner: a trial is a `python -m tfmis.train` process (see `TrialRunner`)."""

        def __init__(self, runner: "TrialRunner | None", **kwargs):
            super().__init__(**kwargs)
            self.runner = runner

        def run_trial(self, trial, *args, **kwargs):
            record = self.runner.run(trial.trial_id, trial.hyperparameters.values)
            if record["status"] != "ok":
                raise keras_tuner.errors.FailedTrialError(record["reason"])
            return {self.runner.objective.name: record["objective"]}

        def save_model(self, trial_id, model, step=0):
            pass  # a trial's run folder keeps its weights

    return {"grid": GridOracle, "random": RandomOracle, "bayesian": BayesianOracle, "tuner": TrainTuner}


def make_oracle(definition: dict, space: SearchSpace, objective: Objective):
    """The chief's oracle for the search's strategy (the workers build one too, for its objective)."""
    import keras_tuner

    classes = _tuner_classes()
    kwargs = {"objective": keras_tuner.Objective(objective.name, objective.direction),
              "hyperparameters": space.hyperparameters(), "max_trials": definition["num_trials"],
              "allow_new_entries": False, "tune_new_entries": False, "seed": definition["seed"],
              "max_consecutive_failed_trials": 10**9}  # a failed trial never ends the search
    strategy = definition["strategy"]
    if strategy == "grid":
        return classes["grid"]([space.to_tuner(v) for v in space.grid()], **kwargs)
    if strategy == "random":
        return classes["random"](**kwargs)
    num_initial = max(2, min(definition["num_trials"] // 3, 2 * len(space.params)))
    return classes["bayesian"](num_initial_points=num_initial, **kwargs)


def _append_event(path: Path, event: dict) -> None:
    """One JSON line, appended with a single write (O_APPEND keeps concurrent workers' lines whole)."""
    line = (json.dumps(event) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_events(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / RUNS_LOG
    if not path.is_file():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a kill
    return events


class TrialRunner:
    """Runs one trial as `python -m tfmis.train` in a child process of a worker, pinned to the worker's devices.

    Args:
        output_dir: the search folder.
        assignment: this worker's share (`assign_devices`).
    """

    def __init__(self, output_dir: Path, assignment: dict):
        self.output_dir = Path(output_dir)
        self.definition, self.config, self.space, self.objective = read_definition(self.output_dir)
        self.assignment = assignment
        self.tuner_id = assignment["tuner_id"]

    def run(self, trial_id: str, tuner_values: dict) -> dict:
        """Trains one trial; returns {"status": "ok" | "failed", "objective", "reason", ...} (never raises
        for a failed run)."""
        values = self.space.decode(tuner_values)
        run_dir = self.output_dir / TRIALS_DIR / str(trial_id)
        attempts = sum(e["event"] == "start" and e["trial_id"] == trial_id for e in read_events(self.output_dir))
        if run_dir.exists():
            print(f"trial {trial_id} was running when the search was interrupted: rerunning it from scratch "
                  f"(removing {run_dir})", flush=True)
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        overrides = [*overrides_for(values), *self.objective.trial_overrides(self.config),
                     f"output.dir={json.dumps(str(run_dir))}", "output.progress=false"]
        command = [sys.executable, "-m", "tfmis.train", "--config", str(self.output_dir / BASE_FILE)]
        for override in overrides:
            command += ["--set", override]
        start = time.time()
        with open(run_dir / "train.log", "wb") as out, open(run_dir / "train.err.log", "wb") as err:
            try:
                child = subprocess.Popen(_dies_with_parent(command, signal.SIGKILL), stdout=out, stderr=err,
                                         env=trial_env(self.assignment))
            except OSError as e:
                return self._end(trial_id, attempts + 1, start, None, f"cannot start tfmis.train: {e}", None, run_dir)
            _append_event(self.output_dir / RUNS_LOG, {
                "event": "start", "trial_id": trial_id, "tuner_id": self.tuner_id, "attempt": attempts + 1,
                "rerun": attempts > 0, "time": start, "pid": child.pid, "hyperparameters": values,
                "cpus": self.assignment["cpus"], "child_cpus": _allowed_cpus(child.pid),
                "gpus": [g.get("uuid") or g["index"] for g in self.assignment["gpus"]],
                "command": command, "run_dir": str(run_dir)})
            print(f"trial {trial_id} started: {' '.join(overrides[:len(values)])}", flush=True)
            exit_code = child.wait()
        if exit_code != 0:
            reason = f"exit code {exit_code}: {_error_line(run_dir / 'train.err.log', run_dir / 'train.log')}"
            return self._end(trial_id, attempts + 1, start, exit_code, reason, None, run_dir)
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
            value = self.objective.value(summary)
        except (OSError, ValueError) as e:
            return self._end(trial_id, attempts + 1, start, exit_code, f"no objective: {e}", None, run_dir)
        return self._end(trial_id, attempts + 1, start, exit_code, None, value, run_dir, summary)

    def _end(self, trial_id, attempt, start, exit_code, reason, value, run_dir, summary=None) -> dict:
        end = time.time()
        record = {"event": "end", "trial_id": trial_id, "tuner_id": self.tuner_id, "attempt": attempt,
                  "time": end, "seconds": end - start, "exit_code": exit_code,
                  "status": "ok" if reason is None else "failed", "objective": value, "reason": reason,
                  "epochs": (summary or {}).get("epochs")}
        _append_event(self.output_dir / RUNS_LOG, record)
        print(f"trial {trial_id} {record['status']}: "
              + (self.objective.display(value) if reason is None else reason), flush=True)
        return record


def chief_main(output_dir: Path) -> int:
    """The chief: builds the oracle (reloading `<DIR>/oracle`) and serves it until stopped."""
    import keras_tuner

    definition, _, space, objective = read_definition(output_dir)
    project = Path(output_dir) / ORACLE_PROJECT
    chief_file = project / "chief.json"
    if (project / "oracle.json").is_file() and not chief_file.is_file():
        atomic_write_json(chief_file, {})  # Keras Tuner reloads the oracle only when the chief's file exists
    oracle = make_oracle(definition, space, objective)
    tuner = _tuner_classes()["tuner"](None, oracle=oracle, directory=str(output_dir), project_name=ORACLE_PROJECT,
                                      overwrite=False)
    state = tuner.oracle
    print(f"chief: serving the oracle on {os.environ['KERASTUNER_ORACLE_IP']}:{os.environ['KERASTUNER_ORACLE_PORT']}"
          f" ({len(state.trials)} trials known, {len(state._retry_queue)} to rerun)", flush=True)
    keras_tuner.src.config.DEBUG = False
    tuner.search(verbose=0)  # blocks, serving the workers
    return 0


def worker_main(output_dir: Path, tuner_id: str, cpus: list[int], gpus: list[dict], gpu_shared: bool) -> int:
    """A tuner worker: pins itself (its training processes inherit the affinity) and runs trials until the
    chief has none left."""
    import keras_tuner

    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    assignment = {"tuner_id": tuner_id, "cpus": cpus, "gpus": gpus, "gpu_shared": gpu_shared}
    runner = TrialRunner(output_dir, assignment)
    oracle = make_oracle(runner.definition, runner.space, runner.objective)
    tuner = _tuner_classes()["tuner"](runner, oracle=oracle, directory=str(output_dir), project_name=ORACLE_PROJECT,
                                      overwrite=False)
    keras_tuner.src.config.DEBUG = False  # a failed trial is reported with its reason, not a traceback
    print(f"{tuner_id}: cores {_ranges(cpus)}, GPUs {[g['index'] for g in gpus] or 'none'}", flush=True)
    tuner.search(verbose=0)
    return 0


# ---------------------------------------------------------------------------------------------- the search (parent)

class SearchFailed(RuntimeError):
    """The chief or a worker process died (its log's last line says why)."""


class HpoSearch:
    """Runs (or resumes) a search with `workers` trials at once and writes its report.

    Args:
        config: the base `Config` (its dataset is prepared first).
        space: the `SearchSpace`.
        output_dir: the search folder (`<DIR>`).
        workers: trials run at once.
        num_trials: trials in all (default: the whole grid; 10 for random and Bayesian search).
        objective: an `Objective` (default best_mean_dice).
        strategy: grid | random | bayesian (default: grid when every key is finite, else bayesian).
        resume: require an existing search in `output_dir` (without it, an existing search with the same
            definition is continued as well).
        progress: show a progress bar (one line per finished trial is printed either way).
        space_file: the space's file name, for the report.
    """

    def __init__(self, config: Config, space: SearchSpace, output_dir, *, workers: int = 1,
                 num_trials: int | None = None, objective: Objective | None = None, strategy: str | None = None,
                 resume: bool = False, progress: bool = True, space_file: str | None = None):
        self.config, self.space = config, space
        self.output_dir = Path(output_dir)
        self.workers = int(workers)
        if self.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {workers}")
        self.objective = objective or Objective("best_mean_dice")
        if strategy is None:
            strategy = "grid" if space.finite() else "bayesian"
        if strategy not in STRATEGIES:
            raise ConfigError(f"--strategy must be one of {list(STRATEGIES)}, got {strategy!r}")
        self.strategy = strategy
        grid_size = len(space.grid()) if strategy == "grid" else None
        if num_trials is not None and num_trials < 1:
            raise ConfigError(f"--num-trials must be >= 1, got {num_trials}")
        if grid_size is not None:
            if num_trials is not None and num_trials > grid_size:
                print(f"The grid has {grid_size} points: running {grid_size} trials, not {num_trials}",
                      file=sys.stderr)
            num_trials = min(num_trials or grid_size, grid_size)
        self.num_trials = num_trials or 10
        self.grid_size = grid_size
        self.resume, self.progress = resume, progress
        self.space_file = space_file or space.source

    # -------------------------------------------------------------- setting up

    def definition(self) -> dict:
        """What the chief and the workers read (hpo_search.json). The oracle's seed is training.seed + 1:
        Keras Tuner takes a seed of 0 as "pick one at random"."""
        d = {"version": SEARCH_VERSION, "config": to_dict(self.config), "space": self.space.to_dict(),
             "space_file": self.space_file, "objective": str(self.objective), "strategy": self.strategy,
             "seed": int(self.config.training.seed) + 1, "num_trials": self.num_trials, "workers": self.workers}
        d["fingerprint"] = _fingerprint(d)
        return d

    def _prepare(self) -> dict:
        """Writes (or checks, when resuming) the definition and the trials' base config; returns the
        oracle's saved state ({} for a new search)."""
        path = self.output_dir / SEARCH_FILE
        definition = self.definition()
        if path.is_file():
            old = json.loads(path.read_text())
            if old.get("fingerprint") != definition["fingerprint"]:
                differ = [k for k in ("config", "space", "objective", "strategy", "seed") if old.get(k) != definition[k]]
                raise ConfigError(
                    f"{self.output_dir} holds a search with a different {', '.join(differ)}: resume it with the same "
                    f"config, space, --objective and --strategy, or give another --output (or delete the folder) "
                    "to start a new search")
        elif self.resume:
            raise ConfigError(f"--resume: {self.output_dir} holds no search ({SEARCH_FILE} missing); run without "
                              "--resume to start one")
        atomic_write_json(path, definition)
        # the parent prepared the data: the trials read it and never convert (two would race)
        base = to_dict(self.config)
        base["data"]["source_dir"], base["data"]["demo"] = None, False
        save_config(from_dict(Config, base), self.output_dir / BASE_FILE)
        (self.output_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
        oracle_file = self.output_dir / ORACLE_PROJECT / "oracle.json"
        return json.loads(oracle_file.read_text()) if oracle_file.is_file() else {}

    # -------------------------------------------------------------- running

    def run(self) -> dict:
        """Runs the search (or what is left of it), writes hpo_report.json, hpo_dice.png and best.yaml,
        prints the table; returns the report.

        Raises:
            SearchFailed: the chief died, or a worker died.
        """
        start = time.time()
        state = self._prepare()
        trials = _oracle_trials(self.output_dir)
        ended = [t for t in trials.values() if t["status"] in _ENDED]
        ongoing = sorted((set((state.get("ongoing_trials") or {}).values()) | set(state.get("retry_queue") or []))
                         - {str(t["trial_id"]) for t in ended}, key=_trial_order)
        if state:
            print(f"Resuming the search in {self.output_dir}: {len(ended)} of {self.num_trials} trials finished"
                  + (f"; trial(s) {', '.join(ongoing)} were running when it stopped and are rerun from scratch"
                     if ongoing else ""), file=sys.stderr)
        errors: list[str] = []
        if len(ended) >= self.num_trials and not ongoing:
            print("All trials have finished: writing the report again", file=sys.stderr)
        else:
            errors = self._run_processes(len(ended))
        report = self.report(time.time() - start, errors)
        self.write_outputs(report)
        if errors:
            raise SearchFailed("; ".join(errors) + f" (logs in {self.output_dir / LOGS_DIR}); rerun the same command "
                               "to resume")
        return report

    def _run_processes(self, already_ended: int) -> list[str]:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        gpus = _visible_gpus()
        plan = assign_devices(self.workers, cpus, gpus)
        space = ", ".join(f"{p.key} {p.describe()}" for p in self.space.params)
        print(f"Hyperparameter search ({self.strategy}, {self.num_trials} trials"
              + (f" of a {self.grid_size}-point grid" if self.grid_size and self.grid_size != self.num_trials else "")
              + f", objective {self.objective} ({self.objective.direction}imised)) over {space}", file=sys.stderr)
        print(_describe_plan(plan, cpus), file=sys.stderr)
        port = free_ports(1)[0]
        base_env = _package_env(dict(os.environ))
        base_env.update(KERASTUNER_ORACLE_IP="127.0.0.1", KERASTUNER_ORACLE_PORT=str(port),
                        CUDA_VISIBLE_DEVICES="-1",  # the chief and the workers never touch a GPU; trials do
                        TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
        module = [sys.executable, "-m", "tfmis.tune.hpo"]
        processes: dict[str, subprocess.Popen] = {}
        logs = []
        try:
            processes["chief"] = self._spawn(module + ["chief", str(self.output_dir)],
                                             {**base_env, "KERASTUNER_TUNER_ID": "chief"}, "chief", logs)
            for a in plan:
                command = module + ["worker", str(self.output_dir), "--tuner-id", a["tuner_id"],
                                    "--cpus", _ranges(a["cpus"]) if a["cpus"] else "",
                                    "--gpus", json.dumps(a["gpus"])] + (["--gpu-shared"] if a["gpu_shared"] else [])
                processes[a["tuner_id"]] = self._spawn(command, {**base_env, "KERASTUNER_TUNER_ID": a["tuner_id"]},
                                                       a["tuner_id"], logs)
            return self._watch(processes, already_ended)
        finally:
            for name, process in processes.items():
                if process.poll() is None:
                    process.terminate()
            for name, process in processes.items():
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            for log in logs:
                log.close()

    def _spawn(self, command, env, name, logs) -> subprocess.Popen:
        log = open(self.output_dir / LOGS_DIR / f"{name}.log", "ab")
        log.write(f"\n=== {datetime.datetime.now().isoformat(timespec='seconds')}: {' '.join(command)}\n".encode())
        log.flush()
        logs.append(log)
        return subprocess.Popen(_dies_with_parent(command, signal.SIGTERM), stdout=log, stderr=subprocess.STDOUT,
                                env=env)

    def _watch(self, processes: dict, already_ended: int) -> list[str]:
        """Prints a line per finished trial until every worker has exited; returns what died."""
        from tfmis.utils.progress import progress_bar

        workers = {name: p for name, p in processes.items() if name != "chief"}
        log = self.output_dir / RUNS_LOG
        offset = log.stat().st_size if log.is_file() else 0  # earlier runs' lines were reported then
        state = {"done": already_ended, "best": None}
        for trial_id, t in _oracle_trials(self.output_dir).items():  # the best of an earlier run
            if t["status"] == "COMPLETED" and t.get("score") is not None and (
                    state["best"] is None or self.objective.better(t["score"], state["best"][1])):
                state["best"] = (trial_id, t["score"])
        bar = progress_bar(self.num_trials, "HPO trials", "trial", disable=not self.progress, initial=already_ended)

        def report_new_events():
            nonlocal offset
            offset, events = _new_events(log, offset)
            for e in events:
                if e["event"] == "start" and e.get("rerun"):
                    bar.write(f"trial {e['trial_id']}: rerunning it (attempt {e['attempt']}; it was running when "
                              "the search was interrupted)", file=sys.stderr)
                if e["event"] != "end":
                    continue
                state["done"] += 1
                best = state["best"]
                if e["status"] == "ok" and (best is None or self.objective.better(e["objective"], best[1])):
                    state["best"] = (e["trial_id"], e["objective"])
                bar.write(self._progress_line(e, state["done"], state["best"]), file=sys.stdout)
                bar.update(1)

        errors = []
        try:
            while True:
                report_new_events()
                if all(p.poll() is not None for p in workers.values()):
                    break
                if processes["chief"].poll() is not None:
                    errors.append(f"the chief (oracle server) exited with code {processes['chief'].returncode}: "
                                  f"{_last_log_line(self.output_dir / LOGS_DIR / 'chief.log')}")
                    break
                time.sleep(POLL_SECONDS)
            report_new_events()
        finally:
            bar.close()
        for name, p in workers.items():
            if p.returncode not in (0, None):
                errors.append(f"worker {name} exited with code {p.returncode}: "
                              f"{_last_log_line(self.output_dir / LOGS_DIR / f'{name}.log')}")
        return errors

    def _progress_line(self, e: dict, done: int, best) -> str:
        values = next((s["hyperparameters"] for s in reversed(read_events(self.output_dir))
                       if s["event"] == "start" and s["trial_id"] == e["trial_id"]), {})
        hps = " ".join(f"{k}={_short(v)}" for k, v in values.items())
        result = (f"{self.objective} {self.objective.display(e['objective'])}, {e['epochs']} epochs"
                  if e["status"] == "ok" else f"FAILED: {e['reason']}")
        best_text = f"; best: trial {best[0]} {self.objective.display(best[1])}" if best else ""
        return (f"trial {e['trial_id']:>3} [{e['tuner_id']}, {e['seconds']:.1f} s] {hps}: {result} "
                f"({done}/{self.num_trials} done{best_text})")

    # -------------------------------------------------------------- the report

    def report(self, elapsed: float, errors: list[str] | None = None) -> dict:
        """The report: every trial the oracle knows, with its run folder's results."""
        records = collect_trials(self.output_dir, self.space, self.objective)
        ok = [r for r in records if r["status"] == "ok"]
        best = None
        for r in ok:
            if best is None or self.objective.better(r["objective"], best["objective"]):
                best = r
        for r in records:
            r["best"] = best is not None and r["trial_id"] == best["trial_id"]
        counts = {s: sum(r["status"] == s for r in records) for s in ("ok", "failed", "interrupted")}
        return {
            "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "output_dir": str(self.output_dir), "space_file": self.space_file, "space": self.space.to_dict(),
            "strategy": self.strategy, "num_trials": self.num_trials, "grid_size": self.grid_size,
            "workers": self.workers,
            "objective": {"name": str(self.objective), "metric": self.objective.name,
                          "direction": self.objective.direction,
                          "not_reached_seconds": NOT_REACHED_SECONDS if self.objective.target else None},
            "trials": records, "counts": counts,
            "peak_concurrency": peak_concurrency(records),
            "best": None if best is None else {k: best[k] for k in ("trial_id", "hyperparameters", "objective",
                                                                     "run_dir")},
            "elapsed_seconds": elapsed, "errors": errors or [],
        }

    def write_outputs(self, report: dict) -> None:
        atomic_write_json(self.output_dir / REPORT_FILE, report)
        plot_dice(report, self.output_dir / PLOT_FILE)
        if report["best"] is not None:
            data = to_dict(self.config)
            for key, value in report["best"]["hyperparameters"].items():
                set_key(data, key, value)
            save_config(from_dict(Config, data), self.output_dir / BEST_FILE)
        print(trials_table(report))


def _trial_order(trial_id: str):
    return (int(trial_id), trial_id) if str(trial_id).isdigit() else (math.inf, str(trial_id))


def _new_events(path: Path, offset: int) -> tuple[int, list[dict]]:
    """The complete lines appended to the runs log since `offset`."""
    try:
        with open(path, "rb") as f:
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


def _error_line(*paths: Path) -> str:
    """The last line of the first log that has one, TensorFlow's own log lines (`W0000 12:00:00...`) passed
    over when anything else is there."""
    from tfmis.tune.trial import _last_lines

    for path in paths:
        lines = _last_lines(path)
        if lines:
            plain = [line for line in lines if not re.match(r"[IWE]\d{4} ", line)]
            return (plain or lines)[-1]
    return "(no error output)"


def _last_log_line(path: Path) -> str:
    from tfmis.tune.trial import _last_lines

    lines = [line for line in _last_lines(path) if not line.startswith("===")]
    return lines[-1] if lines else "(no output)"


def _short(value) -> str:
    return f"{value:g}" if isinstance(value, float) else json.dumps(value) if isinstance(value, (list, dict)) \
        else str(value).lower() if isinstance(value, bool) else str(value)


def _oracle_trials(output_dir: Path) -> dict[str, dict]:
    """Keras Tuner's trial files (`<DIR>/oracle/trial_*/trial.json`), by trial id."""
    trials = {}
    for path in sorted((Path(output_dir) / ORACLE_PROJECT).glob("trial_*/trial.json")):
        try:
            state = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        trials[str(state["trial_id"])] = state
    return trials


def collect_trials(output_dir: Path, space: SearchSpace, objective: Objective) -> list[dict]:
    """Every trial: the oracle's status and values, the workers' start/end records, the run folder's results.

    A trial's `status` is "ok", "failed" or "interrupted" (running when the search stopped; rerun on resume).
    """
    from tfmis.engine.history import History

    output_dir = Path(output_dir)
    events = read_events(output_dir)
    records = []
    for trial_id, state in sorted(_oracle_trials(output_dir).items(), key=lambda kv: _trial_order(kv[0])):
        starts = [e for e in events if e["event"] == "start" and e["trial_id"] == trial_id]
        last = starts[-1] if starts else {}
        end = next((e for e in events if e["event"] == "end" and e["trial_id"] == trial_id
                    and e.get("attempt") == last.get("attempt")), {})
        status = {"COMPLETED": "ok", "FAILED": "failed"}.get(state["status"], "interrupted")
        run_dir = output_dir / TRIALS_DIR / trial_id
        summary = {}
        if (run_dir / "summary.json").is_file():
            summary = json.loads((run_dir / "summary.json").read_text())
        history = History(run_dir).records if status != "interrupted" and run_dir.is_dir() else []
        record = {
            "trial_id": trial_id,
            "hyperparameters": space.decode(state["hyperparameters"]["values"]),
            "status": status,
            "objective": state.get("score") if status == "ok" else None,
            "objective_display": objective.display(state.get("score")) if status == "ok" else None,
            "best_mean_dice": summary.get("best_mean_dice"), "best_epoch": summary.get("best_epoch"),
            "epochs": summary.get("epochs") if summary else (len(history) or None),
            "seconds": end.get("seconds"), "train_seconds": summary.get("elapsed_seconds"),
            "start": last.get("time"), "end": end.get("time"),
            "tuner_id": last.get("tuner_id"), "cpus": last.get("cpus"), "child_cpus": last.get("child_cpus"),
            "gpus": last.get("gpus"), "attempts": len(starts), "rerun": len(starts) > 1,
            "exit_code": end.get("exit_code"),
            "reason": end.get("reason") or (_first_line(state.get("message")) if status == "failed" else None),
            "thresholds_reached": summary.get("thresholds_reached"),
            "val_mean_dice": [[r["epoch"], r["val_mean_dice"]] for r in history if r.get("val_mean_dice") is not None],
            "run_dir": str(run_dir),
        }
        records.append(record)
    return records


def _first_line(message: str | None) -> str | None:
    if not message:
        return None
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


def peak_concurrency(records: list[dict]) -> int:
    """The most trials whose [start, end] intervals overlap at one moment."""
    points = []
    for r in records:
        if r.get("start") is not None and r.get("end") is not None:
            points += [(r["start"], 1), (r["end"], -1)]
    peak = running = 0
    for _, step in sorted(points, key=lambda p: (p[0], p[1])):
        running += step
        peak = max(peak, running)
    return peak


def trial_status(record: dict) -> str:
    if record["status"] == "failed":
        return f"FAILED: {record['reason']}"
    if record["status"] == "interrupted":
        return "interrupted (rerun on resume)"
    text = "ok (best)" if record.get("best") else "ok"
    return text + (", rerun after an interruption" if record["rerun"] else "")


def trials_table(report: dict) -> str:
    """The readable table: trial, worker, each hyperparameter, objective, epochs, seconds, time span, status."""
    keys = list(report["space"])
    starts = [r["start"] for r in report["trials"] if r.get("start") is not None]
    t0 = min(starts) if starts else 0.0
    header = ("trial", "worker", *keys, report["objective"]["name"], "epochs", "seconds", "ran (s from start)", "status")
    rows = [header]
    for r in report["trials"]:
        span = (f"{r['start'] - t0:.0f}-{r['end'] - t0:.0f}" if r.get("start") is not None and r.get("end") is not None
                else "-")
        rows.append((r["trial_id"], r.get("tuner_id") or "-", *(_short(r["hyperparameters"].get(k)) for k in keys),
                     r["objective_display"] or "-", str(r["epochs"]) if r["epochs"] is not None else "-",
                     f"{r['seconds']:.1f}" if r.get("seconds") is not None else "-", span, trial_status(r)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1] for row in rows]
    c = report["counts"]
    lines.append(f"{sum(c.values())} trials ({c['ok']} ok, {c['failed']} failed, {c['interrupted']} interrupted) of "
                 f"{report['num_trials']}, {report['strategy']} search, {report['workers']} worker(s), at most "
                 f"{report['peak_concurrency']} at once; this run took {report['elapsed_seconds']:.0f} s")
    best = report["best"]
    if best:
        hps = ", ".join(f"{k}={_short(v)}" for k, v in best["hyperparameters"].items())
        lines.append(f"best: trial {best['trial_id']} ({hps}): {report['objective']['name']} "
                     f"{next(r['objective_display'] for r in report['trials'] if r['best'])}; config in {BEST_FILE}, "
                     f"run folder {best['run_dir']}")
    else:
        lines.append("best: none (no trial finished)")
    return "\n".join(lines)


def plot_dice(report: dict, path) -> Path:
    """hpo_dice.png: the validation mean Dice per epoch of every trial, one line each, the best highlighted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(9, 5.5))
    plotted = False
    for r in report["trials"]:
        if not r["val_mean_dice"]:
            continue
        epochs, dice = zip(*r["val_mean_dice"])
        hps = ", ".join(f"{k.split('.')[-1]}={_short(v)}" for k, v in r["hyperparameters"].items())
        label = f"trial {r['trial_id']}: {hps}" + (" (best)" if r["best"] else "") + \
            (" FAILED" if r["status"] == "failed" else "")
        if r["best"]:
            ax.plot(epochs, dice, "-o", color="crimson", lw=2.8, ms=5, zorder=3, label=label)
        else:
            ax.plot(epochs, dice, marker=".", lw=1.1, alpha=0.6, ls="--" if r["status"] == "failed" else "-",
                    label=label)
        plotted = True
    if not plotted:
        ax.text(0.5, 0.5, "no trial validated yet", ha="center", va="center", transform=ax.transAxes)
    ax.set(xlabel="epoch", ylabel="validation mean Dice", ylim=(0, 1),
           title=f"{report['strategy']} search, {report['counts']['ok']} trials, objective {report['objective']['name']}")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if plotted:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    with atomic_writer(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return Path(path)


# ---------------------------------------------------------------------------------------------- entry points

def hpo_command(args) -> int:
    """`python -m tfmis.tune hpo` from parsed arguments (see `tfmis.tune.cli`). Exit status: 0 done, 1 no trial
    finished or a process died, 2 bad arguments, config or space."""
    try:
        config = load_config(args.config, args.overrides)
        space = load_space(args.space, config)
        objective = Objective.parse(args.objective)
        output = Path(args.output or Path(config.output.dir) / "hpo")
        search = HpoSearch(config, space, output, workers=args.workers, num_trials=args.num_trials,
                           objective=objective, strategy=args.strategy, resume=args.resume,
                           progress=config.output.progress, space_file=str(args.space))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from tfmis.data.prepare import prepare_dataset

    try:
        output.mkdir(parents=True, exist_ok=True)
        prepare_dataset(config.data, progress=config.output.progress)
        report = search.run()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (SearchFailed, FileNotFoundError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\ninterrupted: rerun the same command to resume the search in {output}", file=sys.stderr)
        return 130
    print(f"Results in {output}: {REPORT_FILE}, {PLOT_FILE}" + (f", {BEST_FILE} (train with it: python -m "
          f"tfmis.train --config {output / BEST_FILE})" if report["best"] else "") + f", {TRIALS_DIR}/<trial id>/")
    return 0 if report["best"] else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tfmis.tune.hpo",
                                description="The chief and worker processes of `python -m tfmis.tune hpo` (started "
                                            "by it, with the KERASTUNER_* environment variables set).")
    sub = p.add_subparsers(dest="role", required=True)
    chief = sub.add_parser("chief", help="serve the oracle")
    chief.add_argument("output")
    worker = sub.add_parser("worker", help="run trials")
    worker.add_argument("output")
    worker.add_argument("--tuner-id", required=True)
    worker.add_argument("--cpus", default="", help="cores, e.g. 0-3,8")
    worker.add_argument("--gpus", default="[]", help="JSON list of GPUs ({index, uuid, ...})")
    worker.add_argument("--gpu-shared", action="store_true")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.role == "chief":
        return chief_main(Path(args.output))
    return worker_main(Path(args.output), args.tuner_id, _parse_ranges(args.cpus), json.loads(args.gpus),
                       args.gpu_shared)


if __name__ == "__main__":
    sys.exit(main())
