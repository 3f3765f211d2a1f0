#!/usr/bin/env python3
"""The planner zoo: a benchmark a planner change must pass. Every dataset kind of `benchmarks/zoo` (brains at 1 and
2 mm, thin and thick CT and MR, BraTS-like regions, a full-size CT, a tiny structure, real brain anatomy), three
arms at the same wall-clock budget, scored on held-out test cases.

For each kind and seed:

1. **data**: the kind's MSD dataset for the seed (`benchmarks.zoo.make_dataset`: dataset.json, imagesTr/labelsTr,
   and the held-out test cases in imagesTs with their labels in labelsTs), generated once into
   `--data-dir/<kind>_seed<S>` and reused (cached) after that;
2. **arms**, each in its own process, one after the other, each with `--minutes` of training:
   - `noconfig`: `python -m tfmis.train --source-dir DATA --set training.max_minutes=T --set output.dir=RUN` (tfmis
     plans the config itself; its conversion goes to DATA/tfrecords_plan). Its budget is the whole command's wall
     time, so T is the hand arm's training command's wall time (start, M minutes of training loop, end), measured
     first: both commands get the same wall time (M when the hand arm is not run);
   - `hand`: the fixed hand recipe `benchmarks/recipes/zoo_hand.yaml` (configs/demo.yaml, class_ratios null) with the
     kind's `hand_patch` (configs/demo.yaml's 48^3, each axis shrunk to the data's extent: `benchmarks.zoo.hand_patch`)
     and `training.max_minutes=M` (conversion to DATA/tfrecords_hand);
   - `monai`: `benchmarks/monai_demo.py` (MONAI's UNet recipe) in its own virtual environment (`--monai-python`) with
     `--max-minutes M`, on the hand arm's preprocessed voxels and split (`benchmarks/export_demo_npy.py`), with the
     hand recipe's patch, crops and validation protocol (as `benchmarks/time_to_dice.py`). An arm whose environment is
     missing is reported as `missing`, not dropped (and not cached: it runs once the environment exists);
   - `nnunet_layout` (the alternative to the planner's CPU network): the plan the no-config arm gets, made by
     `tfmis-plan --max-minutes M`, with its network turned back into the layout the planner used before the CPU
     recipe's (`nnunet_layout_plan`: nnU-Net's full-resolution first level, no deep supervision, one residual unit,
     lr 3e-3), trained with `--config`;
   every tfmis arm and MONAI also get `training.seed` / `--seed` S;
3. **scoring** (one scorer for all arms): the run's FINAL weights predict the held-out test images; tfmis's arms with
   `tfmis-predict --weights final` (written in each scan's own geometry), MONAI with its own sliding window on the test
   volumes preprocessed exactly as tfmis preprocesses them (the hand arm's `index.json`), its softmax mapped back to
   each scan's grid by tfmis's `restore_labels`; then `tfmis.metrics.dice_per_class` (and `region_dice` for kinds with
   regions) of each label map against labelsTs. Per class: the mean over the test cases (a class absent from a case's
   label is left out, MONAI's `ignore_empty`); mean Dice: the mean over the classes;
4. **time**: from each run's `history.jsonl` (`elapsed_seconds`: from the first training step, validation included;
   a plan of several stages adds them up in the order they ran): wall time used against the budget, and the time at
   which the validation mean Dice first reached 0.8 and 0.9 of the arm's own best validation Dice.

Outputs in `--output` (default runs/zoo): `<kind>/seed<S>/<arm>/` (the run folder, its `.log`, `test_predictions/`)
and `<kind>/seed<S>/<arm>.json` (the arm's result: an arm finished with the same budget is not run again; delete the
file to rerun it);
`zoo.json`, `zoo.md` (a table kind x arm x seed and a verdict per kind, "no config >= hand and >= MONAI?", on the test
Dice averaged over the seeds) and `zoo.png`. The processor (`lscpu`'s model name) is printed first and recorded.

Examples:
    python benchmarks/planner_zoo.py --kinds brain_2mm --seeds 0 --minutes 0.3 --output runs/zoo_smoke
    nice -n 5 python benchmarks/planner_zoo.py --seeds 0 1 --minutes 4 --output runs/zoo     # every kind
    python benchmarks/planner_zoo.py --generate-only --seeds 0 1                            # the data only
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from benchmarks.zoo import KINDS, Kind, make_dataset  # noqa: E402
from tfmis.utils.io import atomic_write_json, atomic_writer  # noqa: E402

ARMS = ("noconfig", "hand", "monai", "nnunet_layout")
# the planner's CPU network before the CPU recipe's layout (its alternative, measured in this zoo): nnU-Net's layout
# (a full-resolution first level, no deep supervision, one residual unit, Keras's initialisation) and lr 3e-3
NNUNET_LAYOUT_DROPPED = ("output_upsampling", "deep_supervision", "kernel_initializer")
HAND_RECIPE = REPO / "benchmarks" / "recipes" / "zoo_hand.yaml"
# `--hand-set KEY=VALUE`: overrides of every hand arm (e.g. training.epochs=1000: its schedule fitted to the budget
# instead of the recipe's 80-epoch cap)
HAND_SET: list[str] = []
MONAI_SCRIPT = REPO / "benchmarks" / "monai_demo.py"
MONAI_PYTHONS = (REPO / ".venv-monai" / "bin" / "python", Path("/work/venv-monai/bin/python"))
MONAI_VENV_COMMAND = (
    "python -m venv /work/venv-monai && /work/venv-monai/bin/pip install torch==2.13.0 && "
    "/work/venv-monai/bin/pip install monai nibabel"
)
FRACTIONS = (0.8, 0.9)  # time to these fractions of the arm's best validation Dice
DEFAULT_OUTPUT = "runs/zoo"
DEFAULT_DATA = "data/zoo"


# ------------------------------------------------------------------------------------------ machine


def cpu_model() -> str:
    """`lscpu`'s model name (the processor), or the platform's description where lscpu is missing."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    import platform

    return platform.processor() or platform.machine()


