"""What `--checkpoint` names, and predicting with ensembles of folds and of configurations.

`--checkpoint` is one of:

- a run folder, its weights or a checkpoint: one model (`Predictor`), as always;
- a folder of folds: subfolders `fold_<k>` that are run folders (a configuration of a cross-validation,
  `<cv>/<name>`): the fold ensemble (`Predictor` over their runs; for a cascade, its coarse stage the fold ensemble
  of the folds' `cascade.coarse_run`s);
- a cross-validation folder (`crossval.json`, written by `tfmis-crossval`): the configuration(s) it chose, each the
  ensemble of its folds, and the postprocessing it chose. Two chosen configurations are averaged by
  `ConfigurationEnsemble`.

Which weights of each run predict: a cross-validation's folds those its out-of-fold scores were made with
(`crossval.json`'s `weights`: `final.weights.h5` unless it ran with `--val-best`); a folder of folds their final
weights (nnU-Net's `checkpoint_final`); one run its best weights. `weights=` overrides it. A fold that is missing or
did not finish (no such weights file) stops it with one line naming the fold.

Example:
```python
source = resolve_checkpoint("runs/cv", folds=[0, 2])
predictor = build_predictor(source, device="cpu")
print(source.describe())  # "ensemble of folds 0, 2 of runs/cv/fullres (crossval.json's choice)"
result = predictor.predict_file(InputCase("ct_001", "ct_001.nii.gz"), "predictions/")
```
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np

from tfmis.config import ConfigError, PostprocessingConfig, from_dict, load_config
from tfmis.errors import DataError, MissingInput, UsageError
from tfmis.inference.cascade import make_predictor
from tfmis.inference.inputs import run_config
from tfmis.inference.predictor import ScanPredictor
from tfmis.inference.restore import paint_regions
from tfmis.utils.run_files import weights_file

CROSSVAL_FILE = "crossval.json"
FOLD_FOLDER = re.compile(r"fold_(\d+)")
LABEL_SLAB_VOXELS = 2**22  # voxels of the mean probabilities turned into labels at a time


@dataclasses.dataclass
class EnsembleMember:
    """One configuration: its runs (the folds, in fold order; or the one run `--checkpoint` names)."""

    name: str
    runs: list[Path]
    folder: Path | None = None  # the folder of folds (None for one run)
    folds: list[int] | None = None  # the fold numbers of `runs` (None for one run)
    coarse_folder: Path | None = None  # a cascade's: the folder of its coarse runs


@dataclasses.dataclass
class PredictionSource:
    """What predicts: one run, the folds of a configuration, or a cross-validation's choice.

    `postprocessing` is the cross-validation's chosen `PostprocessingConfig` (None: the runs' own
    `config.postprocessing`)."""

    kind: str  # "run", "folds" or "crossval"
    members: list[EnsembleMember]
    postprocessing: PostprocessingConfig | None = None
    folder: Path | None = None  # the folder of folds or the cross-validation folder
    weights: str = "best"  # each run folder's "best" or "final" weights

    @property
    def models(self) -> int:
        return sum(len(m.runs) for m in self.members)

    def describe(self) -> str:
        """One line for the command's header, e.g. "ensemble of 5 folds of runs/cv/fullres" or "ensemble of fullres
        (5 folds) + lowres (5 folds) of runs/cv (crossval.json's choice)"."""
        if self.kind == "run":
            return f"the run {self.members[0].runs[0]}"
        choice = f" ({CROSSVAL_FILE}'s choice)" if self.kind == "crossval" else ""
        if len(self.members) == 1:
            member = self.members[0]
            return f"{_folds_phrase(member)} of {member.folder}{_cascade_phrase(member)}{choice}"
        parts = " + ".join(
            f"{m.name} ({len(m.runs)} fold{'s' if len(m.runs) > 1 else ''}{_cascade_phrase(m, ', ')})"
            for m in self.members
        )
        return f"ensemble of {parts} of {self.folder}{choice}"


def _folds_phrase(member: EnsembleMember) -> str:
    folds = member.folds or []
    if len(folds) == 1:
        return f"fold {folds[0]}"
    if folds == list(range(len(folds))):
        return f"ensemble of {len(folds)} folds"
    return "ensemble of folds " + ", ".join(map(str, folds))


def _cascade_phrase(member: EnsembleMember, joiner: str = "; ") -> str:
    if member.coarse_folder is None:
        return ""
    return f"{joiner}a cascade after the same folds of {member.coarse_folder}"


def resolve_checkpoint(
    checkpoint: str | Path, folds: list[int] | None = None, weights: str | None = None
) -> PredictionSource:
    """What `checkpoint` names: a cross-validation folder (`crossval.json`), a folder of folds (`fold_<k>`
    subfolders), or one run (a run folder, weights file or checkpoint, left as it is).

    `folds` selects a subset of the folds (e.g. [0, 2]); None: all of them. `weights` ("best" or "final") chooses
    the runs' weights; None: a cross-validation's own choice (`crossval.json`'s `weights`), final for a folder of
    folds, best for one run.

    Raises:
        FileNotFoundError: a fold (or its coarse run) is missing or did not finish: one line naming it, saying to
            rerun tfmis-crossval or to leave it out with --folds.
        ValueError: an unreadable crossval.json, `folds` naming a fold that is not there, or `folds` for one run.
    """
    path = Path(checkpoint)
    if path.is_dir() and (path / CROSSVAL_FILE).is_file():
        return _from_crossval(path, folds, weights)
    if path.is_dir() and not (path / "config.yaml").is_file() and _fold_folders(path):
        weights = weights or "final"
        member = _member(path.name, path, _expected_folds(path), folds, {}, weights)
        return PredictionSource("folds", [member], folder=path, weights=weights)
    if folds is not None:
        raise UsageError(
            f"--folds: {checkpoint} is one run, not a folder of folds (fold_<k> subfolders) or a cross-validation "
            f"folder ({CROSSVAL_FILE})"
        )
    return PredictionSource("run", [EnsembleMember(path.name, [path])], weights=weights or "best")


def _fold_folders(folder: Path) -> dict[int, Path]:
    found = {}
    for child in folder.iterdir():
        match = FOLD_FOLDER.fullmatch(child.name)
        if match and child.is_dir():
            found[int(match.group(1))] = child
    return dict(sorted(found.items()))


def _expected_folds(folder: Path) -> list[int]:
    """The folds a folder of folds should hold: those of the cross-validation it belongs to (its parent's
    crossval.json naming it), else the fold_<k> subfolders present."""
    parent = folder.parent / CROSSVAL_FILE
    if parent.is_file():
        data = _read_crossval(folder.parent)
        if folder.name in data.get("configurations", {}):
            return [int(k) for k in data.get("folds", [])]
    return list(_fold_folders(folder))


def _read_crossval(folder: Path) -> dict:
    path = folder / CROSSVAL_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} is not readable JSON ({e}): rerun tfmis-crossval to rewrite it") from e
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a mapping, got {type(data).__name__}: rerun tfmis-crossval to rewrite it")
    return data


