"""The patch-read layout (`pipeline.cache: patches`): training crops read from uncompressed arrays, not volumes.

A converted dataset's TFRecords hold each case compressed in one record: a crop needs the whole volume decoded.
For datasets larger than memory, training reads its crops from this layout instead, written once beside the
records (nnU-Net's idea: uncompressed arrays a patch is cut from without decoding the volume):
```
OUT/arrays/
  <case>.image.npy        (x, y, z, C) in the records' image dtype (float16 by default), C order, uncompressed
  <case>.label.npy        (x, y, z) uint8
  <case>.locations-s<seed>-n<count>.npz   the class locations of one training seed and per-class count:
                          `foreground_indices` of the label (fg (K, 3) int32, fg_class (K,))
  <case>.json             written last: the record it came from, shape, dtype, the location sets indexed
```
A crop reads only the rows it covers, with positional reads (one per x: the box's y rows with every z, contiguous
on disk): a 128³ crop of a 512 x 512 x 300 float16 CT reads 128 runs of 128 x 300 x 2 bytes (9.8 MB) of its 157 MB.
Nothing is memory-mapped, so what was read never counts in the process's RSS (a map's pages did: 400 crops of 64³
took its file-backed RSS from 13 to 223 MB); the page cache keeps it, which a cgroup is charged for, unless the
arrays cannot fit beside the input's budget: then each read gives its pages back at once (`drop_pages`). The
process holds no volume (docs/training.md, "Data larger than memory", says why this layout).

Each file is written atomically (a temporary renamed when whole) and the case's json last, so an interrupted
writing resumes where it stopped, and a case whose record changed (a new conversion: its place or the sha256 of its
bytes in index.json) is written again. `tfmis-convert --overwrite` removes the folder with the records it replaces,
and `PatchArrays` refuses arrays that do not belong to the current records, so a crop never comes from an older
conversion.

Open files stay bounded: `PatchArrays` keeps the files of at most `MAX_OPEN_CASES` cases open (least recently used
closed first), and the class locations of `LOCATION_CASES`, whatever the number of cases.

Example:
```python
write_patch_layout("OUT", ["case_000", "case_001"], num_classes=3, max_per_class=20000, seed=0)
arrays = PatchArrays("OUT", ["case_000", "case_001"])
image, label = arrays.window(0, origin=[-8, 40, 12], size=[64, 64, 64])   # zeros outside the volume
```
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from tfmis.data.records import decode_example, load_index, read_record_payloads, split_cases
from tfmis.errors import ConfigError, DataError, MissingInput, ResourceError
from tfmis.utils.io import atomic_path, atomic_write_json

ARRAYS_DIR = "arrays"
LAYOUT_VERSION = 2  # 2: one class-locations file per (seed, count), so runs of other seeds never rewrite another's
# cases whose files stay open at once (two descriptors a case; the usual limit is 1024)
MAX_OPEN_CASES = 64
# cases whose class locations stay loaded (16 bytes a location, up to max_per_class a class present: ~4.5 MB a
# case at 15 classes); locate() works on two cases at once, so four is room to spare, and tfmis.data.memory_budget
# counts them
LOCATION_CASES = 4
FD_MARGIN = 64  # descriptors left to everything else when the open-file limit caps the open cases


def arrays_dir(dataset_dir: str | Path) -> Path:
    return Path(dataset_dir) / ARRAYS_DIR


def _record_identity(entry: dict) -> dict:
    """What identifies the record a case's arrays came from: its place and the sha256 of its bytes, so a
    conversion that changes a case's content (another CT window: the same length at the same offset) gives another.
    A conversion made before records had a digest has None there (its arrays are written again once)."""
    return {
        "file": entry["file"],
        "offset": int(entry["offset"]),
        "length": int(entry["length"]),
        "sha256": entry.get("sha256"),
    }


def _case_manifest(folder: Path, case_id: str) -> dict | None:
    path = folder / f"{case_id}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def layout_status(dataset_dir: str | Path, case_ids: list[str], max_per_class: int, seed: int) -> dict:
    """Which of `case_ids` the layout holds as wanted: {"done": [...], "locations": [...], "missing": [...]}.

    `locations`: arrays written from the current record, but no class locations of this seed and count (only those
    are written, beside the others'); `missing`: no arrays, or arrays of an older record."""
    index = load_index(dataset_dir)
    folder = arrays_dir(dataset_dir)
    status = {"done": [], "locations": [], "missing": []}
    for case_id in case_ids:
        entry = index["cases"].get(case_id)
        manifest = _case_manifest(folder, case_id)
        if entry is None:
            raise DataError(f"{dataset_dir}: case {case_id!r} is not in index.json; convert the dataset again")
        if (
            manifest is None
            or manifest.get("version") != LAYOUT_VERSION
            or manifest.get("record") != _record_identity(entry)
        ):
            status["missing"].append(case_id)
        elif _location_set(max_per_class, seed) not in manifest.get("location_sets", []):
            status["locations"].append(case_id)
        else:
            status["done"].append(case_id)
    return status


def _save_npy(path: Path, array: np.ndarray) -> None:
    with atomic_path(path, suffix=".npy") as tmp, open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)


