"""Data parallelism over real worker processes on loopback: MultiWorkerMirroredStrategy started by
`tfmis.launch`, by a hand-written TF_CONFIG, by SLURM's and MPI's environment variables; failures and resume."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import TINY_TRAINING, tiny_config

from tfmis.config import ConfigError, load_config
from tfmis.engine.cluster import detect_launch, free_ports

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
NOISE = ("I0000", "W0000", "WARNING: All log", "oneDNN", "To enable the following", "rebuild TensorFlow")

WORKER_STEPS_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from tfmis.engine.distribution import make_backend
    backend = make_backend("multiworker")  # first: MultiWorkerMirroredStrategy sets up the runtime
    import tensorflow as tf
    sys.path.insert(0, sys.argv[4])
    from conftest import tiny_config
    from test_training import PLAIN_SGD
    from tfmis.engine.trainer import Trainer
    dataset_dir, out, batches = sys.argv[1], sys.argv[2], np.load(sys.argv[3])
    trainer = Trainer(tiny_config(dataset_dir, out + "/run", *PLAIN_SGD, "pipeline.num_images_per_batch=2"),
                      backend=backend)
    rank = backend.rank
    if rank == 0:
        np.savez(out + "/start.npz", *trainer.model.get_weights())
    mine = slice(2 * rank, 2 * rank + 2)  # worker r takes images 2r, 2r+1 of each global batch of 4
    dataset = backend.distribute_dataset(
        lambda ctx: tf.data.Dataset.from_tensor_slices((batches["images"][:, mine], batches["labels"][:, mine])))
    losses = [float(trainer.train_step(batch)[0]) for batch in dataset]
    np.savez(out + f"/rank{rank}.npz", *trainer.model.get_weights())
    with open(out + f"/rank{rank}.json", "w") as f:
        json.dump({"losses": losses, "replicas": backend.num_replicas, "size": backend.size}, f)
""")


def _clean(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith(NOISE))


def _tiny_yaml(tmp_path, dataset_dir, output_dir, **training) -> Path:
    """The tiny test config as a YAML file for `python -m tfmis.train` (one thread per worker process)."""
    data = {}
    for override in [
        f"data.dataset_dir={dataset_dir}",
        f"output.dir={output_dir}",
        *TINY_TRAINING,
        *(f"training.{k}={v}" for k, v in training.items()),
    ]:
        key, value = override.split("=", 1)
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG",)}
    env.update(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    return env


def _tf_config(workers, index):
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})


def _history(run: Path) -> list[dict]:
    path = run / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []


@pytest.mark.slow
def test_multiworker_steps_match_one_process_with_the_same_global_batch(converted_dataset, tmp_path):
    """Two MultiWorkerMirroredStrategy workers started by `python -m tfmis.launch --nproc 2`, each taking 2
    of the 4 images of three fixed global batches, end with identical weights, and their losses and weights
    equal one process taking all 4 images per step from the same initial weights."""
    import tensorflow as tf
    from test_training import PLAIN_SGD, run_step

    from tfmis.data.pipeline import build_train_dataset
    from tfmis.engine.trainer import Trainer

    single = Trainer(tiny_config(converted_dataset, tmp_path / "single", *PLAIN_SGD, "pipeline.num_images_per_batch=4"))
    steps = list(build_train_dataset(single.config).unbatch().batch(4).take(3).as_numpy_iterator())
    np.savez(tmp_path / "batches.npz", images=np.stack([s[0] for s in steps]), labels=np.stack([s[1] for s in steps]))
    script = tmp_path / "steps.py"
    script.write_text(WORKER_STEPS_SCRIPT)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfmis.launch",
            "--nproc",
            "2",
            "--",
            sys.executable,
            str(script),
            str(converted_dataset),
            str(tmp_path),
            str(tmp_path / "batches.npz"),
            str(TESTS),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=ROOT,
    )
    assert result.returncode == 0, _clean(result.stdout + result.stderr)[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["replicas"] for r in ranks] == [2, 2] and [r["size"] for r in ranks] == [2, 2]
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the step's loss is reduced over both workers
    weights = [list(np.load(tmp_path / f"rank{r}.npz").values()) for r in (0, 1)]
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)  # both workers hold the same model after every step
    single.model.set_weights(list(np.load(tmp_path / "start.npz").values()))
    start = [w.copy() for w in single.model.get_weights()]
    single_losses = [run_step(single, (tf.constant(images), tf.constant(labels)))[0] for images, labels in steps]
    np.testing.assert_allclose(ranks[0]["losses"], single_losses, rtol=1e-5)
    assert max(float(np.abs(a - b).max()) for a, b in zip(single.model.get_weights(), start)) > 1e-4
    for a, b in zip(single.model.get_weights(), weights[0]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _start_workers(config_path, workers, *args, extra_env=None):
    procs = []
    for k in range(len(workers)):
        env = _env(TF_CONFIG=_tf_config(workers, k), **(extra_env or {}))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tfmis.train", "--config", str(config_path), *args],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


@pytest.mark.slow
def test_hand_written_tf_config_trains_and_a_killed_worker_ends_the_other_then_resume_continues(
    converted_dataset, tmp_path
):
    """`python -m tfmis.train` on two workers from a hand-written TF_CONFIG: the chief alone writes the history
    and logs; SIGKILL of worker 1 mid-training makes worker 0 exit by itself with the lost-worker error (no hang);
    `tfmis.launch ... --resume` continues from the last committed epoch, and its saves leave no temporary
    checkpoint folder of a non-chief worker behind (not even one the killed worker left mid-save)."""
    run = tmp_path / "run"
    config = _tiny_yaml(tmp_path, converted_dataset, run, epochs=200, steps_per_epoch=3)
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    chief, other = _start_workers(config, workers)
    deadline = time.monotonic() + 240
    while len(_history(run)) < 2 and time.monotonic() < deadline and chief.poll() is None:
        time.sleep(0.5)
    assert len(_history(run)) >= 2, _clean(chief.communicate(timeout=60)[1])[-3000:]
    other.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    _, chief_log = chief.communicate(timeout=180)
    ended_after = time.monotonic() - killed_at
    assert chief.returncode == 1, _clean(chief_log)[-3000:]
    assert "error: worker 0 lost contact with the other workers" in chief_log
    assert "restart all workers with --resume" in chief_log
    assert ended_after < 120
    other_log = other.communicate()[1]
    assert "epoch 1/200" in chief_log and "epoch 1/" not in other_log  # logs come from the chief only
    done = len(_history(run))
    assert [r["epoch"] for r in _history(run)] == list(range(1, done + 1))
    # worker 1 may have died in the middle of a save, leaving its temporary checkpoint folder in .workers/: make
    # sure there is one, as such a kill leaves it
    leftover = run / ".workers" / "worker1" / "checkpoints"
    leftover.mkdir(parents=True, exist_ok=True)
    (leftover / "ckpt-9.index.tempstate").write_text("")

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfmis.launch",
            "--nproc",
            "2",
            "--",
            sys.executable,
            "-m",
            "tfmis.train",
            "--config",
            str(config),
            "--resume",
            "--set",
            f"training.epochs={done + 2}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=ROOT,
    )
    assert result.returncode == 0, _clean(result.stdout + result.stderr)[-3000:]
    assert f"Resuming from {run / 'checkpoints'}/ckpt-{done}" in result.stderr
    assert [r["epoch"] for r in _history(run)] == list(range(1, done + 3))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["num_replicas"] == 2 and summary["epochs"] == done + 2
    assert not (run / ".workers").exists() or not any((run / ".workers").iterdir())  # gone after the next saves