def default_monai_python() -> Path:
    return next((p for p in MONAI_PYTHONS if p.is_file()), MONAI_PYTHONS[0])


# ------------------------------------------------------------------------------------------ scoring


def score_case(prediction: np.ndarray, target: np.ndarray, kind: Kind) -> dict:
    """Dice of each foreground class (and region) of one test case: tfmis's `dice_per_class` (`region_dice`), NaN
    for a class absent from `target`."""
    from tfmis.metrics import dice_per_class, region_dice

    if prediction.shape != target.shape:
        raise ValueError(f"prediction shape {prediction.shape} differs from the label's {target.shape}")
    n = len(kind.labels)
    scores = dict(zip(kind.labels[1:], (float(d) for d in dice_per_class(prediction, target, n))))
    if kind.regions:
        scores.update(zip(kind.regions, (float(d) for d in region_dice(prediction, target, n, kind.regions))))
    return scores


def _nanmean(values) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.mean(values)) if values else None


def aggregate(per_case: dict[str, dict], kind: Kind) -> dict:
    """Per class: the mean over the cases (NaN left out); `mean_dice`: the mean over the classes (and over the regions
    separately, `mean_region_dice`)."""
    classes = list(kind.labels[1:])
    per_class = {c: _nanmean(s.get(c) for s in per_case.values()) for c in classes}
    result = {"per_class": per_class, "mean_dice": _nanmean(per_class.values()), "cases": len(per_case)}
    if kind.regions:
        per_region = {r: _nanmean(s.get(r) for s in per_case.values()) for r in kind.regions}
        result.update(per_region=per_region, mean_region_dice=_nanmean(per_region.values()))
    return result


def load_label(path) -> np.ndarray:
    import nibabel as nib

    return np.asarray(np.rint(np.asanyarray(nib.load(str(path)).dataobj)), dtype=np.uint8)


def test_cases(root: Path) -> list[tuple[str, Path, Path]]:
    """(case id, image, label) of the held-out test cases of a zoo dataset."""
    meta = json.loads((root / "dataset.json").read_text())
    cases = []
    for image in meta["test"]:
        name = Path(image).name
        cases.append((name.removesuffix(".nii.gz"), root / image, root / "labelsTs" / name))
    return cases


def score_folder(predictions: Path, root: Path, kind: Kind) -> dict:
    """Scores `<case>.nii.gz` label maps (in each scan's geometry) against the dataset's labelsTs."""
    per_case = {}
    for case_id, _, label in test_cases(root):
        path = predictions / f"{case_id}.nii.gz"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no prediction for test case {case_id}")
        per_case[case_id] = score_case(load_label(path), load_label(label), kind)
    return {**aggregate(per_case, kind), "per_case": per_case}


# ------------------------------------------------------------------------------------------ histories


def read_histories(run_dir: Path) -> list[list[dict]]:
    """The epoch records of a run folder: its own history.jsonl, else its stages' (`<run>/<stage>/history.jsonl`) in
    the order they were written."""
    own = run_dir / "history.jsonl"
    paths = [own] if own.is_file() else sorted(run_dir.glob("*/history.jsonl"), key=lambda p: p.stat().st_mtime)
    return [[json.loads(line) for line in p.read_text().splitlines() if line.strip()] for p in paths]


