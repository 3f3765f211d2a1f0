"""tfmis-export and tfmis-predict --engine: a real (tiny) trained run exported as SavedModel, ONNX and OpenVINO
predicts through every engine what the run folder predicts; the manifest is checked when read; a missing engine or
file is one line with its exit code."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from conftest import tiny_config

from tfmis.inference.manifest import MANIFEST_FILE, MANIFEST_VERSION

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_run(converted_dataset, tmp_path_factory):
    """A real training run of a few steps (its config.yaml, best weights, summary.json)."""
    from tfmis.engine.trainer import Trainer

    out = tmp_path_factory.mktemp("export_run")
    Trainer(tiny_config(converted_dataset, out, "training.epochs=1", "training.steps_per_epoch=2")).fit()
    return {"dir": out, "source": converted_dataset.parent / "Task99_Test"}


@pytest.fixture(scope="module")
def exported(tiny_run, tmp_path_factory):
    """The tiny run exported in all three formats."""
    from tfmis.inference.exporting import export_model

    folder = tmp_path_factory.mktemp("exported") / "model"
    export_model(tiny_run["dir"], folder)
    return folder


def _labels(folder: Path) -> dict:
    return {p.name: np.asarray(nib.load(str(p)).dataobj) for p in sorted(folder.glob("case_*.nii.gz"))}


def _regions(folder: Path) -> dict:
    """Each case's `region` column of predictions.csv (what a cascade's fine stage saw)."""
    import csv

    with open(folder / "predictions.csv") as f:
        return {row["case"]: row["region"] for row in csv.DictReader(f)}


def _predict(*argv) -> int:
    from tfmis.predict import main

    return main([*argv, "--quiet"])


def test_export_writes_the_manifest_the_card_and_each_format_equal_to_keras(exported, tiny_run):
    """The folder holds manifest.json (this version, the preprocessing, window, labels, versions, sha256s),
    MODEL_CARD.md with the run's validation Dice, and three networks whose logits were checked against Keras'."""
    manifest = json.loads((exported / MANIFEST_FILE).read_text())
    assert manifest["version"] == MANIFEST_VERSION and manifest["formats"] == ["saved_model", "onnx", "openvino"]
    assert manifest["input"]["name"] == "windows" and manifest["output"]["name"] == "logits"
    assert manifest["input"]["shape"] == [None, 16, 16, 16, 2] and manifest["output"]["activation"] == "softmax"
    assert manifest["labels"] == ["background", "organ", "core"]
    assert manifest["preprocessing"]["normalization"] == ["zscore", "zscore"]
    assert manifest["sliding_window"]["overlap"] == 0.25 and manifest["versions"]["tensorflow"]
    (network,) = manifest["networks"]
    assert set(network["sha256"]) == {"saved_model", "onnx", "openvino"} and len(network["weights_sha256"]) == 64
    assert max(network["export_check"].values()) < 1e-4, network["export_check"]
    summary = json.loads((tiny_run["dir"] / "summary.json").read_text())
    card = (exported / "MODEL_CARD.md").read_text()
    assert f"{summary['best_mean_dice']:.4f}" in card and summary["machine"] in card


@pytest.mark.parametrize("engine", ["tensorflow", "onnxruntime", "openvino"])
def test_every_engine_predicts_the_run_folders_label_maps(exported, tiny_run, tmp_path, engine):
    """tfmis-predict on the exported folder (no run folder needed) with each engine writes the label maps
    tfmis-predict writes from the run folder, voxel for voxel."""
    images = tiny_run["source"] / "imagesTr"
    assert (
        _predict("--checkpoint", str(tiny_run["dir"]), "--input", str(images), "--output", str(tmp_path / "run")) == 0
    )
    moved = tmp_path / "moved"  # the exported folder alone, elsewhere
    shutil.copytree(exported, moved)
    code = _predict(
        "--checkpoint", str(moved), "--engine", engine, "--input", str(images), "--output", str(tmp_path / engine)
    )
    assert code == 0
    reference, predicted = _labels(tmp_path / "run"), _labels(tmp_path / engine)
    assert reference.keys() == predicted.keys() and len(reference) == 8
    for name in reference:
        assert np.array_equal(reference[name], predicted[name]), name


def test_probabilities_and_tta_of_an_engine_equal_the_tensorflow_predictor(exported, tiny_run):
    """With test-time augmentation, the onnxruntime engine's probabilities equal the run's Predictor's within 1e-4."""
    from tfmis.config import load_config
    from tfmis.data.sources.image_io import load_image
    from tfmis.inference.deployed import ExportedPredictor
    from tfmis.inference.predictor import Predictor

    image, affine, _ = load_image(str(tiny_run["source"] / "imagesTr" / "case_000.nii.gz"), 2, "case_000")
    run = Predictor(load_config(tiny_run["dir"] / "config.yaml"), tiny_run["dir"], device="cpu", tta=True)
    engine = ExportedPredictor(exported, "onnxruntime", tta=True)
    labels, probabilities, _ = run.predict_array(image, affine)
    engine_labels, engine_probabilities, _ = engine.predict_array(image, affine)
    assert np.max(np.abs(probabilities - engine_probabilities)) <= 1e-4
    assert np.array_equal(labels, engine_labels)