@pytest.mark.parametrize("launcher", ["slurm", "mpi"])
@pytest.mark.slow
def test_srun_and_mpirun_environments_form_one_cluster(converted_dataset, tmp_path, launcher):
    """Two `python -m tfmis.train` processes with the environment `srun` (SLURM_PROCID, SLURM_STEP_NODELIST, ...)
    or Open MPI's `mpirun` (OMPI_COMM_WORLD_RANK/SIZE, no host list: a file rendezvous) sets, and no TF_CONFIG,
    pick `multiworker` by themselves (runtime.distribution auto) and train one model on 2 replicas. The data is
    converted from the MSD folder first, by the chief alone, while the other worker waits (it would otherwise
    find no index.json and fail)."""
    run = tmp_path / "run"
    target = tmp_path / "tfrecords"
    config = _tiny_yaml(tmp_path, target, run, epochs=1, steps_per_epoch=2)
    data = yaml.safe_load(config.read_text())
    data["data"].update(
        source_dir=str(converted_dataset.parent / "Task99_Test"),
        conversion={"split": [0.75, 0.25], "shards": 2, "workers": 1},
    )
    config.write_text(yaml.safe_dump(data))
    port = free_ports(1)[0]
    procs = []
    for rank in (0, 1):
        if launcher == "slurm":
            env = dict(
                SLURM_PROCID=str(rank),
                SLURM_LOCALID=str(rank),
                SLURM_NTASKS="2",
                SLURM_STEP_NUM_TASKS="2",
                SLURM_STEP_NODELIST="localhost",
                SLURM_STEP_TASKS_PER_NODE="2",
                SLURM_JOB_ID="77",
            )
        else:
            env = dict(
                OMPI_COMM_WORLD_RANK=str(rank),
                OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
                OMPI_COMM_WORLD_SIZE="2",
                OMPI_MCA_ess_base_jobid=f"test{port}",
            )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tfmis.train", "--config", str(config), "--set", f"runtime.port={port}"],
                env=_env(**env),
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    logs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], _clean(logs[0] + logs[1])[-3000:]
    assert "on 2 replica(s) (multiworker, 2 worker process(es))" in logs[0]
    assert [r["epoch"] for r in _history(run)] == [1]
    assert (target / "index.json").is_file()
    assert not (run / ".rendezvous").exists()  # the MPI rendezvous is removed once the cluster is up