def _from_crossval(folder: Path, folds: list[int] | None, weights: str | None) -> PredictionSource:
    data = _read_crossval(folder)
    path = folder / CROSSVAL_FILE
    weights = weights or data.get("weights", "best")  # a crossval.json without the key was scored with best weights
    chosen = data.get("chosen") or {}
    names = chosen.get("configurations") or []
    if not names:
        raise DataError(f"{path} has no chosen configuration yet: let tfmis-crossval finish (rerun it to resume)")
    configurations = data.get("configurations") or {}
    members = []
    for name in names:
        if name not in configurations:
            raise DataError(f"{path}: the chosen configuration {name!r} is not among its configurations")
        runs = {int(k): _fold_path(folder, name, int(k), v) for k, v in configurations[name].get("folds", {}).items()}
        members.append(_member(name, folder / name, [int(k) for k in data.get("folds", runs)], folds, runs, weights))
    try:
        postprocessing = from_dict(PostprocessingConfig, chosen.get("postprocessing"), "chosen.postprocessing.")
    except ConfigError as e:
        raise DataError(f"{path}: {e}") from e
    return PredictionSource("crossval", members, postprocessing, folder, weights)


def _fold_path(folder: Path, name: str, fold: int, written: str) -> Path:
    """A fold's run folder as crossval.json names it, or at `<cv>/<name>/fold_<k>` when the folder has moved."""
    run = Path(written)
    moved = folder / name / f"fold_{fold}"
    return run if run.is_dir() or not moved.is_dir() else moved


