"""Exporting a trained model out of tfmis: SavedModel, ONNX and OpenVINO networks and the manifest around them.

`export_model(checkpoint, output)` writes the folder `tfmis.inference.manifest` describes, for one run, the folds
of one configuration (a folder of folds), a cross-validation folder (the configurations it chose, each its folds,
and its postprocessing), or a cascade (a plan of stages, its fine stage or the folds of one: both stages). Each
network is the inference model (no deep-supervision heads) built in float32 and loaded with the run's weights
(best for one run, final for folds, as `tfmis-predict` chooses), traced once as

    tf.function(windows (None, X, Y, Z, C) float32) -> {"logits": (None, X, Y, Z, K) float32}

with (X, Y, Z) the prediction window (`validation.roi_size`, or the training patch) and a dynamic batch, and
written as a SavedModel (Keras' `ExportArchive`, endpoint `serving_default`), as ONNX (tf2onnx, opset 17, from the
same function) and as OpenVINO IR (`openvino.convert_model` of the ONNX file, saved with float32 weights).

Guarantees: the folder is written beside `output` and renamed into place at the end, so `output` is complete or
absent; each format is run once on the same random windows at export and its largest difference from the Keras
model is recorded in the manifest (`export_check`); the manifest holds every file's sha256.

Example:
```python
manifest = export_model("runs/demo", "models/demo", formats=("saved_model", "onnx"))
```
"""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path

import numpy as np

from tfmis.config import load_config, to_dict
from tfmis.errors import UsageError
from tfmis.inference.ensemble import resolve_checkpoint
from tfmis.inference.inputs import find_run_dir, load_weights, run_config
from tfmis.inference.manifest import (
    FORMATS,
    INPUT_NAME,
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    MODEL_CARD_FILE,
    OUTPUT_NAME,
    sha256_of,
)
from tfmis.inference.model_card import model_card, training_summary
from tfmis.postprocessing import postprocessing_enabled
from tfmis.utils.io import atomic_write_json, atomic_writer

ONNX_OPSET = 17
NETWORK_FILES = {"saved_model": "saved_model", "onnx": "model.onnx", "openvino": "openvino/model.xml"}
# the engine that checks each format at export (tfmis.inference.engines)
FORMAT_ENGINES = {"saved_model": "tensorflow", "onnx": "onnxruntime", "openvino": "openvino"}
FORMAT_PACKAGES = {"saved_model": [], "onnx": ["onnx", "tf2onnx"], "openvino": ["onnx", "tf2onnx", "openvino"]}
CHECK_SEED = 0


def parse_formats(value: str) -> tuple[str, ...]:
    """`--format`'s comma-separated list, checked: a `UsageError` naming an unknown format."""
    formats = tuple(dict.fromkeys(f.strip() for f in value.split(",") if f.strip()))
    unknown = [f for f in formats if f not in FORMATS]
    if not formats or unknown:
        raise UsageError(f"--format {value}: expected a comma-separated list of {', '.join(FORMATS)}")
    return formats


def _require_packages(formats) -> None:
    import importlib

    for fmt in formats:
        for package in FORMAT_PACKAGES[fmt]:
            try:
                importlib.import_module(package)
            except ImportError:
                raise UsageError(
                    f"--format {fmt} needs the Python package {package}, which is not installed: "
                    'pip install "tfmis[deploy]"'
                ) from None


def final_stage(checkpoint: str | Path) -> Path:
    """The run a plan of stages predicts with (its last stage's run folder, a cascade's fine stage), or `checkpoint`
    itself when it is not the folder of a plan (as `tfmis-predict` resolves it)."""
    from tfmis.config import load_stages

    path = Path(checkpoint)
    if not path.is_dir() or (path / "config.yaml").is_file() or not (path / "plan.yaml").is_file():
        return path
    stages = load_stages(path / "plan.yaml")
    return Path(load_config(stages[-1][1]).output.dir) if stages else path


def _members(checkpoint, folds, weights) -> tuple[object, list]:
    """(the `PredictionSource`, [(configuration name, its run folders, its first run's `Config`)]); a plan of stages
    is its last stage's run."""
    source = resolve_checkpoint(checkpoint, folds, weights)
    if source.kind == "run":
        source = resolve_checkpoint(final_stage(checkpoint), weights=weights)
    members = []
    for member in source.members:
        runs = [Path(r) for r in member.runs]
        members.append((member.name, runs, load_config(run_config(runs[0]))))
    return source, members


def _inference_network(config, run: Path, weights: str, index: dict):
    """The run's inference model in float32, with its weights; the weights file read."""
    import keras

    from tfmis.task import SegmentationTask

    task = SegmentationTask(config, data_info=index)
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("float32")
    try:
        model = task.build_inference_model()
    finally:
        keras.mixed_precision.set_global_policy(policy)
    read = load_weights(model, run, weights, task)
    return task, model, Path(read)


