"""Running a cross-validation (the library behind `tfmis-crossval` and `tfmis-auto`): the definition from the
command's arguments (`make_definition`), the folder prepared (data converted into K folds, the job configs), the
folds trained on local worker processes or over a launcher's ranks, the progress table, and the choice
(`cross_validate` runs it all). `tfmis.crossval` is the command around it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from tfmis.config import ConfigError
from tfmis.crossvalidation.experiment import (
    DEFINITION_FILE,
    LOGS_DIR,
    SPLITS_FILE,
    Definition,
    fold_run_dir,
    job_config,
    job_config_path,
    parse_configurations,
    read_definition,
    read_job_events,
    write_job_configs,
)
from tfmis.crossvalidation.jobs import fold_done, training_done
from tfmis.crossvalidation.ranks import RANK_TIMEOUT_SECONDS
from tfmis.errors import DataError, PartialFailure
from tfmis.utils.io import atomic_write_json
from tfmis.utils.table import text_table


def make_definition(
    configs: list[str],
    folds: int,
    overrides=(),
    run_folds: str | None = None,
    splits_file: str | None = None,
    val_best: bool = False,
) -> Definition:
    """The cross-validation of `configs` (`[NAME=]PATH`, a config or a plan of stages each; `overrides`, `--set`
    values, go into every configuration) over `folds` folds, or the folds of `splits_file` (nnU-Net's
    splits_final.json); `run_folds` ("0,2") trains only those; `val_best` predicts each held-out fold with its best
    epoch's weights (optimistic). A `ConfigError` names the argument that is wrong."""
    if folds < 2:
        raise ConfigError(f"--folds must be at least 2, got {folds}")
    configurations = parse_configurations(configs, overrides)
    given_splits = None
    if splits_file:
        path = Path(splits_file)
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"--splits-file {path}: not a readable JSON list of folds ({e})") from None
        folds = len(entries)
        given_splits = str(path.resolve())
    chosen = list(range(folds))
    if run_folds:
        try:
            chosen = sorted({int(f) for f in run_folds.split(",")})
        except ValueError:
            raise ConfigError(f"--run-folds: comma-separated fold numbers, got {run_folds!r}") from None
        if not chosen or min(chosen) < 0 or max(chosen) >= folds:
            raise ConfigError(f"--run-folds {run_folds}: folds are 0..{folds - 1}")
    return Definition(configurations, folds, chosen, given_splits, "best" if val_best else "final")


def cross_validate(
    cv_dir: str | Path, definition: Definition, workers: int = 1, rank_timeout: float = RANK_TIMEOUT_SECONDS
) -> int:
    """Runs `definition` in `cv_dir`: on `workers` local processes, or over the ranks of a launcher (`mpirun`,
    `srun`, `tfmis-launch`: each rank its folds; rank 0 prepares and chooses); then scores, chooses and writes the
    results (`finish`). Returns 0 (a rank other than 0 returns once its folds ended).

    Raises:
        PartialFailure: some fold is unfinished (each named in one line above; rerunning continues).
    """
    from tfmis.engine.cluster import detect_launch

    cv_dir = Path(cv_dir)
    launch = detect_launch()
    if launch.size > 1:
        definition, lost = run_rank(cv_dir, definition, launch, rank_timeout)
        if launch.rank != 0:
            return 0  # its failed folds are in jobs.jsonl: rank 0 reports them (exit 3), as --workers does
        for line in lost:
            print(f"error: {line}", file=sys.stderr)
    else:
        cv_dir.mkdir(parents=True, exist_ok=True)
        prepare(cv_dir, definition)
        with Progress(cv_dir, definition):
            run_local_workers(cv_dir, definition, workers)
    unfinished = failures(cv_dir, definition)
    if unfinished:
        for line in unfinished:
            print(f"error: {line}", file=sys.stderr)
        raise PartialFailure(f"{len(unfinished)} fold(s) unfinished: rerun the same command to continue")
    return finish(cv_dir, definition)


def prepare(cv_dir: Path, definition: Definition) -> None:
    """Converts each configuration's data into its K folds (once; a rerun finds them), checks every configuration
    has the same folds, and writes the job configs, splits_final.json and the definition (last: other ranks wait
    for it)."""
    from tfmis.data.prepare import prepare_dataset
    from tfmis.data.records import load_index

    existing = cv_dir / DEFINITION_FILE
    if existing.is_file():
        old = read_definition(cv_dir)
        if old.identity() != definition.identity():
            raise ConfigError(
                f"{cv_dir} holds another cross-validation (other configurations, folds, splits or weights): give "
                "another --output, or the same --config, --set, --folds and --val-best as before to continue it"
            )
    folds_seen = None
    for configuration in definition.configurations:
        config = job_config(cv_dir, configuration, definition.run_folds[0], definition.folds, definition.splits_file)
        print(f"Data of {configuration.name}: {config.data.dataset_dir} ({definition.folds} folds)", file=sys.stderr)
        prepare_dataset(config.data, progress=True)
        index = load_index(config.data.dataset_dir)
        folds = [sorted(index["splits"][f"fold{k}"]["cases"]) for k in range(definition.folds)]
        if folds_seen is None:
            folds_seen = folds
            splits = Path(config.data.dataset_dir) / SPLITS_FILE
            if splits.is_file():
                shutil.copyfile(splits, cv_dir / SPLITS_FILE)
        elif folds != folds_seen:
            raise DataError(
                f"configuration {configuration.name}: its conversion {config.data.dataset_dir} has other folds than "
                f"{definition.configurations[0].name}'s: give both the same --splits-file"
            )
    write_job_configs(cv_dir, definition)
    atomic_write_json(existing, definition.to_json())


