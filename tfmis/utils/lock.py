"""One writer per folder: an exclusive `fcntl.flock` on `<folder>/.tfmis.lock`, naming its holder.

A training run holds its run folder's lock for the whole run (`--resume` included) and a conversion holds its
target's, so a second run or conversion into the same folder stops at once with one line naming the holder
instead of mixing its files with the first one's. A training that only needs the converted data waits for the
conversion instead (`wait=True`).

Example:
```python
with folder_lock("runs/demo", "tfmis-train"):
    ...  # the only process writing runs/demo
```
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from tfmis.errors import RunStateError
from tfmis.utils.io import remove_temp_files

LOCK_FILE = ".tfmis.lock"
WAIT_POLL_S = 0.5  # how often a waiting process tries the lock again

_held: dict[str, list] = {}  # resolved lock path -> [fd, depth]: this process's locks (re-entrant)
_guard = threading.Lock()


class FolderLocked(RunStateError):
    """Another live process holds the folder's lock; the message names it (pid, host, since when, command)."""


def _holder_text(path: Path) -> str:
    """`pid P on host H since T (command)` from a lock file (the holder writes it right after locking)."""
    info = None
    for _ in range(50):  # the holder may be between its flock and its write: read again, briefly
        try:
            info, _ = json.JSONDecoder().raw_decode(path.read_text())
            break
        except (OSError, ValueError):
            time.sleep(0.01)
    if not isinstance(info, dict):
        return "a process that has not written its name yet"
    return f"pid {info.get('pid')} on host {info.get('host')} since {info.get('since')}" + (
        f" ({info['command']})" if info.get("command") else ""
    )


@contextlib.contextmanager
def folder_lock(folder: str | Path, command: str | None = None, wait: bool = False):
    """Holds an exclusive lock on `folder` (created if missing) while the block runs.

    The lock is `fcntl.flock(LOCK_EX | LOCK_NB)` on `<folder>/.tfmis.lock`; after taking it the holder writes its
    pid, host, start time (UTC) and `command` into that file, so that a refused process can say who holds it.

    Stale locks: the kernel drops a flock when the last descriptor of its open file closes, which happens when
    the holding process exits or is killed (SIGKILL, OOM killer, a crash). A lock file whose flock can be taken
    is therefore stale by definition: its previous holder is dead, and its file (left in place, never deleted:
    deleting it would let two processes lock two different files of one name) is simply taken over and
    rewritten. The descriptor is close-on-exec, and tfmis starts its worker processes with `spawn`, so no child
    keeps a dead holder's lock alive.

    Re-entrant within one process: the train command holds its run folder's lock and `Trainer.fit` takes it
    again (a count, one descriptor); it guards against other processes, not other threads of this one.

    Temporaries: on taking the lock (not again when re-entered) the holder removes what writers that died left
    below the folder (`tfmis.utils.io.remove_temp_files`, which keeps a live writer's temporaries). Only the
    holder does: a refused process leaves the folder as it found it, and without flock support nothing is
    removed.

    On a file system without flock support (some network file systems) the block runs unlocked after a
    warning on stderr; NFS emulates flock with its own byte-range locks, so the lock holds across nodes there.

    Args:
        folder: the folder written by the block.
        command: what holds it, for the refused process's message (e.g. "tfmis-train"); default: this
            process's command line.
        wait: when another live process holds the lock, wait until it ends (one line on stderr names the holder)
            instead of raising; for a process that needs what the holder makes (a training that needs its data
            converted), not for one that would write the same files.

    Yields:
        True if the lock is held (False on a file system without locks).

    Raises:
        FolderLocked: another live process holds the lock (not with `wait`).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    key = str(path.resolve())
    with _guard:
        if key in _held:
            _held[key][1] += 1
            fd = None
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    if fd is None:  # already ours
        try:
            yield True
        finally:
            with _guard:
                _held[key][1] -= 1
        return
    unsupported = None
    try:
        _flock(fd, path, folder, wait)
    except BlockingIOError:
        os.close(fd)
        raise FolderLocked(
            f"{folder} is in use by {_holder_text(path)} (lock file {path}); wait for it to finish, or stop it, "
            "or write somewhere else"
        ) from None
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        unsupported = e.strerror
    except BaseException:  # Ctrl-C while waiting
        os.close(fd)
        raise
    if unsupported is not None:
        print(f"warning: cannot lock {folder} ({unsupported}): going on without a lock", file=sys.stderr)
        yield False
        return
    try:
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        }
        data = (json.dumps(info) + "\n").encode()
        os.pwrite(fd, data, 0)  # then cut the old holder's longer tail: a reader takes the first JSON object
        os.ftruncate(fd, len(data))
        with _guard:
            _held[key] = [fd, 1]
        try:
            remove_temp_files(folder)
            yield True
        finally:
            with _guard:
                del _held[key]
    finally:
        os.close(fd)  # releases the flock; the file stays


def _flock(fd: int, path: Path, folder: Path, wait: bool) -> None:
    """Takes the flock on `fd`; raises BlockingIOError when another process holds it, or with `wait` polls until
    it is free (a poll, not a blocking flock: Ctrl-C stays immediate, and NFS's emulated flock is polled alike)."""
    announced = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if not wait:
                raise
        if not announced:
            print(f"waiting for {folder}: in use by {_holder_text(path)}", file=sys.stderr, flush=True)
            announced = True
        time.sleep(WAIT_POLL_S)


def holds_lock(folder: str | Path) -> bool:
    """Whether this process holds `folder`'s lock."""
    with _guard:
        return str((Path(folder) / LOCK_FILE).resolve()) in _held
