"""The one place that knows the machine: GPUs (NVML, TensorFlow, nvidia-smi), host memory, CPU, processes
(/proc), precision.

Everything above this module asks it instead of probing for itself: the trainer and the predictor
(the device to run on, the precision, a case's peak memory), the GPU-fit search (which GPU, how much
memory, a trial's RSS), the hyperparameter search and `tfmis.launch` (which GPUs to share out, which
cores), the resource monitor (NVML's GPUs, a process tree's CPU time and RSS, how much RAM), the
conversion and the planner (how many workers, what this machine runs well). Every default worker and
thread count comes from `usable_cpu_count` (affinity mask and cgroup CPU quota; `os.cpu_count()` sees
neither). `lint-imports` holds the rest of tfmis to this: no other module imports pynvml, reads /proc
or /sys, or counts CPUs (pyproject.toml's `machine-nvml` and `machine-files` contracts).

Nothing here initialises a GPU: TensorFlow is asked only for its *physical* devices
(`tf.config.list_physical_devices`, `get_device_details`), which allocates no device memory, and is
imported only inside the functions that need it, so a process that must never touch a GPU (the
GPU-fit search's parent, the HPO chief) can import this module. The one exception is
`accelerator_device`, which lists the *logical* devices of a process that is about to compute.

On a CPU, `auto` precision is float32 (`recommended_precision` says why), and `hardware_warnings` names the
settings a CPU runs badly: mixed_float16 (CPUs have no float16 arithmetic: every op is emulated) and
`jit_compile: true` (XLA on a CPU is slower than plain TensorFlow). The measurements behind these choices are in
docs/benchmarks.md ("Per CPU kind"; "First epoch, precision and other costs").

Example:
```python
from tfmis.hardware import detect_hardware, hardware_warnings, resolve_precision

hardware = detect_hardware()
print(hardware.describe())  # "CPU only: 2 cores of AMD EPYC (avx, avx2, fma, ...), 23.5 GB RAM; oneDNN on (...)"
keras.mixed_precision.set_global_policy(resolve_precision("auto"))
for line in hardware_warnings(config.training, hardware):
    print("warning:", line)
```
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tfmis.errors import ConfigError, UsageError

MB = 2.0**20
CPU = "/CPU:0"
GPU_RESERVED_MB = 1024  # of a GPU's memory, for the CUDA context and libraries, outside TensorFlow's allocator
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # CPU instructions with bfloat16 arithmetic
CGROUP_ROOT = "/sys/fs/cgroup"
MAX_CASE_WORKERS = 8  # processes reading cases at once: each holds a case's arrays in memory


# ---------------------------------------------------------------------------------------------- GPUs


def nvidia_driver_present() -> bool:
    """Whether an NVIDIA driver is loaded (/proc/driver/nvidia or /dev/nvidiaN), without importing TensorFlow."""
    return Path("/proc/driver/nvidia").exists() or bool(list(Path("/dev").glob("nvidia[0-9]*")))


def physical_gpus() -> list:
    """TensorFlow's physical GPUs (`tf.config.list_physical_devices`: no device memory is allocated)."""
    import tensorflow as tf

    return tf.config.list_physical_devices("GPU")


def accelerator_device() -> str:
    """The first GPU of this process's logical devices, else the CPU (a process about to compute)."""
    import tensorflow as tf

    return "/GPU:0" if tf.config.list_logical_devices("GPU") else CPU


def model_parallel_devices(count: int) -> list[str]:
    """`count` devices for one model split over devices: the first `count` GPUs, or on a machine without GPUs
    the CPU split into `count` logical devices (`tf.config.set_logical_device_configuration`; they share the
    cores, so equality and the cross-device exchanges are real but no speed-up is). Call it before TensorFlow
    initialises its devices; afterwards it only checks that enough logical devices exist.

    Raises:
        ValueError: fewer GPUs than `count` (naming the key and the fix), or a CPU already initialised with
            fewer logical devices.
    """
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if len(gpus) < count:
            raise ConfigError(
                f"runtime.model_parallel needs {count} devices (devices x data) but this process sees {len(gpus)} "
                f"GPU(s): lower runtime.model_parallel.devices / data, or make more GPUs visible"
            )
        return [f"/GPU:{i}" for i in range(count)]
    cpu = tf.config.list_physical_devices("CPU")[0]
    if count > 1 and len(tf.config.get_logical_device_configuration(cpu) or []) < count:
        try:
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
        except RuntimeError as e:  # the runtime is initialised
            raise ConfigError(
                f"runtime.model_parallel needs {count} logical CPU devices, but TensorFlow's devices were "
                f"initialised with {len(tf.config.list_logical_devices('CPU'))}: set them up first "
                "(tfmis.engine.distribution.make_backend does, before anything touches a device)"
            ) from e
    return [f"/CPU:{i}" for i in range(count)]


def visible_nvml_handles(pynvml, count: int, visible: str | None = None) -> list[tuple[int, object]]:
    """(NVML index, handle) of the GPUs `CUDA_VISIBLE_DEVICES` shows (all when unset), in its order.

    As CUDA reads it: entries are NVML indices (with `CUDA_DEVICE_ORDER=PCI_BUS_ID`, nvidia-smi's numbers)
    or GPU UUIDs (`GPU-...`, a unique prefix is enough), and the list ends at the first entry that names
    no GPU ("-1" hides them all).

    Args:
        pynvml: the initialised NVML module.
        count: `pynvml.nvmlDeviceGetCount()`.
        visible: the variable's value (default: this process's environment).
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is None:
        return [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
    uuids = None
    handles = []
    for entry in (e.strip() for e in visible.split(",")):
        try:
            if entry.lstrip("-").isdigit():
                index = int(entry)
                if not 0 <= index < count:
                    break
            elif entry.startswith("GPU-"):
                if uuids is None:
                    uuids = [
                        _text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)
                    ]
                matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(entry)]
                if len(matches) != 1:
                    break
                index = matches[0]
            else:
                break
            handles.append((index, pynvml.nvmlDeviceGetHandleByIndex(index)))
        except pynvml.NVMLError:  # a GPU NVML cannot reach ends the list, as it would for CUDA
            break
    return handles


def accelerators() -> list[dict]:
    """The GPUs this process may use: [{"index", "name", "total_mb", "uuid"}], NVML index per GPU.

    Empty without an NVIDIA driver (checked first, without importing TensorFlow), when TensorFlow sees no
    GPU (TensorFlow built without CUDA: `tf.config.list_physical_devices("GPU")`, which allocates no device
    memory) or when NVML is missing.
    `CUDA_VISIBLE_DEVICES` restricts the list (`visible_nvml_handles`). No GPU is initialised.
    """
    if not nvidia_driver_present():  # checked before TensorFlow is imported
        return []
    try:
        if not physical_gpus():
            return []
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no TensorFlow, no NVML library or no driver: no usable GPU
        return []
    try:
        devices = []
        for index, handle in visible_nvml_handles(pynvml, pynvml.nvmlDeviceGetCount()):
            devices.append(
                {
                    "index": index,
                    "name": _text(pynvml.nvmlDeviceGetName(handle)),
                    "total_mb": pynvml.nvmlDeviceGetMemoryInfo(handle).total / MB,
                    "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
                }
            )
    except pynvml.NVMLError:
        return []
    finally:
        pynvml.nvmlShutdown()
    return sorted(devices, key=lambda d: d["index"])


def nvml_device(index: int) -> dict | None:
    """{"name", "total_mb", "used_mb", "uuid"} of the GPU with this NVML index; None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return {
                "name": _text(pynvml.nvmlDeviceGetName(handle)),
                "total_mb": memory.total / MB,
                "used_mb": memory.used / MB,
                "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
            }
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no library, no driver, no such GPU
        return None


