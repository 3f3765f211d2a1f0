#!/usr/bin/env python3
"""Time to a given Dice, tfmis against MONAI's recipe on the same data and cores.

Arms, each in its own process, one after the other (never two at once), each with the same wall-clock
budget (`--max-minutes`):

- **monai**: `benchmarks/monai_demo.py` in the MONAI virtual environment (`--monai-python`, default
  `.venv-monai/bin/python`; created with `python -m venv .venv-monai && .venv-monai/bin/pip install
  torch==2.13.0 && .venv-monai/bin/pip install monai nibabel`), on the volumes
  `benchmarks/export_demo_npy.py` exports from the config's converted TFRecords (same voxels, same split);
- **tfmis** arms: `python -m tfmis.train --config CONFIG --set training.max_minutes=M --set output.dir=...`
  for `--config` itself (arm named after the file) and for each `--recipe` (a YAML file under
  `benchmarks/recipes/`: `description`, optional `config` (default `--config`) and `set`, a list of
  `key=value` overrides).

`--repeats N` runs the whole sequence N times (monai, tfmis arms, monai, ...), so that every arm sees
the same share of a busy machine; the report gives the median and the range over the repeats.

**Wall time** on both sides is `elapsed_seconds` of the run's history: from just before the first
training step to the end of each epoch, all steps and validations included. Excluded on both sides:
process start-up and imports, data generation/conversion/export (done once, before any arm), loading
the volumes and building the model. Included on both sides: everything after that: tfmis's first epoch
pays for its graph tracing and for filling its volume cache, MONAI's for nothing comparable (eager
PyTorch, volumes already in memory); each arm's process wall time (spawn to exit) is reported as well.

Outputs in `--output` (default `runs/time_to_dice`): one run folder per arm and repeat
(`<arm>/run<k>/`, with its `.log`), `time_to_dice.md`, `time_to_dice.json`, `time_to_dice.png`
(validation mean Dice against wall time, every arm and repeat).

Example:
    python benchmarks/time_to_dice.py --config configs/demo.yaml --max-minutes 4       # about 9 minutes
    python benchmarks/time_to_dice.py --config configs/demo.yaml --max-minutes 3 --repeats 2 \\
        --recipe benchmarks/recipes/full_resolution.yaml
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from tfmis.utils.io import atomic_write_json, atomic_writer  # noqa: E402

DEFAULT_LEVELS = (0.80, 0.85, 0.90)
DEFAULT_OUTPUT = "runs/time_to_dice"
MONAI = "monai"
MONAI_SCRIPT = REPO / "benchmarks" / "monai_demo.py"
DEFAULT_MONAI_PYTHON = REPO / ".venv-monai" / "bin" / "python"
MONAI_VENV_COMMAND = (
    "python -m venv .venv-monai && .venv-monai/bin/pip install torch==2.13.0 && "
    ".venv-monai/bin/pip install monai nibabel"
)
RUN_MARKERS = {"history.jsonl", "config.yaml", "settings.json", "checkpoints", "summary.json", "arm.json"}


# ------------------------------------------------------------------------------------------ arms


def load_recipe(path, default_config: str) -> dict:
    """A tfmis arm from a recipe file: {"name", "config", "overrides", "description", "source"}.

    Args:
        path: YAML with `set` (a list of `key=value` overrides), optional `config` and `description`.
        default_config: the config the overrides apply to when the recipe names none.

    Example:
        >>> arm = load_recipe("benchmarks/recipes/full_resolution.yaml", "configs/demo.yaml")  # doctest: +SKIP
        >>> arm["name"], arm["overrides"][:1]  # doctest: +SKIP
        ('full_resolution', ['model.strides=[1,2,2,2]'])
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"recipe {path}: not found (recipes live in benchmarks/recipes/)")
    spec = yaml.safe_load(path.read_text()) or {}
    unknown = sorted(set(spec) - {"description", "config", "set"})
    if unknown:
        raise ValueError(f"recipe {path}: unknown key(s) {unknown}; a recipe has description, config and set")
    overrides = spec.get("set") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o for o in overrides):
        raise ValueError(f"recipe {path}: `set` must be a list of 'key=value' strings, got {overrides!r}")
    return {
        "name": path.stem,
        "config": str(spec.get("config") or default_config),
        "overrides": list(overrides),
        "description": str(spec.get("description", "")).strip(),
        "source": str(path),
    }


