"""Atomic file writes: a reader never sees a half-written file, a crash never leaves one."""

from __future__ import annotations

import contextlib
import json
import os
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
