"""The exported model's `MODEL_CARD.md` and the training facts the manifest records, read from the run folders.

`training_summary(runs, source)` reads each run's `summary.json` (best and final validation Dice, epochs, the
machine it was trained on where the run recorded it) and `training_data.json` (the dataset, its training cases), and
for a cross-validation folder its `crossval.json` (the out-of-fold Dice of the chosen configuration);
`model_card(manifest)` writes them as a short Markdown page. A fact a run folder does not hold is written as "not
recorded", never guessed.
"""

from __future__ import annotations

import json
from pathlib import Path

NOT_RECORDED = "not recorded"


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def training_summary(runs: list[Path], source) -> dict:
    """{"dataset", "runs": [{run, best_mean_dice, best_dice_per_class, final_mean_dice, epochs, trained_on}],
    "crossval": {...} or None} of the exported runs (`source`: the `PredictionSource` they came from)."""
    data = _read_json(runs[0] / "training_data.json")
    dataset = data.get("source", {})
    splits = data.get("splits", {})
    result = {
        "dataset": {
            "name": dataset.get("name"),
            "layout": dataset.get("layout"),
            "num_training": dataset.get("num_training"),
            "train_cases": len(splits.get("train", {}).get("cases", [])) or None,
            "val_cases": len(splits.get("val", {}).get("cases", [])) or None,
            "dataset_json_sha256": dataset.get("dataset_json_sha256"),
        },
        "runs": [],
        "crossval": None,
    }
    for run in runs:
        summary = _read_json(run / "summary.json")
        result["runs"].append(
            {
                "run": str(run),
                "epochs": summary.get("epochs"),
                "best_epoch": summary.get("best_epoch"),
                "best_mean_dice": summary.get("best_mean_dice"),
                "best_dice_per_class": summary.get("best_dice_per_class"),
                "final_mean_dice": summary.get("final_mean_dice"),
                "trained_on": summary.get("machine") or NOT_RECORDED,
            }
        )
    if source.kind == "crossval":
        chosen = _read_json(Path(source.folder) / "crossval.json").get("chosen") or {}
        keys = ("configurations", "mean_dice", "dice_per_class")
        result["crossval"] = {k: chosen.get(k) for k in keys if k in chosen}
    return result


def _dice(value) -> str:
    return NOT_RECORDED if value is None else f"{value:.4f}"


def model_card(manifest: dict) -> str:
    """MODEL_CARD.md of an exported model: what it segments, from what, trained on what and where, how well it did
    in validation, and how to run it."""
    training = manifest["training"]
    dataset = training["dataset"]
    pre = manifest["preprocessing"]
    window = manifest["sliding_window"]
    lines = [
        "# Model card",
        "",
        f"Exported by tfmis {manifest['versions']['tfmis']} (TensorFlow {manifest['versions']['tensorflow']}) on "
        f"{manifest['created']} from `{manifest['source']['checkpoint']}` ({manifest['source']['kind']}, "
        f"{manifest['source']['weights']} weights).",
        "",
        "## What it does",
        "",
        f"- Segments: {', '.join(manifest['labels'][1:])} (label 1..{len(manifest['labels']) - 1}; 0 is "
        f"{manifest['labels'][0]}); output {manifest['output']['kind']} ({manifest['output']['activation']}).",
        f"- Input channels, in order: {', '.join(manifest['input']['channels'])}.",
        f"- Preprocessing: spacing {pre.get('spacing')} mm (RAS), normalisation {pre.get('normalization')}, "
        f"foreground crop {pre.get('crop_foreground')}.",
        f"- Sliding window: {window['roi_size']} voxels, overlap {window['overlap']}, {window['mode']} blending.",
        f"- Postprocessing: {manifest['postprocessing'] or 'none'}.",
        f"- Networks: {len(manifest['networks'])} ({', '.join(n['name'] for n in manifest['networks'])}), formats: "
        f"{', '.join(manifest['formats'])}.",
        "",
        "## Training data",
        "",
        f"- Dataset: {dataset.get('name') or NOT_RECORDED} ({dataset.get('layout') or 'layout ' + NOT_RECORDED}), "
        f"{dataset.get('num_training') or NOT_RECORDED} labelled cases; training split "
        f"{dataset.get('train_cases') or NOT_RECORDED}, validation split {dataset.get('val_cases') or NOT_RECORDED}.",
        "",
        "## Validation",
        "",
        "| run | epochs | best epoch | best mean Dice | final mean Dice | trained on |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run in training["runs"]:
        lines.append(
            f"| {Path(run['run']).name} | {run['epochs'] or NOT_RECORDED} | {run['best_epoch'] or NOT_RECORDED} | "
            f"{_dice(run['best_mean_dice'])} | {_dice(run['final_mean_dice'])} | {run['trained_on']} |"
        )
    per_class = training["runs"][0].get("best_dice_per_class")
    if per_class:
        scores = ", ".join(f"{k} {v:.4f}" for k, v in per_class.items())
        lines += ["", f"Best epoch's Dice per class (first run): {scores}"]
    if training.get("crossval"):
        lines += ["", f"Cross-validation (out-of-fold): {training['crossval']}"]
    lines += [
        "",
        "## Running it",
        "",
        "`tfmis-predict --checkpoint <this folder> --engine tensorflow|onnxruntime|openvino --input IN --output OUT`; "
        f"without tfmis, each network takes `{manifest['input']['name']}` {manifest['input']['shape']} float32 and "
        f"returns `{manifest['output']['name']}` {manifest['output']['shape']} float32 (see docs/deploying.md).",
        "",
    ]
    return "\n".join(lines)