def test_a_wrong_manifest_version_a_missing_or_changed_network_is_one_line_and_exit_1(
    exported, tiny_run, tmp_path, capsys
):
    """A manifest of another version, a folder missing its ONNX file, and OpenVINO weights changed since the export
    fail before any case: one line naming the file and the fix, exit 1."""
    images = str(tiny_run["source"] / "imagesTs")
    folder = tmp_path / "model"
    shutil.copytree(exported, folder)
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    (folder / MANIFEST_FILE).write_text(json.dumps({**manifest, "version": MANIFEST_VERSION + 1}))
    assert (
        _predict(
            "--checkpoint", str(folder), "--engine", "onnxruntime", "--input", images, "--output", str(tmp_path / "o")
        )
        == 1
    )
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"manifest version {MANIFEST_VERSION + 1}" in line and "tfmis-export" in line, line
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))
    (folder / "networks" / "model" / "model.onnx").unlink()
    assert (
        _predict(
            "--checkpoint", str(folder), "--engine", "onnxruntime", "--input", images, "--output", str(tmp_path / "o")
        )
        == 1
    )
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "model.onnx is missing" in line and "Traceback" not in line, line
    shutil.copy(exported / "networks" / "model" / "model.onnx", folder / "networks" / "model" / "model.onnx")
    weights = folder / "networks" / "model" / "openvino" / "model.bin"
    data = weights.read_bytes()
    weights.write_bytes(data[:-4] + bytes(b ^ 0xFF for b in data[-4:]))  # the OpenVINO weights changed after export
    assert (
        _predict(
            "--checkpoint", str(folder), "--engine", "openvino", "--input", images, "--output", str(tmp_path / "o")
        )
        == 1
    )
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "openvino" in line and "sha256 differs" in line, line


@pytest.mark.slow  # a fresh process imports TensorFlow: about 10 s
def test_an_engine_that_is_not_installed_names_the_extra_and_exits_2(exported, tiny_run, tmp_path, capsys):
    """--engine openvino without the openvino package (hidden from this process): one line naming tfmis[deploy],
    exit 2."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["openvino"] = None  # import openvino raises ImportError, as when it is not installed
        from tfmis.predict import main
        sys.exit(main(["--checkpoint", {str(exported)!r}, "--engine", "openvino", "--input",
                       {str(tiny_run["source"] / "imagesTs")!r}, "--output", {str(tmp_path / "o")!r}]))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 2, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: --engine openvino") and "tfmis[deploy]" in line, line


def test_export_command_refuses_an_existing_output_and_an_unknown_format(tiny_run, tmp_path, capsys):
    """`tfmis-export` into an existing folder, or with --format tflite: exit 2 with one line; --help exits 0."""
    from tfmis.export import main

    assert main(["--checkpoint", str(tiny_run["dir"]), "--output", str(tmp_path)]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["--checkpoint", str(tiny_run["dir"]), "--output", str(tmp_path / "m"), "--format", "tflite"]) == 2
    assert "--format tflite" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0


def test_an_engine_with_a_run_folder_or_bfloat16_with_onnxruntime_is_exit_2(exported, tiny_run, tmp_path, capsys):
    """--engine onnxruntime with a run folder names tfmis-export; --precision bfloat16 with onnxruntime names the
    engines that run it: exit 2, one line each, before any case."""
    images = str(tiny_run["source"] / "imagesTs")
    args = ["--input", images, "--output", str(tmp_path / "o")]
    assert _predict("--checkpoint", str(tiny_run["dir"]), "--engine", "onnxruntime", *args) == 2
    assert "tfmis-export --checkpoint" in capsys.readouterr().err.strip().splitlines()[-1]
    assert _predict("--checkpoint", str(exported), "--engine", "onnxruntime", "--precision", "bfloat16", *args) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: --precision bfloat16") and "openvino" in line, line


OUTSIDE_TFMIS = """
import importlib.util, json, sys
import numpy as np
assert importlib.util.find_spec("tfmis") is None, "tfmis is importable in the clean environment"
engine, model, windows = sys.argv[1], sys.argv[2], np.load(sys.argv[3])
if engine == "onnxruntime":
    assert importlib.util.find_spec("tensorflow") is None, "tensorflow is importable in the onnxruntime environment"
    import onnxruntime
    session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    logits = session.run(["logits"], {"windows": windows})[0]
