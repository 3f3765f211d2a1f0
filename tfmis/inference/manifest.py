"""The exported model folder's `manifest.json`: what prediction needs around the network(s), versioned and checked
when read.

`tfmis-export` (`tfmis.inference.exporting`) writes a folder that predicts without the training run:

```
MODEL_DIR/
  manifest.json                      this file's contents (MANIFEST_VERSION)
  MODEL_CARD.md                      what the model was trained on, its Dice, where it was trained
  networks/<name>/saved_model/       TensorFlow SavedModel, signature `serving_default`
  networks/<name>/model.onnx         ONNX (opset 17)
  networks/<name>/openvino/model.xml OpenVINO IR (+ model.bin)
```

Every network file takes `windows` (N, X, Y, Z, C) float32 — N any, (X, Y, Z) the manifest's
`sliding_window.roi_size`, C the `input.channels` in order, the preprocessed image (RAS voxel axes, resampled and
normalised as `preprocessing` says) — and returns `logits` (N, X, Y, Z, K) float32: the network's raw output before
its activation (`output.activation`: softmax over the K classes, or a sigmoid per region). The sliding window blends
logits (as nnU-Net does) and applies the activation once per voxel; `tfmis.inference.deployed.ExportedPredictor`
reads this file instead of a run's `config.yaml` and `training_data.json`.

`read_manifest` checks the format name and version, the keys prediction reads, and that every network file the
manifest names is there: a wrong version or a missing file is one `DataError` / `MissingInput` line naming the file
and the fix (export again with this tfmis).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tfmis.errors import DataError, MissingInput

MANIFEST_FILE = "manifest.json"
MODEL_CARD_FILE = "MODEL_CARD.md"
MANIFEST_FORMAT = "tfmis-exported-model"
MANIFEST_VERSION = 1
# the network formats, the engine that runs each, and the file a network's entry names for it
FORMATS = ("saved_model", "onnx", "openvino")
ENGINE_FORMATS = {"tensorflow": "saved_model", "onnxruntime": "onnx", "openvino": "openvino"}
INPUT_NAME = "windows"
OUTPUT_NAME = "logits"
REQUIRED_KEYS = (
    "format",
    "version",
    "formats",
    "input",
    "output",
    "labels",
    "preprocessing",
    "sliding_window",
    "postprocessing",
    "networks",
    "training",
    "versions",
)


def sha256_of(path: str | Path) -> str:
    """The hex sha256 of a file, or of a folder's files (their relative paths and contents, in sorted order)."""
    path = Path(path)
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def network_path(folder: str | Path, network: dict, fmt: str) -> Path:
    """The file (or SavedModel folder) of `network`'s `fmt` in the exported model `folder`."""
    return Path(folder) / network["files"][fmt]


def read_manifest(folder: str | Path) -> dict:
    """The checked manifest of the exported model `folder`.

    Guarantees: the format name and `MANIFEST_VERSION` match this tfmis, the keys prediction reads are there, and
    every network file of every listed format exists.

    Raises:
        MissingInput: no manifest.json in `folder`, or a network file it names is missing (named, with the fix).
        DataError: manifest.json is not readable JSON, is of another format or version, or lacks a key.
    """
    folder = Path(folder)
    path = folder / MANIFEST_FILE
    export_again = f"export it again with this tfmis (tfmis-export --checkpoint RUN --output {folder})"
    if not path.is_file():
        raise MissingInput(f"{path} does not exist: {folder} is not an exported model folder; {export_again}")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} is not readable JSON ({e}); {export_again}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise DataError(f"{path} is not a tfmis exported model's manifest (format {MANIFEST_FORMAT!r}); {export_again}")
    version = manifest.get("version")
    if version != MANIFEST_VERSION:
        raise DataError(
            f"{path}: manifest version {version!r}, this tfmis reads version {MANIFEST_VERSION}; {export_again}"
        )
    missing = [key for key in REQUIRED_KEYS if key not in manifest]
    if missing:
        raise DataError(f"{path}: the key {missing[0]!r} is missing; {export_again}")
    if not manifest["networks"]:
        raise DataError(f"{path}: no networks listed; {export_again}")
    for network in (n for stage in stages(manifest) for n in stage["networks"]):
        for fmt in manifest["formats"]:
            file = network_path(folder, network, fmt)
            if not file.exists():
                raise MissingInput(
                    f"{path}: its {fmt} network {file} is missing; copy the whole folder, or {export_again}"
                )
    return manifest


def stages(manifest: dict) -> list[dict]:
    """Every stage of an exported model, each with its `networks`: the manifest itself (or, for an ensemble of
    configurations, each of its `configurations`) and each one's cascade's coarse stage."""
    tops = manifest.get("configurations") or [manifest]
    return [s for top in tops for s in (top, *([top["cascade"]["coarse"]] if top.get("cascade") else []))]


def hashed_path(folder: str | Path, network: dict, fmt: str) -> Path:
    """What a network's `sha256` covers for `fmt`: the SavedModel folder, the ONNX file, or the OpenVINO folder (its
    .xml graph and its .bin weights)."""
    path = network_path(folder, network, fmt)
    return path.parent if fmt == "openvino" else path


def check_network_file(folder: str | Path, network: dict, fmt: str) -> Path:
    """The `fmt` file of `network`, its sha256 checked against the manifest's (a `DataError` naming the file when
    it changed since the export)."""
    file = network_path(folder, network, fmt)
    expected = network.get("sha256", {}).get(fmt)
    if expected is not None and sha256_of(hashed_path(folder, network, fmt)) != expected:
        raise DataError(
            f"{file}: its sha256 differs from {Path(folder) / MANIFEST_FILE}'s: the file changed after the export; "
            "copy the exported folder again, or export again"
        )
    return file


def data_info(manifest: dict) -> dict:
    """The part of a run's `training_data.json` a predictor reads (channels, labels, preprocessing), from the
    manifest."""
    return {
        "source": {"modalities": list(manifest["input"]["channels"]), "labels": list(manifest["labels"])},
        "preprocessing": dict(manifest["preprocessing"]),
        "splits": {},
    }
