"""One place probes the machine (tfmis.hardware): the import-linter contracts that hold every other module to it
(run as real `lint-imports` processes, on this tree and on a copy with probes put in), the worker and thread counts
the package takes from `usable_cpu_count()` under a real `taskset`, and the count's cgroup CPU quota read from
cgroup folder trees laid out as the kernel mounts them."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_msd_dataset

from tfmis.hardware import cgroup_cpu_quota, usable_cpu_count, usable_cpus

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("lint_contracts", REPO / "tools" / "lint_contracts.py")
lint_contracts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lint_contracts)

NVML_CONTRACT = "only tfmis.hardware imports NVML (pynvml) or psutil"
FILES_CONTRACT = "only tfmis.hardware reads /proc or /sys, or counts CPUs"


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """`lint-imports` run in `cwd` on the tfmis found there (PYTHONPATH first), with lines wide enough not to wrap."""
    if shutil.which("lint-imports") is None:
        pytest.skip("lint-imports is not installed (pip install -e '.[dev]')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), os.environ.get("PYTHONPATH", "")]), "COLUMNS": "300"}
    return subprocess.run(["lint-imports", "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_lint_imports_keeps_every_contract_on_this_tree():
    """`lint-imports` on the repository (as .ci/run runs it) keeps every contract, the two machine-probe contracts
    among them: no module but tfmis.hardware imports pynvml, reads /proc or /sys, or counts CPUs."""
    proc = lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"{NVML_CONTRACT} KEPT" in proc.stdout and f"{FILES_CONTRACT} KEPT" in proc.stdout


def copy_tree(target: Path) -> Path:
    """The package, pyproject.toml and the contract types (tools/) copied to `target`, without caches."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "tfmis", target / "tfmis", ignore=ignore)
    shutil.copytree(REPO / "tools", target / "tools", ignore=ignore)
    shutil.copy(REPO / "pyproject.toml", target / "pyproject.toml")
    return target


def test_lint_imports_names_a_proc_read_and_a_pynvml_import_put_into_a_copy_of_the_package(tmp_path):
    """A copy of the package where tfmis.data.sources.msd opens /proc/meminfo and tfmis.utils.io imports pynvml:
    `lint-imports` run on the copy exits non-zero, the NVML contract names the importing module, the import and its
    line, and the probe contract names the file, the line, the path and the fix; the untouched copy keeps both
    contracts."""
    clean = lint_imports(copy_tree(tmp_path / "clean"))
    assert f"{NVML_CONTRACT} KEPT" in clean.stdout and f"{FILES_CONTRACT} KEPT" in clean.stdout, clean.stdout[-3000:]

    copy = copy_tree(tmp_path / "probed")
    msd = copy / "tfmis" / "data" / "sources" / "msd.py"
    source = msd.read_text()
    msd.write_text(source + '\n\ndef _host_memory_text():\n    return open("/proc/meminfo").read()\n')
    proc_line = len(source.splitlines()) + 4
    io = copy / "tfmis" / "utils" / "io.py"
    source = io.read_text()
    io.write_text(source + "\n\ndef _gpu_count():\n    import pynvml\n\n    return pynvml.nvmlDeviceGetCount()\n")
    nvml_line = len(source.splitlines()) + 4

    out = lint_imports(copy)
    assert out.returncode != 0
    assert f"{NVML_CONTRACT} BROKEN" in out.stdout and f"{FILES_CONTRACT} BROKEN" in out.stdout, out.stdout[-3000:]
    assert f"tfmis.utils.io -> pynvml (l.{nvml_line})" in out.stdout, out.stdout[-3000:]
    assert (
        f'tfmis/data/sources/msd.py:{proc_line}: the /proc path "/proc/meminfo" probes the machine in '
        "tfmis.data.sources.msd: read it through tfmis.hardware" in out.stdout
    ), out.stdout[-3000:]


def test_probe_finder_reports_paths_and_cpu_counts_in_code_but_not_in_docstrings():
    """The contract's source scan: /proc and /sys path constants and f-strings starting with one, os.cpu_count,
    multiprocessing.cpu_count, os.sched_getaffinity and `from os import cpu_count` are probes; the same words in a
    docstring, in a message that only mentions /proc, or in an f-string after its first part are not."""
    source = '''"""Reads /proc/self/status (prose)."""
import multiprocessing
import os
from os import sched_getaffinity

def f(pid):
    """Opens "/proc/<pid>/stat"."""
    a = open(f"/proc/{pid}/stat")
    b = os.cpu_count() or multiprocessing.cpu_count()
    c = "/sys/fs/cgroup/cpu.max"
    d = f"see {pid}/proc" + "no /proc here" + "/process"
    return a, b, c, d, os.sched_getaffinity(0)
'''
    assert lint_contracts.machine_probes(source) == [
        (4, "from os import sched_getaffinity"),
        (8, 'the /proc path f"/proc/..."'),
        (9, "multiprocessing.cpu_count"),
        (9, "os.cpu_count"),
        (10, 'the /sys path "/sys/fs/cgroup/cpu.max"'),
        (12, "os.sched_getaffinity"),
    ]