else:
    import tensorflow as tf
    signature = tf.saved_model.load(model).signatures["serving_default"]
    logits = signature(windows=tf.constant(windows))["logits"].numpy()
e = np.exp(logits - logits.max(axis=-1, keepdims=True))
np.save(sys.argv[4], e / e.sum(axis=-1, keepdims=True))
"""


def _clean_environment(folder: Path, *packages) -> Path:
    """A new virtual environment (no system site-packages) with only `packages` from pip's configured index; the
    test is skipped, saying why, when pip cannot install them on this machine, and fails instead in CI
    (`TFMIS_CI=1`), which has pip's index: there a clean environment that cannot be made is a failure."""
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    python = folder / "bin" / "python"
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", *packages], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"pip could not install {' '.join(packages)} into a clean venv here: {done.stderr[-300:]}")
    return python


@pytest.mark.slow  # a virtual environment installed from pip's index: 20 s (onnxruntime) to minutes (tensorflow-cpu)
@pytest.mark.parametrize(
    "engine, packages, fmt",
    [("onnxruntime", ("onnxruntime", "numpy"), "onnx"), ("tensorflow", ("tensorflow-cpu", "numpy"), "saved_model")],
)
def test_an_exported_network_runs_without_tfmis_and_gives_tfmis_probabilities(
    exported, tiny_run, tmp_path, engine, packages, fmt
):
    """In a clean virtual environment holding only `packages` (no tfmis; for ONNX no TensorFlow either), a batch of
    real windows of a preprocessed case through the exported network gives the probabilities tfmis's own window
    function gives (the run folder's Keras model): max |difference| <= 1e-4."""
    import tensorflow as tf

    from tfmis.config import load_config
    from tfmis.data.preprocess import preprocess
    from tfmis.data.sources.image_io import load_image
    from tfmis.inference.manifest import network_path, read_manifest
    from tfmis.inference.predictor import Predictor

    predictor = Predictor(load_config(tiny_run["dir"] / "config.yaml"), tiny_run["dir"], device="cpu")
    image, affine, _ = load_image(str(tiny_run["source"] / "imagesTr" / "case_001.nii.gz"), 2, "case_001")
    volume = preprocess(image, None, affine, predictor.preprocessing)[0].astype(np.float32)
    volume = np.pad(volume, [(0, max(0, 20 - s)) for s in volume.shape[:3]] + [(0, 0)])  # as the window pads
    windows = np.stack([volume[x : x + 16, 2:18, 1:17] for x in (0, 2, 4)])  # 3 real windows (16^3, 2 channels)
    expected = tf.nn.softmax(predictor._forward(windows), axis=-1).numpy()
    np.save(tmp_path / "windows.npy", windows)
    python = _clean_environment(tmp_path / "venv", *packages)
    model = network_path(exported, read_manifest(exported)["networks"][0], fmt)
    script = tmp_path / "outside.py"
    script.write_text(OUTSIDE_TFMIS)
    done = subprocess.run(
        [str(python), str(script), engine, str(model), str(tmp_path / "windows.npy"), str(tmp_path / "out.npy")],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the repository: nothing of tfmis on the path
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert np.max(np.abs(np.load(tmp_path / "out.npy") - expected)) <= 1e-4


@pytest.mark.slow  # two more tiny trainings and an export: about 30 s
def test_a_folder_of_folds_exports_every_fold_and_predicts_their_ensemble(converted_dataset, tiny_run, tmp_path):
    """A folder of two folds (fold_0, fold_1: real tiny runs of other seeds) exports two networks, and the
    onnxruntime engine predicts the label maps of tfmis-predict's fold ensemble on the folder of folds."""
    from tfmis.engine.trainer import Trainer
    from tfmis.inference.exporting import export_model

    folds = tmp_path / "cv" / "fullres"
    for fold in (0, 1):
        config = tiny_config(
            converted_dataset, folds / f"fold_{fold}", "training.epochs=1", f"training.seed={fold + 3}"
        )
        Trainer(config).fit()
    manifest = export_model(folds, tmp_path / "model", formats=("onnx",))
    assert [n["name"] for n in manifest["networks"]] == ["fold_0", "fold_1"] and manifest["source"][
        "weights"
    ] == "final"
    images = str(tiny_run["source"] / "imagesTr")
    assert _predict("--checkpoint", str(folds), "--input", images, "--output", str(tmp_path / "run")) == 0
    engine_out = tmp_path / "onnx"
    assert (
        _predict(
            "--checkpoint",
            str(tmp_path / "model"),
            "--engine",
            "onnxruntime",
            "--input",
            images,
            "--output",
            str(engine_out),
        )
        == 0
    )
    reference, predicted = _labels(tmp_path / "run"), _labels(engine_out)
    assert reference.keys() == predicted.keys() and len(reference) == 8
    for name in reference:
        assert np.array_equal(reference[name], predicted[name]), name


@pytest.mark.slow  # a coarse and a fine tiny training and an export: about 40 s
def test_a_plan_of_a_cascade_exports_both_stages_and_predicts_as_the_plan(converted_dataset, tiny_run, tmp_path):
    """The folder of a plan of two stages (lowres, then a cascade's fine stage with `cascade.coarse_run`) exports
    both stages' networks; each engine predicts the label maps tfmis-predict writes from the plan's folder."""
    import yaml

    from tfmis.config import save_config
    from tfmis.engine.trainer import Trainer
    from tfmis.inference.exporting import export_model

    root = tmp_path / "plan"
    coarse = tiny_config(converted_dataset, root / "lowres", "training.epochs=1", "training.seed=5")
    fine = tiny_config(
        converted_dataset, root / "cascade", "training.epochs=1", f"cascade.coarse_run={root / 'lowres'}"
    )
    entries = []
    for name, config in (("lowres", coarse), ("cascade", fine)):
        Trainer(config).fit()
        save_config(config, root / f"{name}.yaml")
        entries.append({"name": name, "config": str(root / f"{name}.yaml")})
    (root / "plan.yaml").write_text(yaml.safe_dump({"stages": entries}))
    manifest = export_model(root, tmp_path / "model", formats=("saved_model", "onnx"))
    assert manifest["source"]["kind"] == "cascade" and manifest["cascade"]["coarse"]["networks"][0]["name"] == "coarse"
    images = str(tiny_run["source"] / "imagesTr")
    assert _predict("--checkpoint", str(root), "--input", images, "--output", str(tmp_path / "run")) == 0
    reference = _labels(tmp_path / "run")
    regions = _regions(tmp_path / "run")
    assert any(r.startswith("1 region") for r in regions.values()), regions  # the fine stage ran in a region
    for engine in ("tensorflow", "onnxruntime"):
        out = tmp_path / engine
        assert (
            _predict(
                "--checkpoint", str(tmp_path / "model"), "--engine", engine, "--input", images, "--output", str(out)
            )
            == 0
        )
        predicted = _labels(out)
        assert reference.keys() == predicted.keys() and len(reference) == 8
        for name in reference:
            assert np.array_equal(reference[name], predicted[name]), (engine, name)
        assert _regions(out) == regions


@pytest.mark.slow  # four tiny trainings and an export: about a minute
def test_the_folds_of_a_cascade_export_every_fold_and_its_coarse_run_and_predict_as_the_folds(
    converted_dataset, tiny_run, tmp_path
):
    """A folder of two fine-stage folds, each with its own `cascade.coarse_run`, exports four networks (the fine
    folds and both coarse runs, the coarse stage's weights as the fine stage's: final); onnxruntime predicts the label
    maps and the regions tfmis-predict writes from the folder of folds (the coarse folds' ensemble finds the regions,
    the fine folds' ensemble segments them)."""
    from tfmis.engine.trainer import Trainer
    from tfmis.inference.exporting import export_model

    for fold in (0, 1):
        coarse = tmp_path / "lowres" / f"fold_{fold}"
        Trainer(tiny_config(converted_dataset, coarse, "training.epochs=1", f"training.seed={fold + 11}")).fit()
        fine = tiny_config(
            converted_dataset,
            tmp_path / "cascade" / f"fold_{fold}",
            "training.epochs=1",
            f"training.seed={fold + 13}",
            f"cascade.coarse_run={coarse}",
        )
        Trainer(fine).fit()
    manifest = export_model(tmp_path / "cascade", tmp_path / "model", formats=("onnx",))
    assert [n["name"] for n in manifest["networks"]] == ["fold_0", "fold_1"]
    coarse_networks = manifest["cascade"]["coarse"]["networks"]
    assert [n["name"] for n in coarse_networks] == ["coarse_fold_0", "coarse_fold_1"]
    assert [Path(n["run"]).name for n in coarse_networks] == ["fold_0", "fold_1"]
    assert {Path(n["weights_file"]).name for n in coarse_networks} == {"final.weights.h5"}
    images = str(tiny_run["source"] / "imagesTr")
    assert (
        _predict("--checkpoint", str(tmp_path / "cascade"), "--input", images, "--output", str(tmp_path / "run")) == 0
    )
    args = ("--checkpoint", str(tmp_path / "model"), "--engine", "onnxruntime", "--input", images)
    assert _predict(*args, "--output", str(tmp_path / "onnx")) == 0
    reference, predicted = _labels(tmp_path / "run"), _labels(tmp_path / "onnx")
    assert reference.keys() == predicted.keys() and len(reference) == 8
    for name in reference:
        assert np.array_equal(reference[name], predicted[name]), name
    assert _regions(tmp_path / "onnx") == _regions(tmp_path / "run")


@pytest.mark.slow  # four tiny trainings and an export: about a minute
def test_a_crossval_choice_of_two_configurations_exports_their_folds_and_postprocessing(
    converted_dataset, tiny_run, tmp_path
):
    """A cross-validation folder that chose configurations a and b (two folds each, other networks) and the largest
    foreground component exports four networks and the postprocessing; onnxruntime predicts the label maps
    tfmis-predict writes from the cross-validation folder."""
    from tfmis.engine.trainer import Trainer
    from tfmis.inference.exporting import export_model

    cv = tmp_path / "cv"
    runs = {}
    for name, filters in (("a", "[4,8]"), ("b", "[6,12]")):
        runs[name] = []
        for fold in (0, 1):
            out = cv / name / f"fold_{fold}"
            overrides = [f"model.filters={filters}", "training.epochs=1", f"training.seed={fold + 7}"]
            Trainer(tiny_config(converted_dataset, out, *overrides)).fit()
            runs[name].append(str(out))
    chosen = {"configurations": ["a", "b"], "postprocessing": {"largest_foreground_component": True}}
    crossval = {
        "version": 1,
        "folds": [0, 1],
        "configurations": {n: {"folds": {str(k): r for k, r in enumerate(runs[n])}} for n in runs},
        "chosen": chosen,
    }
    (cv / "crossval.json").write_text(json.dumps(crossval))
    manifest = export_model(cv, tmp_path / "model", formats=("onnx",))
    assert [c["name"] for c in manifest["configurations"]] == ["a", "b"]
    assert [n["name"] for c in manifest["configurations"] for n in c["networks"]] == [
        "a/fold_0",
        "a/fold_1",
        "b/fold_0",
        "b/fold_1",
    ]
    assert manifest["postprocessing"]["largest_foreground_component"] is True
    images = str(tiny_run["source"] / "imagesTr")
    assert _predict("--checkpoint", str(cv), "--input", images, "--output", str(tmp_path / "run")) == 0
    out = tmp_path / "onnx"
    code = _predict(
        "--checkpoint", str(tmp_path / "model"), "--engine", "onnxruntime", "--input", images, "--output", str(out)
    )
    assert code == 0
    reference, predicted = _labels(tmp_path / "run"), _labels(out)
    assert reference.keys() == predicted.keys() and len(reference) == 8
    for name in reference:
        assert np.array_equal(reference[name], predicted[name]), name
