#!/usr/bin/env python3
"""Every engine of an exported model against `tfmis-predict` on its run folder: label maps, probabilities, seconds.

For each case of the dataset's labelled training cases (and its test images), the reference is the run folder's
`Predictor` on the CPU (what `tfmis-predict --checkpoint RUN` computes); each engine (`tfmis-predict --checkpoint
MODEL_DIR --engine E`, `tfmis.inference.deployed.ExportedPredictor`) predicts the same case. Printed per engine and
precision: the share of voxels whose label equals the reference's, the largest probability difference, seconds per
case (label maps only, after a warm-up case; the mean of `--repeats` passes), and the mean Dice over the cases of the
run's validation and test splits (held out from training) with its change from the reference.

TensorFlow's bfloat16 is a process-wide oneDNN rewrite, so it is measured last.

Example (after the README's main job and `tfmis-export --checkpoint runs/demo --output models/demo`):
    python benchmarks/engines.py --run runs/demo --model models/demo --dataset data/demo/Task00_DemoBrain
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ENGINES = [("tensorflow", "float32"), ("onnxruntime", "float32"), ("openvino", "float32"), ("openvino", "bfloat16")]


def _dice(labels: np.ndarray, truth: np.ndarray, classes: int) -> float:
    scores = []
    for c in range(1, classes):
        a, b = labels == c, truth == c
        if b.any():
            scores.append(2.0 * np.count_nonzero(a & b) / (np.count_nonzero(a) + np.count_nonzero(b)))
    return float(np.mean(scores))


def _run(predictor, cases, truths, held_out, classes, repeats, reference=None) -> dict:
    """Probabilities and labels per case (one pass), then `repeats` timed label-only passes."""
    from tfmis.data.msd import load_image

    images = {c.case_id: load_image(c.image, len(predictor.modalities), c.case_id, integers=True)[:2] for c in cases}
    outputs = {}
    for case in cases:
        image, affine = images[case.case_id]
        labels, probabilities, _ = predictor.predict_array(image, affine, probabilities=True)
        outputs[case.case_id] = (labels, probabilities)
    seconds = []
    for _ in range(repeats):
        for case in cases:
            image, affine = images[case.case_id]
            start = time.perf_counter()
            predictor.predict_array(image, affine, probabilities=False)
            seconds.append(time.perf_counter() - start)
    row = {
        "seconds": statistics.mean(seconds),
        "dice": statistics.mean(_dice(outputs[k][0], truths[k], classes) for k in held_out),
    }
    if reference is not None:
        same = sum(int(np.count_nonzero(outputs[k][0] == reference[k][0])) for k in outputs)
        total = sum(int(outputs[k][0].size) for k in outputs)
        row["identical"] = same / total
        row["different_voxels"] = total - same
        row["max_probability_difference"] = max(float(np.max(np.abs(outputs[k][1] - reference[k][1]))) for k in outputs)
    return row, outputs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="the training run folder")
    p.add_argument("--model", required=True, help="its exported model folder (tfmis-export)")
    p.add_argument("--dataset", required=True, help="the dataset folder (dataset.json) the run was trained on")
    p.add_argument("--repeats", type=int, default=2, help="timed label-only passes over the cases")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    from tfmis.config import load_config
    from tfmis.data.msd import load_image
    from tfmis.hardware import cpu_name, usable_cpu_count
    from tfmis.inference.deployed import ExportedPredictor
    from tfmis.inference.inputs import collect_inputs
    from tfmis.inference.predictor import Predictor

    reference_predictor = Predictor(load_config(Path(args.run) / "config.yaml"), args.run, device="cpu")
    index = reference_predictor.index
    cases = collect_inputs(Path(args.dataset) / "dataset.json", "training", index=index)
    cases += collect_inputs(Path(args.dataset) / "dataset.json", "test", index=index)
    truths = {c.case_id: load_image(c.label, 1, c.case_id)[0][..., 0].astype(np.uint8) for c in cases if c.label}
    held_out = [k for split in ("val", "test") for k in index["splits"][split]["cases"]]
    classes = len(reference_predictor.class_names)
    print(f"{len(cases)} cases; Dice over {len(held_out)} held-out cases; {usable_cpu_count()} cores of {cpu_name()}")
    reference_row, reference = _run(reference_predictor, cases, truths, held_out, classes, args.repeats)
    rows = [{"engine": "tfmis-predict (run folder)", "precision": "float32", **reference_row}]
    for engine, precision in [*ENGINES, ("tensorflow", "bfloat16")]:
        predictor = ExportedPredictor(args.model, engine, precision)
        row, _ = _run(predictor, cases, truths, held_out, classes, args.repeats, reference)
        rows.append({"engine": engine, "precision": precision, **row})
        print(json.dumps(rows[-1]), flush=True)
    print()
    print("| engine | precision | identical voxels | max probability difference | s / case | held-out Dice (change) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        same = "reference" if "identical" not in row else f"{100 * row['identical']:.4f} % ({row['different_voxels']})"
        diff = "" if "identical" not in row else f"{row['max_probability_difference']:.2g}"
        change = row["dice"] - reference_row["dice"]
        print(
            f"| {row['engine']} | {row['precision']} | {same} | {diff} | {row['seconds']:.2f} | "
            f"{row['dice']:.4f} ({change:+.4f}) |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