def _window_function(model, roi_size, channels: int):
    import tensorflow as tf

    spec = tf.TensorSpec((None, *roi_size, channels), tf.float32, name=INPUT_NAME)

    @tf.function(input_signature=[spec])
    def serve(windows):
        return {OUTPUT_NAME: tf.cast(model(windows, training=False), tf.float32)}

    return serve, spec


def _write_network(model, serve, spec, folder: Path, formats) -> dict:
    """Writes the requested formats of one network into `folder`; {format: relative file}."""
    import keras

    files = {}
    saved = folder / NETWORK_FILES["saved_model"]
    if "saved_model" in formats:
        archive = keras.export.ExportArchive()
        archive.track(model)
        archive.add_endpoint("serving_default", serve)
        archive.write_out(str(saved), verbose=False)
        files["saved_model"] = saved
    onnx_file = folder / NETWORK_FILES["onnx"]
    if "onnx" in formats or "openvino" in formats:
        import tf2onnx

        tf2onnx.convert.from_function(serve, input_signature=[spec], opset=ONNX_OPSET, output_path=str(onnx_file))
        if "onnx" in formats:
            files["onnx"] = onnx_file
    if "openvino" in formats:
        import openvino as ov

        xml = folder / NETWORK_FILES["openvino"]
        xml.parent.mkdir(parents=True, exist_ok=True)
        # from the ONNX file: the same graph as the ONNX engine's; float32 weights (save_model's default is float16)
        ov.save_model(ov.convert_model(str(onnx_file)), str(xml), compress_to_fp16=False)
        files["openvino"] = xml
        if "onnx" not in formats:
            onnx_file.unlink()
    return files


def _check_formats(model, files: dict, roi_size, channels: int) -> dict:
    """{format: the largest |logit difference| from the Keras model} on two seeded random windows."""
    from tfmis.inference.engines import load_network

    windows = np.random.default_rng(CHECK_SEED).normal(size=(2, *roi_size, channels)).astype(np.float32)
    reference = np.asarray(model(windows, training=False), np.float32)
    return {
        fmt: float(np.max(np.abs(load_network(FORMAT_ENGINES[fmt], file)(windows) - reference)))
        for fmt, file in files.items()
    }


def _stage(config, index: dict, networks: list, source) -> dict:
    """What one stage predicts with: its preprocessing, sliding window, networks and training facts."""
    v = config.validation
    roi_size = [int(s) for s in (v.roi_size or config.pipeline.patch_size)]
    return {
        "preprocessing": {
            **index["preprocessing"],
            "orientation": "RAS (the image is reoriented to RAS before resampling)",
            "image_resampling_order": 1,
            "label_resampling_order": 0,
            "probability_resampling_order": 1,
        },
        "sliding_window": {
            "roi_size": roi_size,
            "overlap": float(v.overlap),
            "mode": v.mode,
            "sigma_scale": 0.125,
            "padding_mode": "constant",
            "sw_batch_size": int(v.num_sw_batch_size),
            "blend": "logits (weighted mean of the windows' logits; the activation after blending)",
            "ensemble": "logits of the mean of the networks' probabilities (one network: its logits)",
        },
        "networks": networks,
        "training": {"config": to_dict(config), **training_summary([Path(n["run"]) for n in networks], source)},
    }


def _manifest(config, index: dict, task, source, stage: dict, formats, postprocessing) -> dict:
    """The manifest's contents (`tfmis.inference.manifest`) around `stage` (its networks, preprocessing, sliding
    window, training and a cascade's coarse stage)."""
    import keras
    import tensorflow as tf

    import tfmis

    roi_size = stage["sliding_window"]["roi_size"]
    regions = task.regions
    versions = {"tfmis": tfmis.__version__, "tensorflow": tf.__version__, "keras": keras.__version__}
    for package in ("onnx", "tf2onnx", "onnxruntime", "openvino"):
        try:
            versions[package] = __import__(package).__version__
        except ImportError:
            pass
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions,
        "source": {
            "checkpoint": str(source.folder or stage["networks"][0]["run"]),
            "kind": source.kind if stage["cascade"] is None else "cascade",
            "weights": source.weights,
        },
        "formats": list(formats),
        "input": {
            "name": INPUT_NAME,
            "shape": [None, *roi_size, task.in_channels],
            "dtype": "float32",
            "channels": list(index["source"]["modalities"]),
            "layout": "windows of the preprocessed image: N, X, Y, Z (RAS voxel axes), channels last",
        },
        "output": {
            "name": OUTPUT_NAME,
            "shape": [None, *roi_size, task.out_channels],
            "dtype": "float32",
            "kind": "classes" if regions is None else "regions",
            "activation": "softmax" if regions is None else "sigmoid",
            "regions": None if regions is None else {k: list(v) for k, v in regions.items()},
            "paint_labels": task.paint_labels,
        },
        "labels": list(task.class_names),
        **stage,
        "postprocessing": to_dict(postprocessing) if postprocessing_enabled(postprocessing) else None,
    }