def tfmis_arms(config: str, recipes, overrides, include_config: bool = True) -> list[dict]:
    """The tfmis arms: the config itself (unless `include_config` is false), then one per recipe; `overrides`
    (the `--set` flags) apply to all of them, after the recipe's own."""
    arms = []
    if include_config:
        arms.append(
            {
                "name": Path(config).stem,
                "config": config,
                "overrides": [],
                "description": "the config as is",
                "source": config,
            }
        )
    arms += [load_recipe(r, config) for r in recipes]
    names = [a["name"] for a in arms]
    if MONAI in names or len(set(names)) != len(names):
        raise ValueError(f"arm names must be unique and not {MONAI!r}: {names}; rename a recipe file")
    for arm in arms:
        arm["overrides"] = arm["overrides"] + list(overrides)
    return arms


def tfmis_command(arm: dict, run_dir: Path, max_minutes: float) -> list[str]:
    cmd = [sys.executable, "-m", "tfmis.train", "--config", arm["config"]]
    for override in [
        *arm["overrides"],
        f"training.max_minutes={max_minutes}",
        f"output.dir={run_dir}",
        "output.progress=false",
    ]:
        cmd += ["--set", override]
    return cmd


def monai_protocol_args(config) -> list[str]:
    """`monai_demo.py` flags for the data and evaluation protocol of a tfmis config: the same patch, crops per
    volume read, crops per step, crop-centre ratios and validation (interval, window, overlap, blending, sw
    batch). The training recipe itself (network, loss, optimizer, learning rate, schedule, epochs) stays
    MONAI's (`monai_demo.py`'s defaults); `--monai-arg` flags come after these and win.

    Example:
        >>> from tfmis.config import load_config
        >>> monai_protocol_args(load_config("configs/demo.yaml"))[:4]  # doctest: +SKIP
        ['--patch', '48', '48', '48']
    """
    p, v = config.pipeline, config.validation
    if p.class_ratios is not None:
        ratios = p.class_ratios
    else:  # pos:neg as MONAI's RandCropByLabelClassesd ratios: background neg, the foreground classes share pos
        from tfmis.data.records import load_index

        classes = len(load_index(config.data.dataset_dir)["source"]["labels"])
        ratios = [p.pos_neg_ratio[1]] + [p.pos_neg_ratio[0] / (classes - 1)] * (classes - 1)
    roi = v.roi_size or p.patch_size
    if list(roi) != list(p.patch_size):
        raise ValueError(
            f"validation.roi_size {roi} differs from pipeline.patch_size {p.patch_size}; "
            "monai_demo.py validates with windows of the training patch"
        )
    return [
        "--patch",
        *map(str, p.patch_size),
        "--crops-per-volume",
        str(p.num_crops_per_image),
        "--batch",
        str(p.num_images_per_batch),
        "--class-ratios",
        *map(str, ratios),
        "--val-interval",
        str(v.val_interval),
        "--overlap",
        str(v.overlap),
        "--mode",
        v.mode,
        "--sw-batch-size",
        str(v.num_sw_batch_size),
    ]


def monai_command(args, run_dir: Path, protocol: list[str]) -> list[str]:
    cmd = [
        str(args.monai_python),
        str(MONAI_SCRIPT),
        "--data",
        str(args.npy_dir),
        "--output",
        str(run_dir),
        "--max-minutes",
        str(args.max_minutes),
        "--threads",
        str(args.threads),
    ]
    return cmd + list(protocol) + list(args.monai_args)


def _prepare_run_dir(path: Path) -> None:
    """Removes an earlier run folder of this benchmark; refuses to delete anything else."""
    if not path.exists():
        return
    entries = {p.name for p in path.iterdir()}
    if entries and not entries & RUN_MARKERS:
        raise ValueError(f"{path} exists and is not a run folder of an earlier benchmark: choose another --output")
    shutil.rmtree(path)


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a running process, all its threads (Linux /proc); None elsewhere or once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, IndexError, ValueError):
        return None