def _locations(label: np.ndarray, num_classes: int, max_per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`tfmis.transforms.crop.foreground_indices` of `label`, without its whole-volume index tensors: the crops drawn
    from these locations are the crops the cached volumes give (tested equal), in a fraction of the memory.

    `foreground_indices` keeps, of class c's n voxels in C order, those at the first `max_per_class` positions of
    `argsort(stateless_uniform([n], [seed, c]))`, in C order. TensorFlow's argsort is a top_k of the negated values
    (ties: the lower index first), so the same positions are `top_k(-u, max_per_class)`; they are then found slab by
    slab (counts per x-slab, then the voxels of the slabs that hold kept positions), never as an (n, 3) array."""
    import tensorflow as tf

    fg, classes = [], []
    slab = max(1, (1 << 21) // max(1, int(np.prod(label.shape[1:]))))  # ~2 M voxels (48 MB of indices) a slab
    for c in range(1, num_classes):
        counts = np.array([np.count_nonzero(label[x : x + slab] == c) for x in range(0, label.shape[0], slab)])
        n = int(counts.sum())
        if n == 0:
            continue
        u = tf.random.stateless_uniform([n], seed=[seed, c])
        keep = np.sort(tf.math.top_k(-u, k=min(max_per_class, n)).indices.numpy().astype(np.int64))
        del u
        starts = np.concatenate([[0], np.cumsum(counts)])
        for number, x in enumerate(range(0, label.shape[0], slab)):
            lo, hi = np.searchsorted(keep, [starts[number], starts[number + 1]])
            if hi > lo:
                voxels = np.argwhere(label[x : x + slab] == c)[keep[lo:hi] - starts[number]]
                voxels[:, 0] += x
                fg.append(voxels.astype(np.int32))
                classes.append(np.full(hi - lo, c, np.int32))
    if not fg:
        return np.zeros((0, 3), np.int32), np.zeros((0,), np.int32)
    return np.concatenate(fg), np.concatenate(classes)


def write_patch_layout(
    dataset_dir: str | Path,
    case_ids: list[str],
    num_classes: int,
    max_per_class: int,
    seed: int,
    progress: bool = False,
) -> dict:
    """Writes (or completes) the patch-read layout of `case_ids` of a converted dataset; returns its summary
    {"cases", "written", "shared", "relocated", "seconds", "bytes"}.

    A case whose record has the same content (sha256) as a case of a sibling conversion of the same data (the
    train/val/test conversion `<dir>` and its K-fold ones `<dir>-folds<K>`: `_share_from_siblings`) shares its
    arrays: hard links, not a second copy (`shared`).

    Resumable and idempotent: cases already written from their current record are left alone; a case without class
    locations of this `seed` and `max_per_class` gets them beside its others (a run of another seed reading its own
    meanwhile is not disturbed). Reads the records of the
    cases to write without TensorFlow, each shard once, one case in memory at a time (its record's bytes, the
    arrays written from views of them).
    """
    start = time.perf_counter()
    index = load_index(dataset_dir)
    folder = arrays_dir(dataset_dir)
    folder.mkdir(parents=True, exist_ok=True)
    status = layout_status(dataset_dir, case_ids, max_per_class, seed)
    shared = _share_from_siblings(dataset_dir, index, status["missing"])
    todo = set(status["missing"]) - set(shared)
    status["locations"] += [c for c in shared if c not in status["locations"]]  # the twin's sets may lack ours
    check_free_space(folder, [index["cases"][c] for c in sorted(todo)], index["preprocessing"]["image_dtype"])
    for case_id in status["locations"]:  # arrays are there: the label map gives the locations
        if _location_set(max_per_class, seed) in (_case_manifest(folder, case_id) or {}).get("location_sets", []):
            continue  # a shared case whose twin had them
        label = np.load(folder / f"{case_id}.label.npy")
        fg, fg_class = _locations(label, num_classes, max_per_class, seed)
        del label
        _write_locations(folder, case_id, max_per_class, seed, fg, fg_class)
        manifest = _case_manifest(folder, case_id)
        manifest["location_sets"] = [*manifest.get("location_sets", []), _location_set(max_per_class, seed)]
        atomic_write_json(folder / f"{case_id}.json", manifest)
    prep = index["preprocessing"]
    by_file: dict[str, list[dict]] = {}
    for entry in index["cases"].values():
        if entry["case_id"] in todo:
            by_file.setdefault(entry["file"], []).append(entry)
    written = 0
    for file, entries in sorted(by_file.items()):
        path = Path(dataset_dir) / file
        for entry, payload in read_record_payloads(path, entries, prep["compression"]):
            case_id = entry["case_id"]
            try:
                record = decode_example(payload, prep["image_dtype"])
            except ValueError as err:
                raise DataError(
                    f"{path}: the record of case {case_id!r} cannot be read ({err}); convert the dataset again"
                ) from None
            if record["case_id"] != case_id:
                raise DataError(
                    f"{path}: the record index.json gives case {case_id!r} holds {record['case_id']!r}; "
                    "convert the dataset again"
                )
            image, label = record["image"], record["label"]  # views of the payload: the case is in memory once
            if label.shape[0] == 0:
                raise DataError(f"{dataset_dir}: case {case_id!r} has no label map; only labelled cases train")
            _save_npy(folder / f"{case_id}.image.npy", image)
            _save_npy(folder / f"{case_id}.label.npy", label)
            fg, fg_class = _locations(label, num_classes, max_per_class, seed)
            _write_locations(folder, case_id, max_per_class, seed, fg, fg_class)
            atomic_write_json(
                folder / f"{case_id}.json",
                {
                    "version": LAYOUT_VERSION,
                    "case_id": case_id,
                    "record": _record_identity(entry),
                    "shape": list(label.shape),
                    "channels": int(image.shape[-1]),
                    "image_dtype": str(image.dtype),
                    "location_sets": [_location_set(max_per_class, seed)],
                },
            )
            written += 1
            del record, image, label, payload  # before the next record is read
            if progress:
                print(f"  patch layout: {written}/{len(todo)} cases written ({case_id})", flush=True)
    return {
        "cases": len(case_ids),
        "written": written,
        "shared": len(shared),
        "relocated": len(status["locations"]),
        "seconds": time.perf_counter() - start,
        "bytes": layout_bytes(dataset_dir, case_ids),
    }


SPACE_MARGIN = 1.05  # the class locations and manifests on top of the arrays, and a little room left


def arrays_size(entries: list[dict], image_dtype: str) -> int:
    """Bytes the arrays of these index entries take: each image (x, y, z, C) in the records' dtype and its uint8
    label (the class locations and manifests are small beside them: `SPACE_MARGIN`)."""
    item = np.dtype(image_dtype).itemsize
    return sum(int(np.prod(e["image_shape"])) * item + int(np.prod(e["image_shape"][:3])) for e in entries)


def check_free_space(folder: Path, entries: list[dict], image_dtype: str) -> None:
    """Refuses (ResourceError, one line) to start writing arrays that the disk under `folder` cannot hold: a full
    disk mid-way would end in a traceback and half-written files."""
    need = SPACE_MARGIN * arrays_size(entries, image_dtype)
    free = shutil.disk_usage(folder).free
    if need > free:
        raise ResourceError(
            f"{folder}: the patch-read arrays of {len(entries)} case(s) need {need / 2**30:.2f} GB and the disk has "
            f"{free / 2**30:.2f} GB free; free space there, or convert to a --target-dir on a larger disk"
        )


def sibling_datasets(dataset_dir: str | Path) -> list[Path]:
    """The other conversions of the same data beside `dataset_dir`: `<base>` and `<base>-folds<K>` (where
    `tfmis.config.checks.folds_dataset_dir` puts a K-fold conversion), those holding patch-read arrays."""
    here = Path(dataset_dir).resolve()
    base = re.sub(r"-folds\d+$", "", here.name)
    found = []
    for candidate in sorted(here.parent.iterdir()) if here.parent.is_dir() else []:
        if candidate != here and re.fullmatch(re.escape(base) + r"(-folds\d+)?", candidate.name):
            if (candidate / ARRAYS_DIR).is_dir():
                found.append(candidate)
    return found


def _share_from_siblings(dataset_dir: str | Path, index: dict, case_ids: list[str]) -> list[str]:
    """Links the arrays of `case_ids` from a sibling conversion's case of the same record content (sha256, layout
    version, shape and dtype) into this dataset's folder, with every set of class locations it has; returns the
    cases shared. Each link is made under a temporary name and renamed into place, the manifest last, so a case is
    shared whole or not at all; where links cannot be made (another file system) the case is written as usual."""
    folder = arrays_dir(dataset_dir)
    wanted = {c: index["cases"][c] for c in case_ids if index["cases"][c].get("sha256")}
    shared = []
    for sibling in sibling_datasets(dataset_dir) if wanted else []:
        other_index = load_index(sibling)
        by_digest = {e.get("sha256"): c for c, e in other_index["cases"].items() if e.get("sha256")}
        for case_id, entry in list(wanted.items()):
            twin = by_digest.get(entry["sha256"])
            manifest = _case_manifest(arrays_dir(sibling), twin) if twin else None
            if (
                manifest is None
                or manifest.get("version") != LAYOUT_VERSION
                or manifest.get("record") != _record_identity(other_index["cases"][twin])
                or other_index["preprocessing"]["image_dtype"] != index["preprocessing"]["image_dtype"]
            ):
                continue
            source = arrays_dir(sibling)
            names = [(f"{twin}.image.npy", f"{case_id}.image.npy"), (f"{twin}.label.npy", f"{case_id}.label.npy")]
            sets = manifest.get("location_sets", [])
            names += [
                (locations_file(source, twin, **ls).name, locations_file(folder, case_id, **ls).name) for ls in sets
            ]
            try:
                for old, new in names:
                    temporary = folder / f".{new}.link"
                    temporary.unlink(missing_ok=True)
                    os.link(source / old, temporary)
                    os.replace(temporary, folder / new)
            except OSError:
                continue
            own = {**manifest, "case_id": case_id, "record": _record_identity(entry), "shared_from": str(sibling)}
            atomic_write_json(folder / f"{case_id}.json", own)
            shared.append(case_id)
            del wanted[case_id]
    return shared


def _location_set(max_per_class: int, seed: int) -> dict:
    return {"max_per_class": int(max_per_class), "seed": int(seed)}


def locations_file(folder: Path, case_id: str, max_per_class: int, seed: int) -> Path:
    """The file of a case's class locations for one training seed and per-class count."""
    return folder / f"{case_id}.locations-s{int(seed)}-n{int(max_per_class)}.npz"


