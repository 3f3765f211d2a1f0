#!/usr/bin/env python3
"""Region-based training against class training on BraTS-like data, same data, network, steps and time budget
(whether regions lift tumour core / enhancing Dice on BraTS-like data, which decides whether the planner uses them).

1. generates the BraTS-like demo at `--spacing` mm into `--workdir` if missing (`python -m tfmis.data.demos.brain --size
   brats`: FLAIR/T1w/T1gd/T2w, labels 1 edema, 2 non-enhancing core, 3 enhancing, one tumour per case, many small);
2. for each seed, trains the arms one after the other with `python -m tfmis.train --config
   benchmarks/configs/region_training.yaml` into WORKDIR/runs/ARM_eEPOCHS_seedSEED (the first run converts the
   dataset):
   - `classes`: one softmax over background, edema, core, enhancing (DiceCE without the background's Dice);
   - `regions`: `model.output=regions loss.activation=sigmoid`: one sigmoid per region (whole tumour {1, 2, 3},
     tumour core {2, 3}, enhancing {3}), Dice + BCE per region, painted back into labels WT→1, TC→2, ET→3;
   both for `--epochs` epochs (the regions arm `--regions-epochs`, to give it the same time when its steps are
   faster) or `--minutes` minutes, whichever comes first (`training.max_minutes`), validated at the end only;
3. predicts the validation split with each run (`python -m tfmis.predict --subset split:val`), scored on the original
   grid, for paired per-case differences;

and prints per arm and seed: epochs, training seconds, Dice of the three regions (validation: mean over the cases
holding the region) and of the classes; then the mean per arm and the paired differences (regions - classes) per
seed and over all case x seed pairs. Writes `region_training[_TAG].json` and `.md` into `--workdir`. `--set
KEY=VALUE` overrides both arms' config (e.g. `loss.batch=true`, nnU-Net's batch Dice); `--tag` keeps those runs apart.

Example:
    nice -n 15 python benchmarks/region_training.py --seeds 0,1,2 --epochs 16 --minutes 6
    nice -n 15 python benchmarks/region_training.py --seeds 0,1,2 --epochs 16 --regions-epochs 27 --reuse
    nice -n 15 python benchmarks/region_training.py --seeds 0,1 --epochs 16 --set loss.batch=true --tag batch
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "benchmarks" / "configs" / "region_training.yaml"
REGIONS = ("whole_tumour", "tumour_core", "enhancing_tumour")
SHORT = {"whole_tumour": "WT", "tumour_core": "TC", "enhancing_tumour": "ET"}
CLASSES = ("edema", "non-enhancing tumor", "enhancing tumour")
ARMS = {"classes": [], "regions": ["model.output=regions", "loss.activation=sigmoid"]}


def run(args: list[str], log: Path) -> float:
    """`python ARGS` in the repository, its output in `log`; seconds taken (exits on failure)."""
    start = time.perf_counter()
    print("$ python " + " ".join(args), flush=True)
    with log.open("w") as f:
        done = subprocess.run([sys.executable, *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): python {' '.join(args)}; see {log}")
    return time.perf_counter() - start


def per_case(csv_path: Path) -> dict[str, dict[str, float]]:
    """case -> {region: Dice} from predictions.csv (NaN where the case lacks the region)."""
    out = {}
    for row in csv.DictReader(csv_path.open()):
        out[row["case"]] = {
            r: float(row[f"dice_{r}"]) if row[f"dice_{r}"] not in ("", "nan") else math.nan for r in REGIONS
        }
    return out


def source_dir(root: Path, args) -> Path:
    return root / f"Task01_DemoBraTS_{args.spacing:g}mm"


def train_arm(arm: str, seed: int, args, root: Path) -> dict:
    epochs = args.regions_epochs if arm == "regions" and args.regions_epochs else args.epochs
    out = root / (f"runs_{args.tag}" if args.tag else "runs") / f"{arm}_e{epochs}_seed{seed}"
    if (out / "summary.json").is_file() and args.reuse:
        print(f"reusing {out}", flush=True)
    else:
        sets = [
            f"data.source_dir={source_dir(root, args)}",
            f"data.dataset_dir={root / f'tfrecords_{args.spacing:g}mm'}",
            f"output.dir={out}",
            f"training.seed={seed}",
            f"training.epochs={epochs}",
            f"training.max_minutes={args.minutes}",
            "output.progress=false",
            *args.set,
            *ARMS[arm],
        ]
        if out.exists():
            import shutil

            shutil.rmtree(out)
        out.mkdir(parents=True)
        command = ["-m", "tfmis.train", "--config", str(CONFIG)]
        run(command + [a for s in sets for a in ("--set", s)], out.parent / f"{out.name}.train.log")
    summary = json.loads((out / "summary.json").read_text())
    record = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()][-1]
    result = {
        "arm": arm,
        "seed": seed,
        "epochs": summary["epochs"],
        "stop_reason": summary["stop_reason"],
        "seconds": summary["elapsed_seconds"],
        "regions": {r: record[f"val_dice_{r}"] for r in REGIONS},
        "classes": dict(record["val_dice"]),
    }
    if args.predict:
        predictions = out / "predictions_val"
        if not (predictions / "predictions.csv").is_file() or not args.reuse:
            command = ["-m", "tfmis.predict", "--checkpoint", str(out), "--output", str(predictions), "--quiet"]
            command += ["--input", str(source_dir(root, args) / "dataset.json"), "--subset", "split:val"]
            run(command, out.parent / f"{out.name}.predict.log")
        result["per_case"] = per_case(predictions / "predictions.csv")
    return result


def fmt(value: float) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


def report(results: list[dict]) -> str:
    lines = [
        "| arm | seed | epochs | stop | seconds | WT | TC | ET | edema | non-enh. | enhancing |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r['arm']} | {r['seed']} | {r['epochs']} | {r['stop_reason']} | {r['seconds']:.0f} | "
            + " | ".join(fmt(r["regions"][k]) for k in REGIONS)
            + " | "
            + " | ".join(fmt(r["classes"].get(c)) for c in CLASSES)
            + " |"
        )
    lines += [
        "",
        "| arm | runs | WT mean (sd) | TC mean (sd) | ET mean (sd) | seconds |",
        "| --- | ---: | --- | --- | --- | ---: |",
    ]
    for arm in ARMS:
        mine = [r for r in results if r["arm"] == arm]
        if not mine:
            continue
        cells = []
        for k in REGIONS:
            values = np.array([r["regions"][k] for r in mine], float)
            cells.append(f"{np.nanmean(values):.3f} ({np.nanstd(values, ddof=1) if len(values) > 1 else 0:.3f})")
        seconds = np.mean([r["seconds"] for r in mine])
        lines.append(f"| {arm} | {len(mine)} | " + " | ".join(cells) + f" | {seconds:.0f} |")
    seeds = sorted({r["seed"] for r in results})
    pairs = [
        (
            next(r for r in results if r["seed"] == s and r["arm"] == "classes"),
            next(r for r in results if r["seed"] == s and r["arm"] == "regions"),
        )
        for s in seeds
        if {"classes", "regions"} <= {r["arm"] for r in results if r["seed"] == s}
    ]
    if pairs:
        lines += [
            "",
            "Paired differences, regions - classes:",
            "",
            "| seed | WT | TC | ET |",
            "| --- | ---: | ---: | ---: |",
        ]
        for c, g in pairs:
            lines.append(
                f"| {c['seed']} | " + " | ".join(f"{g['regions'][k] - c['regions'][k]:+.3f}" for k in REGIONS) + " |"
            )
        if all("per_case" in c for pair in pairs for c in pair):
            lines += [
                "",
                "Per validation case (predict on the original grid), regions - classes over case x seed pairs:",
                "",
            ]
            lines += [
                "| region | pairs | mean diff | sd | regions better | classes better |",
                "| --- | ---: | ---: | ---: | ---: | ---: |",
            ]
            for k in REGIONS:
                diffs = np.array(
                    [
                        g["per_case"][case][k] - c["per_case"][case][k]
                        for c, g in pairs
                        for case in c["per_case"]
                        if not math.isnan(c["per_case"][case][k]) and not math.isnan(g["per_case"][case][k])
                    ]
                )
                if len(diffs):
                    sd = diffs.std(ddof=1) if len(diffs) > 1 else 0.0
                    lines.append(
                        f"| {SHORT[k]} | {len(diffs)} | {diffs.mean():+.3f} | {sd:.3f} | "
                        f"{int((diffs > 0.001).sum())} | {int((diffs < -0.001).sum())} |"
                    )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/tmp/tfmis_region_training")
    p.add_argument("--cases", type=int, default=30, help="BraTS-like cases to generate (default 30: 18 train, 12 val)")
    p.add_argument("--spacing", type=float, default=2.0, help="voxel size of the generated cases in mm (default 2)")
    p.add_argument("--epochs", type=int, default=16, help="epochs per arm (default 16)")
    p.add_argument(
        "--regions-epochs",
        type=int,
        default=None,
        help="epochs of the regions arm (default --epochs): more to give it the classes arm's time when its steps are "
        "faster (on a CPU the softmax loss costs more than the sigmoid one)",
    )
    p.add_argument("--minutes", type=float, default=5.0, help="training.max_minutes per arm (default 5)")
    p.add_argument("--seeds", default="0,1", help="training seeds, comma-separated (default 0,1)")
    p.add_argument("--arms", default="classes,regions")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for both arms")
    p.add_argument("--tag", default="", help="runs and results go to WORKDIR/runs_TAG, region_training_TAG.md")
    p.add_argument("--no-predict", dest="predict", action="store_false", help="skip the per-case predict scoring")
    p.add_argument("--reuse", action="store_true", help="reuse finished runs (same arm, epochs, seed) in --workdir")
    args = p.parse_args()
    root = Path(args.workdir)
    source = source_dir(root, args)
    root.mkdir(parents=True, exist_ok=True)
    if not (source / "dataset.json").is_file():
        command = [
            "-m",
            "tfmis.data.demos.brain",
            "--size",
            "brats",
            "--spacing",
            str(args.spacing),
            "--cases",
            str(args.cases),
        ]
        run(command + ["--test-cases", "0", "--output", str(source)], root / "generate.log")
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for arm in args.arms.split(","):
            results.append(train_arm(arm, seed, args, root))
            r = results[-1]
            print(
                f"{arm} seed {seed}: {r['epochs']} epochs, {r['seconds']:.0f} s, "
                + ", ".join(f"{SHORT[k]} {fmt(r['regions'][k])}" for k in REGIONS),
                flush=True,
            )
    table = report(results)
    print(table)
    name = f"region_training_{args.tag}" if args.tag else "region_training"
    (root / f"{name}.json").write_text(json.dumps({"set": args.set, "results": results}, indent=1))
    (root / f"{name}.md").write_text(table + "\n")
    print(f"written: {root / name}.md, .json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
