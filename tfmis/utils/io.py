"""Files written atomically (a reader never sees a half-written file, a crash never leaves one) and log tails."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from pathlib import Path

TEMP_SUFFIX = ".tmp"


def temp_path(path: str | Path) -> Path:
    """A temporary name for writing `path`, unique to this writer: `<name>.<pid>.<random>.tmp` in the same folder
    (a rename within one file system is atomic), so that two writers of one file never share a temporary."""
    path = Path(path)
    return path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


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


def writer_alive(path: str | Path, including_self: bool = True) -> bool:
    """Whether the writer of a `temp_path` temporary (the pid in its name) is alive on this host; False for
    other names. `including_self=False`: this process's own temporaries count as not alive."""
    writer = re.search(r"\.(\d+)\.[0-9a-f]{8}" + re.escape(TEMP_SUFFIX), Path(path).name)
    if writer is None:
        return False
    pid = int(writer.group(1))
    return including_self if pid == os.getpid() else _alive(pid)


def remove_temp_files(folder: str | Path) -> list[Path]:
    """Removes the `*.tmp` files directly in `folder` whose writer is gone; returns them.

    For a folder whose lock (`tfmis.utils.lock.folder_lock`) this process holds: every writer of such a folder
    holds its lock, so a temporary left there belongs to a writer that died. As a second guard, a temporary
    whose writer (the pid in its `temp_path` name) is alive on this host is kept: a process that writes into
    the folder without its lock (e.g. `tfmis-monitor` next to a run) never loses its temporary.
    """
    removed = []
    for tmp in Path(folder).glob("*" + TEMP_SUFFIX):
        if writer_alive(tmp):
            continue
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
            removed.append(tmp)
    return removed


@contextlib.contextmanager
def atomic_writer(path: str | Path, mode: str = "w"):
    """Opens a temporary file next to `path` (`temp_path`) and renames it to `path` only if the block succeeds.

    The data are fsynced before the rename and the folder after it, so after a crash `path` holds the old or
    the new version, whole. Each call has its own temporary, removed on every exit path (an exception in the
    block, a failed rename): any number of threads and processes may write one file at once, and the file
    always holds one writer's complete version (the last rename wins).

    Example:
    ```python
    with atomic_writer("results.csv") as f:
        f.write("epoch,loss\\n")
    ```
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def atomic_write_json(path: str | Path, obj) -> None:
    with atomic_writer(path) as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.write("\n")


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
