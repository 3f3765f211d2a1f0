"""The Horovod backend (`runtime.distribution: horovod`, tfmis/engine/horovod.py) with real processes.

Horovod 0.28.1 builds only against TensorFlow <= 2.16, so these tests run in the environment made by
`tools/install_horovod.sh` (TensorFlow 2.16.2, Horovod with TensorFlow + Gloo):

    tools/install_horovod.sh                       # once: .venv-horovod
    .venv-horovod/bin/python -m pytest tests/test_horovod.py

Processes are started by `horovodrun -np 2 -H localhost:2 --gloo` on the loopback interface and
train the real tiny U-Net on real TFRecords; with Horovod built with MPI (install_horovod.sh does so
when mpicxx is there) also by a real Open MPI `mpirun -np 2` and by `horovodrun --mpi`. In an
interpreter without Horovod (the default TensorFlow 2.21 environment) the Horovod tests are skipped,
and the one test that runs there checks the error a user gets when asking for Horovod without it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_config

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def _horovod_problem() -> str | None:
    """Why Horovod cannot be used from this interpreter, or None if it can."""
    try:
        import horovod.tensorflow  # noqa: F401
    except Exception as e:  # not installed, or built without TensorFlow ops
        return (
            f"Horovod is not usable in {sys.executable} ({type(e).__name__}: {str(e).splitlines()[0]}); "
            "run these tests in the Horovod environment: tools/install_horovod.sh, then "
            ".venv-horovod/bin/python -m pytest tests/test_horovod.py"
        )
    return None


HOROVOD_PROBLEM = _horovod_problem()
HOROVODRUN = Path(sys.executable).parent / "horovodrun"
# CI runs this file twice: in its default step (TensorFlow 2.21, no Horovod: only the missing-Horovod test runs) and in
# its Horovod step (.venv-horovod, TFMIS_CI=horovod: every Horovod test runs). Each run may skip what the other covers,
# nothing else: a Horovod test skipped in the Horovod step fails it (tests/conftest.py).
HOROVOD_STEP = os.environ.get("TFMIS_CI") == "horovod"
COVERED_BY_THE_HOROVOD_STEP = pytest.mark.ci_may_skip("runs in CI's Horovod step, in .venv-horovod")


def needs_horovod(test):
    test = pytest.mark.skipif(HOROVOD_PROBLEM is not None, reason=str(HOROVOD_PROBLEM))(test)
    return test if HOROVOD_STEP else COVERED_BY_THE_HOROVOD_STEP(test)


# momentum SGD, so that the optimizer has state that sync_initial_state must broadcast too
SGD = [
    "optimizer.name=sgd",
    "optimizer.momentum=0.9",
    "optimizer.nesterov=false",
    "optimizer.schedule=constant",
    "optimizer.learning_rate=0.2",
    "optimizer.weight_decay=0.0",
]
STEPS = 3
PER_RANK = 2  # images per process per step; 2 processes = a global batch of 4


def horovodrun(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """`horovodrun -np 2 -H localhost:2 --gloo <args>` on loopback; every line prefixed `[rank]<stream>:`."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}
    command = [str(HOROVODRUN), "-np", "2", "-H", "localhost:2", "--gloo", "--start-timeout", "120", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def rank_lines(output: str, rank: int) -> list[str]:
    """The lines rank `rank` wrote (horovodrun prefixes each with `[rank]<stdout>:` or `[rank]<stderr>:`)."""
    return [m.group(1) for m in re.finditer(rf"^\[{rank}\]<std(?:out|err)>:(.*)$", output, re.M)]


def arrays(npz, prefix: str) -> list[np.ndarray]:
    """The arrays saved as `prefix_0`, `prefix_1`, ... (not `prefix_opt_0`)."""
    count = sum(bool(re.fullmatch(rf"{prefix}_\d+", k)) for k in npz.files)
    return [npz[f"{prefix}_{i}"] for i in range(count)]


def max_diff(a, b) -> float:
    return max(float(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max()) for x, y in zip(a, b))


# ---------------------------------------------------------------- the error without Horovod


@pytest.mark.ci_may_skip("runs in CI's default step, where Horovod is not installed")
@pytest.mark.skipif(
    HOROVOD_PROBLEM is None, reason="Horovod is importable here: the missing-Horovod error cannot occur"
)
def test_horovod_backend_without_horovod_names_the_setting_and_the_installer():
    """In an interpreter without Horovod, make_backend("horovod") raises a RuntimeError that names
    `runtime.distribution: horovod` and `tools/install_horovod.sh` (nothing is initialised first)."""
    from tfmis.engine.distribution import make_backend

    with pytest.raises(RuntimeError) as info:
        make_backend("horovod")
    message = str(info.value)
    assert "runtime.distribution: horovod" in message
    assert "tools/install_horovod.sh" in message


@needs_horovod
def test_horovod_without_tensorflow_ops_names_the_setting_and_the_installer(tmp_path):
    """A Horovod package whose TensorFlow extension was not built (the installed package copied without
    its compiled `horovod/tensorflow/mpi_lib*.so`, which is what a build without HOROVOD_WITH_TENSORFLOW
    leaves) makes HorovodBackend() raise a RuntimeError naming the cause, the setting and the installer."""
    import horovod

    shutil.copytree(
        Path(horovod.__file__).parent, tmp_path / "horovod", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    script = (
        "from tfmis.engine.horovod import HorovodBackend\n"
        "try:\n    HorovodBackend()\nexcept RuntimeError as e:\n    print('RuntimeError:', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RuntimeError:" in result.stdout, result.stdout + result.stderr[-2000:]
    assert str(tmp_path / "horovod") in result.stdout  # it really loaded the copy without the extension
    for part in (
        "horovod.tensorflow does not load",
        "built without TensorFlow ops",
        "runtime.distribution: horovod",
        "tools/install_horovod.sh",
    ):
        assert part in result.stdout


# ---------------------------------------------------------------- steps: 2 Horovod processes vs 1 process

HOROVOD_STEPS = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, sys.argv[3])
    from tfmis.engine.distribution import make_backend
    backend = make_backend("auto")  # first: under horovodrun, auto = horovod (hvd.init, device pinning)
    import keras
    import tensorflow as tf
    from conftest import tiny_config
    from test_horovod import PER_RANK, SGD, STEPS
    from tfmis.engine.horovod import HorovodBackend
    from tfmis.engine.trainer import Trainer

    dataset_dir, out = sys.argv[1], sys.argv[2]
    assert isinstance(backend, HorovodBackend), type(backend)
    rank = backend.rank
    # a different seed per rank: the ranks build different initial weights
    config = tiny_config(dataset_dir, out + "/hvd", *SGD, f"pipeline.num_images_per_batch={PER_RANK}",
                         f"training.seed={11 + rank}", "runtime.distribution=horovod")
    trainer = Trainer(config, backend=backend)
    model, optimizer = trainer.model, trainer.optimizer

    def numpy(variables):
        return [keras.ops.convert_to_numpy(v) for v in variables]

    if rank == 1:  # rank 1 also has an optimizer state of its own (moments, step count): sync must replace it
        rng = np.random.default_rng(1)
        for v in optimizer.variables:
            if "float" in str(v.dtype):
                v.assign(rng.normal(size=v.shape).astype(str(v.dtype)))
            else:
                v.assign(np.full(v.shape, 5, str(v.dtype)))
    saved = {"info": np.array([backend.rank, backend.size, backend.num_replicas, backend.is_chief,
                               backend.saves_checkpoints])}
    for name, values in (("start", numpy(model.variables)), ("start_opt", numpy(optimizer.variables))):
        saved.update({f"{name}_{i}": a for i, a in enumerate(values)})
    backend.sync_initial_state(model, optimizer)
    for name, values in (("synced", numpy(model.variables)), ("synced_opt", numpy(optimizer.variables))):
        saved.update({f"{name}_{i}": a for i, a in enumerate(values)})
    data = np.load(out + "/batches.npz")
    losses, skipped = [], []
    for k in range(STEPS):  # step k: rank r takes images [4k + 2r, 4k + 2r + 2) of the global batch
        lo = (k * backend.size + rank) * PER_RANK
        batch = (tf.constant(data["images"][lo:lo + PER_RANK]), tf.constant(data["labels"][lo:lo + PER_RANK]))
        loss, was_skipped = trainer.train_step(batch)
        losses.append(float(loss))
        skipped.append(float(was_skipped))
    saved.update(losses=np.array(losses), skipped=np.array(skipped))
    for name, values in (("final", numpy(model.variables)), ("final_opt", numpy(optimizer.variables))):
        saved.update({f"{name}_{i}": a for i, a in enumerate(values)})
    np.savez(f"{out}/rank{rank}.npz", **saved)
""")

ONE_PROCESS_STEPS = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, sys.argv[3])
    import keras
    import tensorflow as tf
    from conftest import tiny_config
    from test_horovod import PER_RANK, SGD, STEPS
    from tfmis.engine.distribution import make_backend
    from tfmis.engine.trainer import Trainer

    dataset_dir, out = sys.argv[1], sys.argv[2]
    global_batch = 2 * PER_RANK
    config = tiny_config(dataset_dir, out + "/single", *SGD, f"pipeline.num_images_per_batch={global_batch}",
                         "training.seed=11", "runtime.distribution=none")
    trainer = Trainer(config, backend=make_backend("none"))
    rank0 = np.load(out + "/rank0.npz")
    for i, v in enumerate(trainer.model.variables):  # rank 0's initial weights: what sync_initial_state broadcast
        v.assign(rank0[f"start_{i}"])
    data = np.load(out + "/batches.npz")
    losses = []
    for k in range(STEPS):
        lo = k * global_batch
        batch = (tf.constant(data["images"][lo:lo + global_batch]), tf.constant(data["labels"][lo:lo + global_batch]))
        losses.append(float(trainer.train_step(batch)[0]))
    np.savez(out + "/single.npz", losses=np.array(losses),
             **{f"final_{i}": keras.ops.convert_to_numpy(v) for i, v in enumerate(trainer.model.variables)},
             **{f"final_opt_{i}": keras.ops.convert_to_numpy(v) for i, v in enumerate(trainer.optimizer.variables)})
""")


@pytest.fixture(scope="module")
def horovod_steps(converted_dataset, tmp_path_factory):
    """Runs STEPS real training steps in 2 Horovod processes (2 images each) and in 1 process (4 images)
    from rank 0's initial weights; returns (rank0, rank1, single) as loaded .npz files."""
    from tfmis.data.pipeline import build_train_dataset

    out = tmp_path_factory.mktemp("horovod_steps")
    images, labels = next(
        iter(build_train_dataset(tiny_config(converted_dataset, out / "batches")).unbatch().batch(STEPS * 2 * PER_RANK))
    )
    np.savez(out / "batches.npz", images=images.numpy(), labels=labels.numpy())
    (out / "steps.py").write_text(HOROVOD_STEPS)
    (out / "single.py").write_text(ONE_PROCESS_STEPS)
    start = time.perf_counter()
    result = horovodrun([sys.executable, str(out / "steps.py"), str(converted_dataset), str(out), str(TESTS)], out)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    horovod_seconds = time.perf_counter() - start
    single = subprocess.run(
        [sys.executable, str(out / "single.py"), str(converted_dataset), str(out), str(TESTS)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert single.returncode == 0, single.stderr[-4000:]
    print(f"horovodrun -np 2 ({STEPS} steps): {horovod_seconds:.1f} s")
    return np.load(out / "rank0.npz"), np.load(out / "rank1.npz"), np.load(out / "single.npz")


@needs_horovod
def test_horovodrun_processes_get_a_horovod_backend_with_ranks(horovod_steps):
    """Under horovodrun, make_backend("auto") gives HorovodBackend: ranks 0 and 1 of 2, 2 replicas, only
    rank 0 chief and saving checkpoints."""
    rank0, rank1, _ = horovod_steps
    assert rank0["info"].tolist() == [0, 2, 2, True, True]
    assert rank1["info"].tolist() == [1, 2, 2, False, False]


@needs_horovod
def test_sync_initial_state_gives_every_rank_rank0_weights_and_optimizer_state(horovod_steps):
    """Ranks built with different seeds (different weights; rank 1 with its own optimizer moments and step
    count) hold exactly rank 0's model and optimizer variables after sync_initial_state."""
    rank0, rank1, _ = horovod_steps
    assert max_diff(arrays(rank0, "start"), arrays(rank1, "start")) > 1e-2  # they did start apart
    assert max_diff(arrays(rank0, "start_opt"), arrays(rank1, "start_opt")) > 0.5
    for name in ("synced", "synced_opt"):
        originals = arrays(rank0, name.replace("synced", "start"))
        for a, b, original in zip(arrays(rank0, name), arrays(rank1, name), originals):
            np.testing.assert_array_equal(b, a)
            np.testing.assert_array_equal(a, original)  # rank 0 kept its own


@needs_horovod
def test_horovod_steps_keep_ranks_identical(horovod_steps):
    """After STEPS real steps on different data, both ranks hold bit-identical weights and optimizer state,
    report the same (all-reduced) losses, and skipped no step."""
    rank0, rank1, _ = horovod_steps
    assert max_diff(arrays(rank0, "final"), arrays(rank0, "synced")) > 1e-3  # the steps moved the weights
    for name in ("final", "final_opt"):
        for a, b in zip(arrays(rank0, name), arrays(rank1, name)):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(rank0["losses"], rank1["losses"])
    assert rank0["skipped"].tolist() == [0.0] * STEPS


@needs_horovod
def test_two_horovod_processes_match_one_process_on_the_global_batch(horovod_steps):
    """2 processes x 2 images take the same steps as 1 process (default backend) on the same 4 images:
    the same losses and, after STEPS momentum-SGD steps, the same weights and momenta (float32 tolerance)."""
    rank0, _, single = horovod_steps
    print(
        f"losses 2 processes {rank0['losses'].tolist()} vs 1 process {single['losses'].tolist()}; max |weight diff| "
        f"{max_diff(arrays(rank0, 'final'), arrays(single, 'final')):.2e}, max |momentum diff| "
        f"{max_diff(arrays(rank0, 'final_opt'), arrays(single, 'final_opt')):.2e}"
    )
    np.testing.assert_allclose(rank0["losses"], single["losses"], rtol=1e-5)
    assert len(set(np.round(single["losses"], 6))) == STEPS  # different batches: a real sequence of steps
    moved = max_diff(arrays(single, "final"), arrays(rank0, "synced"))
    assert moved > 1e-3
    assert max_diff(arrays(rank0, "final"), arrays(single, "final")) < 1e-5 * max(1.0, moved)
    assert max_diff(arrays(rank0, "final_opt"), arrays(single, "final_opt")) < 1e-4


# ---------------------------------------------------------------- python -m tfmis.train under horovodrun


@needs_horovod
def test_tfmis_train_under_horovodrun_end_to_end(converted_dataset, tmp_path):
    """`horovodrun -np 2 ... python -m tfmis.train --config tiny.yaml --set runtime.distribution=horovod`
    trains 2 epochs with validation: exit 0; rank 0 alone announces the run, logs both validated epochs and
    writes summary.json (2 replicas), the history and the checkpoints of epochs 1 and 2; then `--resume` with
    training.epochs=3 restores checkpoint 2 on both ranks and trains epoch 3 only."""
    from tfmis.config import save_config

    out = tmp_path / "run"
    save_config(tiny_config(converted_dataset, out), tmp_path / "tiny.yaml")
    start = time.perf_counter()
    result = horovodrun(
        [
            sys.executable,
            "-m",
            "tfmis.train",
            "--config",
            str(tmp_path / "tiny.yaml"),
            "--set",
            "runtime.distribution=horovod",
        ],
        tmp_path,
    )
    seconds = time.perf_counter() - start
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    print(f"tfmis.train under horovodrun -np 2: {seconds:.1f} s")
    announced = [line for rank in (0, 1) for line in rank_lines(output, rank) if "replica(s)" in line]
    assert len(announced) == 1 and announced[0] in rank_lines(output, 0), announced
    assert "2 replica(s) (horovod, 2 worker process(es))" in announced[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs"] == 2 and summary["num_replicas"] == 2
    assert 0.0 <= summary["final_mean_dice"] <= 1.0
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in history] == [1, 2]
    assert sorted(p.name for p in (out / "checkpoints").glob("*.index")) == ["ckpt-1.index", "ckpt-2.index"]
    epoch_lines = [line for line in rank_lines(output, 0) if line.startswith("epoch ") and "val mean Dice" in line]
    assert [line.split()[1] for line in epoch_lines] == ["1/2", "2/2"], output[-3000:]

    # --resume with one more epoch: every rank restores the chief's checkpoint 2 and trains epoch 3 only
    resumed = horovodrun(
        [
            sys.executable,
            "-m",
            "tfmis.train",
            "--config",
            str(tmp_path / "tiny.yaml"),
            "--set",
            "runtime.distribution=horovod",
            "--set",
            "training.epochs=3",
            "--resume",
        ],
        tmp_path,
    )
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-6000:]
    # (a rank that did not restore would run epochs 1-3 against the chief's epoch 3 and never finish)
    assert any("Resuming from" in line and "ckpt-2" in line for line in rank_lines(output, 0)), output[-3000:]
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in history] == [1, 2, 3]
    assert json.loads((out / "summary.json").read_text())["epochs"] == 3


HOROVOD_STATISTICS = textwrap.dedent("""
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[3])
    from tfmis.engine.distribution import make_backend
    backend = make_backend("horovod")
    import keras
    import tensorflow as tf
    from conftest import tiny_config
    from test_horovod import PER_RANK, SGD
    from tfmis.engine.trainer import Trainer

    dataset_dir, out = sys.argv[1], sys.argv[2]
    try:
        Trainer(tiny_config(dataset_dir, out + "/jit", "training.jit_compile=true"), backend=backend)
        jit_error = ""
    except ValueError as e:
        jit_error = str(e)
    trainer = Trainer(tiny_config(dataset_dir, out + "/bn", *SGD, "model.norm=batch",
                                  f"pipeline.num_images_per_batch={PER_RANK}"), backend=backend)
    trainer.backend.sync_initial_state(trainer.model, trainer.optimizer)
    data = np.load(out + "/batches.npz")
    lo = backend.rank * PER_RANK  # each rank its own images: its BatchNorm moving statistics move apart
    trainer.train_step((tf.constant(data["images"][lo:lo + PER_RANK]), tf.constant(data["labels"][lo:lo + PER_RANK])))
    state = [v for v in trainer.model.non_trainable_variables if "float" in str(v.dtype)]
    before = [keras.ops.convert_to_numpy(v) for v in state]
    backend.sync_statistics(trainer.model)
    after = [keras.ops.convert_to_numpy(v) for v in state]
    np.savez(f"{out}/stats{backend.rank}.npz", **{f"before_{i}": a for i, a in enumerate(before)},
             **{f"after_{i}": a for i, a in enumerate(after)})
    with open(f"{out}/jit{backend.rank}.txt", "w") as f:
        f.write(jit_error)
""")


@needs_horovod
def test_horovod_averages_batchnorm_statistics_and_refuses_jit_compile(converted_dataset, tmp_path):
    """Two horovodrun processes with model.norm=batch step on different images, so their BatchNorm moving
    statistics differ; `sync_statistics` (called by the trainer after each epoch's steps) leaves both ranks
    with the element-wise mean of the two. A Trainer with training.jit_compile=true under Horovod is refused
    with an error naming the setting."""
    from tfmis.data.pipeline import build_train_dataset

    images, labels = next(
        iter(build_train_dataset(tiny_config(converted_dataset, tmp_path / "b")).unbatch().batch(2 * PER_RANK))
    )
    np.savez(tmp_path / "batches.npz", images=images.numpy(), labels=labels.numpy())
    (tmp_path / "stats.py").write_text(HOROVOD_STATISTICS)
    result = horovodrun(
        [sys.executable, str(tmp_path / "stats.py"), str(converted_dataset), str(tmp_path), str(TESTS)], tmp_path
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    ranks = [np.load(tmp_path / f"stats{r}.npz") for r in (0, 1)]
    n = len([k for k in ranks[0].files if k.startswith("before_")])
    assert n >= 4  # moving mean and variance of at least two BatchNorm layers
    assert max(max_diff([ranks[0][f"before_{i}"]], [ranks[1][f"before_{i}"]]) for i in range(n)) > 1e-4
    for i in range(n):
        expected = (ranks[0][f"before_{i}"].astype(np.float64) + ranks[1][f"before_{i}"]) / 2
        np.testing.assert_array_equal(ranks[0][f"after_{i}"], ranks[1][f"after_{i}"])
        np.testing.assert_allclose(ranks[0][f"after_{i}"], expected, rtol=1e-6, atol=1e-7)
    for r in (0, 1):
        message = (tmp_path / f"jit{r}.txt").read_text()
        assert "training.jit_compile" in message and "runtime.distribution: horovod" in message


# ---------------------------------------------------------------- tools/install_horovod.sh


def test_install_script_names_a_missing_cmake_before_installing_anything(tmp_path):
    """With python3 but no cmake on PATH, tools/install_horovod.sh stops with an error naming cmake (and how
    to get it) and creates no environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname",):
        os.symlink(shutil.which(tool), bin_dir / tool)
    os.symlink(sys.executable, bin_dir / "python3")
    result = subprocess.run(
        ["/bin/bash", str(REPO / "tools" / "install_horovod.sh"), str(tmp_path / "venv")],
        env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "cmake not found" in result.stderr and "cmake >= 3.13" in result.stderr
    assert not (tmp_path / "venv").exists()


@needs_horovod
@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="not running inside a virtual environment")
def test_install_script_rerun_on_a_finished_environment_skips_every_step():
    """Rerunning tools/install_horovod.sh on the environment these tests run in rebuilds nothing: every step
    reports it is already done, and it ends with horovodrun --check-build listing TensorFlow and Gloo, and the
    MPI controller too when an MPI compiler wrapper (mpicxx/mpicc) is on PATH."""
    result = subprocess.run(
        ["bash", str(REPO / "tools" / "install_horovod.sh"), sys.prefix],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for done in ("exists", "2.16.2 and keras", "already built", "already installed"):
        assert done in out, out[-3000:]
    assert "building horovod" not in out and "creating virtual environment" not in out
    assert re.search(r"\[X\] TensorFlow", out) and re.search(r"\[X\] Gloo", out)
    if shutil.which("mpicxx") or shutil.which("mpicc"):
        assert "TensorFlow ops and Gloo + MPI already built" in out, out[-3000:]
        assert re.search(r"Available Controllers:\s*\n\s*\[X\] MPI", out), out[-3000:]


# ---------------------------------------------------------------- Horovod's MPI controller: mpirun, horovodrun --mpi

MPIRUN = shutil.which("mpirun")


def _mpi_horovod_problem() -> str | None:
    if HOROVOD_PROBLEM is not None:
        return HOROVOD_PROBLEM
    if MPIRUN is None:
        return "mpirun not found: install Open MPI (apt-get install openmpi-bin libopenmpi-dev), rerun the installer"
    import horovod.tensorflow as hvd

    if not hvd.mpi_built():
        return "Horovod was built without MPI: install Open MPI (mpicxx), then rerun tools/install_horovod.sh"
    return None


MPI_HOROVOD_PROBLEM = _mpi_horovod_problem()


def needs_mpi_horovod(test):
    test = pytest.mark.skipif(MPI_HOROVOD_PROBLEM is not None, reason=str(MPI_HOROVOD_PROBLEM))(test)
    return test if HOROVOD_STEP else COVERED_BY_THE_HOROVOD_STEP(test)


HOROVOD_FIT = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, sys.argv[3])
    from tfmis.engine.distribution import make_backend
    backend = make_backend("horovod")  # under mpirun, auto would mean multiworker: Horovod is asked for by name
    from conftest import tiny_config
    from tfmis.engine.trainer import Trainer
    dataset_dir, out, _, epochs, resume = sys.argv[1:6]
    config = tiny_config(dataset_dir, out + "/run", "runtime.distribution=horovod", f"training.epochs={epochs}")
    trainer = Trainer(config, backend=backend)
    trainer.fit(resume=resume == "resume")
    np.savez(f"{out}/rank{backend.rank}-{epochs}.npz", *trainer.model.get_weights())
    backend.finish()
""")


def _launch_fit(launcher: str, tmp_path: Path, converted_dataset, epochs: int, resume: bool):
    script = tmp_path / "fit.py"
    script.write_text(HOROVOD_FIT)
    args = [sys.executable, str(script), str(converted_dataset), str(tmp_path), str(TESTS), str(epochs)]
    args.append("resume" if resume else "fresh")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO)}
    if launcher == "mpirun":
        command = [MPIRUN, "-np", "2", "--oversubscribe", "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL"]
        if os.geteuid() == 0:
            command.append("--allow-run-as-root")
    else:  # horovodrun's MPI mode runs mpirun itself (with --allow-run-as-root and every environment variable)
        command = [str(HOROVODRUN), "--mpi", "-np", "2", "-H", "localhost:2"]
    return subprocess.run(command + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)


@needs_mpi_horovod
@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun --mpi"])
def test_horovod_over_mpi_trains_identical_ranks_and_resumes(converted_dataset, tmp_path, launcher):
    """Horovod built with MPI, started by a real Open MPI `mpirun -np 2` or by `horovodrun --mpi -np 2`:
    `Trainer.fit` for 2 epochs ends with identical weights on both ranks; a second launch with `--resume`
    semantics (`fit(resume=True)`, 3 epochs) restores the chief's checkpoint 2 on both ranks, trains epoch 3
    only, and again ends with identical weights."""
    for epochs, resume in ((2, False), (3, True)):
        result = _launch_fit(launcher, tmp_path, converted_dataset, epochs, resume)
        assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
        weights = [list(np.load(tmp_path / f"rank{r}-{epochs}.npz").values()) for r in (0, 1)]
        assert len(weights[0]) == len(weights[1]) > 0
        for a, b in zip(*weights):
            np.testing.assert_array_equal(a, b)
    history = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in history] == [1, 2, 3]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["num_replicas"] == 2
