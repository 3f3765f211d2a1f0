"""One writer per folder (`tfmis.utils.lock`) and per-writer temporaries (`tfmis.utils.io`): real files, real
processes, real conversions and training runs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import make_msd_dataset, tiny_config

from tfmis.utils.io import OTHER_HOST_STALE_SECONDS, atomic_writer, host_name
from tfmis.utils.lock import LOCK_FILE, FolderLocked, folder_lock, holds_lock

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

# writes `path` WRITES times, each a complete JSON version of PAYLOAD bytes; prints the exceptions it met
WRITER = """
import json, sys
from tfmis.utils.io import atomic_writer
path, name, writes, payload = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
errors = []
for i in range(writes):
    try:
        with atomic_writer(path) as f:
            json.dump({"writer": name, "i": i, "payload": "x" * payload, "length": payload}, f)
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")
print(json.dumps(errors))
"""

# holds a folder's lock until its stdin closes (or it is killed)
HOLDER = """
import sys
from tfmis.utils.lock import folder_lock
with folder_lock(sys.argv[1], "lock holder of the test"):
    print("locked", flush=True)
    sys.stdin.read()
"""

# opens an atomic write of `path`, writes half, prints its temporary's path, then waits for stdin to close
# before finishing the write (or is killed before that)
BLOCKED_WRITER = """
import sys
from tfmis.utils.io import atomic_writer
with atomic_writer(sys.argv[1], "w") as f:
    f.write("first half, ")
    f.flush()
    print(f.name, flush=True)
    sys.stdin.read()
    f.write("second half")
