"""Export a trained model for use outside tfmis: `python -m tfmis.export --checkpoint RUN --output MODEL_DIR`.

Writes MODEL_DIR with the inference network(s) as a TensorFlow SavedModel (signature `serving_default`: `windows` in,
`logits` out), ONNX and OpenVINO IR, a `manifest.json` with everything prediction needs around them (spacing,
orientation and resampling, crop, normalisation and its statistics, sliding window and blending, labels or regions
and their painting order, postprocessing, input channels, versions, each file's sha256) and a `MODEL_CARD.md`.
`tfmis-predict --checkpoint MODEL_DIR --engine tensorflow|onnxruntime|openvino` predicts with it without the run
folder (docs/deploying.md).
"""

from __future__ import annotations

import argparse
import sys

from tfmis.utils.cli import command, writing


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tfmis-export",
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 exported; 1 unusable checkpoint (missing, unfinished, weights that do not fit); "
        "2 bad arguments (an existing --output, an unknown --format or one whose package is missing: install "
        "tfmis[deploy]).",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        help="a training run folder (its best weights, or --weights final; a fold's run folder its final weights), "
        "a plan of stages or a cascade's fine stage "
        "(both stages of a cascade), a folder of folds (fold_<k> run folders: every fold, final weights) or a "
        "cross-validation folder (the configuration(s) it chose, each its folds, and its postprocessing)",
    )
    p.add_argument("--output", required=True, help="the exported model folder to create (must not exist)")
    p.add_argument(
        "--format",
        default="saved_model,onnx,openvino",
        metavar="F,F,...",
        help="network formats to write: saved_model (tensorflow engine, TF Serving), onnx (onnxruntime), openvino "
        "(default: all three)",
    )
    p.add_argument(
        "--weights",
        choices=("best", "final"),
        default=None,
        help="which weights of each run folder (default as tfmis-predict: final for a folder of folds and for one "
        "fold's run folder, whose best weights were chosen on its held-out fold; best for any other run)",
    )
    p.add_argument("--folds", default=None, metavar="K,K,...", help="with a folder of folds: only these folds")
    return p


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from pathlib import Path

    from tfmis.errors import MissingInput

    folds = None
    if args.folds is not None:
        try:
            folds = [int(k) for k in args.folds.split(",")]
        except ValueError:
            parser.error(f"--folds: expected fold numbers like 0,2, got {args.folds!r}")
    if not Path(args.checkpoint).exists():
        raise MissingInput(f"--checkpoint {args.checkpoint}: no such file or folder; give a training run's folder")
    from tfmis.inference.exporting import export_model, parse_formats
    from tfmis.inference.inputs import fold_weights
    from tfmis.inference.manifest import stages

    formats = parse_formats(args.format)
    weights, note = fold_weights(args.checkpoint, args.weights)  # a fold's run folder: its final weights
    if note:
        print(note, file=sys.stderr)
    writing(args.output)
    manifest = export_model(args.checkpoint, args.output, formats, weights=weights, folds=folds)
    networks = {n["name"]: n for stage in stages(manifest) for n in stage["networks"]}  # every stage's
    for network in networks.values():
        checks = ", ".join(f"{fmt} {diff:.2g}" for fmt, diff in network["export_check"].items())
        files = ", ".join(network["files"].values())
        print(f"{network['name']}: {files} (largest logit difference from Keras: {checks})")
    print(f"Exported {len(networks)} network(s) to {args.output} (manifest.json, MODEL_CARD.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