def test_detect_launch_reads_each_launchers_environment():
    """Rank, size, local rank and local size from horovodrun's, TF_CONFIG's, SLURM's, Open MPI's and MPICH's
    variables."""
    workers = ["a:1", "b:2", "c:3"]
    assert detect_launch({}).kind == "single"
    assert detect_launch({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1"}) == detect_launch(
        {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "TF_CONFIG": "x"}
    )
    h_env = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1"}
    h = detect_launch(h_env)
    assert (h.kind, h.rank, h.size, h.local_rank) == ("horovod", 1, 4, 1)
    t = detect_launch(
        {
            "TF_CONFIG": json.dumps(
                {"cluster": {"chief": ["z:0"], "worker": workers}, "task": {"type": "worker", "index": 2}}
            )
        }
    )
    assert (t.kind, t.rank, t.size) == ("tf_config", 3, 4)
    s = detect_launch({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "9"})
    assert (s.kind, s.rank, s.size, s.local_rank) == ("slurm", 5, 8, 1)
    assert detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).kind == "single"  # sbatch without srun -n
    o = detect_launch({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    assert (o.kind, o.rank, o.size, o.local_rank) == ("mpi", 2, 3, 0)
    m = detect_launch({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"})
    assert (m.kind, m.rank, m.size, m.local_rank) == ("mpi", 1, 2, 1)
    # how many processes of the launch share this machine: what each rank's share of cores and GPUs is cut from
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert detect_launch({**ompi, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}).local_size == 2
    assert detect_launch(ompi).local_size == 1
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}
    assert detect_launch(slurm).local_size == 4
    assert detect_launch({**h_env, "HOROVOD_LOCAL_SIZE": "2"}).local_size == 2
    local = {"cluster": {"worker": ["127.0.0.1:1", "localhost:2"]}, "task": {"type": "worker", "index": 1}}
    assert detect_launch({"TF_CONFIG": json.dumps(local)}).local_rank == 1  # tfmis.launch: every worker here
    assert detect_launch({"TF_CONFIG": json.dumps(local)}).local_size == 2
    t_hosts = detect_launch({"TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"index": 2}})})
    assert (t_hosts.local_rank, t_hosts.local_size) == (0, 1)  # other hosts: nothing known about this machine
    with pytest.raises(ValueError, match="TF_CONFIG is not valid JSON"):
        detect_launch({"TF_CONFIG": "{not json"})


def test_training_distribution_key_moved_to_runtime_names_the_new_key():
    """An old config with training.distribution gets an error pointing at runtime.distribution."""
    with pytest.raises(ConfigError, match="'training.distribution' has moved to 'runtime.distribution'"):
        load_config(None, ["training.distribution=mirrored"])
    assert load_config(None, ["runtime.distribution=multiworker"]).runtime.distribution == "multiworker"
    with pytest.raises(ConfigError, match="runtime.distribution"):
        load_config(None, ["runtime.distribution=ray"])


@pytest.mark.parametrize("pipelines", [2, 3])
def test_input_pipelines_read_disjoint_cases_that_cover_the_split(converted_dataset, pipelines):
    """With 2 train shard files, 2 pipelines (workers) shard by file and 3 by case; either way every train case
    is read by exactly one pipeline (so each worker caches only its own part) and data-level shares are even."""
    import tensorflow as tf

    from tfmis.data.pipeline import input_shard, read_records
    from tfmis.data.records import load_index, shard_paths

    index = load_index(converted_dataset)
    files = shard_paths(converted_dataset, "train", index)
    cases = index["splits"]["train"]["cases"]
    assert len(files) == 2 and len(cases) == 6
    seen = []
    for i in range(pipelines):
        context = tf.distribute.InputContext(pipelines, i, pipelines)
        assert input_shard(files, cases, context)["level"] == ("file" if pipelines <= len(files) else "data")
        seen.append(
            [
                meta["case_id"].decode()
                for _, _, meta in read_records(files, index, True, context, "train").as_numpy_iterator()
            ]
        )
    assert sorted(sum(seen, [])) == sorted(cases)  # disjoint and complete
    if pipelines == 3:
        assert [len(s) for s in seen] == [2, 2, 2]
    with pytest.raises(ValueError, match="6 case.*cannot be shared by 7 input pipelines"):
        input_shard(files, cases, tf.distribute.InputContext(7, 0, 7))


@pytest.mark.parametrize("scaling, factor", [("none", 1.0), ("linear", 4.0), ("sqrt", 2.0)])
def test_learning_rate_scales_with_the_global_batch(converted_dataset, tmp_path, scaling, factor):
    """optimizer.lr_scaling: a global batch of 4 (2 images × 2 accumulation steps) against a reference batch of 1
    gives the optimizer learning_rate × 4 (linear, Goyal et al.), × √4 (sqrt) or × 1 (none)."""
    import keras

    from tfmis.engine.trainer import Trainer

    trainer = Trainer(
        tiny_config(
            converted_dataset,
            tmp_path,
            "optimizer.schedule=constant",
            "optimizer.learning_rate=0.01",
            "training.accumulation_steps=2",
            f"optimizer.lr_scaling={scaling}",
            "optimizer.lr_reference_batch=1",
        )
    )
    assert trainer.global_batch == 4
    rate = float(keras.ops.convert_to_numpy(trainer.optimizer.learning_rate))
    assert rate == pytest.approx(0.01 * factor, rel=1e-6)