def history_stats(run_dir: Path, fractions=FRACTIONS) -> dict:
    """Wall time used (the stages' last `elapsed_seconds`, added up), epochs, best validation mean Dice and the time to
    each fraction of it (the first validated epoch at or above, stage offsets included)."""
    offset, curve, epochs, stages = 0.0, [], 0, []
    for records in read_histories(run_dir):
        if not records:
            continue
        for r in records:
            dice = r.get("val_mean_dice")
            if isinstance(dice, (int, float)) and math.isfinite(dice):
                curve.append((offset + r["elapsed_seconds"], float(dice)))
        epochs += len(records)
        stages.append(records[-1]["elapsed_seconds"])
        offset += records[-1]["elapsed_seconds"]
    best = max((d for _, d in curve), default=None)
    times = {}
    for f in fractions:
        hit = None if best is None else next((t for t, d in curve if d >= f * best), None)
        times[f"{f:.1f}"] = hit
    return {
        "wall_seconds": offset if stages else None,
        "stage_seconds": stages,
        "epochs": epochs,
        "best_val_dice": best,
        "time_to_fraction_of_best": times,
        "curve": curve,
    }


# ------------------------------------------------------------------------------------------ arms


def _run(cmd: list[str], log: Path, quiet: bool, env=None) -> tuple[int, float]:
    """Runs `cmd` from the repository, its output teed into `log`; returns (exit status, seconds)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "ab") as f:
        f.write(("$ " + " ".join(map(str, cmd)) + "\n").encode())
        f.flush()
        proc = subprocess.Popen(
            list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO, env=env
        )
        while chunk := proc.stdout.read1(1 << 14):
            f.write(chunk)
            f.flush()
            if not quiet:
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()
        code = proc.wait()
    return code, time.perf_counter() - start


def hand_overrides(kind: Kind, root: Path, seed: int) -> list[str]:
    """The hand recipe's per-dataset settings: where the data is, and the kind's patch."""
    return [
        "data.demo=false",
        f"data.source_dir={root}",
        f"data.dataset_dir={root / 'tfrecords_hand'}",
        "pipeline.patch_size=[{}]".format(",".join(map(str, kind.hand_patch))),
        f"training.seed={seed}",
        *HAND_SET,
    ]


def hand_config(kind: Kind, root: Path, seed: int):
    """The hand arm's config (recipe + per-dataset settings) and its overrides."""
    from benchmarks.time_to_dice import load_recipe
    from tfmis.config import load_config

    recipe = load_recipe(HAND_RECIPE, "configs/demo.yaml")
    overrides = recipe["overrides"] + hand_overrides(kind, root, seed)
    return load_config(recipe["config"], overrides), recipe["config"], overrides


def variant_arms(specs) -> dict[str, list[str]]:
    """`--variant NAME=ARGS` -> {"noconfig_NAME": the extra `tfmis.train` arguments}: the no-config arm with one
    planner rule forced the other way (`--configuration fullres`, `--set pipeline.patch_size=[64,64,64]`), to
    measure the rule against its alternative at the same budget."""
    import shlex

    out = {}
    for spec in specs or ():
        name, sep, extra = spec.partition("=")
        if not sep or not name.isidentifier():
            raise SystemExit(f"--variant {spec!r}: expected NAME=ARGS, e.g. fullres='--configuration fullres'")
        out[f"noconfig_{name}"] = shlex.split(extra)
    return out


VARIANTS: dict[str, list[str]] = {}  # filled by main from --variant


def tfmis_train_command(arm: str, kind: Kind, root: Path, seed: int, run_dir: Path, minutes: float) -> list[str]:
    common = [f"training.max_minutes={minutes}", f"output.dir={run_dir}", "output.progress=false"]
    if arm == "noconfig" or arm in VARIANTS:
        cmd = [sys.executable, "-m", "tfmis.train", "--source-dir", str(root), *VARIANTS.get(arm, [])]
        overrides = [*common, f"data.dataset_dir={plan_target(root, arm)}", f"training.seed={seed}"]
    elif arm == "nnunet_layout":  # the plan preconvert_plan made, its network turned back into nnU-Net's layout
        plan = nnunet_layout_plan(run_dir.with_name(run_dir.name + "_plan"))
        cmd = [sys.executable, "-m", "tfmis.train", "--config", str(plan)]
        overrides = [*common, f"training.seed={seed}"]
    else:
        _, config, recipe = hand_config(kind, root, seed)
        cmd = [sys.executable, "-m", "tfmis.train", "--config", config]
        overrides = [*recipe, *common]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


# converts the data of every stage of a plan (argv[1]), outside any clock
CONVERT_PLAN = (
    "import sys\n"
    "from tfmis.data.prepare import prepare_dataset\n"
    "from tfmis.run_plans import load_stages\n"
    "for stage in load_stages(sys.argv[1]):\n"
    "    prepare_dataset(stage.config.data, progress=False)\n"
)


