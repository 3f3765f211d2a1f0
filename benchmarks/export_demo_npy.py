#!/usr/bin/env python3
"""Exports a converted tfmis dataset's train and validation volumes as .npy files for the MONAI arm.

The MONAI recipe (`benchmarks/monai_demo.py`) must train on exactly the voxels tfmis trains on: the
preprocessed (resampled, cropped, z-scored) volumes stored in the TFRecords, in the same split. This
reads them back with `tfmis.data.records.record_dataset` (the converter's own reader) and writes

    <output>/<split>/<case_id>_image.npy   float32, channels first (C, X, Y, Z), as MONAI expects
    <output>/<split>/<case_id>_label.npy   uint8 (X, Y, Z)
    <output>/manifest.json                 classes, channels, spacing, the cases of each split and
                                           the hash of the index.json they came from

The images are the stored float16 values widened to float32, i.e. bit for bit what tfmis's pipelines
feed the network (they cast the same float16 to float32). A second run with the same dataset does
nothing (the manifest records the index hash, timestamps left out); `--force` rewrites.

Example:
    python benchmarks/export_demo_npy.py --dataset-dir data/demo/tfrecords --output data/demo/npy
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from tfmis.data.records import load_index, record_dataset  # noqa: E402
from tfmis.utils.io import atomic_write_json, atomic_writer  # noqa: E402

MANIFEST = "manifest.json"
DEFAULT_SPLITS = ("train", "val")


VOLATILE_INDEX_KEYS = ("created", "run_seconds")  # rewritten by a conversion that finds nothing to do


def index_digest(dataset_dir: str | Path) -> str:
    """sha256 of the dataset's index.json without its timestamps: a conversion with other data or settings
    changes it, so a stale export is noticed; re-running a finished conversion does not."""
    index = {k: v for k, v in load_index(dataset_dir).items() if k not in VOLATILE_INDEX_KEYS}
    return hashlib.sha256(json.dumps(index, sort_keys=True).encode()).hexdigest()


def export_npy(dataset_dir: str | Path, output: str | Path, splits=DEFAULT_SPLITS, force: bool = False) -> dict:
    """Writes the volumes of `splits` as .npy files and returns the manifest (see the module docstring).

    Args:
        dataset_dir: a converted tfmis dataset (`index.json` + TFRecord shards).
        output: the folder to write.
        splits: the splits to export (each must exist in the dataset).
        force: rewrite even if `output` already holds this dataset's export.

    Returns:
        The manifest dict (also written to `<output>/manifest.json`).

    Example:
        >>> manifest = export_npy("data/demo/tfrecords", "data/demo/npy")  # doctest: +SKIP
        >>> manifest["splits"]["train"][0]["image"]  # doctest: +SKIP
        'train/demo_009_image.npy'
    """
    dataset_dir, output = Path(dataset_dir), Path(output)
    index = load_index(dataset_dir)
    digest = index_digest(dataset_dir)
    missing = [s for s in splits if s not in index["splits"]]
    if missing:
        raise KeyError(f"{dataset_dir}: no split(s) {missing}; available: {sorted(index['splits'])}")
    manifest_path = output / MANIFEST
    if manifest_path.is_file() and not force:
        old = json.loads(manifest_path.read_text())
        complete = all(
            (output / e[k]).is_file() for s in splits for e in old["splits"].get(s, []) for k in ("image", "label")
        )
        if old.get("index_sha256") == digest and set(splits) <= set(old["splits"]) and complete:
            return old
    manifest = {
        "dataset_dir": str(dataset_dir.resolve()),
        "index_sha256": digest,
        "channels": index["source"]["modalities"],
        "classes": index["source"]["labels"],
        "spacing": index["preprocessing"]["spacing"],
        "layout": {"image": "C,X,Y,Z float32", "label": "X,Y,Z uint8"},
        "splits": {},
    }
    for split in splits:
        entries = []
        for image, label, meta in record_dataset(dataset_dir, split, num_parallel_reads=1):
            case_id = meta["case_id"].numpy().decode()
            image = np.moveaxis(image.numpy().astype(np.float32), -1, 0)  # (X, Y, Z, C) -> (C, X, Y, Z)
            label = label.numpy().astype(np.uint8)
            if label.shape != image.shape[1:]:
                raise ValueError(
                    f"{dataset_dir}: case {case_id} of split {split!r} has no label (shape "
                    f"{label.shape}); export only labelled splits (train, val)"
                )
            entry = {
                "case_id": case_id,
                "image": f"{split}/{case_id}_image.npy",
                "label": f"{split}/{case_id}_label.npy",
                "shape": list(label.shape),
            }
            for key, array in (("image", image), ("label", label)):
                with atomic_writer(output / entry[key], "wb") as f:
                    np.save(f, array)
            entries.append(entry)
        manifest["splits"][split] = sorted(entries, key=lambda e: e["case_id"])
        print(f"{split}: {len(entries)} case(s) -> {output / split}", file=sys.stderr)
    atomic_write_json(manifest_path, manifest)
    return manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset-dir", default="data/demo/tfrecords", help="converted tfmis dataset")
    parser.add_argument("--output", default="data/demo/npy", help="folder for the .npy files and manifest.json")
    parser.add_argument("--splits", nargs="+", default=list(DEFAULT_SPLITS), help="splits to export")
    parser.add_argument("--force", action="store_true", help="rewrite an up-to-date export")
    args = parser.parse_args(argv)
    manifest = export_npy(args.dataset_dir, args.output, args.splits, args.force)
    print(json.dumps({s: len(v) for s, v in manifest["splits"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
