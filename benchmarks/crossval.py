"""K-fold cross-validation end to end, and what the folds' ensemble buys on held-out cases.

1. `tfmis-crossval --config CONFIG --folds K --output OUT/cv --workers W` (or under `--launcher "mpirun -np 2"`):
   its wall time, the out-of-fold Dice table, the chosen configuration and postprocessing (from crossval.json);
2. on held-out labelled cases (`--test`, an MSD folder the folds never saw): Dice of the K-fold ensemble
   (`tfmis-predict --checkpoint OUT/cv`) vs every single fold, and vs the fold with the best validation Dice
   (chosen without looking at the test cases);
3. with `--sequential-too`: the same cross-validation with one worker into OUT/cv_sequential, and the ratio of the
   two wall times (one run of each, on the same machine, one after the other).

Example (the demo; about 25 min on 2 cores):
    python -m tfmis.data.demos.brain --output data/demo_holdout --cases 8 --test-cases 0 --seed 7
    python benchmarks/crossval.py --config configs/demo.yaml --set training.epochs=40 --folds 5 --workers 2 \\
        --test data/demo_holdout --output /tmp/cv_demo
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path


def run(command: list[str], log: Path) -> float:
    """Runs `command` (output to `log`); its wall seconds; exits on failure."""
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if code != 0:
        sys.exit(f"{' '.join(command)} failed (exit {code}); see {log}")
    return seconds


def crossval(args, output: Path, workers: int, launcher: str | None) -> float:
    command = ["tfmis-crossval", "--folds", str(args.folds), "--output", str(output)]
    for config in args.config:
        command += ["--config", config]
    for override in args.set:
        command += ["--set", override]
    if launcher:
        command = [*shlex.split(launcher), *command]
    else:
        command += ["--workers", str(workers)]
    output.parent.mkdir(parents=True, exist_ok=True)
    return run(command, output.parent / f"{output.name}.log")


def mean_dice(csv_path: Path) -> tuple[float, dict]:
    """The mean over cases of predictions.csv's per-class Dice (NaN left out), and per class."""
    rows = list(csv.DictReader(open(csv_path)))
    classes = [k[len("dice_") :] for k in rows[0] if k.startswith("dice_") and k != "dice_mean" and "region" not in k]
    per_class = {}
    for name in classes:
        values = [float(r[f"dice_{name}"]) for r in rows if r.get(f"dice_{name}") not in ("", "nan", None)]
        values = [v for v in values if not math.isnan(v)]
        per_class[name] = sum(values) / len(values) if values else float("nan")
    finite = [v for v in per_class.values() if not math.isnan(v)]
    return (sum(finite) / len(finite) if finite else float("nan")), per_class


def predict(checkpoint: Path, test: Path, output: Path, extra=()) -> tuple[float, dict, float]:
    command = ["tfmis-predict", "--checkpoint", str(checkpoint), "--input", str(test / "dataset.json")]
    command += ["--subset", "training", "--output", str(output), "--quiet", *extra]
    output.mkdir(parents=True, exist_ok=True)
    seconds = run(command, output / "predict.log")
    return (*mean_dice(output / "predictions.csv"), seconds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--launcher", default=None, help='e.g. "mpirun --allow-run-as-root -np 2" instead of --workers')
    p.add_argument("--test", type=Path, default=None, help="an MSD folder of held-out labelled cases")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--sequential-too", action="store_true")
    args = p.parse_args()
    from tfmis.hardware import cpu_name, usable_cpu_count

    print(f"Machine: {cpu_name()}, {usable_cpu_count()} usable cores")
    cv = args.output / "cv"
    crossval(args, cv, args.workers, args.launcher)  # a finished one (rerun) only chooses again
    how = args.launcher or f"--workers {args.workers}"
    result = json.loads((cv / "crossval.json").read_text())
    wall = result["wall_seconds"]["span"]  # from the jobs' own start and end times, so also for a rerun
    report = {"machine": cpu_name(), "wall_seconds": {how: wall}, "crossval": result}
    print(f"\nCross-validation ({args.folds} folds, {how}): {wall / 60:.1f} min wall")
    print((cv / "crossval.md").read_text())
    if args.sequential_too:
        crossval(args, args.output / "cv_sequential", 1, None)
        seq = json.loads((args.output / "cv_sequential" / "crossval.json").read_text())["wall_seconds"]["span"]
        report["wall_seconds"]["--workers 1"] = seq
        print(f"One after another (--workers 1): {seq / 60:.1f} min; {how}: {wall / 60:.1f} min: {seq / wall:.2f}x")
    if args.test is not None:
        rows = []
        names = result["chosen"]["configurations"]
        dice, per_class, seconds = predict(cv, args.test, args.output / "test_ensemble")
        what = f"ensemble of {len(result['folds'])} folds ({' + '.join(names)}, chosen postprocessing)"
        rows.append((what, dice, seconds, per_class))
        plain, classes, seconds = predict(cv, args.test, args.output / "test_ensemble_raw", ["--no-postprocessing"])
        rows.append(("ensemble, no postprocessing", plain, seconds, classes))
        for name in names:  # the folds of one configuration, without the pair or the postprocessing
            d, classes, seconds = predict(cv / name, args.test, args.output / f"test_folds_{name}")
            rows.append((f"ensemble of the {len(result['folds'])} folds of {name} alone", d, seconds, classes))
        best_fold, best_val = None, -1.0
        for fold in result["folds"]:
            run_dir = Path(result["configurations"][names[0]]["folds"][str(fold)])
            val = json.loads((run_dir / "summary.json").read_text())["best_mean_dice"]
            d, classes, seconds = predict(
                run_dir, args.test, args.output / f"test_fold_{fold}", ["--no-postprocessing"]
            )
            rows.append((f"{names[0]} fold {fold} alone (validation Dice {val:.3f})", d, seconds, classes))
            if val > best_val:
                best_fold, best_val = fold, val
        singles = [row for row in rows if " alone (validation" in row[0]]
        mean_classes = {c: sum(r[3][c] for r in singles) / len(singles) for c in singles[0][3]}
        mean_single = sum(r[1] for r in singles) / len(singles)
        rows.append((f"mean of the {len(singles)} single folds", mean_single, 0.0, mean_classes))
        report["test"] = {"rows": rows, "per_class_ensemble": per_class, "best_fold_by_validation": best_fold}
        print(f"\nHeld-out test cases ({args.test}): Dice per class (mean over cases) and their mean")
        print(f"  {'':<70} {'mean':>6}  " + "  ".join(f"{c:>12}" for c in per_class))
        for name, d, seconds, classes in rows:
            mark = "  <- best fold by validation Dice" if name.startswith(f"{names[0]} fold {best_fold} ") else ""
            values = "  ".join(f"{classes[c]:>12.4f}" for c in per_class)
            print(f"  {name:<70} {d:.4f}  {values}  ({seconds:.0f} s){mark}")
    (args.output / "report.json").write_text(json.dumps(report, indent=1))
    print(f"\nReport: {args.output / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