class NvmlUnavailable(Exception):
    """NVML cannot be used here (no nvidia-ml-py, no driver, no visible GPU); the message says which."""


class NvmlGpus:
    """NVML kept open on a set of GPUs for repeated reads (the resource monitor's samples); `close()` ends it.

    Args:
        gpus: NVML indices (as nvidia-smi numbers them). Default: the GPUs `CUDA_VISIBLE_DEVICES` shows
            (`visible_nvml_handles`), all when it is unset.

    Raises:
        NvmlUnavailable: no nvidia-ml-py, NVML cannot start, it sees no GPU, or `CUDA_VISIBLE_DEVICES` hides all.
        ValueError: an index of `gpus` that NVML does not know (the message names the indices it knows).

    Attributes:
        devices: [{"index", "name", "total_mb"}], one per GPU, in the order of `gpus`.

    Example:
    ```python
    try:
        nvml = NvmlGpus()
    except NvmlUnavailable as e:
        print("no GPU to sample:", e)
    else:
        print(nvml.read())  # [{"index": 0, "utilization_percent": 12.0, "used_mb": 812.0, "total_mb": 81559.0, ...}]
        nvml.close()
    ```
    """

    def __init__(self, gpus: list[int] | None = None):
        try:
            import pynvml
        except ImportError:
            raise NvmlUnavailable("nvidia-ml-py is not installed: pip install nvidia-ml-py") from None
        try:
            pynvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            raise NvmlUnavailable(f"NVML could not start: {e}") from None
        self._nvml = pynvml
        try:
            count = pynvml.nvmlDeviceGetCount()
            if count == 0:
                raise NvmlUnavailable("NVML sees no GPU")
            if gpus is not None:
                chosen = [int(g) for g in gpus]
                missing = [g for g in chosen if not 0 <= g < count]
                if missing:
                    raise UsageError(
                        f"gpus {missing} not found: NVML sees {count} GPU(s), indices 0-{count - 1} "
                        "(nvidia-smi -L lists them)"
                    )
                self._handles = [(g, pynvml.nvmlDeviceGetHandleByIndex(g)) for g in chosen]
            else:
                self._handles = visible_nvml_handles(pynvml, count)
                if not self._handles:
                    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                    raise NvmlUnavailable(f"CUDA_VISIBLE_DEVICES={visible!r} hides all GPUs")
            self.devices = [
                {
                    "index": index,
                    "name": _text(pynvml.nvmlDeviceGetName(handle)),
                    "total_mb": pynvml.nvmlDeviceGetMemoryInfo(handle).total / MB,
                }
                for index, handle in self._handles
            ]
        except BaseException:
            pynvml.nvmlShutdown()
            raise

    def read(self) -> list[dict]:
        """Each GPU's state now: [{"index", "utilization_percent", "used_mb", "total_mb", "utilization_error"}].

        `utilization_percent` is NaN where NVML cannot say (e.g. on MIG instances); `utilization_error` is then
        NVML's exception, else None."""
        readings = []
        for index, handle in self._handles:
            error = None
            try:
                utilization = float(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except self._nvml.NVMLError as e:
                utilization, error = float("nan"), e
            memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            readings.append(
                {
                    "index": index,
                    "utilization_percent": utilization,
                    "used_mb": memory.used / MB,
                    "total_mb": memory.total / MB,
                    "utilization_error": error,
                }
            )
        return readings

    def close(self) -> None:
        """Shuts NVML down (once; later calls do nothing)."""
        nvml, self._nvml = self._nvml, None
        if nvml is not None:
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError:
                pass


def visible_gpu_ids(env: dict | None = None) -> list[str]:
    """The GPU ids a launcher may share out: `CUDA_VISIBLE_DEVICES`' entries when it is set (without "-1"),
    else the indices nvidia-smi lists (empty without nvidia-smi or a driver)."""
    env = os.environ if env is None else env
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip() and g.strip() != "-1"]
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def nvidia_smi_available() -> bool:
    return shutil.which("nvidia-smi") is not None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# ---------------------------------------------------------------------------------------------- host