# converts the hand arm's data (argv[1]: the recipe's config, argv[2:] its overrides), outside any clock
CONVERT_HAND = (
    "import sys\n"
    "from tfmis.config import load_config\n"
    "from tfmis.data.prepare import prepare_dataset\n"
    "prepare_dataset(load_config(sys.argv[1], sys.argv[2:]).data, progress=False)\n"
)


def plan_target(root: Path, arm: str) -> Path:
    """The conversion folder of a planned arm: DATA/tfrecords_plan, a variant's own (its rule may plan another
    spacing or stage, which a shared folder would refuse)."""
    return root / (f"tfrecords_{arm}" if arm in VARIANTS else "tfrecords_plan")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def plan_arguments(arm: str) -> list[str]:
    """A variant's extra arguments that `tfmis-plan` takes too: its `--set` pairs are for training only, and so is
    `--pilot [SHARE]` (the pilot's other candidates convert inside the arm's clock: the pilot's cost)."""
    extra, out = VARIANTS.get(arm, []), []
    skip = False
    for number, item in enumerate(extra):
        if skip:
            skip = False
        elif item == "--set":
            skip = True
        elif item == "--pilot":
            skip = number + 1 < len(extra) and _is_number(extra[number + 1])
        else:
            out.append(item)
    return out


def preconvert_plan(root: Path, run_dir: Path, log: Path, quiet: bool, minutes: float, arm: str = "noconfig") -> int:
    """Plans the dataset (`tfmis-plan`, into `<run_dir>_plan`) and converts every stage's data into `plan_target`
    (a variant: with its planning arguments) before the arm's clock starts: its `training.max_minutes` is the whole
    command's wall time, and the other arms convert outside their budgets too. The arm's own planning then takes the
    finished conversion's fingerprint and converts nothing. Returns the exit status."""
    plan_dir = run_dir.with_name(run_dir.name + "_plan")
    shutil.rmtree(plan_dir, ignore_errors=True)
    plan = [sys.executable, "-m", "tfmis.plan", "--source-dir", str(root), "--target-dir", str(plan_target(root, arm))]
    plan += plan_arguments(arm)
    code, _ = _run([*plan, "--output-dir", str(plan_dir), "--max-minutes", str(minutes), "--quiet"], log, quiet)
    if code == 0:
        code, _ = _run([sys.executable, "-c", CONVERT_PLAN, str(plan_dir / "plan.yaml")], log, quiet)
    return code


def nnunet_layout_plan(plan_dir: Path) -> Path:
    """Rewrites every stage config of the plan in `plan_dir` (as `tfmis-plan` wrote it) with the CPU network the
    planner made before the CPU recipe's layout: nnU-Net's strides (a full-resolution first level: the recipe's
    strides shifted back), no deep supervision, the default output path and initialisation, one residual unit, lr
    3e-3. Returns the plan file to train. Comments are lost; every other planned value stays."""
    import yaml

    from tfmis.config import load_stages as read_stage_list

    plan = plan_dir / "plan.yaml"
    listed = read_stage_list(plan)
    for path in [Path(p) for _, p in listed] if listed else [plan]:
        config = yaml.safe_load(path.read_text())
        model = config["model"]
        strides = model["strides"]
        if strides[0] != 1:  # the CPU recipe's layout: its first convolution took nnU-Net's first pooling
            model["strides"] = [1, *strides[:-1]]
        for key in NNUNET_LAYOUT_DROPPED:
            model.pop(key, None)
        model["num_res_units"] = 1
        config["optimizer"]["learning_rate"] = 0.003
        with atomic_writer(path) as f:
            f.write(yaml.safe_dump(config, sort_keys=False))
    return plan


def predict_command(run_dir: Path, root: Path, output: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tfmis.predict",
        "--checkpoint",
        str(run_dir),
        "--weights",
        "final",
        "--input",
        str(root / "dataset.json"),
        "--subset",
        "test",
        "--output",
        str(output),
        "--device",
        "cpu",
        "--quiet",
    ]