"""


def _check_version(text: str) -> dict:
    version = json.loads(text)
    assert len(version["payload"]) == version["length"], "a partial version"
    return version


def test_concurrent_atomic_writers_threads_and_processes_never_raise_and_leave_one_complete_version(tmp_path):
    """4 processes and 4 threads write one file 100 times each (400 + 400 writes of 64 kB JSON) while a thread
    reads it in a loop: no writer raises, every read (and the final file) is one writer's whole version, and no
    temporary is left behind."""
    path = tmp_path / "shared.json"
    writes, payload = 100, 64 * 1024
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), f"process{k}", str(writes), str(payload)],
            stdout=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for k in range(4)
    ]
    thread_errors, reads, stop = [], [], threading.Event()

    def write(name):
        for i in range(writes):
            try:
                with atomic_writer(path) as f:
                    json.dump({"writer": name, "i": i, "payload": "x" * payload, "length": payload}, f)
            except Exception as e:
                thread_errors.append(f"{type(e).__name__}: {e}")

    def read():
        while not stop.is_set():
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue  # before the first rename
            reads.append(_check_version(text)["writer"])

    reader = threading.Thread(target=read)
    reader.start()
    threads = [threading.Thread(target=write, args=(f"thread{k}",)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    process_errors = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    stop.set()
    reader.join()
    assert all(p.returncode == 0 for p in procs)
    assert thread_errors == [] and process_errors == [[]] * 4
    final = _check_version(path.read_text())
    assert final["writer"] in {f"process{k}" for k in range(4)} | {f"thread{k}" for k in range(4)}
    assert len(reads) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared.json"], "a temporary was left behind"


def test_atomic_writer_removes_its_temporary_when_the_block_raises(tmp_path):
    """An exception inside the block leaves the old version and no temporary."""
    path = tmp_path / "a.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_writer(path) as f:
        f.write("new, half")
        raise RuntimeError("stop")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def _start(script: str, path: Path) -> subprocess.Popen:
    """`script` in a new Python process, `path` its argument, its stdin and stdout pipes."""
    return subprocess.Popen(
        [sys.executable, "-c", script, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV
    )


def _start_holder(folder: Path) -> subprocess.Popen:
    holder = _start(HOLDER, folder)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_folder_lock_refuses_a_second_process_naming_it_and_is_taken_over_after_it_is_killed(tmp_path):
    """A live holder process makes `folder_lock` raise FolderLocked naming its pid, host, start time and
    command; after SIGKILL (the kernel drops its flock, its lock file stays) the lock is taken over at once and
    the file names the new holder. Within one process the lock is re-entrant."""
    folder = tmp_path / "run"
    holder = _start_holder(folder)
    try:
        with pytest.raises(FolderLocked) as refused, folder_lock(folder):
            pass
        message = str(refused.value)
        info = json.loads((folder / LOCK_FILE).read_text())
        assert f"pid {holder.pid} on host {socket.gethostname()} since {info['since']}" in message
        assert "(lock holder of the test)" in message and "\n" not in message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (folder / LOCK_FILE).is_file(), "the dead holder's lock file is still there: a stale lock"
    with folder_lock(folder, "second") as locked:
        assert locked and holds_lock(folder)
        info = json.loads((folder / LOCK_FILE).read_text())
        assert info["pid"] == os.getpid() and info["command"] == "second"
        with folder_lock(folder) as again:  # re-entrant in one process
            assert again
        assert holds_lock(folder), "the inner block does not release the outer one's lock"
    assert not holds_lock(folder)


def test_taking_a_folders_lock_removes_a_killed_writers_temporary_and_keeps_live_and_other_hosts_ones(tmp_path):
    """While another process holds a folder's lock, a writer SIGKILLed inside `atomic_writer` leaves its temporary
    (in a subfolder here), and a process refused the lock removes nothing. Once the holder has left, the process
    that takes the lock removes the killed writer's temporary and another host's unchanged for over a day, and
    keeps a live writer's (which then completes its write) and another host's fresh one."""
    folder = tmp_path / "run"
    (folder / "progress").mkdir(parents=True)
    holder = _start_holder(folder)
    killed = _start(BLOCKED_WRITER, folder / "progress" / "a.json")
    live = _start(BLOCKED_WRITER, folder / "b.json")
    try:
        killed_tmp, live_tmp = Path(killed.stdout.readline().strip()), Path(live.stdout.readline().strip())
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert killed_tmp.read_text() == "first half, ", "the killed writer's temporary"
        # another host's: its pid means nothing here (it is the killed writer's, dead on this host)
        other = f"{host_name()}-other"
        fresh = folder / f"c.json.{other}.{killed.pid}.0a1b2c3d.tmp"
        stale = folder / f"d.json.{other}.{killed.pid}.0a1b2c3d.tmp"
        for path in (fresh, stale):
            path.write_text("another host's")
        old = time.time() - OTHER_HOST_STALE_SECONDS - 3600
        os.utime(stale, (old, old))

        with pytest.raises(FolderLocked), folder_lock(folder):
            pass
        assert killed_tmp.exists() and stale.exists(), "a process refused the lock removed a temporary"
        holder.stdin.close()
        assert holder.wait() == 0

        with folder_lock(folder):
            remaining = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
            assert remaining == sorted([".tfmis.lock", live_tmp.name, fresh.name])
        live.stdin.close()
        assert live.wait() == 0
    finally:
        for proc in (holder, killed, live):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert (folder / "b.json").read_text() == "first half, second half"
    assert not live_tmp.exists()


@pytest.mark.slow
def test_second_conversion_into_a_locked_target_exits_1_and_keeps_the_holders_temporaries(tmp_path):
    """`tfmis-convert` into a target whose lock a live process holds exits 1 with one error line naming the
    holder, and leaves the holder's temporary file alone; once the holder is killed, the same command converts
    (exit 0) and removes the dead writer's temporary."""
    source = make_msd_dataset(tmp_path / "ds", num_cases=4)
    target = tmp_path / "out"
    holder = _start_holder(target)
    theirs = target / f"train-000-of-001.tfrecord.gz.{host_name()}.{holder.pid}.0a1b2c3d.tmp"
    theirs.write_bytes(b"a shard being written")
    command = [sys.executable, "-m", "tfmis.convert", "--source-dir", str(source), "--target-dir", str(target)]
    command += ["--split", "1", "--shards", "1", "--workers", "1", "--quiet"]
    try:
        refused = subprocess.run(command, capture_output=True, text=True, timeout=120, env=ENV)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert refused.returncode == 1, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"pid {holder.pid} on host" in lines[0]
    assert theirs.read_bytes() == b"a shard being written", "the second conversion removed the holder's temporary"
    assert [p for p in target.glob("*.tfrecord*") if p.suffix != ".tmp"] == [], "the refused conversion wrote"
    converted = subprocess.run(command, capture_output=True, text=True, timeout=120, env=ENV)
    assert converted.returncode == 0, converted.stderr
    assert not theirs.exists() and not list(target.glob("*.tmp"))


