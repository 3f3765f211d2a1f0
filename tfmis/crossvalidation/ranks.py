"""The ranks of a launch (`mpirun`, `srun`, `tfmis-launch`) running a cross-validation: each rank's share of its
machine, and waits that end.

- **A share per rank.** The ranks on one machine (the launch's local size) split its usable cores and its GPUs as
  `--workers` does: rank r's fold trainings see only its GPUs (`CUDA_VISIBLE_DEVICES`), run on its cores (affinity)
  with as many threads. A rank the launcher already bound to some cores keeps them.
- **Heartbeats.** Every rank rewrites `<cv>/ranks/rank<r>.json` every `HEARTBEAT_SECONDS` (a counter, its host, pid
  and state) from a thread, also while its fold trains. A waiting rank judges another by its own clock: a counter
  that has not moved for `timeout` seconds (`--rank-timeout`) is a rank that died (killed, its node lost), and a
  `failed` state a rank that stopped with an error. Either ends the wait with one line naming the rank, its host
  and pid, so no rank waits forever: rank 0 for the others to end, the others for rank 0's preparation.

Example:
```python
with Heartbeat(cv_dir, rank=1, job=launch.job_id):
    wait_for_definition(cv_dir, DEFINITION_FILE, launch.job_id, timeout=300)   # rank 0 failed or went silent: raises
```
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from tfmis.errors import TrainingFailed
from tfmis.utils.io import atomic_write_json

RANKS_DIR = "ranks"
HEARTBEAT_SECONDS = 10.0
RANK_TIMEOUT_SECONDS = 300.0  # a rank not heard of for this long is taken for dead (--rank-timeout)
POLL_SECONDS = 2.0


def heartbeat_path(cv_dir: str | Path, rank: int) -> Path:
    return Path(cv_dir) / RANKS_DIR / f"rank{rank}.json"


class Heartbeat:
    """Rewrites `<cv>/ranks/rank<rank>.json` every `seconds` from a daemon thread while the block runs; `fail(reason)`
    records a failure at once (the others stop waiting for this rank); leaving the block records `ended`."""

    def __init__(self, cv_dir: str | Path, rank: int, job: str = "", seconds: float = HEARTBEAT_SECONDS):
        self.path, self.rank, self.job, self.seconds = heartbeat_path(cv_dir, rank), rank, job, seconds
        self.beat, self.state, self.reason = 0, "running", ""
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _write(self) -> None:
        with self._lock:
            self.beat += 1
            record = {
                "rank": self.rank,
                "job": self.job,
                "beat": self.beat,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "time": time.time(),
                "state": self.state,
                "reason": self.reason,
            }
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_json(self.path, record)
            except OSError:
                pass  # a full or unreachable shared folder: the next beat tries again

    def _loop(self) -> None:
        while not self._stop.wait(self.seconds):
            self._write()

    def fail(self, reason: str) -> None:
        self.state, self.reason = "failed", reason
        self._write()

    def set_state(self, state: str) -> None:
        """E.g. `prepared`: rank 0 has written the folder the others wait for."""
        self.state = state
        self._write()

    def __enter__(self) -> Heartbeat:
        self._write()
        self._thread.start()
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self._stop.set()
        self._thread.join()
        if error is not None and self.state != "failed":
            self.fail(str(error).splitlines()[0] if str(error) else type(error).__name__)
        elif self.state != "failed":
            self.state = "ended"
            self._write()


def read_heartbeat(cv_dir: str | Path, rank: int) -> dict | None:
    try:
        return json.loads(heartbeat_path(cv_dir, rank).read_text())
    except (OSError, ValueError):
        return None


class Watch:
    """Judges the ranks of launch `job` by their heartbeats on this process's clock: `check(rank)` returns the rank's
    heartbeat (None before it wrote one; a file left by another launch counts as none), and raises `TrainingFailed`
    (one line naming the rank, host and pid) when the rank recorded a failure, or when its counter has not moved (or
    no heartbeat appeared) for `timeout` seconds since this watch first looked."""

    def __init__(self, cv_dir: str | Path, timeout: float, job: str = ""):
        self.cv_dir, self.timeout, self.job = cv_dir, timeout, job
        self.seen: dict[int, tuple[int | None, float]] = {}  # rank -> (last counter, when it last moved)

    def check(self, rank: int) -> dict | None:
        record = read_heartbeat(self.cv_dir, rank)
        if record is not None and record.get("job", "") != self.job:
            record = None  # an earlier launch's
        now = time.monotonic()
        beat = record.get("beat") if record else None
        last = self.seen.get(rank)
        if last is None or last[0] != beat:
            self.seen[rank] = (beat, now)
        who = f"rank {rank}" + (f" (host {record['host']}, pid {record['pid']})" if record else "")
        if record and record.get("state") == "failed":
            raise TrainingFailed(f"{who} failed: {record.get('reason') or 'no reason given'}")
        silent = now - self.seen[rank][1]
        if silent > self.timeout:
            heard = "never started its heartbeat" if record is None else "stopped answering"
            raise TrainingFailed(
                f"{who} {heard}: nothing from it for {silent:.0f} s (--rank-timeout {self.timeout:g}); it died or its "
                "node was lost. Rerun the same command to continue: finished folds are kept"
            )
        return record


def wait_for_definition(cv_dir: str | Path, definition_file: str, job: str, timeout: float) -> None:
    """A rank other than 0: until rank 0 of launch `job` has prepared the folder (its heartbeat says `prepared`);
    `TrainingFailed` when rank 0 failed or went silent for `timeout` seconds."""
    watch = Watch(cv_dir, timeout, job)
    while True:
        record = watch.check(0)
        if (
            record is not None
            and record["state"] in ("prepared", "ended")
            and (Path(cv_dir) / definition_file).is_file()
        ):
            return
        time.sleep(POLL_SECONDS)


def wait_for_ranks(cv_dir: str | Path, size: int, job: str, timeout: float) -> list[str]:
    """Rank 0: until every other rank of launch `job` has ended or failed; returns one line per rank that failed or
    went silent for `timeout` seconds (then it stops waiting for it)."""
    watch = Watch(cv_dir, timeout, job)
    lost: dict[int, str] = {}
    ended: set[int] = set()
    while True:
        waiting = [r for r in range(1, size) if r not in ended and r not in lost]
        if not waiting:
            return list(lost.values())
        for rank in waiting:
            try:
                record = watch.check(rank)
            except TrainingFailed as e:
                lost[rank] = str(e)
                continue
            if record is not None and record["state"] == "ended":
                ended.add(rank)
        time.sleep(POLL_SECONDS)


def rank_share(local_rank: int, local_size: int, cpus: list[int], gpus: list[dict], bound: bool = False) -> dict:
    """Rank `local_rank`'s share of this machine among `local_size` ranks (`assign_devices`: equal shares of the
    cores and GPUs, round-robin when there are fewer than ranks); a rank the launcher `bound` to its cores keeps all
    of `cpus`.

    Example:
        >>> [rank_share(r, 2, [0, 1, 2, 3], [])["cpus"] for r in (0, 1)], rank_share(1, 2, [3], [], bound=True)["cpus"]
        ([[0, 1], [2, 3]], [3])
    """
    from tfmis.tuning.hpo.devices import assign_devices

    size = max(local_size, 1)
    share = assign_devices(size, cpus, gpus)[local_rank % size]
    return {**share, "cpus": list(cpus)} if bound else share
