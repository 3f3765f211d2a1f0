"""The folds as independent experiments: each worker takes its share of the folds and, for each, trains every
configuration (a `python -m tfmis.train` process per training) and predicts the fold's held-out cases
(`python -m tfmis.crossval oof`).

A worker is a process pinned to its share of the machine (`python -m tfmis.crossval worker`, started by the
command with `--workers N`), or one rank of a launch (`mpirun`, `srun`, `tfmis-launch`): rank r of n takes folds
r, r + n, ... . Everything is resumable from the folder: a training with `summary.json` is finished and skipped, an
interrupted one continues from its last committed epoch (`--resume`), a fold whose `validation/scores.json` exists
is not predicted again.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tfmis.crossvalidation.experiment import (
    LOGS_DIR,
    SCORES_FILE,
    VALIDATION_DIR,
    Definition,
    append_job_event,
    averaging_pairs,
    candidate_dir,
    fold_run_dir,
    job_config_path,
    pair_name,
    read_job_events,
)
from tfmis.engine.time_budget import budget_epoch_bound
from tfmis.tuning.hpo.devices import dies_with_parent, package_env
from tfmis.utils.io import log_tail

# the variables by which a launcher tells a process its rank: a fold's training runs alone, so they are left out
LAUNCH_PREFIXES = ("TF_CONFIG", "HOROVOD_", "OMPI_", "PMI_", "PMIX_", "MPI_", "SLURM_", "KERASTUNER_")


def single_process_env(env: dict | None = None) -> dict:
    """The environment of a fold's processes: this worker's (its GPUs, threads), without the launcher's rank
    variables, with this copy of tfmis importable."""
    base = os.environ if env is None else env
    out = {k: v for k, v in base.items() if not k.startswith(LAUNCH_PREFIXES)}
    out.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return package_env(out)


# `<cv>/training_budget.json` (written by `tfmis-auto` with a time budget): the seconds each worker's jobs share in
# all (`lane_seconds`: its trainings and its folds' out-of-fold predictions) and what one out-of-fold prediction is
# assumed to take until this worker has made one (`oof_seconds`). Each fold's trainings get one share, the same for
# every configuration of the fold (the candidates compared get the same time): what is left of the lane, less the
# out-of-fold predictions left (measured on this worker's, `oof_seconds` before any), over the trainings left, less
# the time a training process spends outside its training loop (start-up, data, the closing writes), measured on this
# worker's finished trainings (FIRST_OVERHEAD_SECONDS before any). A lane without `oof_seconds` (an older tfmis-auto)
# holds the trainings alone.
TRAINING_BUDGET_FILE = "training_budget.json"
FIRST_OVERHEAD_SECONDS = 20.0
LEAST_TRAINING_MINUTES = 0.1  # a training whose share is used up still trains a few epochs and ends its schedule


def training_minutes(cv_dir: Path, definition: Definition, rank: int, size: int) -> float | None:
    """The `training.max_minutes` of each training of the next fold of worker `rank` of `size` under the
    cross-validation's training budget (`TRAINING_BUDGET_FILE`), or None without one.

    Its share: (the worker's seconds - what its finished jobs took, start-ups included - the out-of-fold predictions
    its unfinished folds still need) / the trainings it has left, less the measured start-up and closing time of one
    training. A fixed split would overrun: every training process spends 10-60 s outside the loop that
    `training.max_minutes` counts, and an out-of-fold prediction takes what it takes."""
    path = Path(cv_dir) / TRAINING_BUDGET_FILE
    if not path.is_file():
        return None
    budget = json.loads(path.read_text())
    lane = float(budget["lane_seconds"])
    worker = f"worker{rank}"
    ended = [e for e in read_job_events(cv_dir) if e.get("event") == "end" and e.get("worker") == worker]
    spent = sum(float(e["seconds"]) for e in ended if e.get("job") in ("train", "oof"))
    overheads = []
    for event in ended:
        if event.get("job") != "train":
            continue
        summary = fold_run_dir(cv_dir, event["configuration"], event["fold"]) / "summary.json"
        if event.get("exit_code") == 0 and summary.is_file():
            elapsed = json.loads(summary.read_text()).get("elapsed_seconds") or 0.0
            overheads.append(max(0.0, float(event["seconds"]) - float(elapsed)))
    overhead = sum(overheads) / len(overheads) if overheads else FIRST_OVERHEAD_SECONDS
    folds = worker_folds(definition, rank, size)
    runs = [fold_run_dir(cv_dir, c.name, fold) for fold in folds for c in definition.configurations]
    left = sum(not training_done(run) for run in runs)
    oof = 0.0
    if "oof_seconds" in budget:
        predicted = [float(e["seconds"]) for e in ended if e.get("job") == "oof" and e.get("exit_code") == 0]
        each = sum(predicted) / len(predicted) if predicted else float(budget["oof_seconds"])
        oof = each * sum(not fold_done(cv_dir, definition, fold) for fold in folds)
    share = (lane - spent - oof) / max(1, left) - overhead
    return max(LEAST_TRAINING_MINUTES, math.floor(share / 60 * 100) / 100)


def training_done(run_dir: Path) -> bool:
    return (Path(run_dir) / "summary.json").is_file()


def oof_done(cv_dir: str | Path, name: str, fold: int) -> bool:
    return (fold_run_dir(cv_dir, name, fold) / VALIDATION_DIR / SCORES_FILE).is_file()


def fold_done(cv_dir: str | Path, definition: Definition, fold: int) -> bool:
    """Every configuration's out-of-fold scores of `fold`, and every averaged pair's (a prediction that died between
    them leaves the fold unfinished, so a rerun completes it rather than choosing without the pair)."""
    return all(oof_done(cv_dir, name, fold) for name in definition.names) and all(
        (candidate_dir(cv_dir, pair_name(a, b), fold) / SCORES_FILE).is_file() for a, b in averaging_pairs(definition)
    )


def failure_line(log: Path) -> str:
    lines = [line for line in log_tail(log) if not line.startswith(("W0000", "I0000", "E0000"))]
    error = [line for line in lines if line.startswith("error")]
    return (error or lines or ["(no output)"])[-1][:300]


def _run(cv_dir: Path, command: list[str], log: Path, event: dict, env: dict) -> tuple[int, str]:
    """Runs one step of a fold as a child process (killed with its worker), its output in `log`; appends its
    start and end to jobs.jsonl; (exit code, the log's error line or "")."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    append_job_event(cv_dir, {**event, "event": "start", "time": start, "pid": os.getpid()})
    with open(log, "ab") as out:
        out.write(f"\n== {' '.join(command)}\n".encode())
        out.flush()
        try:
            code = subprocess.call(dies_with_parent(command, signal.SIGKILL), stdout=out, stderr=out, env=env)
        except OSError as e:
            code, reason = 1, f"cannot start {command[2]}: {e}"
        else:
            reason = "" if code == 0 else failure_line(log)
    end = time.time()
    append_job_event(
        cv_dir,
        {**event, "event": "end", "time": end, "seconds": end - start, "exit_code": code, "reason": reason},
    )
    return code, reason


def run_fold(
    cv_dir: str | Path, definition: Definition, fold: int, env: dict, rank: int = 0, size: int = 1
) -> str | None:
    """Trains every configuration of `fold` not yet trained (under the training budget when there is one) and
    predicts its held-out cases, as worker `rank` of `size`; None, or why it failed (one line naming the
    configuration, the fold and its log)."""
    cv_dir = Path(cv_dir)
    worker = f"worker{rank}"
    # one share for every configuration of the fold: the candidates compared get the same time
    minutes = training_minutes(cv_dir, definition, rank, size)
    for configuration in definition.configurations:
        name = configuration.name
        run = fold_run_dir(cv_dir, name, fold)
        if training_done(run):
            continue
        log = cv_dir / LOGS_DIR / f"{name}_fold_{fold}.train.log"
        command = [sys.executable, "-m", "tfmis.train", "--config", str(job_config_path(cv_dir, name, fold))]
        command.append("--resume")  # an interrupted training continues from its last committed epoch
        if minutes is not None:
            # the share decides the schedule's length: the plan's epoch count only bounds it far beyond
            command += ["--set", f"training.max_minutes={minutes:g}"]
            command += ["--set", f"training.epochs={budget_epoch_bound(minutes)}"]
        event = {"job": "train", "configuration": name, "fold": fold, "worker": worker, "resumed": run.exists()}
        code, reason = _run(cv_dir, command, log, event, env)
        if code != 0:
            return f"{name} fold {fold}: training failed (exit {code}): {reason} (log: {log})"
    if fold_done(cv_dir, definition, fold):
        return None
    log = cv_dir / LOGS_DIR / f"fold_{fold}.oof.log"
    command = [sys.executable, "-m", "tfmis.crossval", "oof", str(cv_dir), "--fold", str(fold)]
    code, reason = _run(cv_dir, command, log, {"job": "oof", "fold": fold, "worker": worker}, env)
    if code != 0:
        return f"fold {fold}: out-of-fold prediction failed (exit {code}): {reason} (log: {log})"
    return None


def worker_folds(definition: Definition, rank: int, size: int) -> list[int]:
    """The folds of worker `rank` of `size`: every size-th, starting at its rank."""
    return definition.run_folds[rank::size]


def run_worker(cv_dir: str | Path, definition: Definition, rank: int, size: int, env: dict | None = None) -> int:
    """Worker `rank` of `size`: its folds one after another; 0, or 1 after a failed fold (the others still run,
    so a rerun has less to do)."""
    env = single_process_env(env)
    failed = []
    for fold in worker_folds(definition, rank, size):
        reason = run_fold(cv_dir, definition, fold, env, rank, size)
        if reason:
            print(f"error: {reason}", file=sys.stderr, flush=True)
            failed.append(reason)
    return 1 if failed else 0
