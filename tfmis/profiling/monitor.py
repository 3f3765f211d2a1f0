"""Where training time goes, from the outside: GPU (or CPU) utilisation and memory sampled into a CSV.

`ResourceMonitor` runs a background thread that, every `interval_s`, appends one CSV row per GPU
(NVML through nvidia-ml-py's `pynvml`: the GPU's utilisation and its memory used/total), or, without
NVIDIA devices, one row for the CPU: the utilisation of a process tree (CPU seconds per second of the
process and all its descendants, in percent of one core, from /proc) and the tree's resident memory.
The columns are the same in both modes, so one plot (`plot_resources`) serves both:

    timestamp, elapsed_s, device, utilization_percent, memory_used_mb, memory_total_mb, memory_used_ratio

(`device` is `gpu<NVML index>` or `cpu`; MB are MiB, 2**20 bytes, as nvidia-smi counts them; in CPU
mode memory_used_mb is the summed RSS of the process tree and memory_total_mb the host's RAM.) Rows
are flushed as they are written, so a run that is killed keeps its CSV up to its last sample.

The machine is read through `tfmis.hardware` (`NvmlGpus`, `process_tree_usage`). This module imports only the
standard library and `tfmis.hardware` at import time (pynvml, matplotlib lazily), so it runs on machines without
TensorFlow. `python -m tfmis.monitor -- COMMAND ...` monitors a command
(`monitor_command`; the command line is `tfmis.monitor`).

Example:
```python
from tfmis.profiling import ResourceMonitor, plot_resources

with ResourceMonitor("runs/demo/resources.csv", interval_s=1.0) as monitor:
    train()
print(monitor.summary()["devices"])
plot_resources("runs/demo/resources.csv", "runs/demo/resources.png")
```
"""

from __future__ import annotations

import csv
import datetime
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tfmis.errors import DataError, UsageError
from tfmis.hardware import NvmlGpus, NvmlUnavailable, host_memory, process_tree_usage, usable_cpu_count

COLUMNS = (
    "timestamp",
    "elapsed_s",
    "device",
    "utilization_percent",
    "memory_used_mb",
    "memory_total_mb",
    "memory_used_ratio",
)
MB = 1 << 20
PREFIX = "tfmis.monitor:"


