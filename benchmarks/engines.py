#!/usr/bin/env python3
"""Every engine of an exported model against `tfmis-predict` on its checkpoint: label maps, probabilities, seconds.

Two measurements (subcommands):

`agree`: the reference is what `tfmis-predict --checkpoint CHECKPOINT` computes on the CPU (a run folder, a folder of
folds, a cross-validation folder, or a plan of stages / cascade: built the way tfmis-predict builds it, postprocessing
included); each engine (`tfmis-predict --checkpoint MODEL_DIR --engine E`: `exported_predictor`) predicts the same
cases. Printed per engine and precision: the share of voxels whose label equals the reference's, the Dice of each
class between the two label maps (voxels of all cases pooled), the largest probability difference, seconds per case
(label maps only, the mean of `--repeats` passes after one pass with probabilities), and the mean foreground Dice
against the cases' labels (those of a run's validation and test splits when the reference is one run and they are
among the cases, else every labelled case) with its change from the reference. TensorFlow's bfloat16 is a
process-wide oneDNN rewrite: measured last.

`speed`: one large scan (e.g. a 512x512x600 CT), every engine in this one process, alternating pass by pass: seconds
per case and the peak resident memory of each pass above the memory before it, as a multiple of the scan's float32
size (benchmarks/engines_timing.py). With `--monai PYTHON` MONAI's `sliding_window_inference` around a DynUNet shaped
like the run's network runs on the same preprocessed volume in that interpreter (benchmarks/monai_unet.py), in turn
with the engines.

Examples (after the README's main job and `tfmis-export --checkpoint runs/demo --output models/demo`):
    python benchmarks/engines.py agree --reference runs/demo --model models/demo --cases data/demo/Task00_DemoBrain
    python benchmarks/engines.py agree --reference CV_FOLDER --model /tmp/cv --cases HOLDOUT --engines float32
    python benchmarks/engines.py speed --reference runs/ct --model models/ct --scan ct_600.nii.gz \
        --monai .venv-monai/bin/python
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

FLOAT32 = [("tensorflow", "float32"), ("onnxruntime", "float32"), ("openvino", "float32")]
ENGINES = [*FLOAT32, ("openvino", "bfloat16"), ("tensorflow", "bfloat16")]


def reference_predictor(checkpoint: str):
    """The predictor `tfmis-predict --checkpoint CHECKPOINT --device cpu` builds (tfmis.predict._run_predictor)."""
    from tfmis.inference.ensemble import build_predictor, resolve_checkpoint
    from tfmis.predict import final_stage

    source = resolve_checkpoint(checkpoint, None, None)
    if source.kind == "run":  # the folder of a plan of stages: its last stage
        source = resolve_checkpoint(final_stage(checkpoint))
    return build_predictor(source, device="cpu"), source


def engine_predictor(model: str, engine: str, precision: str):
    from tfmis.inference.deployed import exported_predictor

    return exported_predictor(model, engine=engine, precision=precision)


def _postprocessed(predictor, labels: np.ndarray) -> np.ndarray:
    if getattr(predictor, "postprocessing", None) is not None:
        predictor._postprocess(labels)  # in place, as predict_file does before writing
    return labels


def _dice(labels: np.ndarray, truth: np.ndarray, classes: int) -> float:
    scores = []
    for c in range(1, classes):
        a, b = labels == c, truth == c
        if b.any():
            scores.append(2.0 * np.count_nonzero(a & b) / (np.count_nonzero(a) + np.count_nonzero(b)))
    return float(np.mean(scores))


def _class_dice(outputs: dict, reference: dict, classes: int) -> list[float]:
    """Dice of each foreground class between two sets of label maps, voxels of all cases pooled."""
    both, sizes = np.zeros(classes), np.zeros(classes)
    for k, (labels, _) in outputs.items():
        other = reference[k][0]
        for c in range(1, classes):
            a, b = labels == c, other == c
            both[c] += np.count_nonzero(a & b)
            sizes[c] += np.count_nonzero(a) + np.count_nonzero(b)
    return [float(2 * both[c] / sizes[c]) if sizes[c] else 1.0 for c in range(1, classes)]


def _run(predictor, images, truths, scored, classes, repeats, reference=None) -> tuple[dict, dict]:
    """Probabilities and labels per case (one pass), then `repeats` timed label-only passes."""
    outputs = {}
    for case_id, (image, affine) in images.items():
        labels, probabilities, _ = predictor.predict_array(image, affine, probabilities=True)
        outputs[case_id] = (_postprocessed(predictor, labels), probabilities)
    seconds = []
    for _ in range(repeats):
        for image, affine in images.values():
            start = time.perf_counter()
            labels, _, _ = predictor.predict_array(image, affine, probabilities=False)
            _postprocessed(predictor, labels)
            seconds.append(time.perf_counter() - start)
    row = {"seconds": statistics.mean(seconds) if seconds else float("nan")}
    if scored:
        row["dice"] = statistics.mean(_dice(outputs[k][0], truths[k], classes) for k in scored)
    if reference is not None:
        same = sum(int(np.count_nonzero(outputs[k][0] == reference[k][0])) for k in outputs)
        total = sum(int(outputs[k][0].size) for k in outputs)
        row["identical"] = same / total
        row["different_voxels"] = total - same
        row["class_dice"] = _class_dice(outputs, reference, classes)
        row["max_probability_difference"] = max(float(np.max(np.abs(outputs[k][1] - reference[k][1]))) for k in outputs)
    return row, outputs


def _load_cases(predictor, folders: list[str], limit: int | None):
    """{case: (image, affine)} and {case: label} of the labelled and test cases of each dataset folder."""
    from tfmis.data.sources.image_io import load_image
    from tfmis.inference.inputs import collect_inputs

    cases = []
    for folder in folders:
        for subset in ("training", "test"):
            try:
                cases += collect_inputs(Path(folder), subset)
            except Exception as e:  # noqa: BLE001 - a dataset without test cases
                print(f"{folder}: no {subset} cases ({type(e).__name__}: {e})")
    cases = cases[:limit] if limit else cases
    channels = len(predictor.modalities)
    images = {c.case_id: load_image(c.image, channels, c.case_id, integers=True)[:2] for c in cases}
    truths = {c.case_id: load_image(c.label, 1, c.case_id)[0][..., 0].astype(np.uint8) for c in cases if c.label}
    return images, truths


def agree(args) -> int:
    """The `agree` table: every engine of `--model` against the reference `--reference` on the cases of `--cases`."""
    from tfmis.hardware import cpu_name, usable_cpu_count

    reference_predictor_, source = reference_predictor(args.reference)
    images, truths = _load_cases(reference_predictor_, args.cases, args.limit)
    index = getattr(reference_predictor_, "index", None) or {}
    held_out = [k for split in ("val", "test") for k in index.get("splits", {}).get(split, {}).get("cases", [])]
    scored = [k for k in held_out if k in truths] if source.models == 1 else []
    scored = scored or list(truths)  # a run's held-out splits among the cases, else every labelled case
    classes = len(reference_predictor_.class_names)
    voxels = sum(int(np.prod(image.shape[:3])) for image, _ in images.values())
    print(
        f"{args.reference} ({source.kind}, {source.models} network(s)): {len(images)} cases, {voxels / 1e6:.2f} M "
        f"voxels; Dice against the labels over {len(scored)} cases; {usable_cpu_count()} cores of {cpu_name()}",
        flush=True,
    )
    start = time.perf_counter()
    reference_row, reference = _run(reference_predictor_, images, truths, scored, classes, args.repeats)
    print(f"reference: {time.perf_counter() - start:.0f} s", flush=True)
    del reference_predictor_
    rows = [{"engine": "tfmis-predict (checkpoint)", "precision": "float32", **reference_row}]
    engines = FLOAT32 if args.engines == "float32" else ENGINES
    for engine, precision in engines:
        predictor = engine_predictor(args.model, engine, precision)
        row, _ = _run(predictor, images, truths, scored, classes, args.repeats, reference)
        rows.append({"engine": engine, "precision": precision, **row})
        print(json.dumps(rows[-1]), flush=True)
        del predictor
    _print_agreement(rows, reference_row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def _print_agreement(rows: list[dict], reference_row: dict) -> None:
    print()
    print(
        "| engine | precision | identical voxels (different) | Dice per class vs reference | "
        "max probability difference | s / case | Dice vs labels (change) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        same = "reference" if "identical" not in row else f"{100 * row['identical']:.5f} % ({row['different_voxels']})"
        per_class = "" if "class_dice" not in row else " / ".join(f"{d:.6f}" for d in row["class_dice"])
        diff = "" if "identical" not in row else f"{row['max_probability_difference']:.2g}"
        dice = ""
        if "dice" in row:
            dice = f"{row['dice']:.4f} ({row['dice'] - reference_row['dice']:+.4f})"
        print(
            f"| {row['engine']} | {row['precision']} | {same} | {per_class} | {diff} | {row['seconds']:.2f} | {dice} |"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("agree", help="label maps, probabilities and seconds of every engine against the reference")
    a.add_argument("--reference", required=True, help="what tfmis-predict --checkpoint takes (run, folds, cv, plan)")
    a.add_argument("--model", required=True, help="its exported model folder (tfmis-export)")
    a.add_argument("--cases", required=True, nargs="+", help="dataset folders (dataset.json): labelled + test cases")
    a.add_argument("--limit", type=int, default=None, help="only the first N cases")
    a.add_argument("--engines", choices=("all", "float32"), default="all", help="float32 only, or bfloat16 too")
    a.add_argument("--repeats", type=int, default=2, help="timed label-only passes over the cases")
    a.add_argument("--json", default=None, help="also write the rows here")
    s = sub.add_parser("speed", help="seconds and peak memory of one large scan per engine, alternating")
    s.add_argument("--reference", required=True, help="the run folder (tfmis-predict --checkpoint)")
    s.add_argument("--model", required=True, help="its exported model folder (tfmis-export)")
    s.add_argument("--scan", required=True, help="the image file to predict")
    s.add_argument("--warmup", default=None, help="a small image of the same kind, predicted once per engine first")
    s.add_argument("--repeats", type=int, default=2, help="timed passes per engine, alternating")
    s.add_argument("--window", action="store_true", help="also time each engine's sliding window alone")
    s.add_argument("--bfloat16", action="store_true", help="also OpenVINO in bfloat16 (an explicit option)")
    s.add_argument("--monai", metavar="PYTHON", default=None, help="an interpreter with torch and MONAI")
    s.add_argument("--json", default=None, help="also write the rows here")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "agree":
        return agree(args)
    from engines_timing import speed

    return speed(args)


if __name__ == "__main__":
    sys.exit(main())