def _export_networks(runs, config, weights: str, index: dict, staging: Path, formats, names) -> tuple[list, object]:
    """Writes each run's network under `staging/networks/<name>`; (the manifest's network entries, the task)."""
    roi_size = tuple(int(s) for s in (config.validation.roi_size or config.pipeline.patch_size))
    networks = []
    for number, (run, name) in enumerate(zip(runs, names)):
        run_config_ = config if number == 0 else load_config(run_config(run))
        task, model, read = _inference_network(run_config_, run, weights, index)
        serve, spec = _window_function(model, roi_size, task.in_channels)
        files = _write_network(model, serve, spec, staging / "networks" / name, formats)
        networks.append(
            {
                "name": name,
                "run": str(run),
                "weights_file": str(read),
                "weights_sha256": sha256_of(read),
                "files": {fmt: str(file.relative_to(staging)) for fmt, file in files.items()},
                "sha256": {fmt: sha256_of(file.parent if fmt == "openvino" else file) for fmt, file in files.items()},
                "export_check": _check_formats(model, files, roi_size, task.in_channels),
            }
        )
    return networks, task


def export_model(
    checkpoint: str | Path,
    output: str | Path,
    formats=FORMATS,
    weights: str | None = None,
    folds: list[int] | None = None,
) -> dict:
    """Exports the run `checkpoint` names (or the folds of one configuration; a cross-validation's chosen
    configurations, each its folds; a cascade: a plan of stages, its fine stage or its folds, with the coarse runs)
    into the new folder `output`; returns the manifest written.

    Raises:
        UsageError: `output` exists, or an unknown format or one whose package is missing.
        MissingInput / DataError: as `tfmis-predict` for the same checkpoint (a missing fold, weights that do
            not fit).
    """
    output = Path(output)
    if output.exists():
        raise UsageError(f"--output {output} exists: give a new folder (or remove it)")
    _require_packages(formats)
    source, members = _members(checkpoint, folds, weights)
    staging = output.parent / f".{output.name}.exporting"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        stages = []
        for name, runs, config in members:
            prefix = f"{name}/" if len(members) > 1 else ""
            stages.append((name, *_export_stage(runs, config, source, staging, formats, prefix)))
        name, stage, task, config, index = stages[0]
        postprocessing = source.postprocessing if source.postprocessing is not None else config.postprocessing
        manifest = _manifest(config, index, task, source, stage, formats, postprocessing)
        if len(stages) > 1:  # a cross-validation's ensemble of configurations: their probabilities averaged
            manifest["configurations"] = [{"name": name, **stage} for name, stage, *_ in stages]
            manifest["source"]["kind"] = "configurations"
        atomic_write_json(staging / MANIFEST_FILE, manifest)
        with atomic_writer(staging / MODEL_CARD_FILE) as f:
            f.write(model_card(manifest))
        staging.rename(output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return json.loads((output / MANIFEST_FILE).read_text())


def _export_stage(runs, config, source, staging: Path, formats, prefix: str) -> tuple:
    """Exports one configuration's networks (and a cascade's coarse run) under `staging/networks/<prefix>...`;
    (its stage dict with its `cascade`, its task, config and training data info)."""
    from tfmis.data.records import load_training_data_info

    index = load_training_data_info(find_run_dir(runs[0]), config.data.dataset_dir)
    names = [prefix + run.name for run in runs] if len(runs) > 1 else [prefix + "model"]
    networks, task = _export_networks(runs, config, source.weights, index, staging, formats, names)
    cascade = None
    if config.cascade.coarse_run:
        # the coarse stage as tfmis-predict builds it: each fold's coarse run (the ensemble of those of folds), with
        # the weights the fine stage's are read with
        coarse_runs = list(dict.fromkeys(Path(load_config(run_config(r)).cascade.coarse_run) for r in runs))
        coarse_config = load_config(run_config(coarse_runs[0]))
        coarse_index = load_training_data_info(coarse_runs[0], coarse_config.data.dataset_dir)
        coarse_names = (
            [f"{prefix}coarse_{r.name}" for r in coarse_runs] if len(coarse_runs) > 1 else [f"{prefix}coarse"]
        )
        coarse_networks, _ = _export_networks(
            coarse_runs, coarse_config, source.weights, coarse_index, staging, formats, coarse_names
        )
        c = config.cascade
        cascade = {
            "coarse": _stage(coarse_config, coarse_index, coarse_networks, source),
            "margin_mm": float(c.margin_mm),
            "min_region_mm3": float(c.min_region_mm3),
            "fine_classes": sorted(c.fine_classes) if c.fine_classes else None,
            "how": "the coarse stage over the whole scan, the fine stage (this stage's networks) in the boxes around "
            "what it finds, grown by margin_mm (tfmis.inference.cascade)",
        }
    return {**_stage(config, index, networks, source), "cascade": cascade}, task, config, index