def progress_rows(cv_dir: Path, definition: Definition) -> list[tuple]:
    """One row per fold: each configuration's state (waiting, epoch e/E with E the schedule's length as known so
    far, trained with the held-out Dice of the weights its fold predicts with, failed with its exit code), the
    out-of-fold prediction's. A trained cell shows the final weights' Dice on the held-out fold ("final Dice", the
    last epoch's: a measurement, not a selection), or with `--val-best` the best epoch's, marked optimistic (the
    held-out fold chose it)."""
    running, failed = {}, {}
    for e in read_job_events(cv_dir):
        key = (e["job"], e.get("configuration"), e["fold"])
        running[key] = e["event"] == "start"
        failed[key] = e.get("exit_code") if e["event"] == "end" and e.get("exit_code") else None
    rows = [("fold", *definition.names, "out-of-fold")]
    for fold in definition.run_folds:
        cells = []
        for name in definition.names:
            run = fold_run_dir(cv_dir, name, fold)
            if training_done(run):
                summary = _json(run / "summary.json")
                if definition.weights == "best":
                    dice = summary.get("best_mean_dice")
                    text = f"trained, best Dice {dice:.3f} (optimistic)" if isinstance(dice, float) else "trained"
                else:
                    dice = summary.get("final_mean_dice")
                    text = f"trained, final Dice {dice:.3f}" if isinstance(dice, float) else "trained"
                cells.append(text)
            elif running.get(("train", name, fold)):
                done, schedule = _history(run / "history.jsonl")
                epochs = schedule or _epochs(job_config_path(cv_dir, name, fold))
                cells.append(f"training, epoch {done + 1}/{epochs}")
            elif failed.get(("train", name, fold)):
                cells.append(f"failed (exit {failed['train', name, fold]})")
            else:
                cells.append("waiting")
        if fold_done(cv_dir, definition, fold):
            cells.append("scored")
        elif running.get(("oof", None, fold)):
            cells.append("predicting")
        elif failed.get(("oof", None, fold)):
            cells.append(f"failed (exit {failed['oof', None, fold]})")
        else:
            cells.append("-")
        rows.append((str(fold), *cells))
    return rows


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _history(path: Path) -> tuple[int, int | None]:
    """(the epochs a run's history holds, the schedule's length its last record knows: a time budget's decision)."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        last = json.loads(lines[-1]) if lines else {}
    except (OSError, ValueError):
        return 0, None
    schedule = last.get("schedule_epochs") if isinstance(last, dict) else None
    return len(lines), schedule if isinstance(schedule, int) else None


def _epochs(path: Path) -> str:
    import yaml

    try:
        return str(yaml.safe_load(path.read_text())["training"]["epochs"])
    except (OSError, ValueError, KeyError, TypeError):
        return "?"


class Progress:
    """Prints the folds' table whenever a cell changes (checked every `seconds`), from a thread."""

    def __init__(self, cv_dir: Path, definition: Definition, seconds: float = 5.0):
        self.cv_dir, self.definition, self.seconds = cv_dir, definition, seconds
        self.last = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def show(self) -> None:
        rows = progress_rows(self.cv_dir, self.definition)
        if rows != self.last:
            self.last = rows
            stamp = time.strftime("%H:%M:%S")
            print(
                f"[{stamp}] cross-validation progress:\n"
                + "\n".join(text_table(rows, "left"))
                + f"\n{dice_note(self.definition)}",
                flush=True,
            )

    def _loop(self) -> None:
        while not self.stop.wait(self.seconds):
            try:
                self.show()
            except (OSError, ValueError):
                pass  # a file being written: next time

    def __enter__(self):
        self.show()
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.show()


def dice_note(definition: Definition) -> str:
    """The line under the progress table saying what its Dice is."""
    if definition.weights == "best":
        return (
            "Dice: each training's best epoch on its held-out fold, the weights --val-best predicts that fold with: "
            "chosen on the fold itself, so optimistic"
        )
    return (
        "Dice: each training's last epoch on its held-out fold (final.weights.h5, what the fold predicts with): a "
        "progress measurement, the held-out fold chooses nothing"
    )


