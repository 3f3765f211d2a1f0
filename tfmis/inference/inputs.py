"""What a prediction reads besides the model: the cases named by `--input` (`collect_inputs`), the training run a
checkpoint belongs to (`find_run_dir`, `run_config`, the runs of an ensemble checked alike) and its weights
(`load_weights`).

Example:
```python
cases = collect_inputs("Task04_Hippocampus/dataset.json", subset="split:val", index=index)
config = load_config(run_config("runs/demo"))
```
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import tensorflow as tf

from tfmis.data.records import load_training_data_info, split_entry
from tfmis.data.sources.cases import case_id_from_path
from tfmis.data.sources.image_io import image_suffix
from tfmis.errors import DataError, MissingInput, UsageError
from tfmis.networks.weights import has_weights_by_path, read_legacy_trainable, read_weights_by_path
from tfmis.utils.run_files import weights_file

if TYPE_CHECKING:
    from tfmis.task import SegmentationTask


@dataclasses.dataclass
class InputCase:
    """A case to predict: its image file (or its channel files in order, nnU-Net v2) and its label file, if any."""

    case_id: str
    image: str | tuple[str, ...]
    label: str | None = None
    series: str | None = None  # a DICOM series: `image` is its folder, this its SeriesInstanceUID

    @property
    def first_file(self) -> str:
        """The (first channel's) image file: its format and name are the prediction's."""
        return self.image if isinstance(self.image, str) else self.image[0]


def collect_inputs(
    input_path: str | Path,
    subset: str = "test",
    label_dir: str | Path | None = None,
    index: dict | None = None,
    series: str | None = None,
) -> list[InputCase]:
    """The cases named by `--input`: one image file, a folder of them, or a dataset (its folder or dataset.json: MSD or
    nnU-Net v2 raw, `tfmis.data.sources.layouts.open_dataset`); or a DICOM series folder, or a folder of them (one case
    each, named after its folder: `dicom_cases`). Images are files `tfmis.data.sources.image_io` reads (NIfTI, NRRD,
    MetaImage); an nnU-Net case is its channel files.

    Args:
        subset: for a dataset.json: `test` (its test list), `training` (all labelled cases), or
            `split:NAME` (the cases of split NAME of the training run's converted dataset, e.g. `split:val`).
        label_dir: folder of ground-truth label maps named like the images (for Dice); a DICOM case's is
            `<case>.nii.gz`.
        index: the training run's index.json (for `split:NAME`).
        series: `--series`: the SeriesInstanceUID to read where a DICOM folder holds several series.
    """
    from tfmis.data.sources.layouts import open_dataset

    path = Path(input_path)
    if path.name == "dataset.json" or (path.is_dir() and (path / "dataset.json").is_file() and subset != "folder"):
        dataset = open_dataset(path.parent if path.name == "dataset.json" else path)
        if subset == "test":
            cases = [InputCase(c.case_id, dataset.resolve_image(c)) for c in dataset.test]
        elif subset == "training":
            cases = [
                InputCase(c.case_id, dataset.resolve_image(c), str(dataset.resolve(c, c.label)))
                for c in dataset.training
            ]
        elif subset.startswith("split:"):
            split = subset.split(":", 1)[1]
            try:
                ids = set(split_entry(index, split)["cases"])  # one split, or several joined: fold0+fold1
            except (KeyError, TypeError, ValueError):
                raise UsageError(
                    f"--subset {subset}: the training run's dataset has splits "
                    f"{sorted(index['splits']) if index else []}"
                ) from None
            cases = [
                InputCase(c.case_id, dataset.resolve_image(c), str(dataset.resolve(c, c.label)))
                for c in dataset.training
                if c.case_id in ids
            ]
        else:
            raise UsageError(f"--subset must be test, training or split:NAME, got {subset!r}")
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if image_suffix(p.name) and not p.name.startswith("._"))
        cases = [InputCase(case_id_from_path(p.name), str(p)) for p in files]
        cases += dicom_cases(path, series)
    elif path.is_file():
        cases = [InputCase(case_id_from_path(path.name), str(path))]
        _not_a_dicom_file(path)
    else:
        raise MissingInput(f"--input {path} does not exist")
    if series is not None and not any(c.series for c in cases):
        raise UsageError(f"--series {series}: --input {path} is not a DICOM series folder (nor a folder of them)")
    if label_dir is not None:
        for c in cases:
            # a label is named as its image, <case><suffix> for an image of channel files, <case>.nii.gz for DICOM
            if c.series:
                name = f"{c.case_id}.nii.gz"
            elif isinstance(c.image, str):
                name = Path(c.image).name
            else:
                name = c.case_id + (image_suffix(c.first_file) or "")
            candidate = Path(label_dir) / name
            c.label = str(candidate) if candidate.is_file() else c.label
    if not cases:
        raise DataError(f"--input {path}: no image files (.nii.gz, .nii, .nrrd, .mha, .mhd) or DICOM series found")
    return cases


def _not_a_dicom_file(path: Path) -> None:
    from tfmis.data.sources.dicom_series import looks_like_dicom

    if looks_like_dicom(path):
        raise UsageError(f"--input {path} is one DICOM slice: give the folder that holds its series")


def dicom_cases(path: Path, series: str | None = None) -> list[InputCase]:
    """The DICOM series under `path` (`tfmis.data.sources.dicom_series.series_folders`): `path` itself when it holds
    DICOM files, else each subfolder that does; a folder of several series reads `series` or is a `UsageError` listing
    them."""
    from tfmis.data.sources.dicom_series import series_folders

    return [InputCase(name, str(folder), series=uid) for name, folder, uid in series_folders(path, series)]


def find_run_dir(checkpoint: str | Path) -> Path | None:
    """The training run folder (the one holding config.yaml) of a run folder, its best weights or a checkpoint."""
    path = Path(checkpoint)
    for candidate in (path, path.parent, path.parent.parent):
        if candidate.is_dir() and (candidate / "config.yaml").is_file():
            return candidate
    return None


def run_config(checkpoint: str | Path) -> Path:
    """The config.yaml of the run that `checkpoint` belongs to; a clear error when there is none."""
    run = find_run_dir(checkpoint)
    plan = Path(checkpoint) / "plan.yaml"
    if run is None and plan.is_file():
        raise MissingInput(
            f"--checkpoint {checkpoint}: it holds a plan (plan.yaml) that has not been trained yet, so there are no "
            f"weights to predict with: train it first (python -m tfmis.train --config {plan}), then give its run folder"
        )
    if run is None:
        raise MissingInput(
            f"--checkpoint {checkpoint}: no config.yaml in or above it, so it is not a training run's folder (nor a "
            "plan of stages, a folder of folds or a cross-validation folder): give one, or the run's config with "
            "--config"
        )
    return run / "config.yaml"


def load_weights(model, checkpoint: str | Path, weights: str = "best", task: SegmentationTask | None = None) -> Path:
    """Loads a run's weights into the inference `model`; returns the file (or checkpoint prefix) read.

    `checkpoint` is a run folder (its `best.weights.h5` or `final.weights.h5`, as `weights` says), a `.weights.h5`
    file, or a tf.train checkpoint of the trainer (a `checkpoints/` folder: its latest; or a `ckpt-N` prefix). The
    trainer's checkpoint holds its training model (with deep supervision, the model plus its heads), so it is read
    by the weights' names (`tfmis.networks.weights`): matching objects by their position in two builds' graphs
    put 44 of the demo network's 73 weights in the wrong place. A checkpoint of an older tfmis (no named weights)
    is read into a training model built by `task` from the optimizer's list of its trainable weights, then copied
    by name. A weights file or checkpoint of another model is a `DataError` of one line naming it.
    """
    path = Path(checkpoint)
    if path.is_dir() and ((path / "config.yaml").is_file() or weights_file(path, weights).is_file()):  # a run folder
        path = weights_file(path, weights)
        if not path.is_file():
            raise MissingInput(_missing_weights(path.parent, weights))
    if path.suffix == ".h5":
        if not path.is_file():
            raise MissingInput(f"checkpoint {path} does not exist")
        _read_weights_file(model, path)
        return path
    prefix = tf.train.latest_checkpoint(str(path)) if path.is_dir() else str(path)
    if prefix is None or not Path(prefix + ".index").is_file():
        raise MissingInput(
            f"no checkpoint at {checkpoint}: give a run folder, its best.weights.h5 or final.weights.h5, or a "
            "checkpoints/ folder or ckpt-N prefix"
        )
    if has_weights_by_path(prefix):  # the trainer's weights under their names
        missing = read_weights_by_path(model, prefix)
    else:  # an older tfmis's checkpoint: the trainable weights in the optimizer's order
        if task is None:
            raise ValueError("load_weights: a checkpoint of an older tfmis needs the task that builds its model")
        _, training_model = task.build_training_model()
        missing = read_legacy_trainable(training_model, prefix)
        if not missing:
            copy_weights_by_name(training_model, model, source=prefix)
    if missing:
        what = f"{len(missing)} of the model's {len(model.weights)} weights are not in it (e.g. {missing[0]})"
        raise DataError(
            f"checkpoint {prefix} does not fit this model (model.* of the config): {what}. "
            "Predict with the config.yaml of the run that wrote the checkpoint"
        )
    return Path(prefix)


def _read_weights_file(model, path: Path) -> None:
    """Reads a `.weights.h5` (Keras matches its layers by kind and order). A file of another model makes Keras raise
    a ValueError of many lines, or, when a group of layers is not in the file at all, only warn and leave those
    layers' fresh weights: both are one `DataError` line naming the file."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model.load_weights(str(path))
        except ValueError as e:
            raise DataError(
                f"weights file {path} does not fit this model (model.* of the config): {_keras_mismatch(e)}. "
                "Predict with the config.yaml of the run that wrote it"
            ) from None
    for w in caught:
        if "no matching group found in the saved file" in str(w.message):
            raise DataError(
                f"weights file {path} does not fit this model (model.* of the config): some of its layers are not "
                "in it. Predict with the config.yaml of the run that wrote it"
            )
    for w in caught:  # the others, as they were
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _keras_mismatch(error: ValueError) -> str:
    """What Keras' error on loading a weights file into another model says, in a few words: how many layers did not
    fit and the first weight with the shapes of the file and of the model, or Keras' first reason."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    count = re.match(r"A total of (\d+) objects could not be loaded", lines[0]) if lines else None
    n = int(count.group(1)) if count else 0
    what = f"{n} of the model's layers {'does' if n == 1 else 'do'} not fit" if count else "it does not fit"
    shapes = re.search(
        r"variable\.shape=(\([^)]*\)), Received: value\.shape=(\([^)]*\))\. Target variable: <Variable path=([^,]+),",
        str(error),
    )
    if shapes:
        return f"{what}, e.g. {shapes.group(3)} is {shapes.group(2)} in the file, {shapes.group(1)} in the model"
    reason = lines[1] if count and len(lines) > 1 else (lines[0] if lines else type(error).__name__)
    return f"{what} ({reason[:200]})"


def copy_weights_by_name(source_model, model, source: str = "the checkpoint") -> None:
    """Assigns each of `model`'s weights the weight of `source_model` with the same path (`encoder0/unit0/conv/
    kernel`, ...); a path missing there or a shape that differs is a `DataError` naming it."""
    by_path = {w.path: w for w in source_model.weights}
    for w in model.weights:
        found = by_path.get(w.path)
        if found is None or tuple(found.shape) != tuple(w.shape):
            what = "is not in it" if found is None else f"has shape {tuple(found.shape)}, not {tuple(w.shape)}"
            raise DataError(
                f"{source}: the weight {w.path} {what}; predict with the config.yaml of the run that wrote it"
            )
        w.assign(found)


def _missing_weights(run: Path, weights: str) -> str:
    if weights == "final":
        return (
            f"{run} has no final.weights.h5: its training has not finished, or an older tfmis trained it; run "
            f"python -m tfmis.train --config {run / 'config.yaml'} --resume to finish it (a finished run only writes "
            "the file), or predict with its best weights"
        )
    return f"{run} has no best.weights.h5: no validation has run yet; train it further (--resume)"


def check_same_training_data(index: dict, checkpoint, first, dataset_dir) -> None:
    """An ensemble's runs must see the scans alike: the preprocessing, channels and classes of `checkpoint`'s run
    (its training_data.json) must be those of `first`'s (`index`)."""
    other = load_training_data_info(find_run_dir(checkpoint), dataset_dir)
    for key, what in (("preprocessing", "preprocessing"), ("source", "channels and classes")):
        mine = other[key] if key == "preprocessing" else (other[key]["modalities"], other[key]["labels"])
        theirs = index[key] if key == "preprocessing" else (index[key]["modalities"], index[key]["labels"])
        if mine != theirs:
            raise DataError(
                f"{checkpoint}: its {what} (training_data.json) differ from those of {first}: the runs of an "
                "ensemble must be folds of one configuration"
            )


def fold_of_run(checkpoint: str | Path) -> tuple[int, int] | None:
    """(k, K) when `checkpoint` is the run folder of a fold training, else None.

    A fold training's config (its run folder's `config.yaml`) has `data.split` set: it trained on K-1 folds and
    validated on the held-out fold k, so its `best.weights.h5` was chosen on that fold. Every fold a
    cross-validation trains (`<cv>/<configuration>/fold_<k>`, its folder's `crossval_definition.json` two levels
    up) has it, and so does `tfmis-train --set data.split.fold=k`."""
    import yaml

    path = Path(checkpoint)
    if not path.is_dir() or not (path / "config.yaml").is_file():
        return None
    try:
        data = yaml.safe_load((path / "config.yaml").read_text())
        split = data["data"]["split"]
        return (int(split["fold"]), int(split["folds"])) if split else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return None


def fold_weights(checkpoint: str | Path, weights: str | None) -> tuple[str | None, str | None]:
    """(the weights to read, a line to print or None) for `--weights` given as `weights` (None: the default).

    A fold training's run folder (`fold_of_run`) predicts with its final weights by default: its best ones were
    chosen on its held-out fold, which then chooses nothing, as cross-validation scores it (nnU-Net's
    `checkpoint_final`). `--weights best` on it is allowed, with a line saying that it is optimistic on that fold."""
    fold = fold_of_run(checkpoint)
    if fold is None:
        return weights, None
    k, folds = fold
    if weights is None:
        return "final", (
            f"{checkpoint} is fold {k} of {folds}: predicting with final.weights.h5, the weights its training ended "
            "with (its best.weights.h5 was chosen on its held-out fold; --weights best to use it)"
        )
    if weights == "best":
        return weights, (
            f"warning: --weights best: {checkpoint} is fold {k} of {folds}, whose best.weights.h5 was chosen on its "
            f"held-out fold {k}: a Dice measured on that fold's cases with it is optimistic (not a selection)"
        )
    return weights, None
