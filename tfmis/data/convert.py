"""MSD folder → preprocessed TFRecord shards + index.json + fingerprint.json.

The conversion is planned up front (seeded split or K folds, shards per split), then cases are
preprocessed in parallel worker processes (numpy/scipy/nibabel only) and written by the main
process, shard by shard, in plan order. Each shard is written under a temporary name and renamed
when complete, and a small progress file records what it holds; a rerun with the same parameters
skips finished shards, a rerun with other parameters is refused (or rebuilt with `overwrite`).

Bad cases never stop the others: each is recorded in `index.json` under `skipped` with its reason.

Example:
```python
report = convert(ConversionConfig(source_dir="Task09_Spleen", target_dir="spleen_tfr",
                                  spacing=(1.5, 1.5, 2.0), ct_window=(-57, 164)))
print(report["skipped"])
```
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Literal

import nibabel as nib
import numpy as np

from tfmis.data import fingerprint as fp
from tfmis.data.msd import CT_MODALITIES, Case, CaseError, DatasetError, MSDDataset, load_case
from tfmis.data.preprocess import PreprocessConfig, preprocess, ras_spacing
from tfmis.data.records import (
    COMPRESSIONS,
    FINGERPRINT_FILE,
    INDEX_FILE,
    SCHEMA_VERSION,
    encode_example,
    framed_size,
    shard_name,
)
from tfmis.hardware import usable_cpu_count
from tfmis.utils.io import TEMP_SUFFIX, atomic_write_json, fsync_dir, remove_temp_files, temp_path
from tfmis.utils.lock import folder_lock
from tfmis.utils.parallel import map_ordered

PLAN_FILE = "conversion.json"
PROGRESS_DIR = ".progress"
EXIT_SKIPPED = 3  # conversion finished, but some cases were skipped


class ParametersChanged(RuntimeError):
    """The target folder holds a conversion made with other parameters."""


class NothingConverted(DatasetError):
    """Every case was skipped: no record was written (the outputs are removed so a rerun starts afresh)."""


DEFAULT_SPLIT = (0.7, 0.15, 0.15)


def _option(
    default, help: str, flag: str | None = None, lengths: tuple[int, ...] | None = None, group: str | None = None
):
    """A conversion option: its default and how `tools/tfrecord.py` offers it (help, flag, value count)."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "lengths": lengths, "group": group})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConversionOptions:
    """How a dataset is converted: the one definition behind the `data.conversion` config section, the
    `tools/tfrecord.py` flags and `ConversionConfig`.

    Args:
        split: fractions for train/val/test (1 to 3 values); the default 0.7,0.15,0.15 unless `folds` is set.
        folds: K for K-fold splits `fold0..fold{K-1}` instead of `split`.
        spacing: target spacing (mm, RAS order); None = the dataset's median spacing.
        reshape: fixed output shape instead of resampling to a spacing.
        shards: shards per split (at most one per case).
        compression: GZIP, ZLIB or NONE.
        workers: parallel preprocessing processes (1 = in this process; None = CPU count, at most 8).
        seed: seed of the split.
        image_dtype: float16 or float32.
        ct_window: (low, high) HU window for CT channels; None = the 0.5/99.5 percentiles of the
            labelled foreground, measured in a first pass (as nnU-Net does).
        ct_normalization: CT channels after clipping to `ct_window`: "scale" to [0, 1], or "zscore": minus
            the mean, over the standard deviation, of the labelled foreground intensities of all training
            cases (nnU-Net's CTNormalization; measured in the same first pass).
        crop_foreground, crop_margin: crop to the non-background bounding box (+ margin voxels).
        crop_to_label_mm: crop to the labelled voxels' box + this many mm instead (a cascade's fine stage).
    """

    split: tuple[float, ...] | None = _option(
        None,
        "fractions of the labelled cases for train,val,test (default 0.7,0.15,0.15); normalised to sum 1",
        lengths=(1, 2, 3),
        group="split",
    )
    folds: int | None = _option(
        None, "K: write K folds (splits fold0..foldK-1) instead of train/val/test", group="split"
    )
    spacing: tuple[float, float, float] | None = _option(
        None,
        "target voxel spacing in mm along R,A,S, e.g. 1.5,1.5,2.0 (default: the dataset's median spacing)",
        group="grid",
    )
    reshape: tuple[int, int, int] | None = _option(
        None, "fixed output shape X,Y,Z after cropping, e.g. 120,120,96 (instead of resampling)", group="grid"
    )
    shards: int = _option(4, "shards per split (at most one per case; default 4)")
    compression: Literal["GZIP", "ZLIB", "NONE"] = _option("GZIP", "TFRecord compression (default GZIP)")
    workers: int | None = _option(
        None, "parallel preprocessing processes (default: CPU count, at most 8; 1 = no subprocess)"
    )
    seed: int = _option(0, "seed of the split (default 0)")
    image_dtype: Literal["float16", "float32"] = _option(
        "float16", "storage dtype of the normalised images (default float16, half the bytes)"
    )
    ct_window: tuple[float, float] | None = _option(
        None,
        "LOW,HIGH Hounsfield window for CT channels, e.g. -57,164 (default: 0.5/99.5 percentiles of the "
        "labelled foreground)",
    )
    ct_normalization: Literal["scale", "zscore"] = _option(
        "scale",
        "CT channels after clipping to the window: scale to [0, 1] (default) or zscore with the mean and "
        "std of the labelled foreground over the training cases (nnU-Net)",
    )
    crop_foreground: bool = _option(True, "do not crop to the foreground bounding box", flag="--no-crop")
    crop_margin: int = _option(0, "voxels kept around the foreground box (default 0)")
    crop_to_label_mm: float | None = _option(
        None,
        "crop each case to its labelled voxels' box grown by MM millimetres instead of the foreground box (the "
        "region a cascade's fine stage sees; cases without labelled voxels keep the foreground crop)",
    )

    def __post_init__(self):
        if self.split is not None and self.folds is not None:
            raise ValueError(f"set only one of split {list(self.split)} and folds {self.folds}")
        if self.split is None and self.folds is None:
            object.__setattr__(self, "split", DEFAULT_SPLIT)
        for name in ("split", "spacing", "reshape", "ct_window"):  # YAML and JSON give lists
            value = getattr(self, name)
            object.__setattr__(self, name, tuple(value) if value is not None else None)
        if self.split is not None:
            if not 1 <= len(self.split) <= 3 or min(self.split) < 0 or sum(self.split) <= 0:
                raise ValueError(f"split must be 1 to 3 non-negative fractions (train,val,test), got {self.split}")
        if self.folds is not None and self.folds < 2:
            raise ValueError(f"folds must be at least 2, got {self.folds}")
        if self.ct_normalization not in ("scale", "zscore"):
            raise ValueError(f"ct_normalization must be scale or zscore, got {self.ct_normalization!r}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {sorted(COMPRESSIONS)}, got {self.compression!r}")
        if self.shards < 1 or (self.workers is not None and self.workers < 1):
            raise ValueError("shards and workers must be at least 1")
        if self.crop_margin < 0:
            raise ValueError(f"crop_margin must be >= 0, got {self.crop_margin}")
        if self.crop_to_label_mm is not None and self.crop_to_label_mm < 0:
            raise ValueError(f"crop_to_label_mm must be >= 0 mm (or null), got {self.crop_to_label_mm}")

    @property
    def num_workers(self) -> int:
        return self.workers or min(usable_cpu_count(), 8)


