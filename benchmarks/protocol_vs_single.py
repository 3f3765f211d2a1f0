#!/usr/bin/env python3
"""nnU-Net's protocol (`tfmis-auto`) against one quick run (`tfmis.train --source-dir`) at the same wall time, scored
on held-out cases neither has seen.

- **Held-out cases**: `--holdout-dir` (an MSD folder of labelled cases), or the last `--holdout N` cases of the
  source's `dataset.json` training list, moved (as symlinks) out of the training copy `<output>/data/train`.
- **The arms**, each in its own processes, both started at once by default, each pinned to one of the two cores
  (`taskset`, one thread each), so that they get the same machine for the same wall time (`--sequential`: one after
  the other, with every core):
  - `single`: `python -m tfmis.train --source-dir TRAIN --set training.max_minutes=M` (plans, converts, trains the
    recommended configuration; its budget counts the training loop only, so its total is M plus planning and
    conversion);
  - `auto`: `tfmis-auto --source-dir TRAIN --folds K --max-minutes M` (plans, converts into K folds, trains every
    candidate configuration in every fold within M minutes in all, chooses the configuration(s) and
    postprocessing on the out-of-fold Dice);
  - `fullres` (with `--arms single,fullres`): the single run forced to full resolution (`--configuration
    fullres`), to compare the plan's recommendation with full resolution at the same budget.
- **Scored**: `tfmis-predict --input HOLDOUT/dataset.json --subset training` with each arm's model (the single run's
  best weights; the protocol's chosen configuration(s), each the ensemble of its K folds, and its postprocessing),
  Dice per class on the original grid (`predictions.csv`).

Prints per arm: the wall time of training (planning and conversion included), of predicting the held-out cases, what
it trained, and the held-out Dice per class and their mean; writes `<output>/protocol_vs_single.json`. Reruns keep
finished arms (delete `<output>/<arm>` to redo one).

Example (the demo; about 25 minutes on 2 cores):
    python benchmarks/protocol_vs_single.py --source-dir data/Task00_DemoBrain --holdout-dir data/demo_holdout \\
        --minutes 10 --output runs/protocol_demo
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ARMS = ("single", "auto", "fullres")


def split_dataset(source: Path, holdout: int, out: Path) -> tuple[Path, Path]:
    """`<out>/train` and `<out>/holdout`: MSD folders of symlinks, the last `holdout` training cases in the second."""
    meta = json.loads((source / "dataset.json").read_text())
    cases = meta["training"]
    if holdout < 1 or holdout >= len(cases) - 1:
        sys.exit(f"--holdout {holdout}: choose between 1 and {len(cases) - 2} ({len(cases)} training cases)")
    folders = {}
    for name, part in (("train", cases[:-holdout]), ("holdout", cases[-holdout:])):
        folder = out / name
        if not (folder / "dataset.json").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            for sub in ("imagesTr", "labelsTr"):
                (folder / sub).mkdir(parents=True)
            for case in part:
                for key in ("image", "label"):
                    rel = Path(case[key])
                    (folder / rel).symlink_to((source / rel).resolve())
            subset = dict(meta, training=part, test=[], numTraining=len(part), numTest=0)
            (folder / "dataset.json").write_text(json.dumps(subset, indent=1))
        folders[name] = folder
    return folders["train"], folders["holdout"]


def arm_command(arm: str, train: Path, out: Path, minutes: float, folds: int, extra: list[str]) -> list[str]:
    sets = [x for s in extra for x in ("--set", s)]
    if arm in ("single", "fullres"):
        forced = ["--configuration", "fullres"] if arm == "fullres" else []
        return [
            sys.executable,
            "-m",
            "tfmis.train",
            "--source-dir",
            str(train),
            "--set",
            f"output.dir={out}",
            "--set",
            f"data.dataset_dir={out}/data",
            "--set",
            f"training.max_minutes={minutes:g}",
            *forced,
            *sets,
        ]
    return ["tfmis-auto", "--source-dir", str(train), "--output", str(out), "--folds", str(folds)] + [
        "--max-minutes",
        f"{minutes:g}",
        *sets,
    ]


def environment(core: int | None) -> tuple[dict, list[str]]:
    env = dict(os.environ)
    if core is None:
        return env, []
    env.update(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1", OMP_NUM_THREADS="1")
    return env, ["taskset", "-c", str(core)]


def checkpoint_of(arm: str, out: Path) -> Path:
    return out / "cv" if arm == "auto" else out


def read_dice(csv_path: Path) -> dict:
    """Per class: the mean over held-out cases of predict's Dice column (NaN cases, both empty, left out)."""
    rows = list(csv.DictReader(csv_path.open()))
    columns = [c for c in rows[0] if c.startswith("dice_") and c != "dice_mean"]
    means = {}
    for column in columns:
        values = [float(r[column]) for r in rows if r[column] not in ("", "nan")]
        means[column[len("dice_") :]] = sum(values) / len(values) if values else math.nan
    return means


