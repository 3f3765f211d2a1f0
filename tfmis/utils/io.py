"""Files written atomically (a reader never sees a half-written file, a crash never leaves one) under per-writer
temporary names, the removal of dead writers' temporaries, JSON-lines logs and log tails."""

from __future__ import annotations

import contextlib
import errno
import functools
import gzip
import json
import os
import re
import secrets
import socket
import time
from pathlib import Path
from typing import NamedTuple

# Another host's temporary cannot be checked for a live writer; one its writer has not touched for this long is
# gone (a temporary lives for one write, and the clocks of hosts sharing a file system agree far better than this)
OTHER_HOST_STALE_SECONDS = 24 * 3600
# `<target>.<host>.<pid>.<random>.tmp<suffix>`
_TEMP_NAME = re.compile(r"(?P<target>.+)\.(?P<host>[\w-]+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp(?P<suffix>(\.\w+)*)", re.A)


class TempName(NamedTuple):
    """What a temporary's name (`temp_path`) says: the file it becomes, its writer's host and pid, its suffix."""

    target: str
    host: str
    pid: int
    suffix: str


@functools.cache
def host_name(hostname: str | None = None) -> str:
    """A short name of this host (or of `hostname`) that is safe in a file name: the first label of the host
    name, with characters other than letters, digits, `_` and `-` replaced by `-`."""
    first = (socket.gethostname() if hostname is None else hostname).split(".")[0]
    return re.sub(r"[^A-Za-z0-9_-]", "-", first)[:64] or "host"


def temp_path(path: str | Path, suffix: str = "") -> Path:
    """The temporary name for writing `path`, unique to this writer: `<name>.<host>.<pid>.<random>.tmp<suffix>`
    in the same folder (a rename within one file system is atomic). `suffix` only for a library that picks its
    format from the name (Keras' `.weights.h5`); `parse_temp_name` reads it back."""
    path = Path(path)
    return path.with_name(f"{path.name}.{host_name()}.{os.getpid()}.{secrets.token_hex(4)}.tmp{suffix}")


def parse_temp_name(name: str) -> TempName | None:
    """The target, host, pid and suffix in a `temp_path` name; None for any other name."""
    match = _TEMP_NAME.fullmatch(name)
    if match is None:
        return None
    return TempName(match["target"], match["host"], int(match["pid"]), match["suffix"])