def usable_cpus() -> list[int]:
    """The cores this process may run on (its affinity mask; all cores where there is none)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def cgroup_cpu_quota(proc_cgroup: str | None = None, root: str | Path = CGROUP_ROOT) -> float | None:
    """The CPUs this process's cgroup lets it use (CPU quota / period), or None when there is no quota.

    Reads the process's own cgroup (`/proc/self/cgroup`) and its ancestors, cgroup v2 (`cpu.max`, "max" =
    none) and v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`, -1 = none); the smallest quota on the path wins,
    as the kernel throttles at each level. A container or a SLURM allocation (with cgroup CPU limits) that
    shows all the host's cores to `os.cpu_count()` shows its real share here.

    Example (a cgroup v1 tree with a 1.5-CPU quota on the job's cgroup):
        >>> import tempfile
        >>> job = Path(tempfile.mkdtemp()) / "cpu" / "job"
        >>> job.mkdir(parents=True)
        >>> _ = (job / "cpu.cfs_quota_us").write_text("150000"), (job / "cpu.cfs_period_us").write_text("100000")
        >>> cgroup_cpu_quota("3:cpu:/job\\n", root=job.parent.parent)
        1.5
    """
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    root = Path(root)
    quotas = []
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not path:
            continue
        if hierarchy == "0" and not controllers:  # cgroup v2: one tree, at root or (hybrid) at root/unified
            bases = [b for b in (root, root / "unified") if (b / "cgroup.controllers").exists()]
            reader = _cgroup2_quota
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's tree
            bases = [b for b in (root / controllers, root / "cpu") if b.is_dir()]
            reader = _cgroup1_quota
        else:
            continue
        base = bases[0] if bases else None
        if base is None:
            continue
        folder = base / path.strip("/")
        for level in (folder, *folder.parents):
            quota = reader(level)
            if quota is not None:
                quotas.append(quota)
            if level == base:
                break
    return min(quotas) if quotas else None


def _cgroup2_quota(folder: Path) -> float | None:
    try:
        quota, _, period = (folder / "cpu.max").read_text().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    except (OSError, ValueError):
        return None


def _cgroup1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def usable_cpu_count(proc_cgroup: str | None = None, cgroup_root: str | Path = CGROUP_ROOT) -> int:
    """How many CPUs this process can keep busy: its affinity mask, capped by its cgroup's CPU quota (rounded
    down, at least 1: a thread more than the quota would be throttled). The count every thread pool and worker
    pool of tfmis is sized from (`os.cpu_count()` sees neither the mask nor the quota).

    Args:
        proc_cgroup, cgroup_root: as `cgroup_cpu_quota` (default: this process's cgroup under /sys/fs/cgroup).
    """
    count = len(usable_cpus())
    quota = cgroup_cpu_quota(proc_cgroup, cgroup_root)
    if quota is not None:
        count = min(count, max(1, int(quota)))
    return max(1, count)


def worker_cpus() -> list[int]:
    """The cores a launcher shares out among the worker processes it pins (the HPO search's tuner workers, the
    cross-validation's fold workers): the affinity mask, cut to `usable_cpu_count()` cores under a smaller cgroup
    CPU quota."""
    return usable_cpus()[: usable_cpu_count()]


def case_workers() -> int:
    """The default number of processes that read cases in parallel (the conversion, the planner's fingerprint):
    `usable_cpu_count()`, at most `MAX_CASE_WORKERS`."""
    return min(usable_cpu_count(), MAX_CASE_WORKERS)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo; the platform's processor name elsewhere)."""
    try:
        name = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            None,
        )
    except OSError:
        name = None
    if not name:
        import platform

        name = platform.processor() or platform.machine()
    return name


def host_memory() -> dict:
    """The host's memory and CPU: {"total_mb", "available_mb", "cgroup_limit_mb", "cpu_name", "cpu_count"}.

    `available_mb` is /proc/meminfo's MemAvailable, lowered to what a cgroup memory limit (a
    container's) leaves; `cgroup_limit_mb` is that limit, or None.
    """
    meminfo = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                meminfo[key] = int(value.split()[0]) / 1024.0
    except OSError:  # no /proc: the page count, and nothing known to be available beyond it
        meminfo["MemTotal"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / MB
    total = meminfo.get("MemTotal", 0.0)
    available = meminfo.get("MemAvailable", meminfo.get("MemFree", 0.0))
    limit = None
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            raw = Path(limit_file).read_text().strip()
            if raw == "max" or int(raw) >= 2**60:  # unlimited
                break
            limit = int(raw) / MB
            available = min(available, limit - int(Path(usage_file).read_text()) / MB)
            break
        except (OSError, ValueError):
            continue
    return {
        "total_mb": total,
        "available_mb": max(available, 0.0),
        "cgroup_limit_mb": limit,
        "cpu_name": cpu_name(),
        "cpu_count": usable_cpu_count(),
    }


def cpu_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The bfloat16 flags (`BF16_CPU_FLAGS`) on the first `flags` line of /proc/cpuinfo (empty elsewhere).

    Example:
        >>> cpu_flags("processor : 0\\nflags : fpu sse avx512f avx512_bf16\\n")
        ('avx512_bf16',)
    """
    present = cpu_isa(cpuinfo)  # one reader of the flags line; BF16_CPU_FLAGS are among its ISA_FLAGS
    return tuple(flag for flag in BF16_CPU_FLAGS if flag in present)


# ---------------------------------------------------------------------------------------------- processes
#
# What a process holds and may use, as the kernel reports it (/proc, Linux): the GPU-fit trials' memory, the
# predictor's per-case peak, the HPO workers' pinning check and the resource monitor's process tree.


def process_status_mb(pid: int | str, field: str) -> float | None:
    """A memory line of /proc/<pid>/status (`VmRSS`, `VmHWM`, ...) in MiB; None once the process is gone, or
    without /proc.

    Example:
        >>> process_status_mb("self", "VmRSS") > 0 if Path("/proc/self/status").exists() else True
        True
    """
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_rss() -> bool:
    """Resets the kernel's high-water mark of this process's resident memory to its current RSS (Linux
    /proc/self/clear_refs 5), so that the next `peak_rss_mb` is the peak since now.

    Returns False where that is not possible (not Linux, or not allowed); `peak_rss_mb` then counts from the
    start of the process.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float | None:
    """This process's peak resident memory (`VmHWM`, since the start or the last `reset_peak_rss`) in MiB; on macOS
    since the start (`ru_maxrss`); None elsewhere."""
    peak = process_status_mb("self", "VmHWM")
    if peak is None and sys.platform == "darwin":  # ru_maxrss: bytes on macOS; no reset
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / MB
    return peak


def parse_cpus(text: str) -> list[int]:
    """The kernel's CPU list format (taskset's, /proc's `Cpus_allowed_list`) as core numbers.

    Example:
        >>> parse_cpus("0-2,5")
        [0, 1, 2, 5]
    """
    values = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        values.extend(range(int(lo), int(hi or lo) + 1))
    return values


def allowed_cpus(pid: int) -> list[int] | None:
    """The cores process `pid` may run on, as the kernel reports them (/proc/<pid>/status `Cpus_allowed_list`);
    None once the process is gone, or without /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return parse_cpus(line.split(":", 1)[1])
    except OSError:
        pass
    return None


def process_tree_usage(pid: int) -> tuple[float, int] | None:
    """(CPU seconds, resident bytes) of process `pid` and all its descendants now (Linux /proc); None when the
    process is gone.

    The CPU seconds are, over the tree's live members, utime + stime + cutime + cstime: when a member exits and its
    parent (a member too) reaps it, its time moves into the parent's cutime/cstime, so the total neither drops
    nor counts it twice, and differences of totals are the tree's CPU use. The resident bytes are summed over the
    members (pages shared between them count once per member). An exited child that is not reaped yet (a zombie)
    still counts.

    Raises:
        RuntimeError: this system has no /proc (not Linux).
    """
    if not os.path.isdir("/proc/self"):
        raise RuntimeError("process CPU time and memory are read from /proc (Linux); this system has none")
    stats = {}
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _proc_stat(entry)
            if fields is not None:
                stats[int(entry)] = fields
                children.setdefault(int(fields[1]), []).append(int(entry))
    if pid not in stats:
        return None
    ticks = pages = 0
    todo = [pid]
    while todo:
        member = todo.pop()
        fields = stats[member]
        ticks += int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
        pages += int(fields[21])
        todo.extend(children.get(member, ()))
    return ticks / os.sysconf("SC_CLK_TCK"), pages * os.sysconf("SC_PAGE_SIZE")


def _proc_stat(pid: int | str) -> list[bytes] | None:
    """Fields after `(comm)` of /proc/<pid>/stat: [0] state, [1] ppid, [11] utime, [12] stime, [13] cutime,
    [14] cstime, [21] rss (pages); None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rfind(b")") + 2 :].split()


# ---------------------------------------------------------------------------------------------- CPU runtime
#
# Decided before TensorFlow is imported (tfmis/__init__.py applies `auto`; a command applies the config's
# `runtime.onednn` as soon as it has read it): TensorFlow reads TF_ENABLE_ONEDNN_OPTS and its thread counts
# once, at import.

ONEDNN_ENV = "TF_ENABLE_ONEDNN_OPTS"
ONEDNN_SETTINGS = ("auto", "on", "off")
# the value tfmis itself put in TF_ENABLE_ONEDNN_OPTS: a child process (a launcher's worker, a test's subprocess)
# inherits both and decides again, while a value that differs from it was set by the user and is respected
_DECIDED_ENV = "TFMIS_ONEDNN_DECIDED"
THREAD_ENVS = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")
_THREADS_DECIDED_ENV = "TFMIS_THREADS_DECIDED"
# instruction-set flags that decide TensorFlow's CPU kernels (/proc/cpuinfo names)
ISA_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_tile",
    "asimd",
    "sve",
)
# measured on the README's demo step (benchmarks/cpu_kinds.py; docs/benchmarks.md, "Per CPU kind")
ONEDNN_MEASURED = "oneDNN's 3D convolutions trained the demo 17-24x faster than Eigen's (docs/benchmarks.md)"


def cpu_isa(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The CPU's instruction-set flags among `ISA_FLAGS` (first `flags` / `Features` line of /proc/cpuinfo).

    Example:
        >>> cpu_isa("processor : 0\\nflags : fpu sse avx avx2 fma avx512f\\n")
        ('avx', 'avx2', 'fma', 'avx512f')
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ()
    line = next((line for line in cpuinfo.splitlines() if line.split(":")[0].strip() in ("flags", "Features")), "")
    present = set(line.partition(":")[2].split())
    return tuple(flag for flag in ISA_FLAGS if flag in present)


@dataclasses.dataclass(frozen=True)
class OneDNNChoice:
    """Whether TensorFlow's oneDNN CPU kernels are on, and why.

    Args:
        enabled: True/False, or None when TensorFlow's own default stands (a CPU kind not measured).
        setting: `runtime.onednn` (auto, on, off).
        reason: why, in words (the setting, the user's environment variable, or the measured rule).
        users_variable: the user's `TF_ENABLE_ONEDNN_OPTS` decided it (tfmis leaves the variable as it is).
    """

    enabled: bool | None
    setting: str
    reason: str
    users_variable: bool = False

    def describe(self) -> str:
        state = {True: "on", False: "off", None: "TensorFlow's default"}[self.enabled]
        return f"oneDNN {state} ({self.reason})"


def onednn_choice(setting: str = "auto", env=None, isa: tuple[str, ...] | None = None, machine: str | None = None):
    """The `OneDNNChoice` for `runtime.onednn` on this machine (pure: reads `env`, sets nothing).

    `on`/`off` are the config's word. `auto` respects a `TF_ENABLE_ONEDNN_OPTS` the user set; otherwise it
    turns oneDNN on where it was measured faster for 3D convolutions (x86-64 with AVX2 and FMA; TensorFlow
    itself turns it on only for AVX512_VNNI / AVX512_BF16 / AMX CPUs, and leaves AVX2-only CPUs such as AMD EPYC
    Zen 2/3 on its Eigen kernels, many times slower there: docs/benchmarks.md, "Per CPU kind") and leaves
    TensorFlow's default elsewhere (ARM, x86-64 without AVX2: not measured).

    Example:
        >>> onednn_choice("auto", env={}, isa=("avx", "avx2", "fma"), machine="x86_64").enabled
        True
        >>> onednn_choice("auto", env={"TF_ENABLE_ONEDNN_OPTS": "0"}, isa=("avx2", "fma"), machine="x86_64").enabled
        False
        >>> onednn_choice("auto", env={}, isa=("asimd",), machine="aarch64").enabled is None
        True
    """
    if setting not in ONEDNN_SETTINGS:
        raise ConfigError(f"runtime.onednn: {setting!r} is not one of {list(ONEDNN_SETTINGS)}")
    env = os.environ if env is None else env
    if setting != "auto":
        return OneDNNChoice(setting == "on", setting, f"runtime.onednn: {setting}")
    user = env.get(ONEDNN_ENV)
    if user is not None and user != env.get(_DECIDED_ENV):
        on = user.strip().lower() in ("1", "true", "yes", "on")
        return OneDNNChoice(on, setting, f"{ONEDNN_ENV}={user} in the environment", users_variable=True)
    isa = cpu_isa() if isa is None else isa
    if machine is None:
        import platform

        machine = platform.machine()
    if machine.lower() in ("x86_64", "amd64"):
        if "avx2" in isa and "fma" in isa:
            return OneDNNChoice(True, setting, f"x86-64 with AVX2 and FMA: {ONEDNN_MEASURED}")
        return OneDNNChoice(None, setting, "x86-64 without AVX2: not measured, TensorFlow decides")
    return OneDNNChoice(None, setting, f"{machine} CPU: not measured, TensorFlow decides")


_onednn: OneDNNChoice | None = None


def apply_onednn(setting: str = "auto") -> OneDNNChoice:
    """Decides oneDNN for this process (`onednn_choice`) and sets `TF_ENABLE_ONEDNN_OPTS` for TensorFlow.

    Must run before TensorFlow is imported (tfmis/__init__.py runs it with `auto`; a command again with its
    config's `runtime.onednn`). After TensorFlow's import the state cannot change: the returned choice then says
    what TensorFlow is running with and that it was imported first.
    """
    global _onednn
    choice = onednn_choice(setting)
    if "tensorflow" in sys.modules:
        running = onednn_running()
        if running is not None and choice.enabled not in (None, running):
            choice = OneDNNChoice(
                running,
                setting,
                f"TensorFlow was imported before tfmis could set {ONEDNN_ENV}; import tfmis first "
                f"(wanted {'on' if choice.enabled else 'off'}: {choice.reason})",
            )
    elif choice.enabled is not None and not choice.users_variable:
        value = "1" if choice.enabled else "0"
        os.environ[ONEDNN_ENV] = value
        os.environ[_DECIDED_ENV] = value
    _onednn = choice
    return choice


def onednn_running() -> bool | None:
    """Whether the imported TensorFlow runs its oneDNN kernels (None before TensorFlow's import or if unknown)."""
    if "tensorflow" not in sys.modules:
        return None
    try:
        from tensorflow.python.util import _pywrap_util_port

        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return None


def current_onednn() -> OneDNNChoice:
    """The choice `apply_onednn` made last in this process (made now with `auto` if none was)."""
    return _onednn or apply_onednn("auto")


def threads_set_by_user(env=None) -> bool:
    """Whether `TF_NUM_INTRAOP_THREADS` / `TF_NUM_INTEROP_THREADS` in `env` are the user's (not tfmis's own)."""
    env = os.environ if env is None else env
    values = [env.get(name) for name in THREAD_ENVS]
    return any(v is not None for v in values) and ",".join(v or "" for v in values) != env.get(_THREADS_DECIDED_ENV)


def set_thread_env(env, intra: int, inter: int) -> None:
    """Puts tfmis's thread counts in `env` (os.environ or a child's), marked as tfmis's (`threads_set_by_user`)."""
    env["TF_NUM_INTRAOP_THREADS"], env["TF_NUM_INTEROP_THREADS"] = str(intra), str(inter)
    env[_THREADS_DECIDED_ENV] = f"{intra},{inter}"


def data_threads() -> int | None:
    """tf.data's private thread pool size where a cgroup CPU quota is below the affinity mask (tf.data sizes its
    pools from the mask), else None: tf.data's own default."""
    count = usable_cpu_count()
    return count if count < len(usable_cpus()) else None


def apply_cpu_threads() -> int:
    """Sizes TensorFlow's intra-op and inter-op thread pools from `usable_cpu_count()`, before its import.

    TensorFlow sizes them from the affinity mask and does not see a cgroup CPU quota (a container, a SLURM job):
    there it would run more threads than the CPUs it gets, and each would be throttled. Sets
    `TF_NUM_INTRAOP_THREADS` / `TF_NUM_INTEROP_THREADS` only where the quota is below the affinity mask and the
    user has set neither. Returns the usable CPU count.
    """
    count = usable_cpu_count()
    if count < len(usable_cpus()) and not threads_set_by_user() and "tensorflow" not in sys.modules:
        set_thread_env(os.environ, count, count)
    return count


# ---------------------------------------------------------------------------------------------- the machine


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The devices a training run on this machine would use.

    Args:
        gpus: one dict per GPU TensorFlow sees: name, compute_capability (major, minor) or None,
            memory_mb (NVML's total, or None).
        cpu_name: the CPU model name.
        cpu_count: logical cores this process may use (`usable_cpu_count`: affinity and cgroup CPU quota).
        cpu_flags: the bfloat16-related instruction-set flags of the CPU (amx_bf16, avx512_bf16).
        host_memory_mb, host_available_mb: total and available RAM (a container's limit applied).
        cpu_isa: the CPU's instruction-set flags that decide TensorFlow's kernels (`cpu_isa`).
        onednn: this process's oneDNN choice with its reason (`OneDNNChoice.describe`), or "".
        target_given: "" for this machine as detected; for a machine to plan for that is not this one
            (`Hardware.target`), how it was given (e.g. "--gpus/--gpu-memory").
        planned_on: with `target_given`, the machine that made the plan, in a few words (`short`).
    """

    gpus: tuple[dict, ...] = ()
    cpu_name: str = "cpu"
    cpu_count: int = 1
    cpu_flags: tuple[str, ...] = ()
    host_memory_mb: float = 0.0
    host_available_mb: float = 0.0
    cpu_isa: tuple[str, ...] = ()
    onednn: str = ""
    target_given: str = ""
    planned_on: str = ""

    @classmethod
    def target(
        cls,
        *,
        gpus: int,
        gpu_memory_mb: float | None = None,
        name: str | None = None,
        cpus: int | None = None,
        host_memory_mb: float | None = None,
        here: Hardware | None = None,
        given: str = "a target description",
    ) -> Hardware:
        """A machine to plan for that is not this one (nnU-Net's `-gpu_memory_target`, for the whole machine).

        Args:
            gpus: how many GPUs (0: a CPU-only machine).
            gpu_memory_mb: each GPU's memory (default: the named model's, `GPU_MODELS`).
            name: a model of `GPU_MODELS` (its memory and compute capability, which decides the precision), or
                None: a GPU of `gpu_memory_mb` and unknown compute capability (planned in float32).
            cpus, host_memory_mb: the target's cores and RAM (default: this machine's; RAM given is taken as
                available).
            here: the machine that plans (default `detect_hardware()`): its CPU and RAM unless given.
            given: how the target was given, for the plan's header (e.g. "--gpus/--gpu-memory").

        Raises:
            ValueError: an unknown `name`, GPUs without memory, or a count or size below 1.

        Example:
            >>> here = Hardware(cpu_name="AMD EPYC", cpu_count=2, host_memory_mb=24000, host_available_mb=20000)
            >>> h100 = Hardware.target(gpus=8, name="H100-80GB", here=here, given="--gpus/--gpu")
            >>> h100.gpu_memory_mb, h100.compute_capability, h100.cpu_count
            (81920, (9, 0), 2)
            >>> h100.planned_for()
            {'gpus': 8, 'gpu_memory_mb': 81920, 'name': 'H100-80GB', 'source': 'target'}
        """
        here = here or detect_hardware()
        model = None
        if name is not None:
            known = gpu_model(name)
            if known is None:
                raise ValueError(f"unknown GPU {name!r}: one of {', '.join(GPU_MODELS)}")
            name, model = known
        if gpus < 0:
            raise ValueError(f"a GPU count is >= 0, got {gpus}")
        memory = gpu_memory_mb if gpu_memory_mb is not None else (model or {}).get("memory_mb")
        if gpus and not memory:
            raise ValueError("GPUs to plan for need their memory (or a named model)")
        gpu = {
            "name": name,  # None: a GPU given by its memory alone
            "compute_capability": model["compute_capability"] if model else None,
            "memory_mb": memory,
        }
        if cpus is not None and cpus < 1:
            raise ValueError(f"a CPU count is >= 1, got {cpus}")
        if host_memory_mb is not None and host_memory_mb <= 0:
            raise ValueError(f"host memory is > 0 MB, got {host_memory_mb}")
        cpu = {} if cpus is None else {"cpu_name": "cpu", "cpu_count": cpus, "cpu_flags": (), "cpu_isa": ()}
        ram = {} if host_memory_mb is None else {"host_memory_mb": host_memory_mb, "host_available_mb": host_memory_mb}
        return dataclasses.replace(here, gpus=(gpu,) * gpus, **cpu, **ram, target_given=given, planned_on=here.short())

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        """The lowest compute capability among the GPUs (every replica must run the plan)."""
        caps = [tuple(g["compute_capability"]) for g in self.gpus if g.get("compute_capability")]
        return min(caps) if caps else None

    @property
    def gpu_memory_mb(self) -> float | None:
        """The smallest GPU's memory (one replica's plan must fit on every GPU)."""
        sizes = [g["memory_mb"] for g in self.gpus if g.get("memory_mb")]
        return min(sizes) if sizes else None

    @property
    def cpu_bf16(self) -> bool:
        return any(flag in self.cpu_flags for flag in BF16_CPU_FLAGS)

    def short(self) -> str:
        """A few words: "2-core AMD EPYC, no GPU", "64-core AMD EPYC, 8 x NVIDIA H100 80GB HBM3 (80 GB)"."""
        cpu = f"{self.cpu_count}-core {self.cpu_name}" if self.cpu_name != "cpu" else f"{self.cpu_count} cores"
        return f"{cpu}, {self._gpus_text() if self.gpus else 'no GPU'}"

    def _gpus_text(self) -> str:
        memory = f" ({_gb(self.gpu_memory_mb)} GB)" if self.gpu_memory_mb else ""
        return f"{len(self.gpus)} x {self.gpus[0]['name'] or 'GPU'}{memory}"

    def planned_for(self) -> dict:
        """What a plan made for this hardware records (`planning.planned_for`, the plan summary's `planned_for`):
        {"gpus", "gpu_memory_mb" (the smallest GPU's, whole MB, or None), "name" (the first GPU's, or None),
        "source": "detected" (this machine) | "target" (`Hardware.target`)}."""
        return {
            "gpus": len(self.gpus),
            "gpu_memory_mb": round(self.gpu_memory_mb) if self.gpu_memory_mb else None,
            "name": self.gpus[0]["name"] if self.gpus else None,
            "source": "target" if self.target_given else "detected",
        }

    def planned_for_text(self) -> str:
        """The plan header's "Planned for:" line: "8 x H100-80GB (80 GB) (target given with --gpus/--gpu-memory;
        this machine: 2-core AMD EPYC, no GPU)", or "this machine, 2-core AMD EPYC, no GPU"."""
        if not self.target_given:
            return f"this machine, {self.short()}"
        what = self._gpus_text() if self.gpus else f"CPU only, {self.cpu_count} cores"
        return f"{what} (target given with {self.target_given}; this machine: {self.planned_on})"

    def describe(self) -> str:
        """One line: the GPUs (or "CPU only"), the usable cores with the CPU's model and instruction sets, the RAM,
        and the oneDNN choice with its reason."""
        flags = ", ".join(self.cpu_isa or self.cpu_flags)
        cpu = f"{self.cpu_count} cores" + (f" of {self.cpu_name}" if self.cpu_name != "cpu" else "")
        cpu += (f" ({flags})" if flags else "") + f", {self.host_memory_mb / 1024:.1f} GB RAM"
        if self.onednn:
            cpu += f"; {self.onednn}"
        if not self.gpus:
            return f"CPU only: {cpu}"
        name = self.gpus[0]["name"] or "GPU"
        cc = self.compute_capability
        memory = f", {self.gpu_memory_mb / 1024:.0f} GB" if self.gpu_memory_mb else ""
        return (
            f"{len(self.gpus)} x {name} (compute capability {cc[0]}.{cc[1]}{memory})"
            if cc
            else f"{len(self.gpus)} x {name}{memory}"
        ) + f"; host: {cpu}"


@functools.lru_cache(maxsize=1)
def detect_hardware() -> Hardware:
    """The `Hardware` of this machine, without initialising any GPU (cached for the process)."""
    import tensorflow as tf

    gpus = []
    physical = physical_gpus()
    nvml = accelerators() if physical else []
    for i, device in enumerate(physical):
        try:
            details = tf.config.experimental.get_device_details(device)
        except Exception:  # noqa: BLE001 - details are optional (e.g. non-CUDA builds)
            details = {}
        cc = details.get("compute_capability")
        gpus.append(
            {
                "name": details.get("device_name") or (nvml[i]["name"] if i < len(nvml) else device.name),
                "compute_capability": tuple(int(c) for c in cc) if cc else None,
                "memory_mb": nvml[i]["total_mb"] if i < len(nvml) else None,
            }
        )
    host = host_memory()
    return Hardware(
        gpus=tuple(gpus),
        cpu_name=host.get("cpu_name") or "cpu",
        cpu_count=usable_cpu_count(),
        cpu_flags=cpu_flags(),
        host_memory_mb=host["total_mb"],
        host_available_mb=host["available_mb"],
        cpu_isa=cpu_isa(),
        onednn=current_onednn().describe(),
    )


# ---------------------------------------------------------------------------------------------- a machine to plan for

# GPUs a plan can be made for by name (`--gpu NAME`, `Hardware.target`): each one's memory and compute capability,
# the two fields of a GPU the planner reads (memory: the patch budget, batch sizes; compute capability:
# `recommended_precision`, >= 7.0 has float16 tensor cores and plans mixed_float16, >= 8.0 has bfloat16 too).
# Memory: the GB of NVIDIA's product datasheet x 1024 (nvidia-smi shows a little less on some, e.g. 81559 MiB on an
# H100 80GB); compute capability: NVIDIA's list of CUDA GPUs (developer.nvidia.com/cuda-gpus).
GPU_MODELS = {
    "V100-16GB": {"memory_mb": 16 * 1024, "compute_capability": (7, 0)},  # Tesla V100 datasheet; Volta
    "V100-32GB": {"memory_mb": 32 * 1024, "compute_capability": (7, 0)},  # Tesla V100 datasheet; Volta
    "T4": {"memory_mb": 16 * 1024, "compute_capability": (7, 5)},  # Tesla T4 datasheet; Turing
    "A10": {"memory_mb": 24 * 1024, "compute_capability": (8, 6)},  # A10 datasheet; Ampere GA102
    "A100-40GB": {"memory_mb": 40 * 1024, "compute_capability": (8, 0)},  # A100 datasheet; Ampere GA100
    "A100-80GB": {"memory_mb": 80 * 1024, "compute_capability": (8, 0)},  # A100 datasheet; Ampere GA100
    "A40": {"memory_mb": 48 * 1024, "compute_capability": (8, 6)},  # A40 datasheet; Ampere GA102
    "RTX-3090": {"memory_mb": 24 * 1024, "compute_capability": (8, 6)},  # GeForce RTX 3090 specs; Ampere GA102
    "RTX-4090": {"memory_mb": 24 * 1024, "compute_capability": (8, 9)},  # GeForce RTX 4090 specs; Ada AD102
    "L4": {"memory_mb": 24 * 1024, "compute_capability": (8, 9)},  # L4 datasheet; Ada AD104
    "L40S": {"memory_mb": 48 * 1024, "compute_capability": (8, 9)},  # L40S datasheet; Ada AD102
    "H100-80GB": {"memory_mb": 80 * 1024, "compute_capability": (9, 0)},  # H100 SXM / PCIe datasheet; Hopper
    "H200-141GB": {"memory_mb": 141 * 1024, "compute_capability": (9, 0)},  # H200 datasheet; Hopper
}
_MEMORY_UNITS = {"": 1.0, "m": 1.0, "mb": 1.0, "mib": 1.0, "g": 1024.0, "gb": 1024.0, "gib": 1024.0, "t": 2**20}
_MEMORY_UNITS.update({"tb": 2.0**20, "tib": 2.0**20})


def gpu_model(name: str) -> tuple[str, dict] | None:
    """(the `GPU_MODELS` name, its entry) for `name`, ignoring case, spaces, dashes and underscores, or a unique
    start of one ("h100"); None for an unknown or ambiguous name ("A100": 40 or 80 GB).

    Example:
        >>> gpu_model("a100 80gb")[0], gpu_model("rtx4090")[0], gpu_model("A100")
        ('A100-80GB', 'RTX-4090', None)
    """
    import re

    def key(text: str) -> str:
        return re.sub(r"[^A-Z0-9]", "", text.upper())

    wanted = key(name)
    exact = [n for n in GPU_MODELS if key(n) == wanted]
    starts = [n for n in GPU_MODELS if key(n).startswith(wanted)] if wanted else []
    found = exact or (starts if len(starts) == 1 else [])
    return (found[0], GPU_MODELS[found[0]]) if found else None


def parse_memory_mb(text: str) -> float:
    """A memory size as MB: "80GB", "80G", "80 GiB", "81920MB", "81920" (a plain number is MB); GB = 1024 MB,
    as nvidia-smi counts.

    Raises:
        ValueError: not a positive number with one of the units MB, GB, TB (or M, G, T; MiB, GiB, TiB).

    Example:
        >>> parse_memory_mb("80GB"), parse_memory_mb("80g"), parse_memory_mb("81920MB"), parse_memory_mb("40960")
        (81920.0, 81920.0, 81920.0, 40960.0)
    """
    import re

    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _MEMORY_UNITS:
        raise ValueError(f"{text!r} is not a memory size (a number with MB, GB or TB, or plain MB)")
    mb = float(match.group(1)) * _MEMORY_UNITS[unit]
    if mb <= 0:
        raise ValueError(f"{text!r} is not a memory size above 0")
    return mb


def _gb(mb: float) -> str:
    """MB as whole GB (one decimal under 10 GB): "80", "7.5"."""
    return f"{mb / 1024:.0f}" if mb >= 10 * 1024 else f"{mb / 1024:.1f}".removesuffix(".0")


PLANNED_MEMORY_SLACK = 0.95  # a GPU with less than 95% of the planned memory is smaller (nvidia-smi shows ~0.5% less)


def planned_hardware_mismatch(planned_for: dict | None, hardware: Hardware | None = None) -> str | None:
    """How `hardware` (default: this machine) falls short of the hardware a plan was made for, or None.

    Args:
        planned_for: a plan's `planning.planned_for` ({"gpus", "gpu_memory_mb", "name", "source"}), or None (a
            config not made by the planner, or made before plans recorded it: nothing to compare).

    Returns:
        "was planned for <that>; this machine has <this>" when this machine has no GPU, fewer GPUs, GPUs with less
        than `PLANNED_MEMORY_SLACK` of the planned memory, or GPUs for a plan made for a CPU; None when it has at
        least what was planned.

    Example:
        >>> planned = {"gpus": 8, "gpu_memory_mb": 81920, "name": "H100-80GB", "source": "target"}
        >>> planned_hardware_mismatch(planned, Hardware())
        'was planned for 8 x 80 GB GPUs (H100-80GB); this machine has no GPU'
        >>> planned_hardware_mismatch({**planned, "gpus": 0, "gpu_memory_mb": None}, Hardware()) is None
        True
    """
    if not planned_for:
        return None
    hardware = hardware or detect_hardware()
    gpus, memory, name = planned_for.get("gpus") or 0, planned_for.get("gpu_memory_mb"), planned_for.get("name")
    if gpus:
        size = f"{_gb(memory)} GB " if memory else ""
        planned = f"{gpus} x {size}GPU{'s' if gpus > 1 else ''}" + (f" ({name})" if name else "")
    else:
        planned = "a CPU-only machine"
    here_memory = hardware.gpu_memory_mb
    if not hardware.has_gpu:
        here = "no GPU" if gpus else None
    elif not gpus:
        here = hardware._gpus_text()
    elif len(hardware.gpus) < gpus or (memory and here_memory and here_memory < PLANNED_MEMORY_SLACK * memory):
        here = hardware._gpus_text()
    else:
        here = None
    return None if here is None else f"was planned for {planned}; this machine has {here}"


# ---------------------------------------------------------------------------------------------- precision


def recommended_precision(hardware: Hardware) -> tuple[str, str]:
    """(precision, reason): the precision this hardware trains fastest in, the more precise one on a tie.

    GPUs with tensor cores (compute capability >= 7): `mixed_float16` with dynamic loss scaling (as
    nnU-Net's and MONAI's AMP; on compute capability >= 8 bfloat16 is as fast, float16 keeps 3 more
    mantissa bits); below 7: `float32`. CPUs: `float32`, also with bfloat16 instructions: `mixed_bfloat16`
    trained no faster than float32 on one CPU with avx512_bf16 and faster, with the same Dice, on another
    (docs/benchmarks.md, "Per CPU kind"), so it is not the default until both CPU kinds are measured in one
    run (benchmarks/cpu_kinds.py); `mixed_float16` is emulated on CPUs. `mixed_bfloat16` stays available by
    name (e.g. to try on CPUs with AMX, whose bfloat16 matrix units are faster).

    Example:
        >>> recommended_precision(Hardware(gpus=({"name": "A100", "compute_capability": (8, 0)},)))[0]
        'mixed_float16'
        >>> recommended_precision(Hardware(cpu_flags=("avx512_bf16",)))[0]
        'float32'
    """
    if hardware.has_gpu:
        cc = hardware.compute_capability
        if cc is None:
            return "float32", "GPU of unknown compute capability: float32 is safe everywhere"
        if cc >= (7, 0):
            return "mixed_float16", (
                f"GPU compute capability {cc[0]}.{cc[1]} >= 7.0: float16 tensor cores with "
                f"dynamic loss scaling (nnU-Net's AMP; float16 keeps 3 more mantissa bits than "
                f"bfloat16 at the same speed)"
            )
        return "float32", f"GPU compute capability {cc[0]}.{cc[1]} < 7.0: no tensor cores, mixed precision gains little"
    if hardware.cpu_bf16:
        flags = "/".join(f for f in BF16_CPU_FLAGS if f in hardware.cpu_flags)
        return "float32", (
            f"CPU only: float16 is emulated (~30x slower); bfloat16 ({flags}) trained no faster than "
            f"float32 on the earlier development CPU (1.18x faster on an AMD EPYC Zen 4), so the more precise float32"
        )
    return "float32", "CPU only, no bfloat16 instructions: float16 and bfloat16 would be emulated (~30x slower)"


def resolve_precision(name: str, hardware: Hardware | None = None) -> str:
    """`training.precision` as a Keras mixed-precision policy name: `auto` becomes this machine's choice.

    Args:
        name: `auto`, `float32`, `mixed_float16` or `mixed_bfloat16`.
        hardware: default `detect_hardware()` (no GPU is initialised).

    Example:
        >>> resolve_precision("float32")
        'float32'
    """
    if name != "auto":
        if name not in PRECISIONS:
            raise ConfigError(f"training.precision: {name!r} is not one of {['auto', *PRECISIONS]}")
        return name
    return recommended_precision(hardware or detect_hardware())[0]


def hardware_warnings(training, hardware: Hardware | None = None) -> list[str]:
    """One line per setting of `training` (a `TrainingConfig`) that this machine runs badly, naming the fix.

    CPU only: `mixed_float16` (float16 is emulated, far slower than float32) and `jit_compile: true` (XLA is
    slower than plain TensorFlow on CPUs; docs/benchmarks.md, "Per CPU kind"). GPUs below compute capability
    8.0: `mixed_bfloat16`. Any machine: oneDNN off (by the environment or the config) where tfmis's `auto` would
    turn it on, and thread counts set above the CPUs this process may use.
    """
    hardware = hardware or detect_hardware()
    lines = []
    onednn = current_onednn()
    if onednn.enabled is False and onednn_choice("auto", env={}).enabled:
        lines.append(
            f"oneDNN is off ({onednn.reason}) on an x86-64 CPU with AVX2 and FMA, where {ONEDNN_MEASURED}; "
            f"unset {ONEDNN_ENV} and use runtime.onednn: auto"
        )
    usable = usable_cpu_count()
    for name in THREAD_ENVS:
        value = os.environ.get(name, "")
        if threads_set_by_user() and value.isdigit() and int(value) > usable:
            lines.append(
                f"{name}={value} but this process may use {usable} CPU(s) (affinity and cgroup quota): threads "
                f"beyond that are throttled; unset it and tfmis sizes the pools"
            )
    precision = training.precision
    best = recommended_precision(hardware)[0]
    if not hardware.has_gpu:
        if precision == "mixed_float16":
            lines.append(
                f"training.precision is mixed_float16 but this machine has no GPU: CPUs emulate float16 "
                f"(~30x slower than float32 on the development CPU); use --set training.precision=auto "
                f"(here: {best})"
            )
        if training.jit_compile:
            lines.append(
                "training.jit_compile is true but this machine has no GPU: XLA on the CPU ran ~10x slower "
                "than plain TensorFlow on the development CPU; use --set training.jit_compile=false"
            )
    else:
        cc = hardware.compute_capability
        if precision == "mixed_bfloat16" and cc is not None and cc < (8, 0):
            lines.append(
                f"training.precision is mixed_bfloat16 but the GPU's compute capability is {cc[0]}.{cc[1]} "
                f"(bfloat16 arithmetic needs 8.0); use --set training.precision=auto (here: {best})"
            )
    return lines
