"""Case workers inside a real memory limit: the planner's first pass and the conversion size their worker pools from
the usable memory (a real cgroup memory limit on the command), skip a case larger than the limit with one line, and
survive a worker the kernel kills (here: SIGKILL from the test, mid-case) with one line naming the case it held,
finishing the job. The data are real NIfTI files the tests write; the limits are scaled down to them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from tfmis.data.case_pool import FINGERPRINT_PEAK_FACTOR, WORKER_BASE_MB, CasePool
from tfmis.data.sources.layouts import open_dataset
from tfmis.hardware import MB, cgroup_memory

REPO = Path(__file__).resolve().parents[1]


def write_ct_dataset(root: Path, shapes: dict[str, tuple[int, int, int]]) -> Path:
    """An MSD-layout CT dataset of int16 HU cases (air, a body box, a labelled organ) of the given shapes."""
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    rng = np.random.default_rng(0)
    affine = np.diag([-0.8, -0.8, 2.5, 1.0])
    training = []
    for case_id, (x, y, z) in shapes.items():
        image = np.full((x, y, z), -1000, np.int16)
        bx, by = x // 8, y // 6
        image[bx : x - bx, by : y - by] = 40
        label = np.zeros((x, y, z), np.uint8)
        organ = (slice(x // 4, 3 * x // 4), slice(y // 4, 3 * y // 4), slice(z // 8, 7 * z // 8))
        label[organ] = 1
        image[organ] = 100 + rng.integers(-30, 30, label[organ].shape)  # noise in the organ only: quick to gzip
        nib.save(nib.Nifti1Image(image, affine), root / "imagesTr" / f"{case_id}.nii.gz")
        nib.save(nib.Nifti1Image(label, affine), root / "labelsTr" / f"{case_id}.nii.gz")
        training.append({"image": f"./imagesTr/{case_id}.nii.gz", "label": f"./labelsTr/{case_id}.nii.gz"})
    meta = {
        "name": root.name,
        "modality": {"0": "CT"},
        "labels": {"0": "background", "1": "organ"},
        "numTraining": len(training),
        "training": training,
        "test": [],
    }
    (root / "dataset.json").write_text(json.dumps(meta))
    return root


def memory_cgroup(limit_mb: float) -> tuple[Path, list[str]]:
    """A new memory cgroup with `limit_mb` inside this process's own (v1 `memory` controller or v2 `memory.max`);
    (folder, command prefix that moves the command into it)."""
    own = Path("/proc/self/cgroup").read_text().splitlines()
    name = f"tfmis-test-{uuid.uuid4().hex[:8]}"
    limit = str(int(limit_mb * MB))
    v1 = next((line.split(":", 2)[2] for line in own if "memory" in line.split(":")[1].split(",")), None)
    if v1 is not None and Path("/sys/fs/cgroup/memory").is_dir():
        folder = Path("/sys/fs/cgroup/memory") / v1.strip("/") / name
        folder.mkdir()
        (folder / "memory.limit_in_bytes").write_text(limit)
    elif Path("/sys/fs/cgroup/cgroup.controllers").exists():
        v2 = next(line.split(":", 2)[2] for line in own if line.startswith("0::"))
        parent = Path("/sys/fs/cgroup") / v2.strip("/")
        (parent / "cgroup.subtree_control").write_text("+memory")
        folder = parent / name
        folder.mkdir()
        (folder / "memory.max").write_text(limit)
        (folder / "memory.swap.max").write_text("0")
    else:
        raise OSError("no cgroup memory controller mounted")
    return folder, ["sh", "-c", f'echo $$ > {folder}/cgroup.procs && exec "$0" "$@"']


def run_limited(limit_mb: float, args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m args...` inside a new memory cgroup of `limit_mb` (skips the test where none can be made; fails in
    CI, which runs as root with a cgroup memory controller: tests/conftest.py)."""
    try:
        folder, prefix = memory_cgroup(limit_mb)
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here (root and a writable cgroup memory controller): {e}")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    try:
        return subprocess.run(
            [*prefix, sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    finally:
        remove_cgroup(folder)


def run_measured(limit_mb: float, command: list[str], cwd: Path, timeout: float = 900) -> tuple[int, str, str, float]:
    """`command` in a new memory cgroup of `limit_mb`: (exit code, stdout, stderr, the cgroup's peak anonymous memory
    in MB, polled every 0.1 s: what the kernel cannot reclaim, so what a limit kills for). Raises OSError where no
    cgroup can be made."""
    import threading

    folder, prefix = memory_cgroup(limit_mb)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    process = subprocess.Popen([*prefix, *command], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    output: dict = {}
    readers = [
        threading.Thread(target=lambda n=n, s=s: output.__setitem__(n, s.read()))
        for n, s in (("out", process.stdout), ("err", process.stderr))
    ]
    for reader in readers:
        reader.start()
    peak, deadline = 0.0, time.monotonic() + timeout
    try:
        while process.poll() is None and time.monotonic() < deadline:
            try:
                stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
                peak = max(peak, int(stat.get("total_rss", stat.get("anon", 0))) / MB)
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        if process.poll() is None:
            process.kill()
        process.wait()
        for reader in readers:
            reader.join()
    finally:
        remove_cgroup(folder)
    decode = lambda raw: raw.decode(errors="replace")  # noqa: E731
    return process.returncode, decode(output["out"]), decode(output["err"]), peak


def remove_cgroup(folder: Path) -> None:
    """Removes a test's cgroup once the processes that ran in it are gone (the kernel frees it a moment after)."""
    for _ in range(100):
        try:
            folder.rmdir()
            return
        except OSError:
            time.sleep(0.1)
    folder.rmdir()


def test_cgroup_memory_reads_this_process_cgroup_limit_and_the_smallest_on_its_path(tmp_path):
    """`cgroup_memory` walks from the process's cgroup to the root (v1 and v2 trees): the smallest limit wins, v2's
    "max" and v1's 2^63 mean none; the unreclaimable memory is the cgroup's anonymous memory, not its page cache."""
    v2 = tmp_path / "v2"
    (v2 / "slurm" / "job").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpu memory\n")
    (v2 / "slurm" / "memory.max").write_text(f"{2048 * 2**20}\n")
    (v2 / "slurm" / "job" / "memory.max").write_text("max\n")
    (v2 / "slurm" / "memory.stat").write_text(f"anon {300 * 2**20}\nfile {900 * 2**20}\n")
    found = cgroup_memory("0::/slurm/job\n", v2)
    assert (found["limit_mb"], found["unreclaimable_mb"]) == (2048.0, 300.0)
    (v2 / "slurm" / "job" / "memory.max").write_text(f"{1024 * 2**20}\n")
    assert cgroup_memory("0::/slurm/job\n", v2)["limit_mb"] == 1024.0
    v1 = tmp_path / "v1"
    (v1 / "memory" / "job").mkdir(parents=True)
    (v1 / "memory" / "job" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_memory("4:memory:/job\n", v1) is None
    assert cgroup_memory("0::/\n", tmp_path / "none") is None


def test_pool_sizes_from_the_largest_case_header_and_skips_a_case_larger_than_the_memory(tmp_path):
    """`CasePool` reads each case's shape from its header: the need is the worker's baseline plus the peak factor
    times the float32 size; a case needing more than all the memory there is comes back skipped with one line
    naming what it needs; the others run in order."""
    root = write_ct_dataset(tmp_path / "Task01_Sizes", {"small": (64, 64, 20), "large": (64, 64, 40)})
    pool = CasePool("Fingerprinting", open_dataset(root), FINGERPRINT_PEAK_FACTOR, asked=2)
    float32 = 64 * 64 * 40 * 4 / MB
    assert pool.needs["large"] == pytest.approx(WORKER_BASE_MB + FINGERPRINT_PEAK_FACTOR * float32)
    assert pool.needs["small"] < pool.needs["large"] and not pool.too_large
    assert pool.describe().startswith(f"Fingerprinting with {pool.workers} worker")
    huge = CasePool("Fingerprinting", open_dataset(root), 1e9, asked=2)  # a factor no memory holds
    assert set(huge.too_large) == {"small", "large"}
    assert "needs about" in huge.too_large["large"] and "more than" in huge.too_large["large"]


@pytest.mark.slow
def test_plan_in_a_memory_limit_runs_one_worker_where_two_would_not_fit_and_skips_a_case_too_large(tmp_path):
    """`tfmis-plan` in a real cgroup limit that holds one case worker but not two: it says it uses 1 worker and why,
    and finishes (exit 0); a case larger than the whole limit is one line naming it and the memory it needs, and is
    left out of the plan's cases."""
    cases = {f"ct_{i}": (352, 352, 300) for i in range(3)}  # 142 MB float32 each: ~390 MB a worker at its peak
    cases["ct_huge"] = (512, 512, 400)  # 400 MB float32: ~880 MB at its peak, more than the limit
    root = write_ct_dataset(tmp_path / "Task02_Limit", cases)
    # the planning process (~50 MB while it fingerprints; TensorFlow, ~650 MB, after) and one worker, not two; each
    # loads GDCM's library when nibabel imports pydicom (the dicom extra: +19 MB a process, so 800 MB, not 760)
    limit = 800
    proc = run_limited(
        # planned for a machine with room for a model (the limit here holds the fingerprint's workers, not training)
        limit,
        ["tfmis.plan", "--source-dir", str(root), "--output", str(tmp_path / "plan.yaml"), "--host-memory", "16GB"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    line = next(x for x in proc.stderr.splitlines() if x.startswith("Fingerprinting with"))
    assert line.startswith("Fingerprinting with 1 worker: 2 CPUs") or "1 CPU" in line, line
    assert f"cgroup limit {limit} MB" in line
    huge = [x for x in proc.stderr.splitlines() if "ct_huge" in x]
    assert len(huge) == 1 and "needs about" in huge[0] and f"the cgroup limit of {limit} MB" in huge[0], huge


def _workers_of(pid: int) -> list[int]:
    """The spawned pool workers among `pid`'s children (not multiprocessing's resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_a_conversion_worker_killed_mid_case_is_one_line_and_the_conversion_finishes(tmp_path):
    """A conversion worker killed by SIGKILL while it holds a case (as the OOM killer does) is one line naming the
    case(s) it held; they are retried alone, the rest continue with fewer workers, and the conversion finishes with
    every case (exit 0, no traceback)."""
    root = write_ct_dataset(tmp_path / "Task03_Kill", {f"ct_{i}": (192, 192, 160) for i in range(4)})
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    target = tmp_path / "converted"
    args = ["--source-dir", str(root), "--target-dir", str(target), "--workers", "2", "--ct-window", "-100,200"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfmis.convert", *args], env=env, stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )
    killed, deadline = None, time.time() + 180
    while killed is None and proc.poll() is None and time.time() < deadline:
        workers = _workers_of(proc.pid)
        if len(workers) == 2:  # both workers started, each on a case
            time.sleep(1.0)
            killed = workers[0]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    _, stderr = proc.communicate(timeout=600)
    assert killed is not None, stderr[-3000:]
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    lines = [x for x in stderr.splitlines() if "was killed" in x]
    assert len(lines) == 1 and "ct_" in lines[0] and "retrying each alone" in lines[0], stderr[-3000:]
    index = json.loads((target / "index.json").read_text())
    assert sorted(index["cases"]) == [f"ct_{i}" for i in range(4)] and not index["skipped"]


def test_map_ordered_survives_a_killed_worker_retries_alone_and_reports_a_case_killed_twice():
    """A task whose worker is SIGKILLed breaks the pool: one line names the tasks that were in flight, they are
    retried alone (task 3 is killed again: `on_lost` gives its result), the rest run with fewer workers, and every
    result comes back in task order."""
    from killing_tasks import square_or_die

    from tfmis.utils.parallel import map_ordered

    lines = []
    results = list(
        map_ordered(
            square_or_die, list(range(7)), 2, ahead=2, on_lost=lambda t: f"lost {t}", say=lines.append, name=str
        )
    )
    assert results == [0, 1, 4, "lost 3", 16, 25, 36]
    assert len(lines) == 1 and "killed" in lines[0] and "3" in lines[0], lines


def test_map_ordered_survives_a_worker_killed_while_it_writes_its_result(monkeypatch):
    """A worker killed half-way through writing its result (the pipe holds a message's first bytes, the write lock is
    never released) leaves CPython's pool waiting for ever; `map_ordered` notices the dead worker, breaks the pool
    after `STUCK_AFTER_S` and goes on as for any killed worker: every result in task order, task 3 (killed again
    alone) from `on_lost`, one line naming it (the wait shortened to 2 s here)."""
    from killing_tasks import square_or_die_writing

    from tfmis.utils import parallel

    monkeypatch.setattr(parallel, "STUCK_AFTER_S", 2.0)
    lines = []
    start = time.monotonic()
    results = list(
        parallel.map_ordered(
            square_or_die_writing, list(range(6)), 2, ahead=2, on_lost=lambda t: f"lost {t}", say=lines.append
        )
    )
    assert results == [0, 1, 4, "lost 3", 16, 25]
    assert len(lines) == 1 and "killed" in lines[0] and "3" in lines[0], lines
    # killed twice (with the others, then alone): twice the wait, and not much more
    assert 2 * parallel.STUCK_AFTER_S <= time.monotonic() - start < 2 * parallel.STUCK_AFTER_S + 30


@pytest.mark.slow
def test_convert_in_a_memory_limit_skips_a_case_larger_than_the_limit_with_exit_3(tmp_path):
    """`tfmis-convert` in a real cgroup limit: a case needing more than the whole limit is one line naming it and the
    memory it needs, recorded in index.json's `skipped`; the others are converted; the command exits 3 (cases
    skipped), with no traceback."""
    cases = {f"ct_{i}": (96, 96, 40) for i in range(2)}
    cases["ct_huge"] = (512, 512, 300)  # 300 MB float32: ~1.3 GB to convert, more than the limit
    root = write_ct_dataset(tmp_path / "Task04_Huge", cases)
    limit = 1000  # the converting process holds TensorFlow (~650 MB); the small cases fit beside it
    target = tmp_path / "converted"
    args = ["--source-dir", str(root), "--target-dir", str(target), "--split", "1", "--ct-window", "-100,200"]
    proc = run_limited(limit, ["tfmis.convert", *args], tmp_path)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    huge = [x for x in proc.stderr.splitlines() if "ct_huge" in x and "needs about" in x]
    assert huge and f"the cgroup limit of {limit} MB" in huge[0], proc.stderr[-3000:]
    index = json.loads((target / "index.json").read_text())
    assert sorted(index["cases"]) == ["ct_0", "ct_1"]
    assert [s["case_id"] for s in index["skipped"]] == ["ct_huge"] and "needs about" in index["skipped"][0]["reason"]