def fsync_dir(folder: str | Path) -> None:
    """Makes a rename (or a new file) in `folder` durable: fsync of the directory itself."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def writer_alive(path: str | Path) -> bool:
    """Whether the writer of the `temp_path` temporary `path` may still be writing it; False for other names.

    On this host: whether its pid is alive (this process counts as alive). Another host's writer cannot be
    asked: alive unless the temporary has not changed for `OTHER_HOST_STALE_SECONDS`.
    """
    path = Path(path)
    writer = parse_temp_name(path.name)
    if writer is None:
        return False
    if writer.host != host_name():
        try:
            return time.time() - path.stat().st_mtime < OTHER_HOST_STALE_SECONDS
        except FileNotFoundError:
            return False
    return writer.pid == os.getpid() or _alive(writer.pid)


def remove_temp_files(folder: str | Path) -> list[Path]:
    """Removes the `temp_path` temporaries in `folder` and its subfolders whose writer is gone (`writer_alive`);
    returns them, sorted.

    Called by `tfmis.utils.lock.folder_lock` when it takes a folder's lock, and only there: a locked folder's
    writers are its lock holder and the few that write next to it without the lock (e.g. `tfmis-monitor`), so a
    temporary the holder finds there is a dead writer's (removed) or one of theirs (kept: its writer is alive).
    A process refused the lock removes nothing; a file this process may not remove is left in place.
    """
    removed = []
    for parent, _, files in os.walk(folder):
        for name in files:
            tmp = Path(parent) / name
            if parse_temp_name(name) is None or writer_alive(tmp):
                continue
            with contextlib.suppress(FileNotFoundError, PermissionError):
                tmp.unlink()
                removed.append(tmp)
    return sorted(removed)


DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
# how a full disk reads when the errno is lost on the way (TensorFlow's ResourceExhaustedError, h5py's RuntimeError)
DISK_FULL_TEXTS = ("no space left on device", "file too large", "disk quota exceeded", "errno = 28", "errno = 27")


def is_disk_full(error: BaseException) -> bool:
    """True when `error` (an OSError, or a library's error wrapping one) says the disk or a file size limit is full."""
    if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
        return True
    text = str(error).lower()
    return any(t in text for t in DISK_FULL_TEXTS)


@contextlib.contextmanager
def atomic_path(path: str | Path, suffix: str = ""):
    """Yields a temporary path next to `path` (`temp_path`) for a writer that takes a path (TensorFlow's
    TFRecordWriter, Keras' `save_weights`); renames the file written there to `path` only if the block succeeds.

    The file is fsynced before the rename and the folder after it, so after a crash `path` holds the old or the
    new version, whole. Each call has its own temporary, removed on every exit path (an exception in the block,
    a failed rename): any number of threads and processes may write one file at once, and the file always holds
    one writer's complete version (the last rename wins). A writer killed in the block leaves its temporary to
    `remove_temp_files`.

    Example:
    ```python
    with atomic_path("run/best.weights.h5", suffix=".weights.h5") as tmp:
        model.save_weights(str(tmp))
    ```
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path, suffix)
    try:
        try:
            yield tmp
        except Exception as e:  # a full disk as a library reports it (no errno, no file): named as this file
            if is_disk_full(e) and not getattr(e, "filename", None):
                code = e.errno if isinstance(e, OSError) and e.errno else errno.ENOSPC
                raise OSError(code, os.strerror(code), str(path)) from e
            raise
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


@contextlib.contextmanager
def atomic_writer(path: str | Path, mode: str = "w"):
    """Opens a temporary file next to `path` and renames it to `path` only if the block succeeds (`atomic_path`:
    durable, whole, no temporary left on any exit path).

    Example:
    ```python
    with atomic_writer("results.csv") as f:
        f.write("epoch,loss\\n")
    ```
    """
    with atomic_path(path) as tmp, open(tmp, mode) as f:
        yield f


def atomic_write_json(path: str | Path, obj) -> None:
    with atomic_writer(path) as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.write("\n")


def atomic_save_nifti(img, path: str | Path) -> None:
    """Saves a single-file nibabel image (`Nifti1Image`, `Nifti2Image`) to `path` (`.nii`, or `.nii.gz`
    compressed) through `atomic_writer`: the image streams into the temporary (no second copy of its data in
    memory), and `path` holds the old or the new image, whole.

    The bytes are those `nibabel.save` writes (gzip level 1, no name or time in the gzip header).
    """
    path = Path(path)
    if not path.name.endswith((".nii", ".nii.gz")):
        raise ValueError(f"{path}: a NIfTI file name ends with .nii or .nii.gz")
    file_map = img.file_map  # to_stream points the image at the stream: keep its own files
    try:
        with atomic_writer(path, "wb") as f:
            if path.name.endswith(".gz"):
                with gzip.GzipFile(filename="", mode="wb", compresslevel=1, fileobj=f, mtime=0) as gz:
                    img.to_stream(gz)
            else:
                img.to_stream(f)
    finally:
        img.file_map = file_map


def log_tail(path: str | Path, max_bytes: int = 16384) -> list[str]:
    """The non-empty lines of a log's last `max_bytes` that may say why a process died: TensorFlow's startup
    notices (`I0000 ...`, "All log messages before absl...") and faulthandler's list of extension modules
    left out."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return [
        line
        for line in lines
        if not re.match(r"I\d{4} |WARNING: All log messages before absl|Extension modules: ", line)
    ]


def append_json_line(path: str | Path, record: dict) -> None:
    """One JSON line appended to the log at `path` with a single write: O_APPEND keeps the lines of concurrent
    writers (processes, nodes on one file system) whole."""
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_json_lines(path: str | Path) -> list[dict]:
    """Every complete line of the JSON-lines log at `path` ([] when there is none); a line cut by a kill is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records