def test_a_trainings_data_preparation_waits_for_another_process_converting_its_target(tmp_path, capsys):
    """`prepare_dataset` (what `tfmis-train` and every cross-validation fold run before training) does not fail
    when another live process holds the conversion target's lock, as two folds starting at once do: it says once
    whom it waits for, waits while the holder lives, then checks the finished conversion and returns it."""
    from tfmis.config import DataConfig
    from tfmis.data.conversion_options import ConversionOptions
    from tfmis.data.prepare import prepare_dataset
    from tfmis.data.records import INDEX_FILE

    source = make_msd_dataset(tmp_path / "ds", num_cases=4)
    options = ConversionOptions(shards=1, workers=1)
    data = DataConfig(dataset_dir=str(tmp_path / "out"), source_dir=str(source), conversion=options)
    prepare_dataset(data, progress=False)
    shards = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (tmp_path / "out").glob("*.tfrecord*")}
    assert shards and (tmp_path / "out" / INDEX_FILE).is_file()
    capsys.readouterr()
    holder = _start_holder(tmp_path / "out")
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("dir", prepare_dataset(data, progress=False)))
    try:
        waiter.start()
        waiter.join(5.0)
        assert waiter.is_alive(), "prepare_dataset returned while another process held the conversion target"
        holder.stdin.close()  # the holder leaves its lock
        holder.wait(timeout=60)
        waiter.join(60.0)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert not waiter.is_alive() and result["dir"] == tmp_path / "out"
    err = capsys.readouterr().err.strip().splitlines()
    waited = f"waiting for {tmp_path / 'out'}: in use by pid {holder.pid} on host {socket.gethostname()} since "
    assert err[0].startswith(waited) and err[0].endswith("(lock holder of the test)"), err
    assert sum(line.startswith("waiting for") for line in err) == 1, err
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (tmp_path / "out").glob("*.tfrecord*")}
    assert after == shards, "the finished conversion's shards were written again"


@pytest.mark.slow
def test_second_training_run_into_a_locked_run_folder_exits_1_and_its_lock_is_stale_once_killed(
    converted_dataset, tmp_path
):
    """A real `tfmis.train` holds its run folder: a second `tfmis.train --resume` into it exits 1 with one line
    naming the first's pid and host, and does not touch the folder; once the first is SIGKILLed its lock file
    stays but its lock is free (stale) and is taken over."""
    from tfmis.config import save_config

    run = tmp_path / "run"
    config = tiny_config(converted_dataset, run, "training.epochs=1000", "training.steps_per_epoch=1")
    save_config(config, tmp_path / "config.yaml")
    command = [sys.executable, "-m", "tfmis.train", "--config", str(tmp_path / "config.yaml")]
    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        # the run writes config.yaml only while it holds the lock
        while first.poll() is None and not (run / "config.yaml").is_file():
            time.sleep(0.05)
        assert first.poll() is None, first.stderr.read()[-3000:]
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == first.pid
        config_before = (run / "config.yaml").stat().st_mtime_ns
        second = subprocess.run(command + ["--resume"], capture_output=True, text=True, timeout=120, env=ENV)
        assert second.returncode == 1
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and f"in use by pid {first.pid} on host {socket.gethostname()}" in errors[0]
        assert "Resuming" not in second.stderr and (run / "config.yaml").stat().st_mtime_ns == config_before
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    with folder_lock(run) as locked:
        assert locked and json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()


@pytest.mark.slow
def test_multiworker_run_into_a_locked_run_folder_stops_every_worker_with_exit_1(converted_dataset, tmp_path):
    """`tfmis.launch --nproc 2` of a MultiWorkerMirroredStrategy `tfmis.train` into a run folder a live process
    holds: only the chief tries the lock, and one broadcast stops both workers (no worker waits for a chief that
    has left): exit 1, the chief's line names the holder, worker 1's says the chief could not lock, and the
    non-chief never touched the lock file."""
    from test_multiworker import _clean, _env, _tiny_yaml

    run = tmp_path / "run"
    config = _tiny_yaml(tmp_path, converted_dataset, run)
    holder = _start_holder(run)
    lock_before = (run / LOCK_FILE).read_bytes()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "tfmis.launch", "--nproc", "2", "--"]
            + [sys.executable, "-m", "tfmis.train", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=240,
            env=_env(),
            cwd=REPO,
        )
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    log = _clean(result.stdout + result.stderr)
    assert result.returncode == 1, log[-3000:]
    errors = [line for line in log.splitlines() if "error: " in line]  # (TensorFlow may log errors of its own)
    # the chief's line names the holder once and is its own (no "[worker 1]" before it on its line; the two
    # processes share one stream, so worker 1's line may still follow it on the same line of the capture)
    holder_named = f"in use by pid {holder.pid} on host"
    assert log.count(holder_named) == 1, log[-3000:]
    start = log.index(holder_named)
    assert "[worker 1]" not in log[log.rfind("\n", 0, start) + 1 : start], log[-3000:]
    assert any("[worker 1]" in line and "the chief could not lock the run folder" in line for line in errors), log
    assert (run / LOCK_FILE).read_bytes() == lock_before
    assert not (run / "config.yaml").exists() and not (run / "checkpoints").exists()
