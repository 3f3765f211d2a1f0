#!/usr/bin/env python3
"""Does a time budget get used? `training.max_minutes` M at two thread counts: how long training ran, and where
the learning-rate schedule ended.

Each run is a real `python -m tfmis.train --config CONFIG --set training.max_minutes=M` in its own process, one
after the other, with `TF_NUM_INTRAOP_THREADS` / `TF_NUM_INTEROP_THREADS` / `OMP_NUM_THREADS` set to each of
`--threads` (default 1 and 2: one core's pace against two, so the trainer must decide two different schedule
lengths for the same budget). `training.epochs` is raised to `--max-epochs` (default 1000) so that it only bounds
the schedule. Per run it prints the budget, the training wall time (the trainer's `elapsed_seconds`, from the start
of the training loop, as the budget counts) and its ratio to the budget, the process's wall time (start-up and,
on the first run, the demo data's generation and conversion included), the decided epochs and the reason, and
the last epoch's learning rate (0 = the cosine schedule ended). Writes `time_budget.json` in `--output`.

Example:
    python benchmarks/time_budget.py --config configs/demo.yaml --minutes 2 --output runs/time_budget
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_once(config: str, minutes: float, threads: int, output: Path, max_epochs: int, extra: list[str]) -> dict:
    """One training run in its own process; its budget, times, decided epochs and final learning rate."""
    run_dir = output / f"threads{threads}"
    env = dict(os.environ)
    env.update(TF_NUM_INTRAOP_THREADS=str(threads), TF_NUM_INTEROP_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    command = [
        sys.executable,
        "-m",
        "tfmis.train",
        "--config",
        config,
        "--set",
        f"training.max_minutes={minutes}",
        "--set",
        f"training.epochs={max_epochs}",
        "--set",
        f"output.dir={run_dir}",
        "--set",
        "output.progress=false",
        *[item for pair in (("--set", s) for s in extra) for item in pair],
    ]
    start = time.perf_counter()
    with open(output / f"threads{threads}.log", "w") as log:
        code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO).returncode
    wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"run with {threads} thread(s) failed (exit {code}): see {output / f'threads{threads}.log'}")
    summary = json.loads((run_dir / "summary.json").read_text())
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines() if line]
    budget = summary["time_budget"]
    return {
        "threads": threads,
        "budget_seconds": 60 * minutes,
        "training_seconds": summary["elapsed_seconds"],
        "ratio": summary["elapsed_seconds"] / (60 * minutes),
        "process_seconds": wall,
        "epochs": summary["epochs"],
        "schedule_epochs": budget["schedule_epochs"],
        "stop_reason": summary["stop_reason"],
        "final_learning_rate": history[-1]["learning_rate"],
        "peak_learning_rate": max(r["learning_rate"] for r in history),
        "reason": budget["reason"],
        "best_mean_dice": summary["best_mean_dice"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--minutes", type=float, default=2.0, help="training.max_minutes of each run")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--max-epochs", type=int, default=1000, help="training.epochs: only an upper bound")
    p.add_argument("--output", default="runs/time_budget")
    p.add_argument("--set", action="append", default=[], help="more config overrides (key=value)")
    args = p.parse_args(argv)
    output = Path(args.output).resolve()
    output.mkdir(parents=True, exist_ok=True)
    results = []
    for threads in args.threads:
        r = run_once(args.config, args.minutes, threads, output, args.max_epochs, args.set)
        results.append(r)
        print(
            f"{threads} thread(s): budget {r['budget_seconds']:.0f} s, training {r['training_seconds']:.1f} s "
            f"({r['ratio']:.2f}x the budget; process {r['process_seconds']:.0f} s), {r['epochs']} epochs "
            f"(schedule {r['schedule_epochs']}, stop: {r['stop_reason']}), final learning rate "
            f"{r['final_learning_rate']:.2g} (peak {r['peak_learning_rate']:.2g}), best mean Dice "
            f"{r['best_mean_dice']:.3f}\n    {r['reason']}",
            flush=True,
        )
    (output / "time_budget.json").write_text(json.dumps({"config": args.config, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
