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
from tfmis.tuning.hpo import HpoSearch, Objective, load_space

config = load_config("configs/demo.yaml")
space = load_space("configs/hpo_space.yaml", config)
report = HpoSearch(config, space, "runs/hpo", workers=2, objective=Objective.parse("best_mean_dice")).run()
print(report["best"]["trial_id"], report["best"]["hyperparameters"])
```
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tfmis.config import Config, ConfigError, from_dict, save_config, set_key, to_dict
from tfmis.engine.cluster import free_ports
from tfmis.errors import TrainingFailed
from tfmis.hardware import accelerators, worker_cpus
from tfmis.tuning.hpo.devices import assign_devices, describe_assignment, dies_with_parent, format_cpus, package_env
from tfmis.tuning.hpo.folder import (
    BASE_FILE,
    BEST_FILE,
    LOGS_DIR,
    ORACLE_PROJECT,
    PLOT_FILE,
    REPORT_FILE,
    RUNS_LOG,
    SEARCH_FILE,
    SEARCH_VERSION,
    definition_fingerprint,
    new_events,
    oracle_trials,
    read_events,
)
from tfmis.tuning.hpo.report import collect_trials, peak_concurrency, plot_dice, short, trials_table
from tfmis.tuning.hpo.space import NOT_REACHED_SECONDS, Objective, SearchSpace
from tfmis.tuning.kt import ENDED, saved_oracle_state, trial_order
from tfmis.utils.io import atomic_write_json, log_tail

STRATEGIES = ("grid", "random", "bayesian")
POLL_SECONDS = 0.5


class SearchFailed(TrainingFailed):
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

    def __init__(
        self,
        config: Config,
        space: SearchSpace,
        output_dir,
        *,
        workers: int = 1,
        num_trials: int | None = None,
        objective: Objective | None = None,
        strategy: str | None = None,
        resume: bool = False,
        progress: bool = True,
        space_file: str | None = None,
    ):
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
                print(f"The grid has {grid_size} points: running {grid_size} trials, not {num_trials}", file=sys.stderr)
            num_trials = min(num_trials or grid_size, grid_size)
        self.num_trials = num_trials or 10
        self.grid_size = grid_size
        self.resume, self.progress = resume, progress
        self.space_file = space_file or space.source

    # -------------------------------------------------------------- setting up

    def definition(self) -> dict:
        """What the chief and the workers read (hpo_search.json). The oracle's seed is training.seed + 1:
        Keras Tuner takes a seed of 0 as "pick one at random"."""
        d = {
            "version": SEARCH_VERSION,
            "config": to_dict(self.config),
            "space": self.space.to_dict(),
            "space_file": self.space_file,
            "objective": str(self.objective),
            "strategy": self.strategy,
            "seed": int(self.config.training.seed) + 1,
            "num_trials": self.num_trials,
            "workers": self.workers,
        }
        d["fingerprint"] = definition_fingerprint(d)
        return d

    def _prepare(self) -> dict | None:
        """Writes (or checks, when resuming) the definition and the trials' base config; returns the
        oracle's saved state (`tfmis.tuning.kt.saved_oracle_state`; None for a new search)."""
        path = self.output_dir / SEARCH_FILE
        definition = self.definition()
        if path.is_file():
            old = json.loads(path.read_text())
            if old.get("fingerprint") != definition["fingerprint"]:
                differ = [
                    k for k in ("config", "space", "objective", "strategy", "seed") if old.get(k) != definition[k]
                ]
                raise ConfigError(
                    f"{self.output_dir} holds a search with a different {', '.join(differ)}: resume it with the same "
                    f"config, space, --objective and --strategy, or give another --output (or delete the folder) "
                    "to start a new search"
                )
        elif self.resume:
            raise ConfigError(
                f"--resume: {self.output_dir} holds no search ({SEARCH_FILE} missing); run without "
                "--resume to start one"
            )
        atomic_write_json(path, definition)
        # the parent prepared the data: the trials read it and never convert (two would race)
        base = to_dict(self.config)
        base["data"]["source_dir"], base["data"]["demo"] = None, False
        save_config(from_dict(Config, base), self.output_dir / BASE_FILE)
        (self.output_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
        return saved_oracle_state(self.output_dir / ORACLE_PROJECT)

    # -------------------------------------------------------------- running

    def run(self) -> dict:
        """Runs the search (or what is left of it), writes hpo_report.json, hpo_dice.png and best.yaml,
        prints the table; returns the report.

        Raises:
            SearchFailed: the chief died, or a worker died.
        """
        start = time.time()
        state = self._prepare()
        ended = [trial_id for trial_id, t in oracle_trials(self.output_dir).items() if t["status"] in ENDED]
        waiting = set((state or {}).get("ongoing", [])) | set((state or {}).get("retry", []))
        ongoing = sorted(waiting - set(ended), key=trial_order)
        if state:
            print(
                f"Resuming the search in {self.output_dir}: {len(ended)} of {self.num_trials} trials finished"
                + (
                    f"; trial(s) {', '.join(ongoing)} were running when it stopped and are rerun from scratch"
                    if ongoing
                    else ""
                ),
                file=sys.stderr,
            )
        errors: list[str] = []
        if len(ended) >= self.num_trials and not ongoing:
            print("All trials have finished: writing the report again", file=sys.stderr)
        else:
            errors = self._run_processes(len(ended))
        report = self.report(time.time() - start, errors)
        self.write_outputs(report)
        if errors:
            raise SearchFailed(
                "; ".join(errors) + f" (logs in {self.output_dir / LOGS_DIR}); rerun the same command to resume"
            )
        return report

    def _run_processes(self, already_ended: int) -> list[str]:
        cpus = worker_cpus()
        gpus = accelerators()
        plan = assign_devices(self.workers, cpus, gpus)
        space = ", ".join(f"{p.key} {p.describe()}" for p in self.space.params)
        print(
            f"Hyperparameter search ({self.strategy}, {self.num_trials} trials"
            + (f" of a {self.grid_size}-point grid" if self.grid_size and self.grid_size != self.num_trials else "")
            + f", objective {self.objective} ({self.objective.direction}imised)) over {space}",
            file=sys.stderr,
        )
        print(describe_assignment(plan, cpus), file=sys.stderr)
        port = free_ports(1)[0]
        base_env = package_env(dict(os.environ))
        base_env.update(
            KERASTUNER_ORACLE_IP="127.0.0.1",
            KERASTUNER_ORACLE_PORT=str(port),
            CUDA_VISIBLE_DEVICES="-1",  # the chief and the workers never touch a GPU; trials do
            TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
        )
        module = [sys.executable, "-m", "tfmis.tuning.hpo"]
        processes: dict[str, subprocess.Popen] = {}
        logs = []
        try:
            processes["chief"] = self._spawn(
                module + ["chief", str(self.output_dir)], {**base_env, "KERASTUNER_TUNER_ID": "chief"}, "chief", logs
            )
            for a in plan:
                command = (
                    module
                    + [
                        "worker",
                        str(self.output_dir),
                        "--tuner-id",
                        a["tuner_id"],
                        "--cpus",
                        format_cpus(a["cpus"]) if a["cpus"] else "",
                        "--gpus",
                        json.dumps(a["gpus"]),
                    ]
                    + (["--gpu-shared"] if a["gpu_shared"] else [])
                )
                processes[a["tuner_id"]] = self._spawn(
                    command, {**base_env, "KERASTUNER_TUNER_ID": a["tuner_id"]}, a["tuner_id"], logs
                )
            return self._watch(processes, already_ended)
        finally:
            for process in processes.values():
                if process.poll() is None:
                    process.terminate()
            for process in processes.values():
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
        return subprocess.Popen(
            dies_with_parent(command, signal.SIGTERM), stdout=log, stderr=subprocess.STDOUT, env=env
        )

    def _watch(self, processes: dict, already_ended: int) -> list[str]:
        """Prints a line per finished trial until every worker has exited; returns what died."""
        from tfmis.utils.progress import progress_bar

        workers = {name: p for name, p in processes.items() if name != "chief"}
        log = self.output_dir / RUNS_LOG
        offset = log.stat().st_size if log.is_file() else 0  # earlier runs' lines were reported then
        state = {"done": already_ended, "best": None}
        for trial_id, t in oracle_trials(self.output_dir).items():  # the best of an earlier run
            if (
                t["status"] == "COMPLETED"
                and t.get("score") is not None
                and (state["best"] is None or self.objective.better(t["score"], state["best"][1]))
            ):
                state["best"] = (trial_id, t["score"])
        bar = progress_bar(self.num_trials, "HPO trials", "trial", disable=not self.progress, initial=already_ended)

        def report_new_events():
            nonlocal offset
            offset, events = new_events(self.output_dir, offset)
            for e in events:
                if e["event"] == "start" and e.get("rerun"):
                    bar.write(
                        f"trial {e['trial_id']}: rerunning it (attempt {e['attempt']}; it was running when "
                        "the search was interrupted)",
                        file=sys.stderr,
                    )
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
                    errors.append(
                        f"the chief (oracle server) exited with code {processes['chief'].returncode}: "
                        f"{last_log_line(self.output_dir / LOGS_DIR / 'chief.log')}"
                    )
                    break
                time.sleep(POLL_SECONDS)
            report_new_events()
        finally:
            bar.close()
        for name, p in workers.items():
            if p.returncode not in (0, None):
                errors.append(
                    f"worker {name} exited with code {p.returncode}: "
                    f"{last_log_line(self.output_dir / LOGS_DIR / f'{name}.log')}"
                )
        return errors

    def _progress_line(self, e: dict, done: int, best) -> str:
        values = next(
            (
                s["hyperparameters"]
                for s in reversed(read_events(self.output_dir))
                if s["event"] == "start" and s["trial_id"] == e["trial_id"]
            ),
            {},
        )
        hps = " ".join(f"{k}={short(v)}" for k, v in values.items())
        result = (
            f"{self.objective} {self.objective.display(e['objective'])}, {e['epochs']} epochs"
            if e["status"] == "ok"
            else f"FAILED: {e['reason']}"
        )
        best_text = f"; best: trial {best[0]} {self.objective.display(best[1])}" if best else ""
        return (
            f"trial {e['trial_id']:>3} [{e['tuner_id']}, {e['seconds']:.1f} s] {hps}: {result} "
            f"({done}/{self.num_trials} done{best_text})"
        )

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
            "output_dir": str(self.output_dir),
            "space_file": self.space_file,
            "space": self.space.to_dict(),
            "strategy": self.strategy,
            "num_trials": self.num_trials,
            "grid_size": self.grid_size,
            "workers": self.workers,
            "objective": {
                "name": str(self.objective),
                "metric": self.objective.name,
                "direction": self.objective.direction,
                "not_reached_seconds": NOT_REACHED_SECONDS if self.objective.target else None,
            },
            "trials": records,
            "counts": counts,
            "peak_concurrency": peak_concurrency(records),
            "best": None
            if best is None
            else {k: best[k] for k in ("trial_id", "hyperparameters", "objective", "run_dir")},
            "elapsed_seconds": elapsed,
            "errors": errors or [],
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


def last_log_line(path: Path) -> str:
    """The last line of a chief's or worker's log (its `===` start markers passed over)."""
    lines = [line for line in log_tail(path) if not line.startswith("===")]
    return lines[-1] if lines else "(no output)"
