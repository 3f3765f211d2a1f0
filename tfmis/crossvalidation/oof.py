"""Out-of-fold predictions: each fold's models predict the fold's held-out cases from the original scans, on their
original grid, as `python -m tfmis.predict` would, with the weights training ended with (`final.weights.h5`: the
held-out fold chooses nothing; `--val-best` takes the best-on-held-out-fold weights instead); the label maps go to
`<run>/validation/`, their Dice per structure (nnU-Net's, `tfmis.postprocessing`) to
`validation/scores.json`. With several configurations the
two-configuration ensembles are scored too: the configurations' probabilities of each case averaged
(`<cv>/ensembles/<a>+<b>/fold_<k>/validation/`).

`python -m tfmis.crossval oof CV_DIR --fold K` (started by the fold's worker).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

from tfmis.crossvalidation.experiment import (
    SCORES_FILE,
    Definition,
    averaging_pairs,
    candidate_dir,
    fold_run_dir,
    pair_name,
    read_definition,
)
from tfmis.data.sources.image_io import output_suffix, read_image
from tfmis.utils.io import atomic_write_json

PROBABILITIES_SUFFIX = "_probabilities.nii.gz"


def fold_cases(definition: Definition, fold: int, predictor) -> list:
    """The held-out cases of `fold` (InputCase with image and label paths), from the configuration's source."""
    from tfmis.data.sources.errors import DatasetNotFound
    from tfmis.inference.inputs import collect_inputs

    source = predictor.config.data.source_dir
    if not source or not (Path(source) / "dataset.json").is_file():
        raise DatasetNotFound(
            f"data.source_dir {source!r}: out-of-fold predictions are made from the original scans; set "
            "data.source_dir to the dataset folder (MSD or nnU-Net v2 raw, with dataset.json) the folds were converted "
            "from"
        )
    return collect_inputs(Path(source) / "dataset.json", f"split:fold{fold}", None, predictor.index)


def prediction_name(case) -> str:
    """The file name `tfmis-predict` gives the label map of `case` (an `InputCase`): its id in its image's format."""
    return f"{case.case_id}{output_suffix(case.first_file)}"


def score_folder(folder: Path, cases: list, labels: list[int], regions: dict | None) -> dict:
    """Dice per structure of each case's label map in `folder` against its reference (nnU-Net's: NaN when both are
    empty), written to `folder/scores.json` last (its presence means the folder is complete)."""
    from tfmis.postprocessing import case_dice

    scores = {
        c.case_id: {
            k: None if math.isnan(v) else v
            for k, v in case_dice(folder / prediction_name(c), c.label, labels, regions).items()
        }
        for c in cases
    }
    record = {
        "cases": scores,
        "references": {c.case_id: c.label for c in cases},
        "predictions": {c.case_id: prediction_name(c) for c in cases},
    }
    atomic_write_json(folder / SCORES_FILE, record)
    return record


def ensemble_folder(folders: list[Path], out: Path, cases: list, paint_labels) -> None:
    """The label maps of the configurations' averaged probabilities (written by predict's `probabilities=True`:
    one channel per class, or per region), one case at a time."""
    from tfmis.data.sources.label_maps import save_like
    from tfmis.inference.restore import paint_regions

    out.mkdir(parents=True, exist_ok=True)
    for case in cases:
        total, affine, header = None, None, None
        for folder in folders:
            image = read_image(folder / f"{case.case_id}{PROBABILITIES_SUFFIX}")
            p = np.asarray(image.array, dtype=np.float32)
            total = p if total is None else total + p
            affine, header = image.affine, image.header
        total /= len(folders)
        if paint_labels is None:
            labels = np.argmax(total, axis=-1).astype(np.uint8)
        else:
            labels = paint_regions(total, paint_labels)
        save_like(labels, affine, header, out / prediction_name(case), np.uint8)


def predict_fold(cv_dir: str | Path, fold: int, device: str | None = None) -> int:
    """Every configuration's out-of-fold predictions and scores for `fold` (those already scored are kept), then
    the two-configuration ensembles'; 0, or 1 after an error line."""
    from tfmis.config import load_config
    from tfmis.inference.cascade import make_predictor
    from tfmis.inference.inputs import run_config

    cv_dir = Path(cv_dir)
    definition = read_definition(cv_dir)
    several = len(definition.configurations) > 1
    cases, labels, regions, paint = None, None, None, {}
    for name in definition.names:
        run = fold_run_dir(cv_dir, name, fold)
        folder = candidate_dir(cv_dir, name, fold)
        config = load_config(run_config(run))
        predictor = make_predictor(config, run, device=device, weights=definition.weights)
        cases = fold_cases(definition, fold, predictor)
        labels = list(range(1, len(predictor.class_names)))
        regions = dict(config.validation.regions) if predictor.task.paint_labels is not None else None
        paint[name] = predictor.task.paint_labels
        if (folder / SCORES_FILE).is_file() and (
            not several or all((folder / f"{c.case_id}{PROBABILITIES_SUFFIX}").is_file() for c in cases)
        ):
            continue
        folder.mkdir(parents=True, exist_ok=True)
        for case in cases:
            result = predictor.predict_file(case, folder, probabilities=several)
            if result.status != "ok":
                print(f"error: {name} fold {fold}, case {case.case_id}: {result.reason}", file=sys.stderr)
                return 1
            print(f"{name} fold {fold}: {case.case_id} predicted in {result.seconds:.1f} s", flush=True)
        score_folder(folder, cases, labels, regions)
        del predictor
    for a, b in averaging_pairs(definition):
        out = candidate_dir(cv_dir, pair_name(a, b), fold)
        if (out / SCORES_FILE).is_file():
            continue
        ensemble_folder([candidate_dir(cv_dir, a, fold), candidate_dir(cv_dir, b, fold)], out, cases, paint[a])
        score_folder(out, cases, labels, regions)
    return 0
