"""MultiWorkerMirroredStrategy under a real Open MPI `mpirun -np 2` and under `tfmis.launch`: training, identical
weights on both ranks, an orderly end (no error lines in any rank's output) and what listens on the network.

`mpirun` is the real launcher (Open MPI's: `-x` passes PYTHONPATH, `--output-filename` keeps each rank's output
apart); the ranks find each other through tfmis's file rendezvous (tfmis/engine/cluster.py). Skipped with the
reason when Open MPI's mpirun is missing (CI installs it: .ci/run). The real-launcher tests (marker `launcher`: mpirun,
srun) are left out of the default run and run in CI's own step: `python -m pytest -m launcher`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import TINY_TRAINING, make_msd_dataset, tiny_config

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
MPIRUN = shutil.which("mpirun")


def _mpi_problem() -> str | None:
    if MPIRUN is None:
        return "mpirun not found: install Open MPI (Debian/Ubuntu: apt-get install openmpi-bin libopenmpi-dev)"
    version = subprocess.run([MPIRUN, "--version"], capture_output=True, text=True).stdout
    if "Open MPI" not in version:
        return f"these tests drive Open MPI's mpirun (-x, --output-filename); found: {version.splitlines()[:1]}"
    return None


MPI_PROBLEM = _mpi_problem()
needs_mpirun = pytest.mark.skipif(MPI_PROBLEM is not None, reason=str(MPI_PROBLEM))

# Lines that mean something went wrong in a worker. Any TensorFlow ERROR line counts: tfmis's runs ask oneDNN for no
# kernel it lacks (float16 records and integer transposes once logged "oneDNN supports DT_... only on platforms
# with AVX-512" at ERROR severity; tests/test_hardware.py checks a single-process run).
ERROR_MARKERS = ("E0000", "UNAVAILABLE", "StartAbort", "Traceback", "Connection refused", "coordination service")
NOT_ERRORS = ()


def error_lines(text: str) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if any(m in line for m in ERROR_MARKERS) and not any(n in line for n in NOT_ERRORS)
    ]


def mpirun(args: list[str], cwd: Path, out: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """`mpirun -np 2 <args>` with PYTHONPATH passed to the ranks and each rank's output in out/1/rank.R/."""
    command = [MPIRUN, "-np", "2", "--oversubscribe", "--output-filename", str(out)]
    if os.geteuid() == 0:
        command.append("--allow-run-as-root")
    command += ["-x", "PYTHONPATH", "-x", "TF_NUM_INTRAOP_THREADS=1", "-x", "TF_NUM_INTEROP_THREADS=1", *args]
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def run_workers(launcher: list[str], config: Path) -> subprocess.CompletedProcess:
    """`<launcher> python -m tfmis.train --config <config>` with this checkout on PYTHONPATH, one CPU thread per
    worker and no inherited TF_CONFIG."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.update(PYTHONPATH=str(ROOT), TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
    command = [*launcher, sys.executable, "-m", "tfmis.train", "--config", str(config)]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def rank_output(out: Path, rank: int) -> str:
    """Everything rank `rank` wrote (Open MPI's --output-filename: out/<job>/rank.<rank>/{stdout,stderr})."""
    return "".join(p.read_text() for p in sorted(out.glob(f"*/rank.{rank}/std*")))


def tiny_yaml(path: Path, dataset_dir: Path, output_dir: Path, *overrides: str) -> Path:
    data = {}
    for override in [f"data.dataset_dir={dataset_dir}", f"output.dir={output_dir}", *TINY_TRAINING, *overrides]:
        key, value = override.split("=", 1)
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(data))
    return path


FIT_SCRIPT = textwrap.dedent("""
    import sys, time
    import numpy as np
    from tfmis.engine.distribution import make_backend
    from tfmis.config import load_config
    config = load_config(sys.argv[1])
    backend = make_backend(config.runtime, output_dir=config.output.dir)  # auto: mpirun's env -> multiworker
    from tfmis.engine.trainer import Trainer
    trainer = Trainer(config, backend=backend)
    trainer.fit()
    np.savez(f"{sys.argv[2]}/rank{backend.rank}.npz", *trainer.model.get_weights())
    print(f"rank {backend.rank} of {backend.size}: {backend.name}, {backend.num_replicas} replicas", file=sys.stderr)
    if backend.rank == 1:
        time.sleep(5)  # rank 1 ends 5 s after the chief is done: the chief must still outlive it
    backend.finish(exit_status=0)  # as tfmis.train: barrier, the others end, the chief last
    raise SystemExit(3)  # not reached: finish ended the process
""")