class ResourceMonitor:
    """Background sampler thread writing GPU (NVML) or process-tree CPU utilisation and memory to a CSV.

    Every `interval_s` it writes one row per GPU (NVML through nvidia-ml-py's `pynvml`), or, when NVML
    cannot be used (no nvidia-ml-py, no driver, no GPU; said once on stderr), one row for the CPU:
    the process tree's CPU utilisation (percent of one core, summed over the process and all its
    descendants, from /proc; can exceed 100 with several cores) and its RSS (summed over the tree, so
    pages shared between processes count once per process). Rows start one interval after `start()`;
    `stop()` adds a last row for the final partial interval when it is at least half an interval long
    (or when there is no row yet). The CSV is rewritten by `start()` and flushed after every row.

    Args:
        csv_path: the CSV to write (its folder is created).
        interval_s: seconds between samples (> 0).
        pid: whose process tree to measure in CPU mode (default: this process). Ignored in NVML mode,
            which measures whole GPUs.
        gpus: NVML indices (as nvidia-smi numbers them) of the GPUs to sample. Default: those in
            CUDA_VISIBLE_DEVICES (integer indices or GPU UUIDs) when it is set, else all GPUs.
        backend: "auto" (NVML if it works, else CPU), "nvml" (raise if NVML cannot be used) or "cpu".

    Attributes:
        backend: "nvml" or "cpu", known after `__init__`.
        devices: device label (`gpu0`, ... or `cpu`) -> {"name", "memory_total_mb"}.
        cpu_count: the CPUs this process may use (`tfmis.hardware.usable_cpu_count`: affinity and cgroup quota;
            CPU mode utilisation is in percent of one core).

    Example:
    ```python
    monitor = ResourceMonitor("runs/demo/resources.csv", interval_s=0.5).start()
    try:
        train()
    finally:
        monitor.stop()
    print(monitor.backend, monitor.summary()["devices"])
    ```
    """

    def __init__(
        self,
        csv_path: str | Path,
        interval_s: float = 1.0,
        pid: int | None = None,
        gpus: list[int] | None = None,
        backend: str = "auto",
    ):
        if not (isinstance(interval_s, (int, float)) and math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"interval_s must be a positive number of seconds, got {interval_s!r}")
        if backend not in ("auto", "nvml", "cpu"):
            raise ValueError(f"backend must be 'auto', 'nvml' or 'cpu', got {backend!r}")
        self.csv_path = Path(csv_path)
        self.interval_s = float(interval_s)
        self.pid = os.getpid() if pid is None else int(pid)
        self.cpu_count = usable_cpu_count()
        self.devices: dict[str, dict] = {}
        self._nvml: NvmlGpus | None = None
        self._tree_last: tuple[float | None, float] = (None, 0.0)  # (when, the tree's CPU seconds then)
        self._file = None
        self._writer = None
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()
        self._lock = threading.Lock()
        self._t0 = None
        self._last_sample_t = None
        self._stopped_t = None
        self._stats: dict[str, dict] = {}
        self._reported_errors: set[str] = set()

        reason = None
        if backend in ("auto", "nvml"):
            try:
                self._nvml = NvmlGpus(gpus)
            except NvmlUnavailable as e:
                if backend == "nvml":
                    raise UsageError(f"backend='nvml' but NVIDIA GPUs cannot be monitored here: {e}") from None
                reason = str(e)
        if self._nvml is not None:
            self.backend = "nvml"
            for gpu in self._nvml.devices:
                self.devices[f"gpu{gpu['index']}"] = {"name": gpu["name"], "memory_total_mb": gpu["total_mb"]}
        else:
            self.backend = "cpu"
            if process_tree_usage(self.pid) is None:
                raise UsageError(f"pid {self.pid}: no such process")
            self.devices["cpu"] = {
                "name": f"CPU ({self.cpu_count} cores), process {self.pid} and its children",
                "memory_total_mb": host_memory()["total_mb"],
            }
            if reason is not None:
                ignored = f"; --gpus/gpus {gpus} ignored" if gpus else ""
                print(
                    f"{PREFIX} no NVIDIA GPU to monitor ({reason}){ignored}; sampling the CPU utilisation and "
                    f"RSS of process {self.pid} and its children instead",
                    file=sys.stderr,
                    flush=True,
                )

    # ----------------------------------------------------------------------------------- NVML
    def _sample_nvml(self) -> list[tuple]:
        rows = []
        for gpu in self._nvml.read():
            label = f"gpu{gpu['index']}"
            if gpu["utilization_error"] is not None:  # e.g. not supported on MIG instances
                self._report_once(f"{label} utilisation", gpu["utilization_error"])
            rows.append((label, gpu["utilization_percent"], gpu["used_mb"], gpu["total_mb"]))
        return rows

    # ------------------------------------------------------------------------------------ CPU
    def _sample_cpu(self, now: float) -> list[tuple]:
        reading = process_tree_usage(self.pid)
        if reading is None:  # the process is gone (and reaped): nothing to measure
            return []
        cpu_s, rss = reading
        previous_t, previous_cpu_s = self._tree_last
        self._tree_last = (now, cpu_s)
        if previous_t is None or now <= previous_t:
            return []
        busy_s = max(0.0, cpu_s - previous_cpu_s)
        total = self.devices["cpu"]["memory_total_mb"]
        return [("cpu", 100.0 * busy_s / (now - previous_t), rss / MB, total)]

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> ResourceMonitor:
        """Writes the CSV header and starts sampling; returns self."""
        if self._thread is not None:
            raise RuntimeError("ResourceMonitor.start() called twice; make a new monitor for a new CSV")
        self.csv_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.csv_path, "w", newline="")
        self._writer = csv.writer(self._file)
        self._writer.writerow(COLUMNS)
        self._file.flush()
        self._t0 = time.monotonic()
        self._last_sample_t = self._t0
        if self.backend == "cpu":
            reading = process_tree_usage(self.pid)
            self._tree_last = (self._t0, reading[0]) if reading else (None, 0.0)
        self._thread = threading.Thread(target=self._run, name="tfmis-resource-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops sampling (adding a last row for the final partial interval, see the class) and closes the CSV."""
        if self._thread is None or self._stopped_t is not None:
            return
        self._stop_event.set()
        self._thread.join()
        now = time.monotonic()
        since = now - self._last_sample_t
        if since >= 0.5 * self.interval_s or (not self._stats and since >= 0.05):
            self._sample(now)
        self._stopped_t = now
        self._file.close()
        if self._nvml is not None:
            self._nvml.close()

    def __enter__(self) -> ResourceMonitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        next_t = self._t0 + self.interval_s
        while not self._stop_event.wait(max(0.0, next_t - time.monotonic())):
            self._sample(time.monotonic())
            next_t += self.interval_s
            if next_t < time.monotonic():  # a slow sample: skip the missed ticks instead of bursting
                next_t = time.monotonic() + self.interval_s

    def _sample(self, now: float) -> None:
        try:
            rows = self._sample_nvml() if self.backend == "nvml" else self._sample_cpu(now)
        except Exception as e:  # keep sampling: one failed read must not end the monitor
            self._report_once("sample", e)
            return
        timestamp = datetime.datetime.now().astimezone().isoformat(timespec="milliseconds")
        elapsed = now - self._t0
        with self._lock:
            self._last_sample_t = now
            for device, utilization, used, total in rows:
                self._writer.writerow(
                    (
                        timestamp,
                        f"{elapsed:.3f}",
                        device,
                        f"{utilization:.1f}",
                        f"{used:.1f}",
                        f"{total:.1f}",
                        f"{used / total:.4f}" if total else "nan",
                    )
                )
                stats = self._stats.setdefault(
                    device,
                    {
                        "samples": 0,
                        "utilization_sum": 0.0,
                        "utilization_n": 0,
                        "max_utilization": -math.inf,
                        "max_memory": 0.0,
                    },
                )
                stats["samples"] += 1
                if math.isfinite(utilization):
                    stats["utilization_sum"] += utilization
                    stats["utilization_n"] += 1
                    stats["max_utilization"] = max(stats["max_utilization"], utilization)
                stats["max_memory"] = max(stats["max_memory"], used)
            self._file.flush()

    def _report_once(self, what: str, error: BaseException) -> None:
        key = f"{what}: {type(error).__name__}"
        if key not in self._reported_errors:
            self._reported_errors.add(key)
            print(f"{PREFIX} {what} failed ({error}); continuing (reported once)", file=sys.stderr, flush=True)

    # -------------------------------------------------------------------------------- results
    def summary(self) -> dict:
        """What was measured so far: per device, samples, mean/max utilisation and max memory used.

        Returns:
            {"backend", "csv", "interval_s", "duration_s", "cpu_count", "pid" (CPU mode, else None),
            "devices": {label: {"name", "samples", "mean_utilization_percent", "max_utilization_percent",
            "max_memory_used_mb", "memory_total_mb"}}}; utilisation values are None without samples.
        """
        with self._lock:
            end = self._stopped_t if self._stopped_t is not None else time.monotonic()
            devices = {}
            for label, info in self.devices.items():
                s = self._stats.get(label, {"samples": 0, "utilization_n": 0, "max_memory": 0.0})
                n = s["utilization_n"]
                devices[label] = {
                    "name": info["name"],
                    "samples": s["samples"],
                    "mean_utilization_percent": round(s["utilization_sum"] / n, 2) if n else None,
                    "max_utilization_percent": round(s["max_utilization"], 2) if n else None,
                    "max_memory_used_mb": round(s["max_memory"], 1) if s["samples"] else None,
                    "memory_total_mb": round(info["memory_total_mb"], 1),
                }
            return {
                "backend": self.backend,
                "csv": str(self.csv_path),
                "interval_s": self.interval_s,
                "duration_s": round(end - self._t0, 3) if self._t0 is not None else 0.0,
                "cpu_count": self.cpu_count,
                "pid": self.pid if self.backend == "cpu" else None,
                "devices": devices,
            }


# ------------------------------------------------------------------------------------- reading, plotting
def read_resources(csv_path: str | Path) -> dict[str, dict[str, list[float]]]:
    """A monitor CSV as {device: {column: values}} for the numeric columns (elapsed_s, utilization_percent,
    memory_used_mb, memory_total_mb, memory_used_ratio), devices in order of first appearance.

    Raises:
        ValueError: the file is not a monitor CSV (its header is named).
    """
    csv_path = Path(csv_path)
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise DataError(
                f"{csv_path}: not a resource monitor CSV: header {reader.fieldnames}, expected {list(COLUMNS)}"
            )
        series: dict[str, dict[str, list[float]]] = {}
        for row in reader:
            if any(row.get(c) in (None, "") for c in COLUMNS):  # a row cut short by a kill
                continue
            columns = series.setdefault(row["device"], {c: [] for c in COLUMNS if c not in ("timestamp", "device")})
            for c, values in columns.items():
                values.append(float(row[c]))
    return series


def plot_resources(csv_path: str | Path, png_path: str | Path, title: str | None = None) -> Path:
    """Utilisation and memory used over time, one line per device, from a monitor CSV (either mode).

    Args:
        csv_path: a CSV written by `ResourceMonitor`.
        png_path: the PNG to write (atomically).
        title: the figure's title (default: the CSV's path).

    Raises:
        ImportError: matplotlib is not installed (the CSV is complete without the plot).
        ValueError: the CSV has no samples, or is not a monitor CSV.

    Example:
    ```python
    plot_resources("runs/demo/resources.csv", "runs/demo/resources.png", title="demo training")
    ```
    """
    series = read_resources(csv_path)
    if not series:
        raise DataError(f"{csv_path}: no samples yet (a run shorter than the sampling interval?): nothing to plot")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            f"plot_resources needs matplotlib (pip install matplotlib); {csv_path} is complete without the plot ({e})"
        ) from e

    from tfmis.utils.io import atomic_writer

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    for device, columns in series.items():
        top.plot(columns["elapsed_s"], columns["utilization_percent"], "-", lw=1.2, label=device)
        bottom.plot(
            columns["elapsed_s"],
            columns["memory_used_mb"],
            "-",
            lw=1.2,
            label=f"{device} (of {max(columns['memory_total_mb']):.0f} MB)",
        )
    if "cpu" in series:
        top.set_ylabel("utilisation (%)\nCPU: % of one core")
        bottom.set_ylabel("memory used (MB)\nCPU: RSS of the process tree")
    else:
        top.set_ylabel("GPU utilisation (%)")
        bottom.set_ylabel("GPU memory used (MB)")
    top.set_ylim(bottom=0)
    bottom.set_ylim(bottom=0)
    bottom.set_xlabel("elapsed (s)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    top.set_title(title or str(csv_path))
    fig.tight_layout()
    png_path = Path(png_path)
    with atomic_writer(png_path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return png_path


def format_summary(summary: dict) -> str:
    """The summary as a short table, one line per device."""
    mode = (
        "NVML"
        if summary["backend"] == "nvml"
        else f"CPU mode, {summary['cpu_count']} cores, utilisation in % of one core, memory = RSS"
    )
    lines = [
        f"{summary['duration_s']:.1f} s sampled every {summary['interval_s']:g} s ({mode})",
        f"{'device':<8} {'samples':>7} {'util mean %':>11} {'util max %':>10} {'mem max MB':>10} "
        f"{'mem total MB':>12}  name",
    ]

    def number(x, width):
        return f"{x:>{width}.1f}" if x is not None else f"{'-':>{width}}"

    for label, d in summary["devices"].items():
        lines.append(
            f"{label:<8} {d['samples']:>7} {number(d['mean_utilization_percent'], 11)} "
            f"{number(d['max_utilization_percent'], 10)} {number(d['max_memory_used_mb'], 10)} "
            f"{number(d['memory_total_mb'], 12)}  {d['name']}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- the CLI
def monitor_command(
    command: list[str], output_dir: str | Path, interval_s: float = 1.0, gpus: list[int] | None = None
) -> int:
    """Runs `command` as a child while monitoring it (CPU mode: the child's process tree); writes
    `output_dir/monitor.csv`, `monitor.png` and `monitor.json` (the summary), prints the summary table on
    stderr, and returns the command's exit status (128 + N when signal N ended it). SIGINT and SIGTERM
    are forwarded to the child's process group (the child runs in its own session).

    Example:
    ```python
    status = monitor_command(["python", "-m", "tfmis.train", "--config", "configs/demo.yaml"], "runs/monitor")
    ```
    """
    from tfmis.utils.io import atomic_write_json

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    proc = None

    def forward(signum, frame):
        if proc is not None:
            try:
                os.killpg(proc.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            proc = subprocess.Popen(command, start_new_session=True)
        except OSError as e:
            print(f"{PREFIX} cannot run {command[0]!r}: {e}", file=sys.stderr)
            return 127
        try:
            monitor = ResourceMonitor(output_dir / "monitor.csv", interval_s, pid=proc.pid, gpus=gpus).start()
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
        _wait_without_reaping(proc.pid)  # the exited child stays a zombie: its CPU time is still readable
        monitor.stop()
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    status = code if code >= 0 else 128 - code
    shown = " ".join(" ".join(command).split())  # one line, however the command was written
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    summary = monitor.summary()
    summary.update(command=command, exit_status=status)
    atomic_write_json(output_dir / "monitor.json", summary)
    png = output_dir / "monitor.png"
    try:
        plot_resources(monitor.csv_path, png, title=f"{shown} ({monitor.backend})")
        plotted = str(png)
    except (ImportError, ValueError) as e:
        plotted = f"not written: {e}"
    print(
        f"{PREFIX} '{shown}' exited with status {status}\n{format_summary(summary)}\n"
        f"CSV: {monitor.csv_path}\nplot: {plotted}",
        file=sys.stderr,
        flush=True,
    )
    return status


def _wait_without_reaping(pid: int) -> None:
    if not hasattr(os, "waitid"):
        return
    while True:
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            return
        except InterruptedError:
            continue
        except ChildProcessError:
            return
