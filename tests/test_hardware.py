"""The CPU runtime tfmis decides before TensorFlow is imported: oneDNN per machine, and thread and worker counts
from the CPUs a process may really use (affinity mask, cgroup CPU quota). Each check runs a real Python process
(TensorFlow reads both settings once, at its import) under a real `taskset` or a real cgroup."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tfmis.hardware import ONEDNN_ENV, cgroup_cpu_quota, onednn_choice, usable_cpu_count

REPO = Path(__file__).resolve().parents[1]
# a clean environment: neither the user's nor this test process's own oneDNN / thread decisions
CLEAN = ("TF_ENABLE_ONEDNN_OPTS", "TFMIS_ONEDNN_DECIDED", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")
CLEAN += ("TFMIS_THREADS_DECIDED",)

# what a process reports: tfmis's counts, and the threads TensorFlow really started after a conv and a tf.data map
REPORT = """
import collections, json, os, sys
import tfmis
from tfmis.data.conversion_options import ConversionConfig
from tfmis.engine.local_workers import worker_environments
from tfmis.data.pipeline import pipeline_options
from tfmis.hardware import current_onednn, usable_cpu_count
import tensorflow as tf
x = tf.random.normal([1, 16, 16, 16, 4])
for _ in range(2):
    tf.nn.conv3d(x, tf.random.normal([3, 3, 3, 4, 4]), [1] * 5, "SAME")
for _ in tf.data.Dataset.range(64).map(lambda a: a + 1, num_parallel_calls=tf.data.AUTOTUNE):
    pass
names = collections.Counter(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
launch = worker_environments(1)[0]
print(json.dumps({
    "usable": usable_cpu_count(),
    "intra_env": os.environ.get("TF_NUM_INTRAOP_THREADS"),
    "inter_env": os.environ.get("TF_NUM_INTEROP_THREADS"),
    "tf_inter_op_threads": names["tf_Compute"],
    "data_threads": pipeline_options(True).threading.private_threadpool_size,
    "conversion_workers": ConversionConfig("src", "dst").num_workers,
    "launch_intra": int(launch["TF_NUM_INTRAOP_THREADS"]),
    "onednn": current_onednn().describe(),
    "onednn_running": bool(__import__("tensorflow.python.util._pywrap_util_port", fromlist=["x"]).IsMklEnabled()),
}))
"""


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env.update(extra)
    return env


def report(prefix=(), code: str = REPORT, **env) -> dict:
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=clean_env(**env)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_taskset_one_core_gives_one_cpu_counts_for_threads_workers_and_launch():
    """Under `taskset -c 0` tfmis counts 1 usable CPU; TensorFlow runs 1 inter-op thread, the conversion 1 worker
    and a launched worker 1 intra-op thread (TensorFlow itself follows the affinity mask: no variable is set)."""
    if shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs taskset and at least 2 usable cores to restrict")
    whole = report()
    pinned = report(prefix=["taskset", "-c", "0"])
    assert whole["usable"] == len(os.sched_getaffinity(0)) >= 2
    assert whole["tf_inter_op_threads"] == whole["usable"] and whole["conversion_workers"] == min(whole["usable"], 8)
    assert pinned["usable"] == 1
    assert pinned["tf_inter_op_threads"] == 1
    assert pinned["conversion_workers"] == 1 and pinned["launch_intra"] == 1
    assert pinned["intra_env"] is None and pinned["data_threads"] is None  # the mask is what TensorFlow reads


def _cpu_cgroup(quota_cpus: float) -> tuple[Path, list[str]]:
    """A new cgroup with a CPU quota (v1 `cpu` controller or v2 `cpu.max`); (folder, command prefix to run in it)."""
    name = f"tfmis-test-{uuid.uuid4().hex[:8]}"
    period = 100_000
    v1 = Path("/sys/fs/cgroup/cpu")
    v2 = Path("/sys/fs/cgroup")
    if (v1 / "cpu.cfs_quota_us").exists():
        folder = v1 / name
        folder.mkdir()
        (folder / "cpu.cfs_period_us").write_text(str(period))
        (folder / "cpu.cfs_quota_us").write_text(str(int(quota_cpus * period)))
    elif (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.controllers").read_text().split():
        (v2 / "cgroup.subtree_control").write_text("+cpu")
        folder = v2 / name
        folder.mkdir()
        (folder / "cpu.max").write_text(f"{int(quota_cpus * period)} {period}")
    else:
        raise OSError("no cgroup cpu controller mounted")
    # the child moves itself into the cgroup, then becomes Python
    return folder, ["sh", "-c", f'echo $$ > {folder}/cgroup.procs && exec "$0" "$@"']


def test_cgroup_quota_of_one_cpu_gives_one_cpu_counts_though_the_mask_shows_more():
    """In a real cgroup with a 1-CPU quota (the mask still shows every core), tfmis counts 1 usable CPU, sets
    TensorFlow's intra-/inter-op pools to 1 before its import (TensorFlow then runs 1 inter-op thread), sizes
    tf.data's private pool and the conversion's workers to 1, and a launched worker gets 1 thread."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs at least 2 usable cores, so that a 1-CPU quota is below the mask")
    try:
        folder, prefix = _cpu_cgroup(1.0)
    except OSError as e:
        pytest.skip(f"cannot make a cgroup with a CPU quota here (root and a writable cgroup cpu controller): {e}")
    try:
        inside = report(prefix=prefix)
    finally:
        folder.rmdir()
    assert inside["usable"] == 1
    assert inside["intra_env"] == "1" and inside["inter_env"] == "1"
    assert inside["tf_inter_op_threads"] == 1
    assert inside["data_threads"] == 1 and inside["conversion_workers"] == 1 and inside["launch_intra"] == 1


