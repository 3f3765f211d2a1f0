#!/usr/bin/env python3
"""Training throughput with `training.steps_per_loop` K against one step per host round-trip.

Each arm is a real `python -m tfmis.train` run of the config (validation off, `--epochs` epochs), one at a
time in its own process; the arms alternate (`--repeats` rounds: K=1, K=k2, ..., then again) so every
arm sees the same share of a busy machine. From each run's `history.jsonl` it takes the epochs after the
first (the first pays for tracing and filling the cache): images/s over those epochs and their input-wait
share (`data_wait_fraction`, which the trainer still measures per step inside a loop). It prints a table
and the ratio of each K's median images/s to K=1's, and writes `steps_per_loop.json` and `.md`.

On a CPU the host waits for each step anyway (the device is the host), so the ratio is ~1 here: what
this checks on this machine is that looping costs nothing and that the input wait is still reported.
On a GPU the loop lets the host queue the next steps while the device works.

Example:
    python benchmarks/steps_per_loop.py --config configs/demo.yaml --loops 1 16 --epochs 6 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from tfmis.utils.io import atomic_write_json, atomic_writer  # noqa: E402


def run_arm(config: str, loop: int, epochs: int, out: Path, overrides: list[str]) -> dict:
    """One training run with `steps_per_loop=loop`; its throughput and input-wait share after epoch 1."""
    command = [
        sys.executable,
        "-m",
        "tfmis.train",
        "--config",
        config,
        "--set",
        f"training.steps_per_loop={loop}",
        "--set",
        f"training.epochs={epochs}",
        "--set",
        f"validation.val_interval={epochs + 1}",
        "--set",
        f"output.dir={out}",
        "--set",
        "output.progress=false",
        "--set",
        "output.tensorboard=false",
        *[a for o in overrides for a in ("--set", o)],
    ]
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if code != 0:
        raise SystemExit(f"error: the run with steps_per_loop={loop} failed (exit {code}); see {log}")
    records = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    steady = records[1:]
    if not steady:
        raise SystemExit("error: --epochs must be at least 2 (the first epoch is left out)")
    images = sum(r["images_per_second"] * (r["epoch_seconds"]) for r in steady)
    seconds = sum(r["epoch_seconds"] for r in steady)
    return {
        "steps_per_loop": loop,
        "images_per_second": images / seconds,
        "data_wait_fraction": statistics.mean(r["data_wait_fraction"] for r in steady),
        "epoch_seconds": statistics.median(r["epoch_seconds"] for r in steady),
        "run": str(out),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument(
        "--loops",
        type=int,
        nargs="+",
        default=[1, 16],
        help="steps_per_loop values; the first is the reference (default 1 16)",
    )
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--output", default="runs/steps_per_loop")
    args = p.parse_args(argv)
    out = Path(args.output)
    results = {loop: [] for loop in args.loops}
    for repeat in range(1, args.repeats + 1):
        for loop in args.loops:
            result = run_arm(args.config, loop, args.epochs, out / f"loop{loop}_run{repeat}", args.overrides)
            results[loop].append(result)
            print(
                f"round {repeat}, steps_per_loop {loop}: {result['images_per_second']:.2f} images/s, "
                f"input wait {100 * result['data_wait_fraction']:.1f} %",
                flush=True,
            )
    reference = statistics.median(r["images_per_second"] for r in results[args.loops[0]])
    lines = [
        "| steps_per_loop | images/s (median) | images/s per run | input wait, % of step time | ratio to "
        f"{args.loops[0]} |",
        "|---|---|---|---|---|",
    ]
    summary = {}
    for loop, runs in results.items():
        median = statistics.median(r["images_per_second"] for r in runs)
        summary[loop] = {"images_per_second": median, "ratio": median / reference, "runs": runs}
        speeds = ", ".join(f"{r['images_per_second']:.2f}" for r in runs)
        waits = ", ".join(f"{100 * r['data_wait_fraction']:.1f}" for r in runs)
        lines.append(f"| {loop} | {median:.2f} | {speeds} | {waits} | {median / reference:.2f} |")
    table = "\n".join(lines)
    print(table)
    atomic_write_json(out / "steps_per_loop.json", {"config": args.config, "epochs": args.epochs, "results": summary})
    with atomic_writer(out / "steps_per_loop.md") as f:
        f.write(f"# steps_per_loop on {args.config} ({args.epochs} epochs per run, epoch 1 left out)\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