def _member(
    name: str, folder: Path, expected: list[int], wanted: list[int] | None, runs: dict, weights: str
) -> EnsembleMember:
    """The configuration `name`'s runs of the folds `wanted` (all `expected` ones when None), each checked."""
    runs = runs or _fold_folders(folder)
    if wanted is not None:
        unknown = [k for k in wanted if k not in expected]
        if unknown:
            raise UsageError(
                f"--folds {','.join(map(str, wanted))}: {folder} has no fold {unknown[0]} (its folds: "
                f"{', '.join(map(str, expected))})"
            )
    selected = list(wanted) if wanted is not None else list(expected)
    coarse_folders = []
    for fold in selected:
        run = runs.get(fold, folder / f"fold_{fold}")
        others = ",".join(str(k) for k in selected if k != fold)
        coarse = _check_fold(run, f"fold {fold} of {name}", others, weights)
        if coarse is not None:
            coarse_folders.append(Path(coarse).parent)
    member_runs = [runs.get(fold, folder / f"fold_{fold}") for fold in selected]
    coarse_folder = coarse_folders[0] if coarse_folders else None
    return EnsembleMember(name, member_runs, folder, selected, coarse_folder)


def _check_fold(run: Path, what: str, others: str, weights: str) -> str | None:
    """Checks that a fold's run folder (and a cascade's coarse run) holds finished weights; its coarse run or None."""
    leave_out = f", or leave it out with --folds {others}" if others else ""
    _check_run(run, what, leave_out, weights)
    coarse = load_config(run / "config.yaml").cascade.coarse_run
    if coarse:
        _check_run(Path(coarse), f"the coarse run of {what}", leave_out, weights)
    return coarse or None


def _check_run(run: Path, what: str, leave_out: str, weights: str) -> None:
    if not (run / "config.yaml").is_file():
        raise MissingInput(f"{what}: {run} is missing (no config.yaml): rerun tfmis-crossval to train it{leave_out}")
    if not weights_file(run, weights).is_file():
        raise MissingInput(
            f"{what}: {run} has no {weights_file(run, weights).name} (its training did not finish): rerun "
            f"tfmis-crossval to finish it{leave_out}"
        )


def build_predictor(source: PredictionSource, config=None, adjust=None, **kwargs) -> ScanPredictor:
    """The predictor of `source`: a `Predictor` (one run, or a fold ensemble; a `CascadePredictor` for a cascade), or
    a `ConfigurationEnsemble` of two or more configurations. A cross-validation's chosen postprocessing replaces the
    runs' own.

    Args:
        config: the `Config` to predict with (`--config`); default: each configuration's first run's config.yaml.
            Only for one configuration.
        adjust: a function applied to each configuration's `Config` (e.g. `--model-parallel`, `--roi-size`).
        kwargs: `Predictor`'s (sliding window, device, test-time augmentation, buffer dtype).
    """
    if config is not None and len(source.members) > 1:
        raise UsageError(
            f"--config: {source.folder / CROSSVAL_FILE} chose {len(source.members)} configurations, each with its own "
            "config.yaml: leave --config out"
        )
    predictors = []
    for member in source.members:
        member_config = config if config is not None else load_config(run_config(member.runs[0]))
        member_config = adjust(member_config) if adjust is not None else member_config
        runs = member.runs if len(member.runs) > 1 else member.runs[0]
        predictors.append(make_predictor(member_config, runs, **{"weights": source.weights, **kwargs}))
    if len(predictors) == 1:
        predictor = predictors[0]
    else:
        predictor = ConfigurationEnsemble(predictors, [m.name for m in source.members])
    if source.postprocessing is not None:
        predictor.postprocessing = source.postprocessing
    return predictor