def test_cgroup_quota_reader_takes_the_smallest_quota_on_the_path_of_v1_and_v2_trees(tmp_path):
    """`cgroup_cpu_quota` walks from the process's cgroup to the root: the smallest quota wins (a parent's 0.5 CPU
    limits a child's 3), v2's "max" and v1's -1 mean none, and a process with no quota gets None."""
    v1 = tmp_path / "v1"
    (v1 / "cpu" / "slurm" / "job1").mkdir(parents=True)
    for folder, quota in ((v1 / "cpu" / "slurm", 50_000), (v1 / "cpu" / "slurm" / "job1", 300_000)):
        (folder / "cpu.cfs_quota_us").write_text(str(quota))
        (folder / "cpu.cfs_period_us").write_text("100000")
    # the controllers' line names cpu,cpuacct; the tree is mounted at cpu/ (as here)
    assert cgroup_cpu_quota("4:cpu,cpuacct:/slurm/job1\n", root=v1) == pytest.approx(0.5)
    (v1 / "cpu" / "slurm" / "cpu.cfs_quota_us").write_text("-1")
    assert cgroup_cpu_quota("4:cpu,cpuacct:/slurm/job1\n", root=v1) == pytest.approx(3.0)

    v2 = tmp_path / "v2"
    (v2 / "container").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpu memory\n")
    (v2 / "container" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota("0::/container\n", root=v2) is None
    (v2 / "container" / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota("0::/container\n", root=v2) == pytest.approx(1.5)
    assert cgroup_cpu_quota("2:memory:/x\n", root=v2) is None  # no cpu line: no quota


@pytest.mark.slow
def test_onednn_is_decided_before_tensorflow_starts_and_the_users_variable_wins():
    """A fresh process that imports tfmis first runs TensorFlow with oneDNN as `onednn_choice('auto')` says for this
    CPU (on for x86-64 with AVX2 and FMA); the user's TF_ENABLE_ONEDNN_OPTS=0 or =1 is respected and named as the
    reason; `runtime.onednn: off` applied before TensorFlow's import turns it off."""
    expected = onednn_choice("auto", env={}).enabled
    auto = report()
    if expected is not None:
        assert auto["onednn_running"] is expected
    assert auto["onednn"].startswith("oneDNN ")
    for value, running in (("0", False), ("1", True)):
        user = report(**{ONEDNN_ENV: value})
        assert user["onednn_running"] is running
        assert f"{ONEDNN_ENV}={value} in the environment" in user["onednn"]
    off = report(
        code="import tfmis\nfrom tfmis.hardware import apply_onednn\napply_onednn('off')\n"
        + REPORT.replace("import tfmis\n", "", 1)
    )
    assert off["onednn_running"] is False and "runtime.onednn: off" in off["onednn"]


@pytest.mark.ci_may_skip("skips on CPUs where tfmis leaves oneDNN at TensorFlow's default")
def test_tensorflow_imported_before_tfmis_is_reported_as_what_it_runs():
    """When TensorFlow was imported before tfmis could decide, the choice reports oneDNN as TensorFlow runs it and
    says why tfmis could not change it (on a CPU where `auto` turns it on and the user's environment turned it
    off first)."""
    if onednn_choice("auto", env={}).enabled is not True:
        pytest.skip("tfmis's auto leaves TensorFlow's default on this CPU: nothing to differ from")
    code = (
        "import os; os.environ['TF_ENABLE_ONEDNN_OPTS'] = '0'\nimport tensorflow\n"
        "del os.environ['TF_ENABLE_ONEDNN_OPTS']\nimport json, tfmis\nfrom tfmis.hardware import current_onednn\n"
        "c = current_onednn(); print(json.dumps({'enabled': c.enabled, 'reason': c.reason}))"
    )
    got = report(code=code)
    assert got["enabled"] is False and "TensorFlow was imported before tfmis" in got["reason"]


# every augmentation, both placements' paths, deep supervision, validation every epoch: the ops a run can ask oneDNN
# for (TensorFlow logs an unsupported dtype once per process, at ERROR severity, as `E0000 ... util.cc`)
ALL_PATHS = [
    "pipeline.augment.rot90_prob=1.0",
    "pipeline.augment.flip_prob=1.0",
    "pipeline.augment.intensity_prob=1.0",
    "pipeline.augment.noise_std=0.1",
    "pipeline.augment.noise_prob=1.0",
    "pipeline.augment.rotate_prob=1.0",
    "pipeline.augment.scale_prob=1.0",
    "pipeline.augment.elastic_prob=1.0",
    "model.filters=[4,8,8]",
    "model.strides=[1,2,2]",
    "model.deep_supervision=1",
]


@pytest.mark.slow
def test_a_training_run_and_a_prediction_print_the_hardware_line_and_no_tensorflow_error_line(
    converted_dataset, msd_dataset, tmp_path
):
    """`python -m tfmis.train` (every augmentation at probability 1, deep supervision, validation) and `python -m
    tfmis.predict` on its run, in fresh processes with tfmis's own oneDNN choice: the run prints one `Hardware:` line
    with the CPU's usable cores and the oneDNN choice with its reason, and neither prints a TensorFlow ERROR line
    (float16 records, uint8 labels and integer transposes once made oneDNN log one on CPUs without AVX512-FP16)."""
    from conftest import tiny_config

    from tfmis.config import save_config

    save_config(tiny_config(converted_dataset, tmp_path / "run", *ALL_PATHS), tmp_path / "config.yaml")
    env = clean_env(TF_CPP_MIN_LOG_LEVEL="0")  # TensorFlow's ERROR lines are printed at every level below 2

    def command(*args) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [sys.executable, "-m", *map(str, args)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result

    train = command("tfmis.train", "--config", tmp_path / "config.yaml")
    hardware = [line for line in train.stderr.splitlines() if line.startswith("Hardware: ")]
    assert len(hardware) == 1 and f"{usable_cpu_count()} cores" in hardware[0], hardware
    assert "; oneDNN " in hardware[0] and onednn_choice("auto", env={}).reason in hardware[0], hardware
    run, scans = tmp_path / "run", msd_dataset / "imagesTs"
    predict = command("tfmis.predict", "--checkpoint", run, "--input", scans, "--output", tmp_path / "predictions")
    for name, result in (("train", train), ("predict", predict)):
        errors = [line for line in result.stderr.splitlines() if line.startswith("E0000") or " E0000 " in line]
        assert errors == [], f"{name}: {errors}"


def test_train_prints_one_hint_each_for_onednn_turned_off_and_threads_beyond_the_usable_cpus(tmp_path):
    """`python -m tfmis.train` with TF_ENABLE_ONEDNN_OPTS=0 (where `auto` would turn oneDNN on) and
    TF_NUM_INTRAOP_THREADS above the usable CPUs prints one `warning:` line for each, naming the fix, before anything
    else happens (here the missing dataset then stops the run, before its run folder is made)."""
    too_many = str(4 * usable_cpu_count())
    result = subprocess.run(
        [sys.executable, "-m", "tfmis.train", "--config", str(REPO / "configs" / "demo.yaml")]
        + ["--set", "data.source_dir=null", "--set", f"data.dataset_dir={tmp_path / 'missing'}"]
        + ["--set", f"output.dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(**{ONEDNN_ENV: "0", "TF_NUM_INTRAOP_THREADS": too_many}),
        cwd=tmp_path,
    )
    assert result.returncode == 1 and "holds no converted dataset" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # a run that cannot start leaves no run folder (nor its lock file)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    onednn = [w for w in warnings if "oneDNN is off" in w]
    threads = [w for w in warnings if w.startswith(f"warning: TF_NUM_INTRAOP_THREADS={too_many} ")]
    assert len(threads) == 1 and "unset it" in threads[0], warnings
    if onednn_choice("auto", env={}).enabled:
        assert len(onednn) == 1 and f"unset {ONEDNN_ENV}" in onednn[0] and "runtime.onednn: auto" in onednn[0]
    else:
        assert onednn == [], warnings