@dataclasses.dataclass(frozen=True)
class ConversionConfig(ConversionOptions):
    """What `convert` does: the options plus where from and to. See `tools/tfrecord.py --help`.

    Args:
        source_dir: MSD dataset folder (with dataset.json).
        target_dir: output folder for shards, index.json and fingerprint.json.
        overwrite: rebuild when the target holds a conversion with other parameters.
        progress: show a progress bar.
        **options: the `ConversionOptions`.
    """

    source_dir: str
    target_dir: str
    overwrite: bool = False
    progress: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ConversionConfig:
        """From `build_parser()`'s arguments."""
        options = {f.name: getattr(args, f.name) for f in dataclasses.fields(ConversionOptions)}
        return cls(
            source_dir=args.source_dir,
            target_dir=args.target_dir,
            overwrite=args.overwrite,
            progress=not args.quiet,
            **options,
        )

    def requested(self, dataset_json_sha256: str) -> dict:
        """The parameters that decide the output (not workers/progress/overwrite)."""
        keep = {f.name for f in dataclasses.fields(ConversionOptions)} - {"workers"}
        d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items() if k in keep}
        d["dataset_json_sha256"] = dataset_json_sha256
        d["schema_version"] = SCHEMA_VERSION
        return d


def assign_splits(case_ids: list[str], split, folds, seed: int) -> dict[str, list[str]]:
    """Seeded assignment of cases to `train/val/test` fractions or to `fold0..foldK-1`."""
    order = [case_ids[i] for i in np.random.default_rng(seed).permutation(len(case_ids))]
    if folds is not None:
        return {f"fold{k}": order[k::folds] for k in range(folds)}
    names = ("train", "val", "test")[: len(split)]
    fractions = np.array(split, dtype=float) / sum(split)
    exact = fractions * len(order)
    counts = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - counts), kind="stable")[: len(order) - counts.sum()]:
        counts[i] += 1  # largest remainders get the leftover cases
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return {name: order[bounds[i] : bounds[i + 1]] for i, name in enumerate(names)}