def export_for_monai(kind: Kind, root: Path, seed: int, quiet: bool) -> tuple[Path, list[str]]:
    """The hand arm's converted data (converted now if that arm has not run) exported for MONAI: train and val as
    `export_demo_npy.py` writes them, plus the held-out test images preprocessed as tfmis preprocesses them
    (`split` "test_heldout" of the manifest, each entry with its `Geometry`); returns (npy folder, MONAI's protocol
    flags)."""
    from benchmarks.export_demo_npy import export_npy
    from benchmarks.time_to_dice import monai_protocol_args
    from tfmis.data.prepare import prepare_dataset
    from tfmis.data.preprocess import PreprocessConfig, preprocess
    from tfmis.data.records import load_index
    from tfmis.data.sources.image_io import load_image

    config, _, _ = hand_config(kind, root, seed)
    prepare_dataset(config.data, progress=not quiet)
    npy = root / "npy_hand"
    manifest = export_npy(config.data.dataset_dir, npy)
    index = load_index(config.data.dataset_dir)
    preprocessing = PreprocessConfig.from_dict(index["preprocessing"])
    entries = []
    for case_id, image_path, _ in test_cases(root):
        entry = {"case_id": case_id, "image": f"test_heldout/{case_id}_image.npy"}
        geometry_path = npy / "test_heldout" / f"{case_id}_geometry.json"
        if not (npy / entry["image"]).is_file() or not geometry_path.is_file():
            image, affine, _ = load_image(image_path, len(kind.modalities), case_id, integers=True)
            volume, _, geometry = preprocess(image, None, affine, preprocessing)
            with atomic_writer(npy / entry["image"], "wb") as f:
                np.save(f, np.moveaxis(np.asarray(volume, dtype=np.float32), -1, 0))
            atomic_write_json(geometry_path, geometry.to_dict())
        entry["geometry"] = str(geometry_path.relative_to(npy))
        entries.append(entry)
    manifest["splits"]["test_heldout"] = entries
    atomic_write_json(npy / "manifest.json", manifest)
    return npy, monai_protocol_args(config)


def score_monai(probabilities: Path, npy: Path, root: Path, kind: Kind) -> dict:
    """MONAI's softmax on the preprocessed test volumes mapped back to each scan's grid (`restore_labels`), written
    as `<case>.nii.gz` next to them, and scored as the tfmis arms are."""
    import nibabel as nib

    from tfmis.data.preprocess import Geometry
    from tfmis.inference.restore import restore_labels

    out = probabilities.parent / "test_predictions"
    out.mkdir(parents=True, exist_ok=True)
    for case_id, image_path, _ in test_cases(root):
        probs = np.load(probabilities / f"{case_id}_probabilities.npy")
        geometry = Geometry.from_dict(json.loads((npy / "test_heldout" / f"{case_id}_geometry.json").read_text()))
        labels, _ = restore_labels(np.ascontiguousarray(np.moveaxis(probs, 0, -1)), geometry)
        image = nib.load(str(image_path))
        nib.save(nib.Nifti1Image(labels.astype(np.uint8), image.affine), str(out / f"{case_id}.nii.gz"))
    return score_folder(out, root, kind)


SAME_WALL_TIME = "the hand arm's training command's wall time"


def planned_arm(arm: str) -> bool:
    """An arm that trains a plan (`--source-dir`, or a plan's stages file): its budget is the whole command's wall
    time."""
    return arm in ("noconfig", "nnunet_layout") or arm in VARIANTS


def run_arm(arm: str, kind: Kind, root: Path, seed: int, args, command_seconds: float | None = None) -> dict:
    """Trains, predicts and scores one arm; returns its result (status ok, failed or missing). A planned arm's budget
    (the whole command's wall time) is `command_seconds` when given: the hand arm's training command's wall time
    (its start, training loop and end), so both commands get the same wall time."""
    run_dir = Path(args.output) / kind.name / f"seed{seed}" / arm
    if run_dir.exists():  # an unfinished earlier attempt (a finished one has its result file): start afresh
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    log = run_dir.with_suffix(".log")
    log.unlink(missing_ok=True)
    result = {"kind": kind.name, "seed": seed, "arm": arm, "budget_seconds": 60 * args.minutes, "run_dir": str(run_dir)}
    minutes = args.minutes
    if planned_arm(arm) and command_seconds:
        minutes = round(command_seconds / 60, 3)
        result.update(command_budget_seconds=60 * minutes, budget_rule=SAME_WALL_TIME)
    if arm == "monai":
        python = Path(args.monai_python)
        if not python.is_file():
            return {**result, "status": "missing", "reason": f"{python}: no MONAI environment ({MONAI_VENV_COMMAND})"}
        npy, protocol = export_for_monai(kind, root, seed, args.quiet)
        probabilities = run_dir / "test_probabilities"
        cmd = [
            str(python),
            str(MONAI_SCRIPT),
            "--data",
            str(npy),
            "--output",
            str(run_dir),
            "--max-minutes",
            str(args.minutes),
            "--threads",
            str(args.threads),
            "--seed",
            str(seed),
            *protocol,
            "--predict-split",
            "test_heldout",
            "--predict-output",
            str(probabilities),
            *args.monai_arg,
        ]
        env = {**os.environ, **dict(item.split("=", 1) for item in args.monai_env)}
        code, seconds = _run(cmd, log, args.quiet, env)
        result.update(command=cmd, process_seconds=seconds)
        if code != 0:
            return {**result, "status": "failed", "reason": f"exit status {code}; see {log}"}
        scoring = lambda: score_monai(probabilities, npy, root, kind)  # noqa: E731
    else:
        start = time.perf_counter()
        if arm in ("noconfig", "nnunet_layout") or arm in VARIANTS:
            code = preconvert_plan(root, run_dir, log, args.quiet, args.minutes, arm)
        else:
            _, config, overrides = hand_config(kind, root, seed)
            code, _ = _run([sys.executable, "-c", CONVERT_HAND, config, *overrides], log, args.quiet)
        result["prepare_seconds"] = time.perf_counter() - start
        if code != 0:
            return {**result, "status": "failed", "reason": f"planning/converting exit status {code}; see {log}"}
        cmd = tfmis_train_command(arm, kind, root, seed, run_dir, minutes)
        code, seconds = _run(cmd, log, args.quiet)
        result.update(command=cmd, process_seconds=seconds)
        if code != 0:
            return {**result, "status": "failed", "reason": f"training exit status {code}; see {log}"}
        predictions = run_dir / "test_predictions"
        code, predict_seconds = _run(predict_command(run_dir, root, predictions), log, args.quiet)
        result["predict_seconds"] = predict_seconds
        if code not in (0, 3):
            return {**result, "status": "failed", "reason": f"tfmis-predict exit status {code}; see {log}"}
        scoring = lambda: score_folder(predictions, root, kind)  # noqa: E731
    result.update(history_stats(run_dir))
    try:
        result["test"] = scoring()
    except (FileNotFoundError, ValueError) as e:
        return {**result, "status": "failed", "reason": f"scoring: {e}"}
    return {**result, "status": "ok"}


