#!/usr/bin/env python3
"""Real scan sizes, no config: what `train --source-dir` plans and reaches in a time budget, against a hand-written
coarse config in the same budget.

For `brats` (the MNI brain at 1 mm, 240x240x155, four channels: `python -m tfmis.data.demos.brain --size brats`) or `ct`
(512x512x100-600 abdominal CT, int16 HU, five organs: `python -m tfmis.data.demos.ct --size full`) it

1. generates the dataset into `--workdir` if it is missing;
2. `auto`: `python -m tfmis.train --source-dir DIR --set training.max_minutes=M` (the plan chooses fullres, lowres
   or a cascade and shares the budget between the stages), then `python -m tfmis.predict` through the stages on the
   validation split, scored on the original grid;
3. `hand`: `python -m tfmis.train --config benchmarks/configs/real_size_<dataset>.yaml` (one coarse stage written by
   hand) with the same budget, predicted and scored the same way;

and prints, per arm: the configuration, wall-clock seconds of training (all stages) and of prediction, and the mean
Dice per class (and per BraTS region) over the validation cases from predictions.csv.

Example:
    python benchmarks/real_size.py brats --minutes 10
    python benchmarks/real_size.py ct --minutes 10 --cases 12 --arms auto
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BRATS_REGIONS = "validation.regions={whole_tumour: [1, 2, 3], tumour_core: [2, 3], enhancing: [3]}"


def generate(dataset: str, root: Path, cases: int) -> Path:
    source = root / ("Task01_DemoBraTS" if dataset == "brats" else "Task91_DemoCTFull")
    if (source / "dataset.json").is_file():
        return source
    if dataset == "brats":
        cmd = ["-m", "tfmis.data.demos.brain", "--size", "brats", "--cases", str(cases), "--test-cases", "0"]
    else:
        cmd = ["-m", "tfmis.data.demos.ct", "--size", "full", "--cases", str(cases), "--test-cases", "0"]
        cmd += ["--slices", "100,600"]
    run([*cmd, "--output", str(source)])
    return source


def run(args: list[str]) -> float:
    """Runs `python ARGS` in the repository, streaming its output; seconds taken."""
    start = time.perf_counter()
    print("$ python " + " ".join(args), flush=True)
    done = subprocess.run([sys.executable, *args], cwd=REPO)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): python {' '.join(args)}")
    return time.perf_counter() - start


def scores(csv_path: Path) -> dict[str, float]:
    """Mean over the cases of every dice_* column of predictions.csv (NaN cells left out)."""
    rows = list(csv.DictReader(csv_path.open()))
    out = {}
    for column in rows[0]:
        if column.startswith("dice_"):
            values = [float(r[column]) for r in rows if r[column] not in ("", "nan")]
            out[column[5:]] = sum(values) / len(values) if values else math.nan
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dataset", choices=("brats", "ct"))
    p.add_argument("--minutes", type=float, default=10.0, help="training budget per arm (default 10)")
    p.add_argument("--cases", type=int, default=6, help="cases to generate (default 6)")
    p.add_argument("--workdir", default="/tmp/tfmis_real_size")
    p.add_argument("--arms", default="auto,hand", help="auto, hand or both (default)")
    args = p.parse_args()
    root = Path(args.workdir)
    source = generate(args.dataset, root, args.cases)
    extra = ["--set", BRATS_REGIONS] if args.dataset == "brats" else []
    budget = ["--set", f"training.max_minutes={args.minutes}"]
    table = []
    for arm in args.arms.split(","):
        run_dir = root / f"{args.dataset}_{arm}"
        data_dir = root / f"{args.dataset}_{arm}_tfrecords"
        places = ["--set", f"output.dir={run_dir}", "--set", f"data.dataset_dir={data_dir}"]
        if arm == "auto":
            train = ["-m", "tfmis.train", "--source-dir", str(source), *places, *budget, *extra]
        else:
            config = REPO / "benchmarks" / "configs" / f"real_size_{args.dataset}.yaml"
            train = ["-m", "tfmis.train", "--config", str(config), "--set", f"data.source_dir={source}", *places]
            train += [*budget, *extra]
        train_seconds = run([*train, "--set", "output.progress=false"])
        out = root / f"{args.dataset}_{arm}_predictions"
        predict_seconds = run(
            ["-m", "tfmis.predict", "--checkpoint", str(run_dir), "--input", str(source / "dataset.json")]
            + ["--subset", "split:val", "--output", str(out), "--quiet"]
        )
        plan = run_dir / "plan.yaml"
        found = re.search(r"recommended (fullres|lowres|cascade)\b", plan.read_text()) if plan.is_file() else None
        configuration = found.group(1) if found else "written"
        table.append((arm, configuration, train_seconds, predict_seconds, scores(out / "predictions.csv")))
    print(f"\n{args.dataset}: {args.minutes:g}-minute budget, validation split, Dice on the original grid")
    for arm, configuration, train_seconds, predict_seconds, dice in table:
        parts = ", ".join(f"{k} {v:.3f}" for k, v in dice.items())
        print(f"  {arm:<5} {configuration:<9} train {train_seconds:6.0f} s  predict {predict_seconds:5.0f} s  {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
