"""A dataset folder (MSD or nnU-Net v2 raw) → preprocessed TFRecord shards + index.json + fingerprint.json.

The conversion is planned up front (seeded split, or K folds stratified by the classes each case holds or read
from a splits_final.json; shards per split), then cases are
preprocessed in parallel worker processes (numpy/scipy and the image readers only) and written by the main
process, shard by shard, in plan order. Each shard is written under a temporary name and renamed
when complete, and a small progress file records what it holds; a rerun with the same parameters
skips finished shards, a rerun with other parameters is refused (or rebuilt with `overwrite`).

Bad cases never stop the others: each is recorded in `index.json` under `skipped` with its reason.

This module drives the conversion (the target's lock and state, the plan in conversion.json, the index); its parts
are `conversion_options` (`ConversionOptions`, `ConversionConfig`), `folds` (the split and the folds, nnU-Net's
splits_final.json), `conversion_cases` (the worker's case, the dataset's measurements) and `shard_writer` (the
shards and their progress records); callers import each name from the module that defines it. `process_case` and
`label_classes` are called through this module's names (a benchmark or a test replaces them here).

Example:
```python
report = convert(ConversionConfig(source_dir="Task09_Spleen", target_dir="spleen_tfr",
                                  spacing=(1.5, 1.5, 2.0), ct_window=(-57, 164)))
print(report["skipped"])
```
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import importlib
import itertools
import json
import shutil
import sys
import time
from pathlib import Path

from tfmis.data import case_stats
from tfmis.data.case_pool import CONVERSION_PEAK_FACTOR, LOAD_PEAK_FACTOR, CasePool
from tfmis.data.conversion_cases import (
    ct_foreground_statistics,
    dataset_median_spacing,
    first_unreadable,
    label_classes,
    process_case,
)
from tfmis.data.conversion_options import ConversionConfig, ConversionOptions
from tfmis.data.folds import (
    SPLITS_FILE,
    assign_splits,
    folds_from_file,
    nnunet_splits,
    read_splits_file,
    splits_sha256,
)
from tfmis.data.patch_layout import arrays_dir
from tfmis.data.preprocess import PreprocessConfig
from tfmis.data.records import FINGERPRINT_FILE, INDEX_FILE, SCHEMA_VERSION
from tfmis.data.shard_writer import PROGRESS_DIR, finished_shards, plan_shards, write_shard
from tfmis.data.sources.cases import SegmentationDataset
from tfmis.data.sources.errors import DatasetError
from tfmis.data.sources.layouts import open_dataset
from tfmis.errors import RunStateError
from tfmis.utils.io import atomic_write_json, parse_temp_name
from tfmis.utils.lock import folder_lock

PLAN_FILE = "conversion.json"
EXIT_SKIPPED = 3  # conversion finished, but some cases were skipped


class ParametersChanged(RunStateError):
    """The target folder holds a conversion made with other parameters."""


class NothingConverted(DatasetError):
    """Every case was skipped: no record was written (the outputs are removed so a rerun starts afresh)."""


def convert(config: ConversionConfig, wait: bool = False) -> dict:
    """Runs (or resumes) a conversion; returns the written index (plus `run_seconds`).

    The conversion holds the target's lock (`tfmis.utils.lock.folder_lock`) from start to end. With `wait`, a
    conversion of the same target by another live process is waited for (one line names it), then this one
    checks its result (a no-op when it finished with the same parameters).

    Raises:
        FolderLocked: another live conversion holds the target (the message names it; not with `wait`).
    """
    start = time.time()
    dataset = open_dataset(config.source_dir)
    target = Path(config.target_dir)
    with folder_lock(target, "tfmis-convert", wait=wait):  # taking it removes the temporaries of dead writers
        return _convert(config, dataset, target, start)


def _convert(config: ConversionConfig, dataset: SegmentationDataset, target: Path, start: float) -> dict:
    from tfmis.utils.progress import progress_bar

    # read before the target is touched: a splits file inside it (an earlier conversion's) is removed by overwrite
    file_folds = read_splits_file(config.splits_file) if config.splits_file is not None else None
    (target / PROGRESS_DIR).mkdir(parents=True, exist_ok=True)
    requested = config.requested(
        _sha256(dataset.root / "dataset.json"), splits_sha256(file_folds) if file_folds is not None else None
    )
    _prepare_target(target, requested, config.overwrite, dataset)
    previous = json.loads((target / PLAN_FILE).read_text()) if (target / PLAN_FILE).is_file() else {}
    ct_norm = "ct_zscore" if config.ct_normalization == "zscore" else "ct"
    modal_norm = tuple(ct_norm if m.upper() == "CT" else "zscore" for m in dataset.modalities)
    splits = None
    if previous.get("requested") == requested and "resolved" in previous:  # resuming
        spacing, ct_window = previous["resolved"]["spacing"], previous["resolved"]["ct_window"]
        ct_mean_std = previous["resolved"].get("ct_mean_std")
        splits = previous["resolved"].get("splits")  # planned once: stratified folds read every label
    else:
        spacing = config.spacing or dataset_median_spacing(dataset)
        ct_window, ct_mean_std = config.ct_window, None
        if ct_norm in modal_norm and (ct_window is None or ct_norm == "ct_zscore"):
            window, mean_std = ct_foreground_statistics(dataset, config.workers)
            ct_window = ct_window if ct_window is not None else window
            ct_mean_std = mean_std if ct_norm == "ct_zscore" else None
    if spacing is None and config.reshape is None:  # not one header could be read: nothing can be converted
        raise NothingConverted(
            f"{dataset.root}: 0 of {len(dataset.training)} cases readable, so nothing to convert "
            f"(first: {first_unreadable(dataset)}); fix the files dataset.json lists and rerun"
        )
    if splits is None:
        splits = _plan_splits(config, dataset, file_folds)
    atomic_write_json(
        target / PLAN_FILE,
        {
            "requested": requested,
            "resolved": {"spacing": spacing, "ct_window": ct_window, "ct_mean_std": ct_mean_std, "splits": splits},
        },
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

    plan = plan_shards(splits, config.shards, config.compression)
    # a finished conversion (index.json, written after every shard was synced) checks sizes only, which is cheap
    # at every training start; resuming an unfinished one checks the checksums of the shards it keeps too
    done = finished_shards(target, plan, not (target / INDEX_FILE).is_file(), lambda line: print(line, file=sys.stderr))
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

    if tasks:  # the shard writer's TensorFlow, imported before the pool is sized from what this process holds
        importlib.import_module("tensorflow")
    pool = CasePool("Converting", dataset, CONVERSION_PEAK_FACTOR, cases=[t[0] for t in tasks], asked=config.workers)
    if tasks and config.progress:  # --quiet: only the per-case and error lines
        bar.write(pool.describe(), file=sys.stderr)
    results = pool.run(process_case, tasks, _skipped_case, say=lambda line: bar.write(line, file=sys.stderr))
    for shard in pending:
        write_shard(target, shard, itertools.islice(results, len(shard["cases"])), index_meta, on_case)
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
    if config.folds is not None:  # before index.json, whose presence says the conversion is complete
        atomic_write_json(target / SPLITS_FILE, nnunet_splits(splits))
    atomic_write_json(target / INDEX_FILE, index)
    return index


def _skipped_case(case_id: str, reason: str) -> dict:
    """The worker result of a case the pool did not read (too large for the memory, or killed even alone)."""
    return {"case_id": case_id, "status": "skipped", "reason": reason}


def _plan_splits(config: ConversionConfig, dataset: SegmentationDataset, file_folds: list[dict] | None) -> dict:
    """The cases of each split: the splits file's folds, stratified folds (every training label read once, in
    parallel), or seeded fractions."""
    if file_folds is not None:
        return folds_from_file(file_folds, dataset, config.splits_file)
    ids = [c.case_id for c in dataset.training]
    classes = None
    if config.folds is not None:
        tasks = [(c, str(dataset.root)) for c in dataset.training]
        pool = CasePool("Reading the labels", dataset, LOAD_PEAK_FACTOR, asked=config.workers)
        classes = dict(zip(ids, pool.run(label_classes, tasks, lambda case_id, reason: [])))
    return assign_splits(ids, config.split, config.folds, config.seed, classes)


def _build_index(
    target: Path,
    dataset: SegmentationDataset,
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
    summary = case_stats.summarize(fingerprints, dataset.labels, dataset.modalities)
    atomic_write_json(target / FINGERPRINT_FILE, {"dataset": summary, "cases": fingerprints})
    return {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": {
            "dir": str(dataset.root),
            "name": dataset.name,
            "layout": dataset.layout,
            "modalities": dataset.modalities,
            "labels": dataset.labels,
            "regions": dataset.regions,
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
            "fold_assignment": requested.get("fold_assignment"),  # stratified or splits_file (folds only)
            "splits_file": config.splits_file,
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
        written = [s for s in split["shards"] if s["records"]]
        empty = len(split["shards"]) - len(written)
        lines.append(
            f"  {name:<6} {split['num_records']:>4} records in {len(written)} shard(s)"
            + (f" (and {empty} empty: every case planned for it was skipped)" if empty else "")
        )
    lines += [f"  {line}" for line in case_stats.background_lines(index.get("background"))]
    if index["skipped"]:  # each reason was printed once, when its case was met; it is in index.json too
        ids = [s["case_id"] for s in index["skipped"]]
        named = ", ".join(ids[:20]) + (f" and {len(ids) - 20} more" if len(ids) > 20 else "")
        lines.append(f"  skipped: {named} (each case's reason above, and in index.json 'skipped')")
    for w in index["warnings"]:
        lines.append(f"  warning {w['case_id']}: {w['message']}")
    return "\n".join(lines)


# ---------------------------------------------------------------- the target folder


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _prepare_target(target: Path, requested: dict, overwrite: bool, dataset: SegmentationDataset | None = None) -> None:
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
                and list(dataset_median_spacing(dataset) or []) == resolved[k]
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
    """Removes a conversion's outputs from `target`: its records, progress, index, fingerprint, plan and splits, and
    its patch-read arrays (written from the records removed here)."""
    arrays = arrays_dir(target)
    if arrays.is_dir():
        shutil.rmtree(arrays)
    for path in [
        *_shard_files(target),
        *(target / PROGRESS_DIR).glob("*"),
        target / INDEX_FILE,
        target / FINGERPRINT_FILE,
        target / PLAN_FILE,
        target / SPLITS_FILE,
    ]:
        if path.is_file():
            path.unlink()


def _shard_files(target: Path) -> list[Path]:
    """The TFRecord files in `target` (not a writer's temporaries)."""
    return [p for p in target.glob("*.tfrecord*") if parse_temp_name(p.name) is None]