@pytest.mark.launcher
@needs_mpirun
def test_mpirun_multiworker_fit_gives_identical_weights_and_ends_quietly_when_a_worker_ends_late(
    converted_dataset, tmp_path
):
    """Real `mpirun -np 2` runs `Trainer.fit` (2 epochs, validation, checkpoints) with `runtime.distribution: auto`:
    both ranks pick multiworker from Open MPI's environment (2 replicas), end with identical weights, exit 0
    (through `Backend.finish(exit_status=0)`), and neither rank's output holds an error line, although rank 1 ends
    5 s after the chief is done. (Without the ordered end the chief ends first and rank 1 logs `StartAbort
    UNAVAILABLE: Failed to send RPC to coordination service ... Connection refused`, the user's report.)"""
    config = tiny_yaml(tmp_path / "tiny.yaml", converted_dataset, tmp_path / "run")
    (tmp_path / "fit.py").write_text(FIT_SCRIPT)
    out = tmp_path / "out"
    start = time.monotonic()
    result = mpirun([sys.executable, str(tmp_path / "fit.py"), str(config), str(tmp_path)], tmp_path, out)
    logs = [rank_output(out, r) for r in (0, 1)]
    assert result.returncode == 0, (result.stdout + result.stderr)[-2000:] + logs[0][-2000:] + logs[1][-2000:]
    assert time.monotonic() - start > 5  # mpirun returned after the slow rank 1, which the chief waited for
    for rank, log in enumerate(logs):
        assert f"rank {rank} of 2: multiworker, 2 replicas" in log
        assert error_lines(log) == [], f"rank {rank}:\n" + "\n".join(error_lines(log))
    weights = [list(np.load(tmp_path / f"rank{r}.npz").values()) for r in (0, 1)]
    assert len(weights[0]) == len(weights[1]) > 0
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)
    history = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in history] == [1, 2]


@pytest.mark.launcher
@needs_mpirun
def test_tfmis_train_under_mpirun_trains_resumes_and_ends_quietly(converted_dataset, tmp_path):
    """`mpirun -np 2 python -m tfmis.train --config tiny.yaml` (the user's command, on the tiny config): exit 0,
    2 replicas, the chief's history has both epochs, no error line in either rank's output; then the same command
    with `--resume --set training.epochs=3` continues from the chief's checkpoint of epoch 2, quietly too."""
    config = tiny_yaml(tmp_path / "tiny.yaml", converted_dataset, tmp_path / "run")
    command = [sys.executable, "-m", "tfmis.train", "--config", str(config)]
    for attempt, extra in enumerate([[], ["--resume", "--set", "training.epochs=3"]]):
        out = tmp_path / f"out{attempt}"
        result = mpirun(command + extra, ROOT, out)
        logs = [rank_output(out, r) for r in (0, 1)]
        assert result.returncode == 0, (result.stdout + result.stderr)[-2000:] + logs[0][-3000:] + logs[1][-3000:]
        assert "on 2 replica(s) (multiworker, 2 worker process(es))" in logs[0]
        for rank, log in enumerate(logs):
            assert error_lines(log) == [], f"rank {rank}:\n" + "\n".join(error_lines(log))
    assert f"Resuming from {tmp_path / 'run' / 'checkpoints'}/ckpt-2" in logs[0]
    history = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in history] == [1, 2, 3]
    assert not (tmp_path / "run" / ".rendezvous").exists()


RANK_RUNNER = textwrap.dedent("""
    import json, os, sys, time
    from tfmis.crossval import main
    code = main(sys.argv[2:])  # tfmis-crossval's own main, in the process mpirun started
    with open(f"{sys.argv[1]}/rank{os.environ['OMPI_COMM_WORLD_RANK']}.json", "w") as f:
        json.dump({"code": code, "time": time.time()}, f)
    sys.exit(code)
""")