def _write_locations(folder: Path, case_id: str, max_per_class: int, seed: int, fg, fg_class) -> None:
    with atomic_path(locations_file(folder, case_id, max_per_class, seed), suffix=".npz") as tmp, open(tmp, "wb") as f:
        np.savez(f, fg=fg, fg_class=fg_class)


def layout_bytes(dataset_dir: str | Path, case_ids: list[str]) -> int:
    """Bytes on disk of the layout's files of `case_ids` (every set of class locations included)."""
    folder = arrays_dir(dataset_dir)
    total = 0
    for c in case_ids:
        files = [folder / f"{c}{s}" for s in (".image.npy", ".label.npy", ".json")]
        total += sum(f.stat().st_size for f in [*files, *folder.glob(f"{c}.locations-*.npz")] if f.exists())
    return total


def check_locations(arrays: PatchArrays, max_per_class: int, seed: int) -> None:
    """Refuses (ConfigError) arrays without class locations indexed with the run's `training.seed` and
    `pipeline.max_foreground_indices` (their crops would not be the volume pipeline's); else `arrays` reads those."""
    wanted = _location_set(max_per_class, seed)
    for case_id, manifest in zip(arrays.case_ids, arrays.manifests):
        if wanted not in manifest.get("location_sets", []):
            raise ConfigError(
                f"{arrays.folder / (case_id + '.json')}: class locations indexed with {manifest.get('location_sets')}, "
                f"the run samples with {wanted} (pipeline.max_foreground_indices, training.seed); they are "
                "indexed at training start (tfmis.data.patch_layout.write_patch_layout)"
            )
    arrays.location_set = wanted


