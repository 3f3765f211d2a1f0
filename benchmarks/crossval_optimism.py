#!/usr/bin/env python3
"""How optimistic out-of-fold scores are when each held-out fold chooses its own weights.

A fold's training validates on its held-out fold, and `best.weights.h5` is the epoch with the best Dice there.
`tfmis-crossval` scores the held-out folds with `final.weights.h5` (nnU-Net's rule); `--val-best` scores them with
the best weights. For a finished cross-validation this script predicts every fold's held-out cases with the other
weights too (into `<cv>/optimism/`, resumable), scores them exactly as the cross-validation does (nnU-Net's Dice on
the original grid) and prints per configuration: the out-of-fold foreground mean and per-class Dice with the final
weights, with the best-on-held-out weights, the difference in Dice points, and which configuration each rule
chooses. Configurations only (pairs of configurations are left out).

Example (the demo, 5 folds; about 12 minutes on 2 cores):
    tfmis-crossval --config configs/demo.yaml --folds 5 --set training.epochs=40 --output /tmp/cv_demo
    python benchmarks/crossval_optimism.py /tmp/cv_demo
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

from tfmis.config import load_config
from tfmis.crossvalidation.experiment import SCORES_FILE, candidate_dir, fold_run_dir, read_definition
from tfmis.crossvalidation.oof import fold_cases, score_folder
from tfmis.crossvalidation.selection import mean_per_structure
from tfmis.inference.cascade import make_predictor
from tfmis.inference.inputs import run_config


def other_folder(cv: Path, name: str, fold: int, weights: str) -> Path:
    return cv / "optimism" / weights / name / f"fold_{fold}" / "validation"


def predict_with(cv: Path, definition, name: str, fold: int, weights: str) -> Path:
    """The held-out cases of `fold` predicted with the run's `weights` and scored (kept when already there)."""
    folder = other_folder(cv, name, fold, weights)
    if (folder / SCORES_FILE).is_file():
        return folder
    run = fold_run_dir(cv, name, fold)
    config = load_config(run_config(run))
    predictor = make_predictor(config, run, device="cpu", weights=weights)
    cases = fold_cases(definition, fold, predictor)
    folder.mkdir(parents=True, exist_ok=True)
    for case in cases:
        result = predictor.predict_file(case, folder)
        if result.status != "ok":
            sys.exit(f"{name} fold {fold}, case {case.case_id}: {result.reason}")
    regions = dict(config.validation.regions) if predictor.task.paint_labels is not None else None
    score_folder(folder, cases, list(range(1, len(predictor.class_names))), regions)
    return folder


def dice_of(folders: list[Path]) -> dict:
    cases = {}
    for folder in folders:
        cases.update(json.loads((folder / SCORES_FILE).read_text())["cases"])
    return mean_per_structure(cases)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cv", type=Path, help="a finished tfmis-crossval folder")
    args = p.parse_args(argv)
    definition = read_definition(args.cv)
    scored = definition.weights  # what the cross-validation's own scores used
    other = "best" if scored == "final" else "final"
    print(f"cv {args.cv}: {definition.folds} folds (run {definition.run_folds}), scored with {scored} weights")
    rows = {}
    for name in definition.names:
        folders = {scored: [candidate_dir(args.cv, name, f) for f in definition.run_folds]}
        folders[other] = [predict_with(args.cv, definition, name, f, other) for f in definition.run_folds]
        rows[name] = {w: dice_of(fs) for w, fs in folders.items()}
    structures = [k for k in next(iter(rows.values()))["final"] if k != "foreground_mean"]
    results = args.cv / "crossval.json"
    names = json.loads(results.read_text()).get("structure_names", {}) if results.is_file() else {}
    header = ["configuration", "weights", "foreground mean", *(names.get(s, s) for s in structures)]
    lines = [header]
    for name, by_weights in rows.items():
        for weights in ("final", "best"):
            d = by_weights[weights]
            lines.append([name, weights, *(f"{d[k]:.4f}" for k in ("foreground_mean", *structures))])
        gain = {k: 100 * (by_weights["best"][k] - by_weights["final"][k]) for k in ("foreground_mean", *structures)}
        lines.append([name, "best - final (points)", *(f"{gain[k]:+.2f}" for k in ("foreground_mean", *structures))])
    print("| " + " | ".join(header) + " |\n|" + " --- |" * len(header))
    for line in lines[1:]:
        print("| " + " | ".join(line) + " |")
    for weights in ("final", "best"):
        means = {n: r[weights]["foreground_mean"] for n, r in rows.items()}
        chosen = max(means, key=lambda n: means[n] if math.isfinite(means[n]) else -1)
        print(f"chosen by the {weights} weights' out-of-fold Dice: {chosen}")
    model = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in model.splitlines() if line.startswith("Model name")), "?")
    print(f"processor: {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