def plan_shards(splits: dict[str, list[str]], shards: int, compression: str) -> list[dict]:
    plan = []
    for split, cases in splits.items():
        n = min(shards, len(cases))
        for k, chunk in enumerate(np.array_split(np.array(cases, dtype=object), n) if n else []):
            plan.append(
                {
                    "split": split,
                    "shard": k,
                    "file": shard_name(split, k, n, compression),
                    "cases": [str(c) for c in chunk],
                }
            )
    return plan


def header_spacing(case: Case, dataset: MSDDataset) -> np.ndarray:
    """RAS voxel spacing from the image header alone (no voxel data read)."""
    path = dataset.resolve(case, case.image)
    if not Path(path).is_file():
        raise CaseError(case.case_id, f"image file {path} does not exist")
    try:
        return ras_spacing(nib.load(str(path)).affine)
    except Exception as e:  # any header problem: the worker reports it with the full reason
        raise CaseError(case.case_id, f"cannot read header of {path}: {e}") from e


# ---------------------------------------------------------------- worker side (no TensorFlow here)


def _process_case(task: tuple) -> dict:
    case, source_dir, prep = task
    try:
        dataset = MSDDataset(source_dir)
        loaded = load_case(case, dataset)
        # the raw intensities are sampled first: preprocess then normalises in the loaded image's own memory
        ct = _ct_channels(dataset)
        intensity = fp.case_intensity(loaded.image, loaded.label, ct)
        background = fp.case_background(loaded.image, ct)  # what preprocess's foreground_mask finds (6 faces read)
        image, label, geometry = preprocess(loaded.image, loaded.label, loaded.affine, prep, overwrite_image=True)
        warnings = []
        if label is not None and not (label > 0).any():
            warnings.append("label has no foreground voxels")
        return {
            "case_id": case.case_id,
            "status": "ok",
            "image": image,
            "label": label,
            "geometry": geometry.to_dict(),
            "warnings": warnings,
            "disk_dtype": loaded.header_dtype,
            "fingerprint": fp.case_fingerprint(
                None,
                loaded.label,
                ras_spacing(loaded.affine),
                geometry,
                label,
                dataset.num_classes,
                intensity,
                background,
            ),
        }
    except CaseError as e:
        return {"case_id": case.case_id, "status": "skipped", "reason": e.reason}
    except Exception as e:  # never let one case stop the others
        return {"case_id": case.case_id, "status": "skipped", "reason": f"unexpected {type(e).__name__}: {e}"}


def _foreground_sample(task: tuple) -> np.ndarray | None:
    case, source_dir = task
    try:
        dataset = MSDDataset(source_dir)
        loaded = load_case(case, dataset)
        return fp.foreground_sample(loaded.image, loaded.label, _ct_channels(dataset))
    except Exception:
        return None  # reported by the main pass