def labels_of_probabilities(probabilities: np.ndarray, paint_labels=None) -> np.ndarray:
    """uint8 label map of (X, Y, Z, K) probabilities: the argmax, or the regions painted (`paint_labels`), a few
    x-slices at a time (no int64 scan-sized argmax)."""
    labels = np.empty(probabilities.shape[:-1], np.uint8)
    step = max(1, LABEL_SLAB_VOXELS // max(1, int(np.prod(probabilities.shape[1:-1]))))
    for first in range(0, probabilities.shape[0], step):
        part = probabilities[first : first + step]
        labels[first : first + step] = (
            np.argmax(part, axis=-1) if paint_labels is None else paint_regions(part, paint_labels)
        )
    return labels


class ConfigurationEnsemble(ScanPredictor):
    """Predicts each case with several configurations (each a `Predictor`, usually a fold ensemble) and averages
    their probabilities on the scan's grid, then takes the argmax (or paints the regions), as nnU-Net's
    `nnUNetv2_ensemble` averages the configurations' probabilities (nnunetv2/ensembling/ensemble.py).

    Cost: each configuration predicts the whole case and restores all its probabilities to the scan's grid (K float32
    maps: the way `--probabilities` takes, slower than the label-only restore of one configuration, which resamples
    only the voxels between classes), one after the other. The running sum and the configuration's map are the most
    held at once: two K-channel float32 maps of the scan (8K bytes per voxel), besides the scan itself, kept until
    the last configuration has preprocessed it. The time is the configurations' times added.

    The configurations must have the same classes (and, for region runs, the same regions) and channels.
    """

    def __init__(self, members: list, names: list[str]):
        first = members[0]
        for name, member in zip(names[1:], members[1:]):
            if (
                list(member.class_names) != list(first.class_names)
                or member.task.paint_labels != first.task.paint_labels
            ):
                raise DataError(
                    f"configuration {name}: its classes {member.class_names} (regions {member.task.paint_labels}) "
                    f"differ from {names[0]}'s {first.class_names} (regions {first.task.paint_labels}): only "
                    "configurations of the same classes can be averaged"
                )
            if len(member.modalities) != len(first.modalities):
                raise DataError(
                    f"configuration {name}: its channels {member.modalities} differ from {names[0]}'s "
                    f"{first.modalities}"
                )
        self.members, self.names = members, names
        self.task, self.class_names, self.modalities = first.task, first.class_names, first.modalities
        self.score_columns, self.index = first.score_columns, first.index
        self.postprocessing = first.postprocessing
        self.events: list = []

    def predict_image(self, holder: list, affine: np.ndarray, case_id: str = "", probabilities: bool = True):
        """(uint8 label map, mean probabilities (X, Y, Z, K) float32 or None, devices) of the image in `holder`
        ([image], emptied once the last configuration has it)."""
        image = holder.pop()
        total, devices, regions = None, [], []
        for number, member in enumerate(self.members):
            given = [image]
            if number == len(self.members) - 1:
                del image  # the last configuration lets the scan go once it is preprocessed
            logged = len(member.events)
            _, member_probabilities, device = member.predict_image(given, affine, case_id, probabilities=True)
            self.events.extend(member.events[logged:])
            devices.append(device)
            regions.append(member.last_region)
            if total is None:
                total = member_probabilities
            else:
                total += member_probabilities
            del member_probabilities
        total /= len(self.members)
        self.last_region = "; ".join(f"{n}: {r}" for n, r in zip(self.names, regions) if r)
        labels = labels_of_probabilities(total, self.task.paint_labels)
        return labels, (total if probabilities else None), " / ".join(dict.fromkeys(devices))