@pytest.mark.launcher
@needs_mpirun
def test_a_rank_killed_under_mpirun_is_reported_by_rank_0_after_the_rank_timeout(tmp_path):
    """`mpirun --allow-run-as-root -np 2 tfmis-crossval --folds 2 --rank-timeout 15`, Open MPI told to let the other
    ranks run on when one dies (`--mca orte_enable_recovery 1`; by default it ends the whole job itself, which
    tests/test_crossval.py checks): rank 1, SIGKILLed (its pid from its heartbeat) while it waits for rank 0's
    conversion, leaves rank 0 alone to convert, train and predict fold 0 and then wait for it. tfmis's own timeout
    ends that wait: 15 s (`--rank-timeout`) to 15 s + 2 polls + 10 s after rank 0 started waiting (its
    `worker_end` event), one `error: rank 1 (host, pid) stopped answering ...` line with the killed pid, fold 1 named
    unfinished, exit 3 (`PartialFailure`, read from the rank's own `main`: mpirun in this mode exits 0 whatever its
    ranks exit), and none of mpirun's abort text; no process of the job is left."""
    from tfmis.config import save_config
    from tfmis.crossvalidation.experiment import read_job_events
    from tfmis.crossvalidation.ranks import POLL_SECONDS, read_heartbeat

    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=6)
    config = tiny_config(
        tmp_path / "tfrecords",
        tmp_path / "runs",
        f"data.source_dir={source}",
        "data.conversion.shards=1",
        "training.epochs=1",
        "training.steps_per_epoch=1",
    )
    save_config(config, tmp_path / "tiny.yaml")
    (tmp_path / "rank.py").write_text(RANK_RUNNER)
    cv, out, exits = tmp_path / "cv", tmp_path / "out", tmp_path / "exits"
    exits.mkdir()
    timeout = 15
    command = [MPIRUN, "-np", "2", "--oversubscribe", "--output-filename", str(out), "-x", "PYTHONPATH"]
    command += ["--allow-run-as-root"] if os.geteuid() == 0 else []
    command += ["--mca", "orte_enable_recovery", "1", sys.executable, str(tmp_path / "rank.py"), str(exits)]
    command += ["--config", str(tmp_path / "tiny.yaml"), "--folds", "2", "--output", str(cv)]
    command += ["--rank-timeout", str(timeout)]
    env = {**{k: v for k, v in os.environ.items() if k != "TF_CONFIG"}, "PYTHONPATH": str(ROOT)}
    job = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while (read_heartbeat(cv, 1) or {}).get("state") != "running":
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()[0][-3000:]
        time.sleep(0.05)
    rank1 = read_heartbeat(cv, 1)
    assert not (cv / "crossval_definition.json").exists(), "rank 1 was to be killed while it waits for rank 0"
    os.kill(rank1["pid"], signal.SIGKILL)
    launcher = job.communicate(timeout=600)[0]
    rank0 = rank_output(out, 0)
    assert "mpirun noticed" not in launcher and "job has been aborted" not in launcher, launcher[-3000:]
    assert not (exits / "rank1.json").exists()
    ended = json.loads((exits / "rank0.json").read_text())
    assert ended["code"] == 3, launcher[-2000:] + rank0[-3000:]
    lost = [line for line in rank0.splitlines() if line.startswith("error: rank 1 ")]
    assert len(lost) == 1, rank0[-3000:]
    assert lost[0].startswith(f"error: rank 1 (host {rank1['host']}, pid {rank1['pid']}) stopped answering: nothing")
    assert f"(--rank-timeout {timeout})" in lost[0] and "Rerun the same command" in lost[0]
    silent = int(re.search(r"nothing from it for (\d+) s", lost[0]).group(1))
    assert timeout <= silent <= timeout + 2 * POLL_SECONDS + 1, lost[0]
    assert "error: fold 1: not finished" in rank0 and "1 fold(s) unfinished" in rank0, rank0[-3000:]
    (waiting,) = [e for e in read_job_events(cv, jobs=False) if e["event"] == "worker_end" and e["rank"] == 0]
    assert waiting["code"] == 0  # rank 0's own fold trained and was predicted
    took = ended["time"] - waiting["time"]
    assert timeout <= took < timeout + 2 * POLL_SECONDS + 10, took
    time.sleep(2)
    left = subprocess.run(["pgrep", "-f", str(cv)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the job are still running: {left}"


@pytest.mark.slow
def test_tfmis_launch_says_what_it_exposes_and_two_workers_end_quietly(converted_dataset, tmp_path):
    """`python -m tfmis.launch --nproc 2 -- python -m tfmis.train ...` on loopback: it first says which ports its
    workers' TensorFlow gRPC servers use and that TensorFlow listens on them on all interfaces; the 2-worker
    training exits 0 and neither worker's output (the chief's own, worker 1's `[worker 1]` lines) holds an error."""
    config = tiny_yaml(tmp_path / "tiny.yaml", converted_dataset, tmp_path / "run")
    result = run_workers([sys.executable, "-m", "tfmis.launch", "--nproc", "2", "--"], config)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    exposure = re.search(
        r"tfmis.launch: 2 workers: TensorFlow gRPC servers on 127\.0\.0\.1:(\d+), 127\.0\.0\.1:(\d+)", output
    )
    assert exposure, output[:2000]
    assert "ALL network interfaces" in output and "without authentication" in output
    assert "on 2 replica(s) (multiworker, 2 worker process(es))" in output
    assert error_lines(output) == [], "\n".join(error_lines(output))


def test_exposure_warning_is_printed_for_a_cluster_beyond_loopback_only(capsys):
    """The chief's start-up warning (`tfmis.engine.distribution.warn_exposure`) names every address and the
    private-network advice when any worker address is not loopback, and says nothing for 127.0.0.1 / localhost
    / ::1 clusters (tfmis.launch prints its own line for those); `is_loopback` reads host:port, [v6]:port and
    names that resolve to loopback."""
    from tfmis.engine.cluster import is_loopback
    from tfmis.engine.distribution import warn_exposure

    assert all(is_loopback(a) for a in ("127.0.0.1:5000", "localhost:1", "[::1]:2", "127.0.1.1:3"))
    assert not any(is_loopback(a) for a in ("10.1.2.3:5000", "[2001:db8::1]:4", "no-such-host.invalid:1"))
    warn_exposure({"worker": ["127.0.0.1:5000", "localhost:5001"]})
    assert capsys.readouterr().err == ""
    warn_exposure({"worker": ["10.1.2.3:23456", "10.1.2.4:23456"]})
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "10.1.2.3:23456, 10.1.2.4:23456" in err
    assert "ALL network interfaces" in err and "without authentication" in err and "private cluster network" in err


def _slurm_problem() -> str | None:
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return (
            "srun not found: SLURM is not installed (CI: .ci/run sets up a one-node SLURM, tools/slurm_single_node.sh)"
        )
    idle = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    if idle.returncode != 0 or not idle.stdout.strip():
        return (
            f"no SLURM controller answers (sinfo: {idle.stderr.strip()[:200]}): start one, tools/slurm_single_node.sh"
        )
    return None


@pytest.mark.launcher
@pytest.mark.skipif(_slurm_problem() is not None, reason=str(_slurm_problem()))
def test_tfmis_train_under_a_real_srun_trains_on_two_replicas_and_ends_quietly(converted_dataset, tmp_path):
    """`srun -n 2 python -m tfmis.train --config tiny.yaml` on a real (one-node) SLURM: both tasks pick multiworker
    from SLURM's environment (2 replicas), exit 0, and neither task's output holds an error line."""
    config = tiny_yaml(tmp_path / "tiny.yaml", converted_dataset, tmp_path / "run")
    result = run_workers(["srun", "-N", "1", "-n", "2", "--output", str(tmp_path / "task%t.log")], config)
    logs = [(tmp_path / f"task{t}.log").read_text() for t in (0, 1)]
    assert result.returncode == 0, result.stderr[-2000:] + logs[0][-3000:] + logs[1][-3000:]
    assert "on 2 replica(s) (multiworker, 2 worker process(es))" in logs[0]
    for task, log in enumerate(logs):
        assert error_lines(log) == [], f"task {task}:\n" + "\n".join(error_lines(log))
    history = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in history] == [1, 2]