def _ct_channels(dataset: MSDDataset) -> list[int]:
    return [i for i, m in enumerate(dataset.modalities) if str(m).upper() in CT_MODALITIES]


# ---------------------------------------------------------------- main side


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _prepare_target(
    target: Path, requested: dict, overwrite: bool, dataset: MSDDataset | None = None, locked: bool = True
) -> None:
    if locked:  # every writer of the target holds its lock: these are the leftovers of a dead conversion
        remove_temp_files(target)
        remove_temp_files(target / PROGRESS_DIR)
    plan_path = target / PLAN_FILE
    if plan_path.is_file():
        plan = json.loads(plan_path.read_text())
        previous = dict(plan.get("requested", {}))
        resolved = plan.get("resolved", {})
        defaults = {f.name: f.default for f in dataclasses.fields(ConversionOptions)}
        for k, new in requested.items():
            if k not in previous and k in defaults and new == defaults[k]:
                previous[k] = new  # an option added since that conversion, asked for with its default
            old = previous.get(k)
            if old == new or resolved.get(k) is None:
                continue
            if old is None and new == resolved[k]:
                previous[k] = new  # the default it resolved, now asked for by its value (as a plan writes it)
            elif (
                new is None
                and old == resolved[k]
                and k == "spacing"
                and dataset is not None
                and list(_median_spacing(dataset) or []) == resolved[k]
            ):
                previous[k] = None  # the value asked for then is what the default (the median) resolves to
        if previous != requested:
            changed = sorted(k for k in set(previous) | set(requested) if previous.get(k) != requested.get(k))
            details = "; ".join(f"{k}: {previous.get(k)!r} -> {requested.get(k)!r}" for k in changed)
            if not overwrite:
                raise ParametersChanged(
                    f"{target} holds a conversion made with other parameters ({details}); "
                    "use another --target-dir, or --overwrite to rebuild it"
                )
            _remove_outputs(target)
    elif _shard_files(target) and not overwrite:
        raise ParametersChanged(
            f"{target} holds TFRecord files that this tool did not plan; use an empty --target-dir, or --overwrite"
        )
    elif overwrite:
        _remove_outputs(target)


def _remove_outputs(target: Path) -> None:
    for path in [
        *_shard_files(target),
        *(target / PROGRESS_DIR).glob("*"),
        target / INDEX_FILE,
        target / FINGERPRINT_FILE,
        target / PLAN_FILE,
    ]:
        if path.is_file():
            path.unlink()


def _shard_files(target: Path) -> list[Path]:
    """The TFRecord files in `target` (not a writer's temporaries)."""
    return [p for p in target.glob("*.tfrecord*") if not p.name.endswith(TEMP_SUFFIX)]


def _median_spacing(dataset: MSDDataset) -> tuple[float, float, float] | None:
    spacings = []
    for case in dataset.training:
        try:
            spacings.append(header_spacing(case, dataset))
        except CaseError:
            pass  # the worker reports this case with its reason
    return tuple(float(s) for s in np.round(np.median(spacings, axis=0), 4)) if spacings else None


def _first_unreadable(dataset: MSDDataset) -> str:
    """The first training case whose image header cannot be read, with the reason (`case_id: why`)."""
    for case in dataset.training:
        try:
            header_spacing(case, dataset)
        except CaseError as e:
            return f"{case.case_id}: {e.reason}"
    return "none"