# ------------------------------------------------------------------------------------------ report


def _fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


GOAL = ("noconfig", ("hand", "monai"))  # no config must reach each of these (the planner's goal)


def verdicts(results: list[dict], kinds, arms) -> dict:
    """Per kind: the test mean Dice of each arm averaged over the seeds, and whether no config >= the hand recipe
    and >= MONAI's recipe (the other arms are reported, not judged)."""
    out = {}
    goal, rivals = GOAL
    for kind in kinds:
        means = {}
        for arm in arms:
            rows = [r for r in results if r["kind"] == kind and r["arm"] == arm]
            values = [r["test"]["mean_dice"] for r in rows if r.get("status") == "ok"]
            means[arm] = float(np.mean(values)) if values and len(values) == len(rows) else None
        judged = [a for a in (goal, *rivals) if a in arms]
        if goal not in arms or len(judged) < 2:  # e.g. `--arms hand`: nothing to judge
            verdict = "not judged (" + ", ".join(a for a in (goal, *rivals) if a not in arms) + " not run)"
        elif any(means[a] is None for a in judged):
            verdict = "incomplete (" + ", ".join(a for a in judged if means[a] is None) + " missing or failed)"
        else:
            holds = all(means[goal] >= means[a] for a in judged if a != goal)
            verdict = "yes" if holds else "no"
        out[kind] = {"means": means, "verdict": verdict}
    return out


