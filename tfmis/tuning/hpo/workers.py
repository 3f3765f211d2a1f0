"""The processes of a hyperparameter search: the chief serves the oracle, each worker runs trials, each trial
is a `python -m tfmis.train` process pinned to the worker's devices.

`python -m tfmis.tuning.hpo chief DIR` and `python -m tfmis.tuning.hpo worker DIR --tuner-id tuner0 ...` are
started by `HpoSearch` (`tfmis.tuning.hpo.search`) with Keras Tuner's `KERASTUNER_*` environment variables
set; Keras Tuner (and with it TensorFlow) is imported only here, in those processes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tfmis.hardware import allowed_cpus, parse_cpus
from tfmis.tuning.hpo.devices import dies_with_parent, format_cpus, trial_env
from tfmis.tuning.hpo.folder import BASE_FILE, ORACLE_PROJECT, TRIALS_DIR, append_event, read_definition, read_events
from tfmis.tuning.hpo.space import Objective, SearchSpace, overrides_for
from tfmis.utils.cli import start_tensorflow_without_sklearn
from tfmis.utils.io import log_tail


def make_oracle(definition: dict, space: SearchSpace, objective: Objective):
    """The chief's oracle for the search's strategy (the workers build one too, for its objective)."""
    from tfmis.tuning import kt

    strategy = definition["strategy"]
    num_initial = max(2, min(definition["num_trials"] // 3, 2 * len(space.params)))
    return kt.make_oracle(
        strategy,
        objective=objective.name,
        direction=objective.direction,
        hyperparameters=space.hyperparameters(),
        seed=definition["seed"],
        max_trials=definition["num_trials"],
        num_initial_points=num_initial if strategy == "bayesian" else None,
        grid=[space.to_tuner(v) for v in space.grid()] if strategy == "grid" else None,
    )


def last_log_line(*paths: Path) -> str:
    """The last line of the first log that has one, TensorFlow's own log lines (`W0000 12:00:00...`) passed
    over when anything else is there."""
    for path in paths:
        lines = log_tail(path)
        if lines:
            plain = [line for line in lines if not re.match(r"[IWE]\d{4} ", line)]
            return (plain or lines)[-1]
    return "(no error output)"


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
            print(
                f"trial {trial_id} was running when the search was interrupted: rerunning it from scratch "
                f"(removing {run_dir})",
                flush=True,
            )
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        overrides = [
            *overrides_for(values),
            *self.objective.trial_overrides(self.config),
            f"output.dir={json.dumps(str(run_dir))}",
            "output.progress=false",
        ]
        command = [sys.executable, "-m", "tfmis.train", "--config", str(self.output_dir / BASE_FILE)]
        for override in overrides:
            command += ["--set", override]
        start = time.time()
        with open(run_dir / "train.log", "wb") as out, open(run_dir / "train.err.log", "wb") as err:
            try:
                child = subprocess.Popen(
                    dies_with_parent(command, signal.SIGKILL), stdout=out, stderr=err, env=trial_env(self.assignment)
                )
            except OSError as e:
                return self._end(trial_id, attempts + 1, start, None, f"cannot start tfmis.train: {e}", None, run_dir)
            append_event(
                self.output_dir,
                {
                    "event": "start",
                    "trial_id": trial_id,
                    "tuner_id": self.tuner_id,
                    "attempt": attempts + 1,
                    "rerun": attempts > 0,
                    "time": start,
                    "pid": child.pid,
                    "hyperparameters": values,
                    "cpus": self.assignment["cpus"],
                    "child_cpus": allowed_cpus(child.pid),
                    "gpus": [g.get("uuid") or g["index"] for g in self.assignment["gpus"]],
                    "command": command,
                    "run_dir": str(run_dir),
                },
            )
            print(f"trial {trial_id} started: {' '.join(overrides[: len(values)])}", flush=True)
            exit_code = child.wait()
        if exit_code != 0:
            reason = f"exit code {exit_code}: {last_log_line(run_dir / 'train.err.log', run_dir / 'train.log')}"
            return self._end(trial_id, attempts + 1, start, exit_code, reason, None, run_dir)
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
            value = self.objective.value(summary)
        except (OSError, ValueError) as e:
            return self._end(trial_id, attempts + 1, start, exit_code, f"no objective: {e}", None, run_dir)
        return self._end(trial_id, attempts + 1, start, exit_code, None, value, run_dir, summary)

    def evaluate(self, trial_id: str, tuner_values: dict) -> tuple[float | None, str | None]:
        """One Keras Tuner trial: (objective, None), or (None, why the training run failed)."""
        record = self.run(trial_id, tuner_values)
        return (record["objective"], None) if record["status"] == "ok" else (None, record["reason"])

    def _end(self, trial_id, attempt, start, exit_code, reason, value, run_dir, summary=None) -> dict:
        end = time.time()
        record = {
            "event": "end",
            "trial_id": trial_id,
            "tuner_id": self.tuner_id,
            "attempt": attempt,
            "time": end,
            "seconds": end - start,
            "exit_code": exit_code,
            "status": "ok" if reason is None else "failed",
            "objective": value,
            "reason": reason,
            "epochs": (summary or {}).get("epochs"),
        }
        append_event(self.output_dir, record)
        print(
            f"trial {trial_id} {record['status']}: " + (self.objective.display(value) if reason is None else reason),
            flush=True,
        )
        return record


def chief_main(output_dir: Path) -> int:
    """The chief: builds the oracle (reloading `<DIR>/oracle`) and serves it until stopped."""
    from tfmis.tuning import kt

    definition, _, space, objective = read_definition(output_dir)
    kt.allow_reload(Path(output_dir) / ORACLE_PROJECT)
    oracle = make_oracle(definition, space, objective)
    tuner = kt.make_tuner(
        None, objective.name, oracle=oracle, directory=str(output_dir), project_name=ORACLE_PROJECT, overwrite=False
    )
    print(
        f"chief: serving the oracle on {os.environ['KERASTUNER_ORACLE_IP']}:{os.environ['KERASTUNER_ORACLE_PORT']}"
        f" ({len(tuner.oracle.trials)} trials known, {len(kt.retry_queue(tuner))} to rerun)",
        flush=True,
    )
    kt.run_search(tuner)  # blocks, serving the workers
    return 0


def worker_main(output_dir: Path, tuner_id: str, cpus: list[int], gpus: list[dict], gpu_shared: bool) -> int:
    """A tuner worker: pins itself (its training processes inherit the affinity) and runs trials until the
    chief has none left."""
    from tfmis.tuning import kt

    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    assignment = {"tuner_id": tuner_id, "cpus": cpus, "gpus": gpus, "gpu_shared": gpu_shared}
    runner = TrialRunner(output_dir, assignment)
    oracle = make_oracle(runner.definition, runner.space, runner.objective)
    tuner = kt.make_tuner(
        runner.evaluate,
        runner.objective.name,
        oracle=oracle,
        directory=str(output_dir),
        project_name=ORACLE_PROJECT,
        overwrite=False,
    )
    print(f"{tuner_id}: cores {format_cpus(cpus)}, GPUs {[g['index'] for g in gpus] or 'none'}", flush=True)
    kt.run_search(tuner)  # a failed trial is reported with its reason, not a traceback
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tfmis.tuning.hpo",
        description="The chief and worker processes of `python -m tfmis.tune hpo` (started "
        "by it, with the KERASTUNER_* environment variables set).",
    )
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
    if argv is None:  # the search's own process: TensorFlow starts without scikit-learn, as a command's does
        start_tensorflow_without_sklearn()
    if args.role == "chief":
        return chief_main(Path(args.output))
    return worker_main(Path(args.output), args.tuner_id, parse_cpus(args.cpus), json.loads(args.gpus), args.gpu_shared)