def _ct_foreground_statistics(dataset: MSDDataset, workers: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """((0.5, 99.5) percentiles, (mean, std)) of the CT channels' labelled foreground intensities, sampled from
    every training case (nnU-Net's foreground intensity properties)."""
    tasks = [(c, str(dataset.root)) for c in dataset.training]
    samples = [s for s in map_ordered(_foreground_sample, tasks, workers) if s is not None]
    if not samples:
        raise DatasetError(f"{dataset.root}: no readable case to measure the CT window from; pass --ct-window")
    ct_channels = [i for i, m in enumerate(dataset.modalities) if m.upper() == "CT"]
    values = np.concatenate([s[:, ct_channels].ravel() for s in samples]).astype(np.float64)
    return fp.ct_window(values), (float(values.mean()), float(values.std()))


def _write_shard(target: Path, shard: dict, results, index_meta: dict, on_case) -> dict:
    """Writes one shard from its cases' worker results; returns its progress record."""
    import tensorflow as tf

    final = target / shard["file"]
    tmp = temp_path(final)
    options = tf.io.TFRecordOptions(
        compression_type="" if index_meta["compression"] == "NONE" else index_meta["compression"]
    )
    record = {
        "file": shard["file"],
        "split": shard["split"],
        "shard": shard["shard"],
        "cases": {},
        "skipped": {},
        "warnings": {},
        "fingerprints": {},
    }
    offset = 0
    with tf.io.TFRecordWriter(str(tmp), options) as writer:
        for result in results:
            cid = result["case_id"]
            if result["status"] != "ok":
                record["skipped"][cid] = result["reason"]
                on_case(cid, f"skipped: {result['reason']}")
                continue
            metadata = {
                "case_id": cid,
                "geometry": result["geometry"],
                "modalities": index_meta["modalities"],
                "labels": index_meta["labels"],
                "image_disk_dtype": result["disk_dtype"],
            }
            payload = encode_example(cid, result["image"], result["label"], metadata)
            writer.write(payload)
            record["cases"][cid] = {
                "case_id": cid,
                "split": shard["split"],
                "shard": shard["shard"],
                "file": shard["file"],
                "position": len(record["cases"]),
                "offset": offset,
                "length": len(payload),
                "image_shape": list(result["image"].shape),
                "geometry": result["geometry"],
            }
            offset += framed_size(len(payload))
            record["fingerprints"][cid] = result["fingerprint"]
            if result["warnings"]:
                record["warnings"][cid] = result["warnings"]
                on_case(cid, "warning: " + "; ".join(result["warnings"]))
            else:
                on_case(cid, None)
            # let this case's arrays go before the next one is read: with workers=1 the next case is
            # preprocessed in this process while `result` and `payload` would still hold this one
            del result, payload
    # durable before the progress file says it is done: the shard's bytes, then its name in the folder
    record["bytes"], record["sha256"] = _file_digest(tmp, sync=True)
    os.replace(tmp, final)
    fsync_dir(target)
    record["records"] = len(record["cases"])
    atomic_write_json(target / PROGRESS_DIR / (shard["file"] + ".json"), record)
    return record


def _file_digest(path: Path, sync: bool = False) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file, read in 4 MiB blocks; `sync`: fsync it too."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
            size += len(block)
        if sync:
            os.fsync(f.fileno())
    return size, digest.hexdigest()


def _finished_shards(target: Path, plan: list[dict], checksums: bool, say) -> set[str]:
    """The planned shards whose file and progress record exist and agree: the size always, the sha256 too with
    `checksums`. A shard that disagrees is reported through `say` and left out (so it is written again)."""
    done = set()
    for shard in plan:
        path, progress = target / shard["file"], target / PROGRESS_DIR / (shard["file"] + ".json")
        if not (path.is_file() and progress.is_file()):
            continue
        record = json.loads(progress.read_text())
        size = path.stat().st_size
        if "bytes" in record and size != record["bytes"]:
            say(f"{shard['file']}: {size} bytes on disk, {record['bytes']} recorded: writing it again")
            continue
        if checksums and "sha256" in record:
            _, sha256 = _file_digest(path)
            if sha256 != record["sha256"]:
                say(
                    f"{shard['file']}: sha256 {sha256[:12]}... differs from the recorded {record['sha256'][:12]}...: "
                    "writing it again"
                )
                continue
        done.add(shard["file"])
    return done


def convert(config: ConversionConfig) -> dict:
    """Runs (or resumes) a conversion; returns the written index (plus `run_seconds`).

    The conversion holds the target's lock (`tfmis.utils.lock.folder_lock`) from start to end.

    Raises:
        FolderLocked: another live conversion holds the target (the message names it).
    """
    start = time.time()
    dataset = MSDDataset(config.source_dir)
    target = Path(config.target_dir)
    with folder_lock(target, "tfmis-convert") as locked:
        return _convert(config, dataset, target, start, locked)


def _convert(config: ConversionConfig, dataset: MSDDataset, target: Path, start: float, locked: bool) -> dict:
    from tfmis.utils.progress import progress_bar

    (target / PROGRESS_DIR).mkdir(parents=True, exist_ok=True)
    requested = config.requested(_sha256(dataset.root / "dataset.json"))
    _prepare_target(target, requested, config.overwrite, dataset, locked)
    previous = json.loads((target / PLAN_FILE).read_text()) if (target / PLAN_FILE).is_file() else {}
    ct_norm = "ct_zscore" if config.ct_normalization == "zscore" else "ct"
    modal_norm = tuple(ct_norm if m.upper() == "CT" else "zscore" for m in dataset.modalities)
    if previous.get("requested") == requested and "resolved" in previous:  # resuming
        spacing, ct_window = previous["resolved"]["spacing"], previous["resolved"]["ct_window"]
        ct_mean_std = previous["resolved"].get("ct_mean_std")
    else:
        spacing = config.spacing or _median_spacing(dataset)
        ct_window, ct_mean_std = config.ct_window, None
        if ct_norm in modal_norm and (ct_window is None or ct_norm == "ct_zscore"):
            window, mean_std = _ct_foreground_statistics(dataset, config.num_workers)
            ct_window = ct_window if ct_window is not None else window
            ct_mean_std = mean_std if ct_norm == "ct_zscore" else None
    if spacing is None and config.reshape is None:  # not one header could be read: nothing can be converted
        raise NothingConverted(
            f"{dataset.root}: 0 of {len(dataset.training)} cases readable, so nothing to convert "
            f"(first: {_first_unreadable(dataset)}); fix the files dataset.json lists and rerun"
        )
    atomic_write_json(
        target / PLAN_FILE,
        {"requested": requested, "resolved": {"spacing": spacing, "ct_window": ct_window, "ct_mean_std": ct_mean_std}},
    )
    spacing = tuple(spacing) if spacing is not None else None
    ct_window = tuple(ct_window) if ct_window is not None else None
    prep = PreprocessConfig(
        spacing=spacing,
        reshape=config.reshape,
        normalization=modal_norm,
        ct_window=ct_window,
        ct_mean_std=tuple(ct_mean_std) if ct_mean_std is not None else None,
        crop_foreground=config.crop_foreground,
        crop_margin=config.crop_margin,
        crop_to_label_mm=config.crop_to_label_mm,
        image_dtype=config.image_dtype,
    )

    splits = assign_splits([c.case_id for c in dataset.training], config.split, config.folds, config.seed)
    plan = plan_shards(splits, config.shards, config.compression)
    # a finished conversion (index.json, written after every shard was synced) checks sizes only, which is cheap
    # at every training start; resuming an unfinished one checks the checksums of the shards it keeps too
    done = _finished_shards(
        target, plan, not (target / INDEX_FILE).is_file(), lambda line: print(line, file=sys.stderr)
    )
    pending = [s for s in plan if s["file"] not in done]
    by_id = {c.case_id: c for c in dataset.training}
    tasks = [(by_id[cid], str(dataset.root), prep) for s in pending for cid in s["cases"]]
    index_meta = {"compression": config.compression, "modalities": dataset.modalities, "labels": dataset.labels}

    bar = progress_bar(len(tasks), f"Converting {dataset.name}", "case", disable=not config.progress)
    if done:
        bar.write(
            f"Resuming: {len(done)} of {len(plan)} shards already complete, {len(tasks)} cases to go", file=sys.stderr
        )

    def on_case(case_id: str, message: str | None):
        if message:
            bar.write(f"  {case_id}: {message}", file=sys.stderr)
        bar.update(1)

    results = map_ordered(_process_case, tasks, config.num_workers)
    for shard in pending:
        _write_shard(target, shard, itertools.islice(results, len(shard["cases"])), index_meta, on_case)
    bar.close()

    index = _build_index(target, dataset, config, requested, prep, splits, plan)
    if not index["cases"]:  # an index of 0 records is no conversion: say why, and do not resume from it
        _remove_outputs(target)
        first = index["skipped"][0] if index["skipped"] else {"case_id": "-", "reason": "no case listed"}
        raise NothingConverted(
            f"{dataset.root}: 0 of {len(dataset.training)} cases converted, all skipped (first: "
            f"{first['case_id']}: {first['reason']}); fix the files dataset.json lists and rerun"
        )
    index["run_seconds"] = round(time.time() - start, 2)
    atomic_write_json(target / INDEX_FILE, index)
    return index


def _build_index(
    target: Path,
    dataset: MSDDataset,
    config: ConversionConfig,
    requested: dict,
    prep: PreprocessConfig,
    splits: dict,
    plan: list,
) -> dict:
    progress = [json.loads((target / PROGRESS_DIR / (s["file"] + ".json")).read_text()) for s in plan]
    cases, skipped, warnings, fingerprints = {}, [], [], {}
    for record in progress:
        cases.update(record["cases"])
        fingerprints.update(record["fingerprints"])
        skipped += [{"case_id": k, "reason": v} for k, v in record["skipped"].items()]
        warnings += [{"case_id": k, "message": m} for k, ms in record["warnings"].items() for m in ms]
    for case in dataset.training:  # where each record came from: predict maps results back onto these files
        if case.case_id in cases:
            cases[case.case_id].update(image=case.image, label=case.label)
    total_bytes = sum(r["bytes"] for r in progress)
    summary = fp.summarize(fingerprints, dataset.labels, dataset.modalities)
    atomic_write_json(target / FINGERPRINT_FILE, {"dataset": summary, "cases": fingerprints})
    return {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": {
            "dir": str(dataset.root),
            "name": dataset.name,
            "modalities": dataset.modalities,
            "labels": dataset.labels,
            "num_training": len(dataset.training),
            "num_test": len(dataset.test),
            "dataset_json_sha256": requested["dataset_json_sha256"],
        },
        "requested": requested,
        "preprocessing": {**prep.to_dict(), "compression": config.compression},
        "split": {
            "fractions": list(config.split) if config.split else None,
            "folds": config.folds,
            "seed": config.seed,
        },
        "splits": {
            name: {
                "cases": ids,
                "num_records": sum(r["records"] for r in progress if r["split"] == name),
                "shards": [
                    {"file": r["file"], "records": r["records"], "bytes": r["bytes"], "sha256": r.get("sha256")}
                    for r in progress
                    if r["split"] == name
                ],
            }
            for name, ids in splits.items()
        },
        "cases": cases,
        # per channel: the cases whose background is a non-zero border constant (z-scored), cropped against it
        "background": summary.get("background"),
        "skipped": sorted(skipped, key=lambda s: s["case_id"]),
        "warnings": sorted(warnings, key=lambda w: w["case_id"]),
        "stats": {
            "records": len(cases),
            "bytes": total_bytes,
            "bytes_per_case": round(total_bytes / len(cases)) if cases else 0,
        },
    }


def summary_text(index: dict) -> str:
    """A short human-readable account of a conversion."""
    prep = index["preprocessing"]
    grid = f"reshape {prep['reshape']}" if prep["reshape"] else f"spacing {prep['spacing']} mm"
    lines = [
        f"{index['source']['name']}: {index['stats']['records']} cases converted, "
        f"{len(index['skipped'])} skipped, {len(index['warnings'])} warnings "
        f"({grid}, {prep['image_dtype']}, {prep['compression']}, "
        f"{index['stats']['bytes_per_case'] / 1e6:.2f} MB/case, {index['run_seconds']:.1f} s)"
    ]
    for name, split in index["splits"].items():
        lines.append(f"  {name:<6} {split['num_records']:>4} records in {len(split['shards'])} shard(s)")
    lines += [f"  {line}" for line in fp.background_lines(index.get("background"))]
    for s in index["skipped"]:
        lines.append(f"  SKIPPED {s['case_id']}: {s['reason']}")
    for w in index["warnings"]:
        lines.append(f"  warning {w['case_id']}: {w['message']}")
    return "\n".join(lines)
