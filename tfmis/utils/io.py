"""Files written atomically (a reader never sees a half-written file, a crash never leaves one) and log tails."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path


@contextlib.contextmanager
def atomic_writer(path: str | Path, mode: str = "w"):
    """Opens `path.tmp` for writing and renames it to `path` only if the block succeeds.

    Example:
    ```python
    with atomic_writer("results.csv") as f:
        f.write("epoch,loss\\n")
    ```
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
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