def training_cases(dataset_dir: str | Path, split: str) -> list[str]:
    """The case ids of a training split (a name or joined names), in storage order."""
    return [c["case_id"] for c in split_cases(load_index(dataset_dir), split)]


def _open_cases_allowed(wanted: int, folder: Path) -> int:
    """`wanted` cases' files (two descriptors each), fewer when the open-file limit has no room for them beside the
    files open now and `FD_MARGIN` for what opens later (TensorFlow's threads, checkpoints, logs); refused
    (ResourceError, one line) when not even one case fits."""
    from tfmis.hardware import open_files

    files = open_files()
    if files is None or files[1] is None:  # unknown or unlimited: the map count alone bounds them
        return max(1, wanted)
    open_now, soft = files
    room = (soft - open_now - FD_MARGIN) // 2
    if room < 1:
        raise ResourceError(
            f"{folder}: the open-file limit {soft} leaves no room for a case's two array files beside the {open_now} "
            f"files open and {FD_MARGIN} kept for others; raise it (ulimit -n 4096)"
        )
    return max(1, min(wanted, room))


class _CaseFiles:
    """One case's open array files: (file, data offset, shape, dtype) for the image and the label. Readers hold a
    reference while they read, so an eviction from the LRU closes a file only once its last read is done."""

    def __init__(self, folder: Path, case_id: str, drop_pages: bool = False):
        self.image = self._open(folder / f"{case_id}.image.npy", drop_pages)
        self.label = self._open(folder / f"{case_id}.label.npy", drop_pages)

    @staticmethod
    def _open(path: Path, drop_pages: bool) -> tuple:
        f = open(path, "rb", buffering=0)
        if drop_pages and hasattr(os, "posix_fadvise"):  # no read-ahead: it would cache pages no crop asked for
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        try:  # the .npy header: shape, dtype and where the data starts
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
        except Exception:
            f.close()
            raise
        if fortran:
            f.close()
            raise DataError(f"{path}: a Fortran-order array; the layout writes C order: write it again")
        if drop_pages and hasattr(os, "posix_fadvise"):
            _drop(f.fileno(), 0, f.tell())  # the header's page
        return f, f.tell(), tuple(shape), np.dtype(dtype)