def what_trained(arm: str, out: Path) -> str:
    if arm == "auto":
        record = json.loads((out / "cv" / "crossval.json").read_text())
        chosen = record["chosen"]
        protocol = json.loads((out / "protocol.json").read_text())
        return (
            f"chosen {' + '.join(chosen['configurations'])} (out-of-fold {chosen['foreground_mean_dice']:.3f}); "
            f"{protocol['summary']}"
        )
    parts = []
    for summary in sorted([out / "summary.json", *out.glob("*/summary.json")]):
        if summary.is_file():
            record = json.loads(summary.read_text())
            stage = "" if summary.parent == out else f"{summary.parent.name}: "
            parts.append(f"{stage}{record['epochs']} epochs; {(record.get('time_budget') or {}).get('reason', '')}")
    return " / ".join(parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source-dir", required=True, type=Path)
    p.add_argument("--holdout-dir", type=Path, help="an MSD folder of labelled held-out cases")
    p.add_argument("--holdout", type=int, default=3, help="without --holdout-dir: the last N training cases")
    p.add_argument("--minutes", type=float, default=10.0, help="each arm's wall-clock budget")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--sequential", action="store_true", help="one arm after the other, every core each")
    p.add_argument("--arms", default="single,auto", help="two of single, auto, fullres (default single,auto)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="KEY=VALUE for both arms")
    args = p.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    if args.holdout_dir:
        train, holdout = args.source_dir, args.holdout_dir
    else:
        train, holdout = split_dataset(args.source_dir, args.holdout, args.output / "data")
    results_file = args.output / "protocol_vs_single.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}

    arms = [a.strip() for a in args.arms.split(",")]
    if len(arms) != 2 or not set(arms) <= set(ARMS):
        sys.exit(f"--arms {args.arms}: two of {', '.join(ARMS)}")
    running = {}
    for index, arm in enumerate(arms):
        out = args.output / arm
        if arm in results and "train_seconds" in results[arm]:
            continue
        env, pin = environment(None if args.sequential else index)
        command = pin + arm_command(arm, train, out, args.minutes, args.folds, args.overrides)
        log = open(args.output / f"{arm}.log", "w")
        print(f"[{arm}] {' '.join(command)}", flush=True)
        start = time.time()
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        running[arm] = (process, start)
        if args.sequential:
            process.wait()
    for arm, (process, start) in running.items():
        code = process.wait()
        results[arm] = {"train_seconds": time.time() - start, "train_exit": code}
        print(f"[{arm}] exit {code} after {results[arm]['train_seconds']:.0f} s", flush=True)
        results_file.write_text(json.dumps(results, indent=1))

    for arm in arms:
        out = args.output / arm
        record = results[arm]
        if record.get("train_exit") not in (0, None):
            print(f"[{arm}] training failed (exit {record['train_exit']}): see {args.output / (arm + '.log')}")
            continue
        predictions = args.output / f"{arm}_holdout"
        if not (predictions / "predictions.csv").is_file():
            start = time.time()
            command = [
                "tfmis-predict",
                "--checkpoint",
                str(checkpoint_of(arm, out)),
                "--input",
                str(holdout / "dataset.json"),
                "--subset",
                "training",
                "--output",
                str(predictions),
                "--quiet",
            ]
            with open(args.output / f"{arm}_predict.log", "w") as log:
                code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT)
            if code != 0:
                print(f"[{arm}] predict failed (exit {code}): see {args.output / (arm + '_predict.log')}")
                continue
            record["predict_seconds"] = time.time() - start
        record["dice"] = read_dice(predictions / "predictions.csv")
        record["trained"] = what_trained(arm, out)
        results_file.write_text(json.dumps(results, indent=1))

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")
    print(
        f"\n{args.source_dir.name}: {args.minutes:g} min per arm, {model}, "
        f"{'one after the other' if args.sequential else 'at once, one core each'}"
    )
    classes = next((list(r["dice"]) for r in results.values() if "dice" in r), [])
    print("| arm | training wall s | predict s | " + " | ".join(classes) + " | mean | trained |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in classes) + " | ---: | --- |")
    for arm in arms:
        r = results.get(arm, {})
        if "dice" not in r:
            print(f"| {arm} | {r.get('train_seconds', math.nan):.0f} | | failed |")
            continue
        values = [r["dice"][c] for c in classes]
        finite = [v for v in values if not math.isnan(v)]
        mean = sum(finite) / len(finite) if finite else math.nan
        cells = " | ".join(f"{v:.3f}" for v in values)
        print(
            f"| {arm} | {r['train_seconds']:.0f} | {r.get('predict_seconds', math.nan):.0f} | {cells} | {mean:.3f} | "
            f"{r['trained']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