# what a process reports: the worker and thread counts the package would use by default
DEFAULT_COUNTS = r"""
import json, sys
import tfmis.data.case_pool as case_pool
from tfmis import hardware
from tfmis.data.conversion_options import ConversionConfig
from tfmis.planning.fingerprint import fingerprint_msd
from tfmis.profiling import ResourceMonitor
from tfmis.tuning.hpo.devices import assign_devices

fingerprint_workers = []
map_ordered = case_pool.map_ordered


def recording_map_ordered(fn, tasks, workers, **kwargs):  # the fingerprint's real pool, its size recorded
    fingerprint_workers.append(workers)
    return map_ordered(fn, tasks, workers, **kwargs)


case_pool.map_ordered = recording_map_ordered
fingerprint_msd(sys.argv[1], progress=False)
print(json.dumps({
    "usable": hardware.usable_cpu_count(),
    "conversion_workers": ConversionConfig("src", "dst").num_workers,
    "fingerprint_workers": fingerprint_workers,
    "monitor_cpu_count": ResourceMonitor(sys.argv[2], backend="cpu").cpu_count,
    "worker_cpus": hardware.worker_cpus(),
    "two_workers_cpus": [a["cpus"] for a in assign_devices(2, hardware.worker_cpus(), [])],
    "host_cpu_count": hardware.host_memory()["cpu_count"],
}))
"""


def default_counts(prefix: list[str], dataset: Path, tmp_path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", DEFAULT_COUNTS, str(dataset), str(tmp_path / "monitor.csv")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_taskset_one_core_makes_every_default_worker_and_thread_count_one(tmp_path):
    """Under a real `taskset -c 0` the package's default counts are all 1: usable_cpu_count, the conversion's
    workers, the fingerprint's reader pool (recorded as map_ordered receives it), the resource monitor's
    cpu_count, host_memory's cpu_count (the GPU-fit trials' CPU record), and the cores the HPO search and the
    cross-validation share out (two workers share core 0). Unpinned, the same counts follow the machine's cores."""
    if shutil.which("taskset") is None:
        pytest.skip("taskset is not installed (util-linux)")
    if len(usable_cpus()) < 2:
        pytest.skip("needs at least 2 usable cores, so that taskset -c 0 restricts")
    dataset = make_msd_dataset(tmp_path / "Task99_Test", num_cases=3)
    pinned = default_counts(["taskset", "-c", "0"], dataset, tmp_path)
    assert pinned == {
        "usable": 1,
        "conversion_workers": 1,
        "fingerprint_workers": [1],
        "monitor_cpu_count": 1,
        "worker_cpus": [0],
        "two_workers_cpus": [[0], [0]],
        "host_cpu_count": 1,
    }
    whole = default_counts([], dataset, tmp_path)
    usable = usable_cpu_count()
    assert whole["usable"] == whole["monitor_cpu_count"] == whole["host_cpu_count"] == usable >= 2
    assert whole["conversion_workers"] == min(usable, 8) and whole["fingerprint_workers"] == [min(usable, 8)]
    assert whole["worker_cpus"] == usable_cpus()[:usable]


def test_usable_cpu_count_is_the_mask_capped_by_the_cgroup_quota_of_fake_v1_v2_and_container_trees(tmp_path):
    """`usable_cpu_count` over cgroup trees laid out as the kernel mounts them: a v2 quota of 1.5 CPUs gives 1 (rounded
    down), a quota above the mask gives the mask; a container whose own cgroup is mounted at the v1 root (the
    process's cgroup path, /docker/<id>, is not there) takes the mount's quota; a hybrid host's v2 tree under
    unified/ is read; and under a real `taskset -c 0` a 2-CPU quota still gives 1."""
    mask = len(usable_cpus())
    v2 = tmp_path / "v2"
    (v2 / "job").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpuset cpu memory\n")
    (v2 / "job" / "cpu.max").write_text("150000 100000\n")
    assert usable_cpu_count("0::/job\n", v2) == 1
    (v2 / "job" / "cpu.max").write_text(f"{(mask + 3) * 100000} 100000\n")
    assert usable_cpu_count("0::/job\n", v2) == mask

    container = tmp_path / "v1"
    (container / "cpu,cpuacct").mkdir(parents=True)
    (container / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("100000\n")
    (container / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota("5:cpu,cpuacct:/docker/0123abcd\n", container) == pytest.approx(1.0)
    assert usable_cpu_count("5:cpu,cpuacct:/docker/0123abcd\n", container) == 1

    hybrid = tmp_path / "hybrid"
    (hybrid / "unified" / "user.slice").mkdir(parents=True)
    (hybrid / "unified" / "cgroup.controllers").write_text("cpu\n")
    (hybrid / "unified" / "user.slice" / "cpu.max").write_text("50000 100000\n")
    assert cgroup_cpu_quota("1:name=systemd:/user.slice\n0::/user.slice\n", hybrid) == pytest.approx(0.5)

    if shutil.which("taskset") is None or mask < 2:
        return
    (v2 / "job" / "cpu.max").write_text("200000 100000\n")
    assert usable_cpu_count("0::/job\n", v2) == 2
    code = f"from tfmis.hardware import usable_cpu_count; print(usable_cpu_count('0::/job\\n', {str(v2)!r}))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "1"
