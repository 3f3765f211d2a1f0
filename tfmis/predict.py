"""Segment scans with a trained model: `python -m tfmis.predict --checkpoint RUN_DIR --input ...`.

Reads NIfTI (`.nii.gz`, `.nii`) and, with `tfmis[formats]`, NRRD and MetaImage (`.nrrd`, `.mha`, `.mhd`) scans, alone,
in a folder, or as a dataset (MSD, or nnU-Net v2 raw with one file per channel); and, with `tfmis[dicom]`, DICOM
series. Writes `<case><suffix>` label maps (uint8) in each input's own format and geometry (shape, affine,
orientation, header; an `.mha` keeps its direction, origin and spacing), or for DICOM series with `--output-format
dicom-seg` `<case>.seg.dcm` (a DICOM SEG referencing the series: `tfmis.inference.dicom_seg`), optional
`<case>_probabilities.nii.gz` (NIfTI whatever the input; one channel per class, or per region), `predictions.csv`
(and Dice per class per case when labels are available), and prints a summary table. A cascade (the folder of a plan
of stages, or its fine stage) predicts the whole scan at low resolution first and the region it finds at full
resolution (`tfmis.inference.cascade`). A folder of folds (`fold_<k>` run folders) predicts with the ensemble of its
folds, a cross-validation folder (`crossval.json`) with the configuration(s) and postprocessing it chose
(`tfmis.inference.ensemble`). Each case's seconds and peak resident memory (`peak_rss_mb`) are logged, in the table
and in the CSV.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tfmis.utils.cli import command, writing


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tfmis-predict",
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 all cases written; 3 some cases failed (listed in the table and predictions.csv); "
        "1 unusable config, checkpoint or input; 2 bad arguments.",
    )
    _add_model_arguments(p.add_argument_group("the model"))
    _add_case_arguments(p.add_argument_group("the cases and what is written"))
    _add_window_arguments(p.add_argument_group("the sliding window and where it runs"))
    _add_engine_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _add_model_arguments(g) -> None:
    """What predicts: the checkpoint (a run, a plan, folds, a cross-validation), its folds, weights, postprocessing."""
    g.add_argument(
        "--checkpoint",
        required=True,
        help="a run folder (its best.weights.h5, or final.weights.h5 with --weights final; a fold's run folder its "
        "final.weights.h5), a weights file, or a "
        "checkpoints/ folder or ckpt-N prefix (the trainer's state at that epoch); the folder of a cascade plan (or "
        "its fine stage) runs the coarse stage on the whole scan and the fine stage on the region it finds; a folder "
        "of folds (fold_0, fold_1, ... run folders, e.g. <cv>/fullres) "
        "predicts with the ensemble of the folds (their probabilities averaged); a cross-validation folder "
        "(crossval.json, from tfmis-crossval) with the configuration(s) it chose, each the ensemble of its folds, "
        "and the postprocessing it chose",
    )
    g.add_argument(
        "--folds",
        default=None,
        metavar="K,K,...",
        help="with a folder of folds or a cross-validation folder: only these folds (e.g. 0,2; default all)",
    )
    g.add_argument(
        "--weights",
        choices=("best", "final"),
        default=None,
        help="which weights of each run folder: best (the best validation epoch's; for a fold of a "
        "cross-validation chosen on its held-out fold, so optimistic there) or final (the weights training ended "
        "with); default: a cross-validation folder's own choice (final unless it ran with --val-best), final for a "
        "folder of folds and for one fold's run folder (its config has data.split), best for any other run",
    )
    g.add_argument(
        "--no-postprocessing",
        action="store_true",
        help="write the label maps as predicted: no postprocessing (default: the run config's postprocessing, or "
        "for a cross-validation folder the one it chose)",
    )
    g.add_argument(
        "--config",
        default=None,
        help="the training run's config (default: config.yaml of the run folder of --checkpoint)",
    )


def _add_case_arguments(g) -> None:
    """What is read (files, a dataset, DICOM series) and what is written (format, probabilities, scores)."""
    g.add_argument(
        "--input",
        required=True,
        help="an image file (.nii.gz, .nii; .nrrd, .mha, .mhd with tfmis[formats]), a folder of them, or a dataset "
        "(its folder or dataset.json: MSD, or nnU-Net v2 raw with one file per channel; see --subset); or a folder "
        "holding a DICOM series (CT or MR slices), or a folder of such folders (one case each, named after its folder)",
    )
    g.add_argument(
        "--series",
        default=None,
        metavar="UID",
        help="the SeriesInstanceUID to read where a DICOM folder holds several series (they are listed without it)",
    )
    g.add_argument(
        "--output-format",
        choices=("nifti", "dicom-seg"),
        default="nifti",
        help="how label maps are written: nifti (<case>.nii.gz, default) or dicom-seg (<case>.seg.dcm, a DICOM "
        "Segmentation referencing the input series, one segment per class present, labelled with its name; needs "
        "DICOM input and tfmis[dicom])",
    )
    g.add_argument(
        "--new-study-uid",
        action="store_true",
        help="with --output-format dicom-seg: a series without StudyInstanceUID (anonymised) gets a SEG with a new "
        "study UID, and a warning (a viewer files it as a study of its own); without it such a case fails",
    )
    g.add_argument("--output", required=True, help="output folder")
    g.add_argument(
        "--subset",
        default="test",
        help="with a dataset.json: test (its test list, default), training (all labelled cases), or "
        "split:NAME (a split of the converted training data, e.g. split:val)",
    )
    g.add_argument("--label-dir", default=None, help="ground-truth labels named like the images: adds Dice per class")
    g.add_argument("--probabilities", action="store_true", help="also write per-class (or per-region) probability maps")


def _add_window_arguments(g) -> None:
    """The sliding window (test-time augmentation, batch, overlap, size) and where it runs (device, buffers, model
    parallelism)."""
    g.add_argument("--tta", action="store_true", help="test-time augmentation: average over flips")
    g.add_argument("--tta-axes", default="0,1,2", help="axes (R,A,S = 0,1,2) flipped by --tta (default 0,1,2)")
    g.add_argument("--sw-batch-size", type=int, default=None, help="windows per forward pass (default: the config's)")
    g.add_argument("--overlap", type=float, default=None, help="sliding-window overlap (default: the config's)")
    g.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        default=None,
        help="where to run (default gpu when one is visible); gpu falls back to the CPU, then to smaller "
        "sliding-window batches, for volumes that do not fit",
    )
    g.add_argument(
        "--accelerator-memory-mb",
        type=float,
        default=None,
        help="budget for whole-volume buffers on the GPU; larger volumes go to the CPU",
    )
    g.add_argument(
        "--buffer-dtype",
        choices=("float32", "float16"),
        default="float32",
        help="sliding-window sum buffer: float16 halves its memory (labels may differ at near-ties)",
    )
    g.add_argument(
        "--model-parallel",
        default=None,
        metavar="MODE:N",
        help="one model over N devices for each window batch: spatial:N (each window cut into N slabs: windows "
        "N times larger fit), pipeline:N, or none (default: the run config's runtime.model_parallel); weights "
        "trained either way work",
    )
    g.add_argument(
        "--roi-size",
        default=None,
        metavar="X,Y,Z",
        help="sliding-window size (default: the config's validation.roi_size or training patch); multiples of the "
        "network's stride products",
    )


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """--engine and --precision: what runs the network of an exported model folder (docs/deploying.md)."""
    p.add_argument(
        "--engine",
        choices=("tensorflow", "onnxruntime", "openvino"),
        default="tensorflow",
        help="what runs the network: tensorflow (a run folder's Keras model, or an exported folder's SavedModel), "
        "onnxruntime or openvino (an exported model folder from tfmis-export; needs tfmis[deploy]); the sliding "
        "window, blending, test-time augmentation and postprocessing are the same for all",
    )
    p.add_argument(
        "--precision",
        choices=("float32", "bfloat16"),
        default="float32",
        help="with an exported model folder: the engine's arithmetic; bfloat16 (tensorflow, openvino) is faster on "
        "CPUs with AVX-512 BF16 or AMX and changes a few voxels (docs/deploying.md)",
    )


def _model_parallel_override(config, value: str | None, roi: str | None, parser):
    """The config with --model-parallel and --roi-size applied (a usage error names the flag), its windows checked
    against the model-parallel split (`tfmis.config.check_model_parallel`: a config error naming the flag)."""
    import dataclasses

    if value is not None:
        mode, _, n = value.partition(":")
        if mode not in ("none", "spatial", "pipeline") or (mode != "none" and not n.isdigit()) or (n and int(n) < 1):
            parser.error(f"--model-parallel: expected none, spatial:N or pipeline:N, got {value!r}")
        mp = dataclasses.replace(config.runtime.model_parallel, mode=mode, devices=int(n or 1), data=1)
        config = dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, model_parallel=mp))
    if roi is not None:
        try:
            size = [int(v) for v in roi.split(",")]
        except ValueError:
            size = []
        if len(size) != 3 or min(size) < 1:
            parser.error(f"--roi-size: expected three positive integers like 96,96,96, got {roi!r}")
        config = dataclasses.replace(config, validation=dataclasses.replace(config.validation, roi_size=size))
    from tfmis.config import check_model_parallel

    # the windows against the slabs (and the network against the split) before any model is built: exit 2
    windows = "--roi-size" if roi is not None else "validation.roi_size" if config.validation.roi_size else None
    check_model_parallel(config, windows=windows or "pipeline.patch_size", flag="--model-parallel")
    return config


def final_stage(checkpoint: str) -> str:
    """The run that predicts: `checkpoint` itself, or, for the folder of a plan of several stages (its plan.yaml
    names them), the last stage's run folder (a cascade's fine stage, which runs the coarse stage first)."""
    from tfmis.config import load_config, load_stages

    plan = Path(checkpoint) / "plan.yaml"
    if not Path(checkpoint).is_dir() or (Path(checkpoint) / "config.yaml").is_file() or not plan.is_file():
        return checkpoint
    stages = load_stages(plan)
    return load_config(stages[-1][1]).output.dir if stages else checkpoint


def _folds(value: str | None, parser) -> list[int] | None:
    if value is None:
        return None
    try:
        folds = [int(k) for k in value.split(",")]
    except ValueError:
        folds = []
    if not folds or min(folds) < 0 or len(set(folds)) != len(folds):
        parser.error(f"--folds: expected distinct fold numbers like 0,2, got {value!r}")
    return folds


def _check_dicom_arguments(args) -> None:
    """DICOM input needs pydicom, and --output-format dicom-seg highdicom too and a folder as --input (a DICOM series,
    or a folder of them): usage errors (exit 2) before anything is loaded. (A folder of series folders is checked
    for pydicom when its cases are collected.)"""
    from tfmis.data.sources.dicom_series import is_dicom_folder, require
    from tfmis.errors import UsageError

    path = Path(args.input)
    if is_dicom_folder(path):
        require(f"--input {path} (DICOM)", "pydicom")
    if args.output_format != "dicom-seg":
        return
    require("--output-format dicom-seg", "pydicom", "highdicom")
    if path.exists() and (not path.is_dir() or (path / "dataset.json").is_file()):
        raise UsageError(
            f"--output-format dicom-seg: --input {path} is not a DICOM series folder; a DICOM SEG references the "
            "series it segments: give a DICOM series folder (or a folder of them), or --output-format nifti"
        )


def _check_dicom_cases(cases, output_format: str) -> None:
    """With --output-format dicom-seg every case must be a DICOM series (a usage error names the first that is not)."""
    from tfmis.errors import UsageError

    other = [c for c in cases if c.series is None]
    if output_format == "dicom-seg" and other:
        raise UsageError(
            f"--output-format dicom-seg: {other[0].image} is not a DICOM series; a DICOM SEG references the series it "
            "segments: give DICOM series folders only, or --output-format nifti"
        )


def _run_predictor(args, folds, tta_axes):
    """(the predictor, the `PredictionSource`) of a run folder, plan, folder of folds or cross-validation folder:
    the tensorflow engine only."""
    from tfmis.config import load_config
    from tfmis.errors import UsageError
    from tfmis.inference.ensemble import build_predictor, resolve_checkpoint
    from tfmis.inference.inputs import fold_weights

    if args.engine != "tensorflow" or args.precision != "float32":
        flag = f"--engine {args.engine}" if args.engine != "tensorflow" else f"--precision {args.precision}"
        raise UsageError(
            f"{flag} runs an exported model folder: export {args.checkpoint} first (tfmis-export --checkpoint "
            f"{args.checkpoint} --output MODEL_DIR) and give MODEL_DIR as --checkpoint"
        )
    weights, note = fold_weights(args.checkpoint, args.weights)  # a fold's run folder: its final weights
    if note:
        print(note, file=sys.stderr)
    source = resolve_checkpoint(args.checkpoint, folds, weights)
    if source.kind == "run" and args.config is None:  # the folder of a plan of stages: its last stage
        source = resolve_checkpoint(final_stage(args.checkpoint), weights=weights)
    if source.kind in ("folds", "crossval") and source.weights == "best":
        print(
            f"warning: best weights: each fold's best.weights.h5 of {args.checkpoint} was chosen on its held-out fold "
            "(optimistic there; the default is the final weights)",
            file=sys.stderr,
        )
    if source.models > 1 and args.subset.startswith("split:"):
        raise UsageError(
            f"--subset {args.subset}: a split of one run's training data, but {source.models} runs predict, each "
            "trained on other cases: predict the test set (--subset test) or a folder of scans"
        )
    predictor = build_predictor(
        source,
        config=load_config(args.config) if args.config else None,
        adjust=lambda c: _model_parallel_override(c, args.model_parallel, args.roi_size, build_parser()),
        sw_batch_size=args.sw_batch_size,
        overlap=args.overlap,
        device=args.device,
        tta=args.tta,
        tta_axes=tta_axes,
        accelerator_memory_mb=args.accelerator_memory_mb,
        buffer_dtype=args.buffer_dtype,
    )
    return predictor, source


# what an exported model folder fixes at export: these flags are refused with it
EXPORT_FIXED = ("config", "folds", "weights", "model_parallel", "roi_size", "accelerator_memory_mb")


def _exported_predictor(args, folds, tta_axes):
    """The `ExportedPredictor` of an exported model folder (its manifest.json) run by --engine."""
    from tfmis.errors import UsageError
    from tfmis.inference.deployed import exported_predictor

    given = [name for name in EXPORT_FIXED if getattr(args, name) is not None]
    if given or args.subset.startswith("split:") or args.device == "gpu":
        flag = f"--{given[0].replace('_', '-')}" if given else "--device gpu" if args.device == "gpu" else "--subset"
        raise UsageError(
            f"{flag}: {args.checkpoint} is an exported model folder, which fixes its networks, weights and windows "
            "and runs on the CPU (a training split is the run folder's): leave it out, or predict with the run folder"
        )
    return exported_predictor(
        args.checkpoint,
        engine=args.engine,
        precision=args.precision,
        sw_batch_size=args.sw_batch_size,
        overlap=args.overlap,
        tta=args.tta,
        tta_axes=tta_axes,
        buffer_dtype=args.buffer_dtype,
    )


@command
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        tta_axes = tuple(int(a) for a in args.tta_axes.split(","))
    except ValueError:
        build_parser().error(f"--tta-axes: expected comma-separated axes like 0,1,2, got {args.tta_axes!r}")
    folds = _folds(args.folds, build_parser())
    from tfmis.errors import MissingInput, PartialFailure

    _check_dicom_arguments(args)
    if not Path(args.checkpoint).exists():  # before TensorFlow's start-up and any config lookup
        raise MissingInput(
            f"--checkpoint {args.checkpoint}: no such file or folder; give a training run's folder (it holds "
            "config.yaml), a plan of stages, a folder of folds or a cross-validation folder"
        )
    from tqdm import tqdm

    from tfmis.inference.inputs import collect_inputs
    from tfmis.inference.manifest import MANIFEST_FILE
    from tfmis.inference.outputs import dice_line, results_table, write_csv
    from tfmis.postprocessing import describe_postprocessing

    if (Path(args.checkpoint) / MANIFEST_FILE).is_file():  # an exported model folder (tfmis-export)
        predictor, source = _exported_predictor(args, folds, tta_axes), None
    else:
        predictor, source = _run_predictor(args, folds, tta_axes)
    if args.no_postprocessing:
        predictor.postprocessing = None
    cases = collect_inputs(args.input, args.subset, args.label_dir, predictor.index, series=args.series)
    _check_dicom_cases(cases, args.output_format)
    predictor.output_format = args.output_format
    predictor.new_study_uid = args.new_study_uid
    where = " (--no-postprocessing)" if args.no_postprocessing else ""
    where = where or (" (crossval.json's choice)" if source is not None and source.postprocessing is not None else "")
    print(f"Predicting with {predictor.describe() if source is None else source.describe()}")
    print(f"Postprocessing: {describe_postprocessing(predictor.postprocessing)}{where}", flush=True)
    output = Path(args.output)
    results = []
    for case in tqdm(cases, desc="Predicting", unit="case", disable=args.quiet, file=sys.stderr):
        logged = len(predictor.events)
        result = predictor.predict_file(case, output, probabilities=args.probabilities)
        if result.status != "ok":
            tqdm.write(f"  {case.case_id}: FAILED: {result.reason}", file=sys.stderr)
        for event in predictor.events[logged:]:  # what ran out of memory, and what worked
            tqdm.write(f"  {event}", file=sys.stderr)
        if result.peak_rss_mb is not None:
            tqdm.write(
                f"  {case.case_id}: {result.seconds:.1f} s, peak RSS {result.peak_rss_mb:.0f} MiB", file=sys.stderr
            )
        results.append(result)
    writing(output / "predictions.csv")
    write_csv(results, output / "predictions.csv", predictor.class_names, predictor.score_columns)
    print(results_table(results))
    if any(r.dice for r in results):
        print(dice_line(results, predictor.class_names))
    failed = sum(r.status != "ok" for r in results)
    print(f"{len(results) - failed} of {len(results)} case(s) written to {output} (predictions.csv has the details)")
    if failed:
        raise PartialFailure(f"{failed} of {len(results)} case(s) failed (listed above and in predictions.csv)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