def _read_box(files: tuple, lo, hi, out: np.ndarray, dst: tuple, drop_pages: bool) -> None:
    """Copies [lo, hi) of a C-order .npy array (x, y, z[, C]) into `out[dst]` with positional reads, one per x: the
    rows y of the box with every z (contiguous on disk), z cut in memory. With `drop_pages` the page cache of the
    range read is given back at once (posix_fadvise DONTNEED), so that neither the process (no map: its RSS) nor its
    cgroup (the page cache) keeps what was read."""
    f, offset, shape, dtype = files
    fd = f.fileno()
    row = int(np.prod(shape[2:])) * dtype.itemsize  # one (x, y) row: every z and channel
    count = int(hi[1] - lo[1]) * row
    first = offset + (int(lo[0]) * shape[1] + int(lo[1])) * row
    for i, x in enumerate(range(int(lo[0]), int(hi[0]))):
        start = offset + (x * shape[1] + int(lo[1])) * row
        data = os.pread(fd, count, start)
        if len(data) != count:
            raise DataError(f"{f.name}: {len(data)} bytes at {start} where {count} were expected (truncated?)")
        block = np.frombuffer(data, dtype).reshape(int(hi[1] - lo[1]), *shape[2:])[:, int(lo[2]) : int(hi[2])]
        out[(dst[0].start + i, dst[1], dst[2])] = block
    if drop_pages and hasattr(os, "posix_fadvise"):
        _drop(fd, first, start + count)


