"""The ranks of a launched cross-validation: each rank's share of its machine, and waits that end when a rank
fails or dies (real heartbeat threads in real processes, killed with SIGKILL)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tfmis.crossvalidation.ranks import (
    Heartbeat,
    heartbeat_path,
    rank_share,
    read_heartbeat,
    wait_for_definition,
    wait_for_ranks,
)
from tfmis.engine.cluster import bound_by_launcher
from tfmis.errors import TrainingFailed

ROOT = Path(__file__).resolve().parents[1]


def start_rank(cv: Path, rank: int, job: str, seconds: float = 0.2, then: str = "time.sleep(600)"):
    """A real process beating as `rank` of launch `job` every `seconds` (then running `then` inside the block)."""
    code = (
        "import sys, time\n"
        "from tfmis.crossvalidation.ranks import Heartbeat\n"
        f"with Heartbeat({str(cv)!r}, {rank}, {job!r}, seconds={seconds}) as beat:\n"
        f"    {then}\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-c", code], env=env)
    deadline = time.monotonic() + 60
    while read_heartbeat(cv, rank) is None or read_heartbeat(cv, rank).get("pid") != process.pid:
        assert time.monotonic() < deadline and process.poll() is None, "the rank never beat"
        time.sleep(0.05)
    return process


def test_rank_0_stops_waiting_for_a_rank_killed_with_sigkill_within_the_timeout(tmp_path):
    """Rank 1 (a real process beating every 0.2 s) is killed with SIGKILL: rank 0's wait ends within the 3 s timeout
    plus two polls, with one line naming rank 1, its host and pid, and saying a rerun continues; a rank that ended
    normally is not reported."""
    cv = tmp_path / "cv"
    killed = start_rank(cv, 1, "job7")
    normal = start_rank(cv, 2, "job7", then="pass")
    normal.wait(timeout=60)
    assert read_heartbeat(cv, 2)["state"] == "ended"
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=10)
    start = time.monotonic()
    lost = wait_for_ranks(cv, 3, "job7", timeout=3.0)
    took = time.monotonic() - start
    assert 3.0 <= took < 3.0 + 10.0, took
    assert len(lost) == 1 and lost[0].startswith(f"rank 1 (host {os.uname().nodename}, pid {killed.pid}) stopped")
    assert "--rank-timeout 3" in lost[0] and "Rerun the same command" in lost[0]


def test_the_others_stop_waiting_at_once_when_rank_0_fails_and_ignore_an_earlier_launchs_file(tmp_path):
    """Rank 0's failure (an error while preparing, recorded by its heartbeat) ends another rank's wait for the folder
    at the next poll with rank 0's error line, not after the 6 hours it used to wait; a failed heartbeat left by an
    earlier launch does not stop the new launch's ranks, which wait until rank 0 says the folder is prepared."""
    cv = tmp_path / "cv"
    failing = start_rank(cv, 0, "run1", then="raise SystemExit('conversion failed: case_003 unreadable')")
    failing.wait(timeout=60)
    record = read_heartbeat(cv, 0)
    assert record["state"] == "failed" and "case_003 unreadable" in record["reason"]
    start = time.monotonic()
    with pytest.raises(TrainingFailed, match=r"^rank 0 \(host .*\) failed: conversion failed: case_003 unreadable"):
        wait_for_definition(cv, "crossval_definition.json", "run1", timeout=300)
    assert time.monotonic() - start < 10

    # a new launch (another job id): rank 0 of run2 prepares the folder after a while
    (cv / "crossval_definition.json").write_text("{}")
    rank0 = start_rank(cv, 0, "run2", then="time.sleep(1.5); beat.set_state('prepared'); time.sleep(600)")
    try:
        start = time.monotonic()
        wait_for_definition(cv, "crossval_definition.json", "run2", timeout=30)
        assert time.monotonic() - start >= 1.0, "it went on before rank 0 of this launch had prepared"
        assert read_heartbeat(cv, 0)["state"] == "prepared"
    finally:
        rank0.kill()


def test_a_rank_takes_its_local_share_of_cores_and_gpus_unless_the_launcher_bound_it():
    """Two ranks on a 4-core, 2-GPU machine take cores 0-1 with GPU 0 and cores 2-3 with GPU 1; a rank Open MPI
    (default binding) or SLURM (--cpu-bind) bound to its cores keeps them; `--bind-to none` and no launcher binding
    leave the split to tfmis."""
    gpus = [{"index": 0, "uuid": "GPU-a"}, {"index": 1, "uuid": "GPU-b"}]
    shares = [rank_share(r, 2, [0, 1, 2, 3], gpus) for r in (0, 1)]
    assert [s["cpus"] for s in shares] == [[0, 1], [2, 3]]
    assert [[g["index"] for g in s["gpus"]] for s in shares] == [[0], [1]]
    assert rank_share(1, 2, [1], gpus, bound=True)["cpus"] == [1]
    assert bound_by_launcher({"OMPI_MCA_orte_bound_at_launch": "1"})
    assert not bound_by_launcher({"OMPI_MCA_orte_bound_at_launch": "1", "OMPI_MCA_hwloc_base_binding_policy": "none"})
    assert bound_by_launcher({"SLURM_CPU_BIND_TYPE": "mask_cpu:"})
    assert not bound_by_launcher({"SLURM_CPU_BIND_TYPE": "none"}) and not bound_by_launcher({})


def test_heartbeat_file_is_rewritten_whole_with_a_moving_counter(tmp_path):
    """While the block runs the file always parses (atomic rewrite) and its counter rises; leaving records ended."""
    cv = tmp_path / "cv"
    beats = []
    with Heartbeat(cv, 4, "j", seconds=0.05):
        for _ in range(20):
            beats.append(json.loads(heartbeat_path(cv, 4).read_text())["beat"])
            time.sleep(0.02)
    assert beats == sorted(beats) and beats[-1] > beats[0]
    assert read_heartbeat(cv, 4)["state"] == "ended"