def render_markdown(report: dict) -> str:
    lines = [
        "# Planner zoo",
        "",
        f"Processor: **{report['cpu']}** ({report['cores']} cores); budget {report['minutes']:g} min per arm; "
        f"seeds {', '.join(map(str, report['seeds']))}; {report['created']}.",
        "",
        "Test Dice on the held-out cases (final weights; per class the mean over the cases, mean Dice the mean over "
        "the classes). Wall time: training `elapsed_seconds` used / budget. t0.8 / t0.9: seconds until the validation "
        "mean Dice first reached 0.8 / 0.9 of the arm's best validation Dice.",
        "",
        "| kind | arm | seed | status | test mean Dice | per-class Dice | wall s / budget s | t0.8, s | t0.9, s | "
        "best val Dice | epochs |",
        "| --- | --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["results"]:
        status = r.get("status", "?")
        test = r.get("test") or {}
        per_class = ", ".join(f"{k} {_fmt(v, 2)}" for k, v in (test.get("per_class") or {}).items())
        if test.get("per_region"):
            per_class += "; regions: " + ", ".join(f"{k} {_fmt(v, 2)}" for k, v in test["per_region"].items())
        times = r.get("time_to_fraction_of_best") or {}
        reason = f" ({r['reason']})" if status != "ok" and r.get("reason") else ""
        budget = r.get("command_budget_seconds", r["budget_seconds"])  # a planned arm: the whole command's
        lines.append(
            f"| {r['kind']} | {r['arm']} | {r['seed']} | {status}{reason} | {_fmt(test.get('mean_dice'))} | "
            f"{per_class or '-'} | {_fmt(r.get('wall_seconds'), 0)} / {budget:.0f} | "
            f"{_fmt(times.get('0.8'), 0)} | {_fmt(times.get('0.9'), 0)} | {_fmt(r.get('best_val_dice'))} | "
            f"{r.get('epochs', '-')} |"
        )
    lines += [
        "",
        "Verdict per kind (test mean Dice averaged over the seeds): no config >= hand and >= MONAI?",
        "",
        "| kind | " + " | ".join(report["arms"]) + " | no config >= hand and >= MONAI? |",
        "| --- | " + " | ".join("---:" for _ in report["arms"]) + " | --- |",
    ]
    for kind, v in report["verdicts"].items():
        m = v["means"]
        lines.append(f"| {kind} | " + " | ".join(_fmt(m.get(a)) for a in report["arms"]) + f" | {v['verdict']} |")
    lines += ["", "Data generation (seconds, cached after the first run):", ""]
    for key, seconds in report["generation_seconds"].items():
        lines.append(f"- {key}: {seconds:.1f} s")
    lines += ["", "Plot: `zoo.png`.", ""]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds, arms = report["kinds"], report["arms"]
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(kinds) + 2), 4.5))
    width = 0.8 / len(arms)
    for j, arm in enumerate(arms):
        xs = np.arange(len(kinds)) + (j - (len(arms) - 1) / 2) * width
        means = [report["verdicts"][k]["means"].get(arm) for k in kinds]
        ax.bar(xs, [0 if m is None else m for m in means], width, label=arm)
        for x, kind in zip(xs, kinds):
            seeds = [
                r["test"]["mean_dice"]
                for r in report["results"]
                if r["kind"] == kind
                and r["arm"] == arm
                and r.get("status") == "ok"
                and r["test"]["mean_dice"] is not None
            ]
            ax.plot([x] * len(seeds), seeds, "k.", ms=4)
    ax.set_xticks(np.arange(len(kinds)), kinds, rotation=30, ha="right")
    ax.set(ylabel="test mean Dice (final weights)", ylim=(0, 1), title=f"Planner zoo, {report['minutes']:g} min/arm")
    ax.set_title(f"Planner zoo, {report['minutes']:g} min per arm ({report['cpu']})", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    with atomic_writer(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ main


def _say(args, message: str) -> None:
    if not args.quiet:
        print(message, file=sys.stderr, flush=True)


def collected_results(output: Path, kinds, seeds) -> tuple[list[dict], list[str]]:
    """(every arm's result file under `output` for `kinds` and `seeds`, in kind, seed and arm order; the arms
    found): the report of runs made by several invocations (`--report-only`)."""
    results = []
    for kind in kinds:
        for seed in seeds:
            folder = output / kind / f"seed{seed}"
            found = {p.stem: p for p in folder.glob("*.json")} if folder.is_dir() else {}
            for arm in sorted(found, key=lambda a: (a not in ARMS, ARMS.index(a) if a in ARMS else 0, a)):
                result = json.loads(found[arm].read_text())
                if result.get("arm") == arm:
                    results.append(result)
    arms = list(dict.fromkeys(r["arm"] for r in results))
    return results, arms


def report_only(args) -> dict:
    """zoo.json, zoo.md and zoo.png of every result already in `--output` (the kinds and seeds asked), training
    nothing: a zoo run in pieces, or resumed, reported as one."""
    output = Path(args.output)
    results, arms = collected_results(output, args.kinds, args.seeds)
    minutes = sorted({r["budget_seconds"] / 60 for r in results})
    report = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "minutes": minutes[0] if len(minutes) == 1 else args.minutes,
        "seeds": list(args.seeds),
        "kinds": [k for k in args.kinds if any(r["kind"] == k for r in results)],
        "arms": arms,
        "generation_seconds": {},
        "results": results,
    }
    report["verdicts"] = verdicts(results, report["kinds"], arms)
    atomic_write_json(output / "zoo.json", report)
    with atomic_writer(output / "zoo.md") as f:
        f.write(render_markdown(report))
    plot(report, output / "zoo.png")
    print(f"{len(results)} results of {len(report['kinds'])} kinds reported in {output / 'zoo.md'}")
    return report


def run_zoo(args) -> dict:
    if args.report_only:
        return report_only(args)
    output, data_dir = Path(args.output), Path(args.data_dir)
    cpu = cpu_model()
    print(f"Processor: {cpu} ({os.cpu_count()} cores)", flush=True)
    output.mkdir(parents=True, exist_ok=True)
    generation, results = {}, []
    for kind_name in args.kinds:
        kind = KINDS[kind_name]
        for seed in args.seeds:
            root = (data_dir / f"{kind.name}_seed{seed}").resolve()
            start = time.perf_counter()
            info = make_dataset(root, kind, seed)
            generation[f"{kind.name} seed {seed}"] = info["seconds"]
            _say(
                args,
                f"{kind.name} seed {seed}: {root} ({info['seconds']:.1f} s to generate, "
                f"{time.perf_counter() - start:.1f} s now)",
            )
            if args.generate_only:
                continue
            hand_seconds = None  # the hand arm runs first: the planned arms get its command's wall time
            for arm in sorted(args.arms, key=lambda a: a != "hand"):
                result_path = output / kind.name / f"seed{seed}" / f"{arm}.json"
                if result_path.is_file():
                    result = json.loads(result_path.read_text())
                    fair = not planned_arm(arm) or result.get("budget_rule") == SAME_WALL_TIME or not hand_seconds
                    if result.get("status") == "ok" and result.get("budget_seconds") == 60 * args.minutes and fair:
                        if arm == "hand":
                            hand_seconds = result.get("process_seconds")
                        _say(args, f"  {arm}: done before ({result_path})")
                        results.append(result)
                        continue
                _say(args, f"  {arm}: training {args.minutes:g} min (log {result_path.with_suffix('.log')})")
                result = run_arm(arm, kind, root, seed, args, hand_seconds)
                if arm == "hand" and result["status"] == "ok":
                    hand_seconds = result.get("process_seconds")
                if result["status"] != "missing":
                    atomic_write_json(result_path, result)
                test = result.get("test") or {}
                _say(
                    args,
                    f"  {arm}: {result['status']}, test mean Dice {_fmt(test.get('mean_dice'))} "
                    f"{result.get('reason', '')}",
                )
                results.append(result)
    report = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "minutes": args.minutes,
        "seeds": list(args.seeds),
        "kinds": list(args.kinds),
        "arms": list(args.arms),
        "generation_seconds": generation,
        "results": results,
        "verdicts": verdicts(results, args.kinds, args.arms),
    }
    if args.generate_only:
        return report
    atomic_write_json(output / "zoo.json", report)
    with atomic_writer(output / "zoo.md") as f:
        f.write(render_markdown(report))
    plot(report, output / "zoo.png")
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmarks/planner_zoo.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS), help="dataset kinds (default all)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds (data and training), default 0")
    p.add_argument("--minutes", type=float, default=4.0, help="wall-clock training budget of every arm (default 4)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS, help="arms (default all)")
    p.add_argument(
        "--hand-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override of the hand recipe, every hand arm (repeatable): e.g. training.epochs=1000 fits its "
        "schedule to the budget instead of stopping at the recipe's 80 epochs",
    )
    p.add_argument(
        "--variant",
        action="append",
        metavar="NAME=ARGS",
        help="one more arm, noconfig_NAME: the no-config command with these extra tfmis.train arguments (a rule "
        "forced the other way, e.g. fullres='--configuration fullres'); repeatable",
    )
    p.add_argument("--output", default=DEFAULT_OUTPUT, help=f"results (default {DEFAULT_OUTPUT})")
    p.add_argument("--data-dir", default=DEFAULT_DATA, help=f"generated datasets (default {DEFAULT_DATA})")
    p.add_argument(
        "--monai-python",
        default=str(default_monai_python()),
        help=f"python of the MONAI environment (default .venv-monai or /work/venv-monai; {MONAI_VENV_COMMAND})",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads of the MONAI arm (default 2)")
    p.add_argument(
        "--monai-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument of benchmarks/monai_demo.py appended to the MONAI arm's command (repeatable; give it with "
        "=): --monai-arg=--fit-budget --monai-arg=--epochs=1000 fits MONAI's cosine schedule to the budget as "
        "--hand-set training.epochs=1000 does the hand recipe's, instead of its 60 epochs",
    )
    p.add_argument(
        "--monai-env",
        action="append",
        default=["OMP_WAIT_POLICY=PASSIVE"],
        metavar="KEY=VALUE",
        help="environment of the MONAI arm (default OMP_WAIT_POLICY=PASSIVE: PyTorch's spinning OpenMP threads "
        "collapse on a machine shared with other work)",
    )
    p.add_argument("--generate-only", action="store_true", help="generate (or find) the datasets, train nothing")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: zoo.md, zoo.json and zoo.png from every result already in --output for --kinds and "
        "--seeds (a zoo run in pieces reported as one)",
    )
    p.add_argument("--quiet", action="store_true", help="arm output only into the logs")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.minutes <= 0:
        print("error: --minutes must be > 0", file=sys.stderr)
        return 2
    if any("=" not in item for item in args.monai_env):
        print(f"error: --monai-env takes KEY=VALUE, got {args.monai_env}", file=sys.stderr)
        return 2
    if any("=" not in item for item in args.hand_set):
        print(f"error: --hand-set takes KEY=VALUE, got {args.hand_set}", file=sys.stderr)
        return 2
    HAND_SET.extend(args.hand_set)
    VARIANTS.update(variant_arms(args.variant))
    args.arms = [*args.arms, *VARIANTS]
    try:
        report = run_zoo(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.generate_only:
        for key, seconds in report["generation_seconds"].items():
            print(f"{key}: {seconds:.1f} s")
        return 0
    print(render_markdown(report))
    failed = [r for r in report["results"] if r.get("status") == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