class CpuSampler(threading.Thread):
    """Records an arm's process CPU seconds as each epoch record appears in its `history.jsonl` (polled every
    `interval` s): CPU time to a Dice level, a cost measure that other work on the machine barely changes (unlike
    wall time). The value includes the process's start-up (imports, data loading, model building)."""

    def __init__(self, pid: int, history: Path, interval: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.history, self.interval = pid, history, interval
        self.cpu_by_epoch: list[float] = []
        self.done = threading.Event()

    def _complete_lines(self) -> int:
        try:
            return self.history.read_bytes().count(b"\n")
        except OSError:
            return 0

    def run(self) -> None:
        while not self.done.wait(self.interval):
            lines = self._complete_lines()
            if lines > len(self.cpu_by_epoch):
                cpu = process_cpu_seconds(self.pid)
                if cpu is not None:
                    self.cpu_by_epoch += [cpu] * (lines - len(self.cpu_by_epoch))


def run_arm(cmd: list[str], run_dir: Path, quiet: bool, env=None) -> dict:
    """Runs one arm's command, its output teed into `<run_dir>.log`; returns its process wall seconds and the
    process CPU seconds at each epoch record (`CpuSampler`; empty where /proc is missing)."""
    _prepare_run_dir(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.with_suffix(".log")
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        f.write((" ".join(cmd) + "\n").encode())
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        sampler = CpuSampler(proc.pid, run_dir / "history.jsonl")
        sampler.start()
        while chunk := proc.stdout.read1(1 << 14):
            f.write(chunk)
            f.flush()
            if not quiet:
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()
        code = proc.wait()
        sampler.done.set()
        sampler.join()
    if code != 0:
        raise RuntimeError(f"arm failed (exit status {code}): {' '.join(cmd)}; its output is in {log}")
    return {"process_seconds": time.perf_counter() - t0, "log": str(log), "cpu_by_epoch": sampler.cpu_by_epoch}


# ------------------------------------------------------------------------------------------ analysis


def read_history(run_dir) -> list[dict]:
    """The epoch records of a run folder's `history.jsonl` (tfmis's Trainer and monai_demo.py write the same keys)."""
    path = Path(run_dir) / "history.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; did the arm run (see {Path(run_dir)}.log)?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def run_stats(records: list[dict], levels, cpu_by_epoch=None) -> dict:
    """Time to each Dice level, best Dice and epoch times of one run.

    Time to a level is the `elapsed_seconds` of the first validated epoch whose mean Dice is at or above
    it (None if never). `epoch_seconds` is the mean time of an epoch's steps (data wait + compute, no
    validation) over epochs 2..N; `first_epoch_seconds` the same for epoch 1 (tfmis: graph tracing and
    cache fill included). With `cpu_by_epoch` (process CPU seconds when each record appeared, see
    `CpuSampler`), `cpu_to_dice` gives the CPU seconds to each level the same way.

    Example:
        >>> records = [{"epoch": 1, "elapsed_seconds": 3.0, "data_wait_seconds": 0.5, "compute_seconds": 2.5},
        ...            {"epoch": 2, "elapsed_seconds": 5.0, "data_wait_seconds": 0.1, "compute_seconds": 1.4,
        ...             "val_mean_dice": 0.86}]
        >>> stats = run_stats(records, [0.8, 0.9])
        >>> stats["time_to_dice"], stats["best_dice"], stats["epoch_seconds"]
        ({'0.80': 5.0, '0.90': None}, 0.86, 1.5)
    """
    if not records:
        raise ValueError("no epoch records: the arm trained no epoch")
    validated = [r for r in records if _finite(r.get("val_mean_dice"))]
    steady = records[1:] or records
    cpu = list(cpu_by_epoch or [])
    times, epochs, cpu_times = {}, {}, {}
    for level in sorted(float(x) for x in levels):
        hit = next((r for r in validated if r["val_mean_dice"] >= level), None)
        times[f"{level:.2f}"] = None if hit is None else hit["elapsed_seconds"]
        epochs[f"{level:.2f}"] = None if hit is None else hit["epoch"]
        position = None if hit is None else records.index(hit)
        cpu_times[f"{level:.2f}"] = cpu[position] if position is not None and position < len(cpu) else None
    best = max(validated, key=lambda r: r["val_mean_dice"], default=None)

    def step_seconds(r):
        return r["data_wait_seconds"] + r["compute_seconds"]

    return {
        "time_to_dice": times,
        "epoch_to_dice": epochs,
        "cpu_to_dice": cpu_times,
        "best_dice": best["val_mean_dice"] if best else None,
        "best_epoch": best["epoch"] if best else None,
        "best_dice_seconds": best["elapsed_seconds"] if best else None,
        "epochs": len(records),
        "elapsed_seconds": records[-1]["elapsed_seconds"],
        "epoch_seconds": statistics.fmean(step_seconds(r) for r in steady),
        "first_epoch_seconds": step_seconds(records[0]),
        "val_seconds": statistics.fmean(r["val_seconds"] for r in validated) if validated else None,
        "curve": [[r["elapsed_seconds"], r["val_mean_dice"]] for r in validated],
    }


def _median(values):
    """Median of the runs' values; None when any run never got there (a level not reached in every run)."""
    values = list(values)
    if not values or any(v is None for v in values):
        return None
    return statistics.median(values)


def _range(values):
    known = [v for v in values if v is not None]
    return [min(known), max(known)] if known else None


def arm_summary(runs: list[dict], levels) -> dict:
    """Medians (and min-max ranges) over an arm's repeats of what `run_stats` gives."""
    keys = [f"{float(x):.2f}" for x in sorted(levels)]
    summary = {"runs": len(runs), "time_to_dice": {}, "time_to_dice_range": {}, "reached": {}, "cpu_to_dice": {}}
    for key in keys:
        values = [r["time_to_dice"][key] for r in runs]
        summary["time_to_dice"][key] = _median(values)
        summary["time_to_dice_range"][key] = _range(values)
        summary["reached"][key] = sum(v is not None for v in values)
        summary["cpu_to_dice"][key] = _median(r.get("cpu_to_dice", {}).get(key) for r in runs)
    for key in (
        "best_dice",
        "epochs",
        "epoch_seconds",
        "first_epoch_seconds",
        "val_seconds",
        "elapsed_seconds",
        "process_seconds",
    ):
        values = [r.get(key) for r in runs]
        summary[key] = _median(values)
        summary[f"{key}_range"] = _range(values)
    return summary


def ratios(summaries: dict, levels) -> dict:
    """MONAI / tfmis time to each level per tfmis arm (> 1: tfmis gets there sooner); None where either
    arm did not reach it in every repeat."""
    base = summaries.get(MONAI)
    out = {}
    for name, s in summaries.items():
        if name == MONAI or base is None:
            continue
        out[name] = {}
        for key in (f"{float(x):.2f}" for x in sorted(levels)):
            m, t = base["time_to_dice"][key], s["time_to_dice"][key]
            out[name][key] = m / t if m is not None and t else None
    return out


# ------------------------------------------------------------------------------------------ report


def _seconds(value, spread=None, runs: int = 1) -> str:
    if value is None:
        return "not reached"
    text = f"{value:.1f}"
    if runs > 1 and spread:
        text += f" ({spread[0]:.1f}–{spread[1]:.1f})"
    return text


def render_markdown(result: dict) -> str:
    levels = result["levels"]
    keys = [f"{x:.2f}" for x in levels]
    lines = [
        "# Time to a given Dice: tfmis vs MONAI",
        "",
        f"Config `{result['config']}`, budget {result['max_minutes']:g} min per arm, {result['repeats']} repeat(s), "
        f"measured {result['created']} on {result['device']}; {result['threads']} threads for torch"
        + (f" (environment {', '.join(result['monai_env'])})" if result.get("monai_env") else "")
        + ". Arms ran "
        "one after the other in their own processes. Time = wall seconds from just before the first training "
        "step, validation included (tfmis: graph tracing and cache fill in epoch 1; excluded on both sides: "
        "process start-up, data conversion/export, loading the volumes, building the model). With repeats: "
        "median (min–max); a level counts as reached only if every repeat reached it.",
        "",
        "| arm | "
        + " | ".join(f"time to {k}, s" for k in keys)
        + " | best Dice | epochs | s/epoch | first epoch, s | validation, s | process, s |",
        "| --- | " + " | ".join("---:" for _ in keys) + " | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, s in result["summaries"].items():
        n = s["runs"]
        cells = [
            _seconds(s["time_to_dice"][k], s["time_to_dice_range"][k], n)
            + ("" if s["reached"][k] in (0, n) else f" [{s['reached'][k]}/{n} reached]")
            for k in keys
        ]
        best = "-" if s["best_dice"] is None else f"{s['best_dice']:.4f}"
        if n > 1 and s["best_dice_range"]:
            best += f" ({s['best_dice_range'][0]:.4f}–{s['best_dice_range'][1]:.4f})"
        val = "-" if s["val_seconds"] is None else f"{s['val_seconds']:.2f}"
        lines.append(
            f"| {name} | "
            + " | ".join(cells)
            + f" | {best} | {s['epochs']:g} | {s['epoch_seconds']:.2f} | {s['first_epoch_seconds']:.1f} "
            f"| {val} | {s['process_seconds']:.0f} |"
        )
    if result["ratios"]:
        lines += [
            "",
            "MONAI time / tfmis time to each level (> 1: tfmis gets there sooner):",
            "",
            "| arm | " + " | ".join(keys) + " |",
            "| --- | " + " | ".join("---:" for _ in keys) + " |",
        ]
        for name, r in result["ratios"].items():
            lines.append(f"| {name} | " + " | ".join("-" if r[k] is None else f"{r[k]:.2f}x" for k in keys) + " |")
    if any(v is not None for s in result["summaries"].values() for v in s.get("cpu_to_dice", {}).values()):
        lines += [
            "",
            "Process CPU seconds (all threads, start-up included) when each level was first reached: a cost "
            "that other work on the machine changes far less than wall time (median over repeats):",
            "",
            "| arm | " + " | ".join(keys) + " |",
            "| --- | " + " | ".join("---:" for _ in keys) + " |",
        ]
        for name, s in result["summaries"].items():
            cells = ["-" if s["cpu_to_dice"].get(k) is None else f"{s['cpu_to_dice'][k]:.0f}" for k in keys]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Arms:", ""]
    for arm in result["arms"]:
        settings = " ".join(f"`{o}`" for o in arm["overrides"]) or "(none)"
        what = f" — {arm['description']}" if arm.get("description") else ""
        lines.append(f"- **{arm['name']}**: `{arm['source']}`{what}; overrides {settings}")
    lines += ["", f"Plot: `time_to_dice.png`. Benchmark wall time {result['seconds'] / 60:.1f} min.", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, runs) in enumerate(result["runs"].items()):
        color = "black" if name == MONAI else colors[i % len(colors)]
        for k, run in enumerate(runs):
            curve = run["curve"]
            if curve:
                ax.plot(
                    *zip(*curve),
                    marker="o",
                    ms=3,
                    lw=1.2,
                    color=color,
                    alpha=1.0 if k == 0 else 0.45,
                    label=name if k == 0 else None,
                )
    for level in result["levels"]:
        ax.axhline(level, color="grey", ls=":", lw=0.8)
    ax.set(
        xlabel="wall time since the first training step (s), validation included",
        ylabel="validation mean Dice",
        title=f"Dice vs wall time ({result['device']})",
        ylim=(max(0.0, min(result["levels"]) - 0.2), 1.0),
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    with atomic_writer(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return path


def _device(threads: int) -> str:
    from tfmis.hardware import detect_hardware

    return detect_hardware().describe()


# ------------------------------------------------------------------------------------------ main


def run_benchmark(args) -> dict:
    """Prepares the data once, runs every arm `--repeats` times back to back, writes the report; returns it."""
    from tfmis.config import load_config
    from tfmis.data.prepare import prepare_dataset

    arms = tfmis_arms(args.config, args.recipe, args.overrides, include_config=not args.skip_config)
    for arm in arms:  # config errors before anything runs
        load_config(arm["config"], arm["overrides"])
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    names = [a["name"] for a in arms]
    if not args.skip_monai:
        if not Path(args.monai_python).is_file():
            raise FileNotFoundError(
                f"{args.monai_python}: no MONAI environment; create it with {MONAI_VENV_COMMAND}"
                " (or pass --monai-python, or --skip-monai)"
            )
        config = load_config(args.config, args.overrides)
        prepare_dataset(config.data, progress=not args.quiet)  # generate + convert once, before any clock runs
        from benchmarks.export_demo_npy import export_npy

        args.npy_dir = args.npy_dir or str(Path(config.data.dataset_dir).parent / "npy")
        export_npy(config.data.dataset_dir, args.npy_dir)
        protocol = monai_protocol_args(config)
        names = [MONAI] + names
    else:
        for arm in arms:
            prepare_dataset(load_config(arm["config"], arm["overrides"]).data, progress=not args.quiet)
    by_name = {a["name"]: a for a in arms}
    started = time.perf_counter()
    runs = {name: [] for name in names}
    total = len(names) * args.repeats
    env = dict(os.environ)
    monai_env = {**env, **dict(item.split("=", 1) for item in args.monai_env)}
    for repeat in range(1, args.repeats + 1):
        for name in names:
            run_dir = output / name / f"run{repeat}"
            done = sum(len(v) for v in runs.values()) + 1
            _say(
                args,
                f"[{done}/{total}] {name}, repeat {repeat}, up to {args.max_minutes:g} min "
                f"(log: {run_dir.with_suffix('.log')})",
            )
            cmd = (
                monai_command(args, run_dir, protocol)
                if name == MONAI
                else tfmis_command(by_name[name], run_dir, args.max_minutes)
            )
            process = run_arm(cmd, run_dir, args.quiet, monai_env if name == MONAI else env)
            stats = {**run_stats(read_history(run_dir), args.levels, process["cpu_by_epoch"]), **process}
            runs[name].append(stats)
            reached = ", ".join(f"{k}: {_seconds(v)}" for k, v in stats["time_to_dice"].items())
            _say(
                args,
                f"    {name}: best Dice {stats['best_dice']:.4f} in {stats['epochs']} epochs; time to Dice {reached}",
            )
    summaries = {name: arm_summary(r, args.levels) for name, r in runs.items()}
    result = {
        "config": args.config,
        "max_minutes": args.max_minutes,
        "repeats": args.repeats,
        "levels": sorted(float(x) for x in args.levels),
        "threads": args.threads,
        "monai_env": list(args.monai_env),
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": _device(args.threads),
        "arms": (
            [
                {
                    "name": MONAI,
                    "source": str(MONAI_SCRIPT.relative_to(REPO)),
                    "overrides": [*protocol, *args.monai_args],
                    "description": "MONAI 1.x UNet recipe in its own virtual environment",
                }
            ]
            if MONAI in names
            else []
        )
        + arms,
        "runs": runs,
        "summaries": summaries,
        "ratios": ratios(summaries, args.levels),
        "seconds": time.perf_counter() - started,
    }
    atomic_write_json(output / "time_to_dice.json", result)
    with atomic_writer(output / "time_to_dice.md") as f:
        f.write(render_markdown(result))
    plot(result, output / "time_to_dice.png")
    return result


def _say(args, message: str) -> None:
    if not args.quiet:
        print(message, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmarks/time_to_dice.py",
        description=__doc__.split("\n\n")[0],
        epilog="Writes time_to_dice.md, time_to_dice.json, time_to_dice.png and the run folders into --output.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default="configs/demo.yaml", help="tfmis config (its own arm; the recipes' base)")
    p.add_argument(
        "--recipe",
        action="append",
        default=[],
        metavar="YAML",
        help="another tfmis arm: a recipe file (description, config, set: [key=value, ...]); repeatable",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override for every tfmis arm, e.g. --set training.seed=1",
    )
    p.add_argument("--skip-config", action="store_true", help="run only the --recipe arms, not --config as is")
    p.add_argument("--max-minutes", type=float, default=4.0, help="wall-clock budget of every arm (default 4)")
    p.add_argument("--repeats", type=int, default=1, help="run the whole sequence of arms this many times")
    p.add_argument("--levels", type=float, nargs="+", default=list(DEFAULT_LEVELS), help="Dice levels to time")
    p.add_argument("--output", default=DEFAULT_OUTPUT, help=f"report and run folders (default {DEFAULT_OUTPUT})")
    p.add_argument("--skip-monai", action="store_true", help="tfmis arms only")
    p.add_argument(
        "--monai-python",
        default=str(DEFAULT_MONAI_PYTHON),
        help=f"python of the MONAI environment ({MONAI_VENV_COMMAND})",
    )
    p.add_argument(
        "--monai-arg",
        dest="monai_args",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for benchmarks/monai_demo.py, e.g. --monai-arg=--num-res-units=1",
    )
    p.add_argument(
        "--npy-dir",
        default=None,
        help="where the MONAI arm's volumes are exported (default: next to the config's data.dataset_dir, npy/)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads of the MONAI arm (default 2)")
    p.add_argument(
        "--monai-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable for the MONAI arm, e.g. OMP_WAIT_POLICY=PASSIVE on a machine shared "
        "with other work (PyTorch's OpenMP threads spin while waiting and collapse, 5-10x slower, "
        "when other processes hold the cores)",
    )
    p.add_argument("--quiet", action="store_true", help="no arm output on the terminal (it still goes to the logs)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.repeats < 1 or args.max_minutes <= 0:
        print("error: --repeats must be >= 1 and --max-minutes > 0", file=sys.stderr)
        return 2
    bad = [item for item in args.monai_env if "=" not in item or not item.split("=", 1)[0]]
    if bad:
        print(f"error: --monai-env takes KEY=VALUE, got {bad}", file=sys.stderr)
        return 2
    try:
        result = run_benchmark(args)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(render_markdown(result))
    print(f"Results in {args.output}: time_to_dice.md, time_to_dice.json, time_to_dice.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