def _drop(fd: int, start: int, stop: int) -> None:
    """Gives the page cache of bytes [start, stop) of `fd` back, the pages they touch whole (the kernel drops only
    the pages a range covers entirely)."""
    page = mmap.PAGESIZE
    low, high = start // page * page, -(-stop // page) * page
    os.posix_fadvise(fd, low, high - low, os.POSIX_FADV_DONTNEED)


class PatchArrays:
    """The patch-read layout of `case_ids`: crops and label lookups read only what they cover.

    Cases are addressed by their position in `case_ids`. Every case's arrays must come from its current record in
    index.json (refused otherwise: `DataError`). Reads are positional (`os.pread`), never memory maps, so the pages
    read count in no process's RSS; with `drop_pages` they leave the page cache too, which a cgroup is charged for
    (`tfmis.data.memory_budget.keeps_pages` decides: only when the arrays do not fit beside the input's budget, where a
    cache would not hold them anyway). The files open on first use; at most `max_open` cases keep theirs open (a
    descriptor each file), the least recently used closed first; the class locations of the last
    `LOCATION_CASES` cases stay loaded (what the budget counts).
    """

    def __init__(
        self, dataset_dir: str | Path, case_ids: list[str], max_open: int = MAX_OPEN_CASES, drop_pages: bool = False
    ):
        self.folder = arrays_dir(dataset_dir)
        self.case_ids = list(case_ids)
        self.max_open = _open_cases_allowed(int(max_open), self.folder)
        self.drop_pages = bool(drop_pages)
        self.manifests = []
        records = load_index(dataset_dir)["cases"]
        for case_id in self.case_ids:
            manifest = _case_manifest(self.folder, case_id)
            if manifest is None:
                raise MissingInput(
                    f"{self.folder}: case {case_id!r} has no patch-read arrays; they are written at training start "
                    "with pipeline.cache=patches (or run tfmis-convert with --patch-layout)"
                )
            entry = records.get(case_id)
            if manifest.get("version") != LAYOUT_VERSION:
                raise DataError(
                    f"{self.folder / (case_id + '.json')}: the arrays of case {case_id!r} are of layout version "
                    f"{manifest.get('version')}, this tfmis reads {LAYOUT_VERSION}; write them again (tfmis-convert "
                    "--patch-layout, or train with pipeline.cache=patches, which does it at the start)"
                )
            if entry is None or manifest.get("record") != _record_identity(entry):
                raise DataError(
                    f"{self.folder / (case_id + '.json')}: the arrays of case {case_id!r} were written from another "
                    "conversion than the records in index.json; write them again (tfmis-convert --patch-layout, or "
                    "train with pipeline.cache=patches, which does it at the start)"
                )
            self.manifests.append(manifest)
        # the class locations read: the run's (`check_locations` sets it), else each case's first set
        self.location_set: dict | None = None
        self._files: OrderedDict[int, _CaseFiles] = OrderedDict()
        self._lock = threading.Lock()
        self._locations: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    @property
    def shapes(self) -> np.ndarray:
        """(N, 3) int32: each case's (x, y, z)."""
        return np.array([m["shape"] for m in self.manifests], np.int32).reshape(-1, 3)

    @property
    def channels(self) -> int:
        return int(self.manifests[0]["channels"]) if self.manifests else 0

    @property
    def open_cases(self) -> int:
        """Cases whose files are open now (at most `max_open`)."""
        return len(self._files)

    @property
    def loaded_locations(self) -> int:
        """Cases whose class locations are loaded now (at most `LOCATION_CASES`)."""
        return len(self._locations)

    def _case(self, case: int) -> _CaseFiles:
        with self._lock:  # tf.data's reader threads share this instance
            if case in self._files:
                self._files.move_to_end(case)
                return self._files[case]
            while len(self._files) >= self.max_open:  # the last reference dropped closes its files
                self._files.popitem(last=False)
            case_id = self.case_ids[case]
            try:
                files = _CaseFiles(self.folder, case_id, self.drop_pages)
            except OSError as e:
                if e.errno == errno.EMFILE:
                    raise ResourceError(
                        f"{self.folder}: too many open files opening case {case_id!r}'s arrays "
                        f"({2 * len(self._files)} held by the open cases, the rest by the process's other files); "
                        "raise the limit (ulimit -n 4096)"
                    ) from None
                raise
            self._files[case] = files
            return files

    def locations(self, case: int) -> tuple[np.ndarray, np.ndarray]:
        """The case's class locations (fg (K, 3) int32, fg_class (K,) int32), as indexed when it was written."""
        with self._lock:
            if case in self._locations:
                self._locations.move_to_end(case)
                return self._locations[case]
        chosen = self.location_set or self.manifests[case]["location_sets"][0]
        path = locations_file(self.folder, self.case_ids[case], chosen["max_per_class"], chosen["seed"])
        with np.load(path) as stored:
            found = (stored["fg"].astype(np.int32), stored["fg_class"].astype(np.int32))
        with self._lock:
            self._locations[case] = found
            while len(self._locations) > LOCATION_CASES:
                self._locations.popitem(last=False)
        return found

    def labels_at(self, case: int, indices: np.ndarray) -> np.ndarray:
        """The labels at (N, 3) voxel indices inside the volume (uint8, (N,)): one byte read each."""
        f, offset, shape, _ = self._case(case).label
        indices = np.asarray(indices, np.int64).reshape(-1, 3)
        flat = (indices[:, 0] * shape[1] + indices[:, 1]) * shape[2] + indices[:, 2]
        return np.array([os.pread(f.fileno(), 1, offset + int(i))[0] for i in flat], np.uint8)

    def window(self, case: int, origin, size, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
        """The `size` window at `origin` (voxels; negative or past the end = zeros there), as
        `tfmis.transforms.augment.window` cuts it from the decoded volume: image (*size, C) as `dtype`, label (*size)
        uint8, read straight into place (`_read_box`)."""
        files = self._case(case)
        origin, size = np.asarray(origin, np.int64), np.asarray(size, np.int64)
        shape = np.asarray(files.label[2], np.int64)
        lo, hi = np.clip(origin, 0, shape), np.clip(origin + size, 0, shape)
        out_image = np.zeros((*size, files.image[2][-1]), dtype)
        out_label = np.zeros(tuple(size), np.uint8)
        if np.all(hi > lo):
            dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, origin))
            _read_box(files.image, lo, hi, out_image, dst, self.drop_pages)
            _read_box(files.label, lo, hi, out_label, dst, self.drop_pages)
        return out_image, out_label