def run_local_workers(cv_dir: Path, definition: Definition, workers: int) -> int:
    """`workers` worker processes, each pinned to its share of the cores and GPUs (the hyperparameter search's
    assignment), each taking every workers-th fold; 0 when all succeeded."""
    from tfmis.hardware import accelerators, worker_cpus
    from tfmis.tuning.hpo.devices import assign_devices, describe_assignment, dies_with_parent, trial_env

    cpus = worker_cpus()
    gpus = accelerators() if workers > 1 else []
    plan = assign_devices(workers, cpus, gpus)
    if workers > 1:
        print(f"Folds on {describe_assignment(plan, cpus).replace('tuner', 'worker')}", file=sys.stderr)
    logs = cv_dir / LOGS_DIR
    logs.mkdir(parents=True, exist_ok=True)
    children = []
    for rank, share in enumerate(plan):
        command = [sys.executable, "-m", "tfmis.crossval", "worker", str(cv_dir), "--rank", str(rank)]
        command += ["--size", str(workers)]
        if workers > 1:
            command += ["--cpus", ",".join(map(str, share["cpus"]))]
        env = trial_env(share) if workers > 1 else dict(os.environ)
        out = open(logs / f"worker{rank}.log", "ab")  # noqa: SIM115 (closed below, after the child ends)
        children.append((subprocess.Popen(dies_with_parent(command, 9), stdout=out, stderr=out, env=env), out))
    codes = []
    for child, out in children:
        codes.append(child.wait())
        out.close()
    return 0 if all(c == 0 for c in codes) else 1


def run_rank(cv_dir: Path, definition: Definition, launch, timeout: float) -> tuple[Definition, list[str]]:
    """One rank of a launch: rank 0 prepares the folder while the others wait for it, each rank trains its folds on
    its share of its machine (`ranks.rank_share`), and rank 0 waits for the others to end. Every wait ends: a rank that
    failed or went silent for `timeout` seconds (`ranks.Watch`) stops it. Returns the definition and, on rank 0, one
    line per rank it stopped waiting for."""
    from tfmis.crossvalidation.experiment import append_job_event
    from tfmis.crossvalidation.jobs import run_worker
    from tfmis.crossvalidation.ranks import Heartbeat, rank_share, wait_for_definition, wait_for_ranks
    from tfmis.engine.cluster import bound_by_launcher
    from tfmis.hardware import accelerators, worker_cpus
    from tfmis.tuning.hpo.devices import format_cpus, trial_env

    cv_dir.mkdir(parents=True, exist_ok=True)
    lost: list[str] = []
    with Heartbeat(cv_dir, launch.rank, launch.job_id) as heartbeat:
        if launch.rank == 0:
            prepare(cv_dir, definition)
            heartbeat.set_state("prepared")
            print(f"Folds over the {launch.size} ranks of the launch ({launch.kind})", file=sys.stderr)
        else:
            wait_for_definition(cv_dir, DEFINITION_FILE, launch.job_id, timeout)
            definition = read_definition(cv_dir)
        share = rank_share(launch.local_rank, launch.local_size, worker_cpus(), accelerators(), bound_by_launcher())
        if share["cpus"] and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, share["cpus"])  # the fold trainings inherit it
        gpus = ",".join(str(g["index"]) for g in share["gpus"]) or "none"
        print(
            f"rank {launch.rank} (local {launch.local_rank} of {launch.local_size}): cores "
            f"{format_cpus(share['cpus'])}, GPU {gpus}",
            file=sys.stderr,
            flush=True,
        )
        progress = Progress(cv_dir, definition) if launch.rank == 0 else None
        if progress:
            progress.__enter__()
        code = run_worker(cv_dir, definition, launch.rank, launch.size, env=trial_env(share))
        append_job_event(cv_dir, {"event": "worker_end", "rank": launch.rank, "time": time.time(), "code": code})
        if launch.rank == 0:
            lost = wait_for_ranks(cv_dir, launch.size, launch.job_id, timeout)
            progress.__exit__(None, None, None)
    return definition, lost


def failures(cv_dir: Path, definition: Definition) -> list[str]:
    """Why each unfinished fold is unfinished: the last failed job's reason, or "not run"."""
    last = {}
    for e in read_job_events(cv_dir):
        if e["event"] == "end":
            last[(e["job"], e.get("configuration"), e["fold"])] = e
    out = []
    for fold in definition.run_folds:
        if fold_done(cv_dir, definition, fold):
            continue
        failed = [e for (job, _, f), e in last.items() if f == fold and e["exit_code"] != 0]
        if failed:
            e = failed[-1]
            what = f"{e.get('configuration') or 'out-of-fold prediction'} fold {fold}"
            out.append(f"{what} failed (exit {e['exit_code']}): {e['reason']}")
        else:
            out.append(f"fold {fold}: not finished")
    return out


def finish(cv_dir: Path, definition: Definition) -> int:
    from tfmis.crossvalidation.selection import postprocessing_lines, select, table_text, write_results

    result = select(cv_dir, definition)
    paths = write_results(cv_dir, definition, result)
    print(table_text(result))
    for line in postprocessing_lines(result):
        print(f"postprocessing: {line}")
    wall = result["wall_seconds"]
    print(
        f"Chosen: {' + '.join(result['chosen']['configurations'])}. Wall time {wall['span'] / 60:.1f} min "
        f"(the jobs' own times add up to {wall['sum'] / 60:.1f} min). Results: {', '.join(p.name for p in paths)} "
        f"in {cv_dir}"
    )
    return 0
