"""A conversion's shards: which cases each shard holds (`plan_shards`), writing one shard from its cases' worker
results (`write_shard`, under a temporary name, durable before its progress record says it is done), and the shards
a rerun keeps (`finished_shards`: file and progress record agree in size, and in sha256 when resuming).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from tfmis.data.records import encode_example, framed_size, shard_name
from tfmis.utils.io import atomic_path, atomic_write_json

PROGRESS_DIR = ".progress"  # in the target: one progress record per finished shard


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


def write_shard(target: Path, shard: dict, results, index_meta: dict, on_case) -> dict:
    """Writes one shard from its cases' worker results; returns its progress record."""
    import tensorflow as tf

    final = target / shard["file"]
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
    # durable before the progress file says it is done: atomic_path fsyncs the shard, renames it, fsyncs the folder
    with atomic_path(final) as tmp, tf.io.TFRecordWriter(str(tmp), options) as writer:
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
                # the record's content: what its patch-read arrays are tied to (a reconversion with another CT
                # window writes a record of the same length at the same offset)
                "sha256": hashlib.sha256(payload).hexdigest(),
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
    record["bytes"], record["sha256"] = file_digest(final)
    record["records"] = len(record["cases"])
    atomic_write_json(target / PROGRESS_DIR / (shard["file"] + ".json"), record)
    return record


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file, read in 4 MiB blocks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


def finished_shards(target: Path, plan: list[dict], checksums: bool, say) -> set[str]:
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
            _, sha256 = file_digest(path)
            if sha256 != record["sha256"]:
                say(
                    f"{shard['file']}: sha256 {sha256[:12]}... differs from the recorded {record['sha256'][:12]}...: "
                    "writing it again"
                )
                continue
        done.add(shard["file"])
    return done
