"""Regular vs fast training: MONAI's fast-training notebook, in TensorFlow (`python -m tfmis.benchmark`,
`tfmis-benchmark`, `tools/benchmark.py`).

The same network is trained on the same data twice, each arm in its own subprocess (fresh TensorFlow
state) through the real `tfmis.engine.trainer.Trainer`, with the same wall-clock budget
(`training.max_minutes`) and the same images per epoch:

- **regular** (`tfmis.data.regular`): every volume decoded from its NIfTI files and preprocessed again
  on every read (serial `tf.py_function`), no cache, no prefetch; float32, batch 1, Dice loss, Adam
  (`REGULAR_OVERRIDES`), the config's crops, augmentation, model and learning-rate schedule.
- **fast** (`tfmis.data.pipeline`): the config as it is: TFRecords, cache, parallel crops, prefetch,
  its own precision, loss, optimizer and batch size (e.g. a `python -m tfmis.tune fit` result).

Both validate the same way (sliding window on the converted validation volumes). The report compares
their `history.jsonl`: epoch time, images/s, data-wait share, and the wall time to each
`training.dice_thresholds` mean Dice, as ratios regular / fast; `--pipeline-only` times the two input
pipelines without a model.

Outputs in `--output` (default `runs/benchmark`): `regular/` and `fast/` (the two run folders, with
their `.log`), `curves_vs_epoch.png`, `curves_vs_time.png`, `epoch_time.png`, `time_to_dice.png`,
`benchmark.md`, `benchmark.json`.

Example:
```bash
python tools/benchmark.py --config configs/demo.yaml                  # about 10 minutes on 2 CPU cores
python tools/benchmark.py --config configs/demo.yaml --pipeline-only  # input pipelines only, about 1 minute
```
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tfmis.utils.io import atomic_write_json, atomic_writer

ARMS = ("regular", "fast")
DEFAULT_OUTPUT = "runs/benchmark"
DEFAULT_MAX_MINUTES = 4.0
# a typical first TensorFlow implementation (DistMIS-like; MONAI's notebook's regular arm): float32, batch 1,
# plain Dice loss, Adam; the NIfTI pipeline of tfmis.data.regular replaces the TFRecord one (nothing cached)
REGULAR_OVERRIDES = (
    "pipeline.num_images_per_batch=1",
    "pipeline.cache=none",
    "training.precision=float32",
    "training.accumulation_steps=1",
    "training.jit_compile=false",
    "loss.name=dice",
    "optimizer.name=adam",
    "optimizer.weight_decay=0.0",
    "optimizer.clipnorm=null",
)
PNGS = ("curves_vs_epoch.png", "curves_vs_time.png", "epoch_time.png", "time_to_dice.png")
ARM_FILE = "arm.json"
COLORS = {"regular": "tab:red", "fast": "tab:blue"}


# ---------------------------------------------------------------- the two arms' configs


def arm_config(config_path, overrides, arm: str, output_dir, max_minutes: float | None = None, regular_overrides=()):
    """The training config of one arm.

    Args:
        config_path: the YAML config (both arms start from it).
        overrides: `key=value` strings applied to both arms.
        arm: `regular` or `fast`.
        output_dir: the arm's run folder (`output.dir`).
        max_minutes: wall-clock budget (`training.max_minutes`); None or 0 = the config's epochs only.
        regular_overrides: `key=value` strings applied to the regular arm after `REGULAR_OVERRIDES`.

    Returns:
        A `tfmis.config.Config`. The regular arm keeps the fast arm's images per epoch: an explicit
        `training.steps_per_epoch` is multiplied by the fast arm's batch (per replica x accumulation).

    Example:
    ```python
    config = arm_config("configs/demo.yaml", [], "regular", "runs/benchmark/regular", max_minutes=4)
    ```
    """
    from tfmis.config import load_config

    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    budget = [f"training.max_minutes={max_minutes}" if max_minutes else "training.max_minutes=null"]
    common = [*overrides, f"output.dir={output_dir}", *budget]
    if arm == "fast":
        return load_config(config_path, common)
    base = load_config(config_path, common)
    extra = list(REGULAR_OVERRIDES)
    if base.training.steps_per_epoch:
        fast_batch = base.pipeline.num_images_per_batch * base.training.accumulation_steps
        extra.append(f"training.steps_per_epoch={base.training.steps_per_epoch * fast_batch}")
    return load_config(config_path, [*common, *extra, *regular_overrides])


def train_dataset_fn(arm: str):
    """The `Trainer(train_dataset_fn=...)` of an arm."""
    if arm == "regular":
        from tfmis.data.regular import build_regular_train_dataset

        return build_regular_train_dataset
    from tfmis.data.pipeline import build_train_dataset

    return build_train_dataset


def run_arm(config, arm: str) -> dict:
    """Trains one arm in this process with the real `Trainer` and writes `arm.json` into its run folder.

    Args:
        config: from `arm_config`.
        arm: `regular` or `fast`.

    Returns:
        The arm record: the Trainer's summary, steps per epoch, global batch, parameter count,
        setup seconds (Trainer construction) and fit seconds.
    """
    process_start = time.perf_counter()
    from tfmis.engine.distribution import make_backend

    backend = make_backend(config.runtime, output_dir=config.output.dir)  # before anything touches devices
    from tfmis.engine.trainer import Trainer

    trainer = Trainer(config, backend=backend, train_dataset_fn=train_dataset_fn(arm))
    tc = config.training
    budget = f"{tc.max_minutes:g} min" if tc.max_minutes else "no time limit"
    print(
        f"{arm} arm: {trainer.model.count_params():,} parameters, global batch {trainer.global_batch}, "
        f"{trainer.steps_per_epoch} steps/epoch, precision {tc.precision}, loss {config.loss.name}, optimizer "
        f"{config.optimizer.name}, cache {config.pipeline.cache}, up to {tc.epochs} epochs or {budget}",
        file=sys.stderr,
        flush=True,
    )
    fit_start = time.perf_counter()
    summary = trainer.fit(resume=False)
    record = {
        "arm": arm,
        "summary": summary,
        "steps_per_epoch": trainer.steps_per_epoch,
        "global_batch": trainer.global_batch,
        "parameters": int(trainer.model.count_params()),
        "setup_seconds": fit_start - process_start,
        "fit_seconds": time.perf_counter() - fit_start,
        "settings": {
            "precision": tc.precision,
            "loss": config.loss.name,
            "optimizer": config.optimizer.name,
            "batch": config.pipeline.num_images_per_batch,
            "cache": config.pipeline.cache,
            "max_minutes": tc.max_minutes,
            "epochs": tc.epochs,
        },
    }
    atomic_write_json(Path(config.output.dir) / ARM_FILE, record)
    return record


# ---------------------------------------------------------------- input pipelines alone


def measure_pipeline(dataset_fn, config, epoch_batches: int, timed_batches: int) -> dict:
    """Times a training input pipeline without a model.

    The pipeline is built fresh (an empty cache), its first batch timed (`first_batch_seconds`: cold
    cache), then the rest of its first epoch (`first_epoch_seconds`, `epoch_batches` batches in all:
    the warm-up, which fills a cache), then `timed_batches` more batches: the steady state.

    Returns:
        dict with `batch_size`, `first_batch_seconds`, `first_epoch_seconds`, `epoch_batches`,
        `timed_batches`, `timed_images`, `timed_seconds`, `samples_per_second` (steady state).
    """
    start = time.perf_counter()
    iterator = iter(dataset_fn(config, None, 0))
    batch_size = int(next(iterator)[0].shape[0])
    first_batch = time.perf_counter() - start
    for _ in range(epoch_batches - 1):
        next(iterator)
    first_epoch = time.perf_counter() - start
    t0, images = time.perf_counter(), 0
    for _ in range(timed_batches):
        images += int(next(iterator)[0].shape[0])
    seconds = time.perf_counter() - t0
    return {
        "batch_size": batch_size,
        "first_batch_seconds": first_batch,
        "first_epoch_seconds": first_epoch,
        "epoch_batches": epoch_batches,
        "timed_batches": timed_batches,
        "timed_images": images,
        "timed_seconds": seconds,
        "samples_per_second": images / max(seconds, 1e-9),
    }


def pipeline_benchmark(configs: dict, batches: int | None = None, scratch_dir=None, progress: bool = True) -> dict:
    """Samples/s of the regular and the fast input pipelines (no model), one after the other.

    Args:
        configs: {"regular": Config, "fast": Config} from `arm_config`.
        batches: timed batches per pipeline after its first (warm-up) epoch; None = two epochs' worth.
        scratch_dir: where a `pipeline.cache: file` fast pipeline writes a fresh (cold) cache, removed after.

    Returns:
        {"regular": measurement, "fast": measurement, "samples_per_second_ratio": fast / regular}
        (measurements from `measure_pipeline`, plus `steps_per_epoch` and `cache`).
    """
    import dataclasses

    from tfmis.data.pipeline import train_steps_per_epoch

    out = {}
    for arm in ARMS:
        config = configs[arm]
        scratch = None
        if config.pipeline.cache == "file":  # a cold cache: not the one earlier runs left in cache_dir
            scratch = Path(scratch_dir or ".") / "pipeline_cache"
            shutil.rmtree(scratch, ignore_errors=True)
            config = dataclasses.replace(config, pipeline=dataclasses.replace(config.pipeline, cache_dir=str(scratch)))
        steps = train_steps_per_epoch(config)
        timed = batches or 2 * steps
        if progress:
            print(
                f"input pipeline {arm}: 1 warm-up epoch ({steps} batches), then {timed} timed batches",
                file=sys.stderr,
                flush=True,
            )
        try:
            out[arm] = {
                **measure_pipeline(train_dataset_fn(arm), config, steps, timed),
                "steps_per_epoch": steps,
                "cache": "none (NIfTI read every time)" if arm == "regular" else config.pipeline.cache,
            }
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        if progress:
            m = out[arm]
            print(
                f"  {m['samples_per_second']:.2f} samples/s (first batch {m['first_batch_seconds']:.2f} s, first "
                f"epoch {m['first_epoch_seconds']:.2f} s)",
                file=sys.stderr,
                flush=True,
            )
    out["samples_per_second_ratio"] = out["fast"]["samples_per_second"] / max(
        out["regular"]["samples_per_second"], 1e-12
    )
    return out


# ---------------------------------------------------------------- comparing the arms' histories


def read_history(run_dir) -> list[dict]:
    """The epoch records of a run folder's `history.jsonl`."""
    path = Path(run_dir) / "history.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; did the arm's training run (see {Path(run_dir)}.log)?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def arm_stats(records: list[dict], thresholds) -> dict:
    """The numbers the report compares, from one arm's epoch records.

    Epoch time is the time of an epoch's steps (data wait + compute, no validation), and images/s the
    history's per-epoch figure; both are means over epochs 2..N (epoch 1 includes graph tracing and a
    cold cache), or epoch 1 alone for a one-epoch run. The data-wait share is over all epochs. Time to
    a Dice threshold is `elapsed_seconds` (training and validation since the run started) of the
    first validation at or above it, None if never reached.
    """
    if not records:
        raise ValueError("no epoch records: the arm trained no epoch")
    steady = records[1:] or records
    wait = sum(r["data_wait_seconds"] for r in records)
    busy = sum(r["data_wait_seconds"] + r["compute_seconds"] for r in records)
    dice = [r["val_mean_dice"] for r in records if _finite(r.get("val_mean_dice"))]
    reached = {}
    for t in sorted(float(t) for t in thresholds):
        hit = next((r for r in records if _finite(r.get("val_mean_dice")) and r["val_mean_dice"] >= t), None)
        reached[f"{t:.2f}"] = None if hit is None else {"epoch": hit["epoch"], "seconds": hit["elapsed_seconds"]}
    return {
        "epochs": len(records),
        "steady_epochs": [r["epoch"] for r in steady],
        "epoch_seconds": _mean(r["data_wait_seconds"] + r["compute_seconds"] for r in steady),
        "epoch_seconds_with_validation": _mean(r["epoch_seconds"] for r in steady),
        "images_per_second": _mean(r["images_per_second"] for r in steady),
        "data_wait_share": wait / max(busy, 1e-12),
        "elapsed_seconds": records[-1]["elapsed_seconds"],
        "best_mean_dice": max(dice) if dice else None,
        "time_to_dice": reached,
    }


def compare(stats: dict) -> dict:
    """Speed-up ratios of the fast arm over the regular one (>1: fast is faster).

    Args:
        stats: {"regular": arm_stats(...), "fast": arm_stats(...)}.

    Returns:
        {"epoch_time": regular / fast epoch seconds, "images_per_second": fast / regular,
         "time_to_dice": {threshold: regular / fast seconds, for the thresholds both reached}}
    """
    r, f = stats["regular"], stats["fast"]
    return {
        "epoch_time": r["epoch_seconds"] / max(f["epoch_seconds"], 1e-12),
        "images_per_second": f["images_per_second"] / max(r["images_per_second"], 1e-12),
        "time_to_dice": {
            t: r["time_to_dice"][t]["seconds"] / max(f["time_to_dice"][t]["seconds"], 1e-12)
            for t in r["time_to_dice"]
            if r["time_to_dice"][t] and f["time_to_dice"][t]
        },
    }


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# ---------------------------------------------------------------- report


def render_markdown(result: dict) -> str:
    """`benchmark.md`: the training comparison (if run) and the input-pipeline comparison (if run)."""
    lines = [
        "# Regular vs fast training",
        "",
        f"Config `{result['config']}`"
        + (f" with `{' '.join(result['overrides'])}`" if result["overrides"] else "")
        + f"; measured {result['created']} on {result['device']}.",
        "",
    ]
    if "training" in result:
        t = result["training"]
        s, ratio = t["stats"], t["ratios"]
        arms = t["arms"]
        budget = f"{t['max_minutes']:g} min" if t["max_minutes"] else "no time limit"
        lines += [
            "## Training",
            "",
            f"Each arm trained in its own process through `tfmis.engine.trainer.Trainer` with the same budget "
            f"({budget}) and the same images per epoch. regular: NIfTI decoded and preprocessed on every read, no "
            f"cache, {_settings(arms['regular'])}. fast: TFRecords + cache + prefetch, {_settings(arms['fast'])}. "
            "Epoch time = data wait + compute of an epoch's steps (no validation), mean over epochs 2..N; "
            "time to Dice = wall time since the start of training (validation included) to the first validation "
            "at or above the threshold.",
            "",
            "| | regular | fast | speed-up (fast vs regular) |",
            "| --- | ---: | ---: | ---: |",
            f"| epochs trained (stop reason) | {s['regular']['epochs']} ({_stop(arms['regular'])}) "
            f"| {s['fast']['epochs']} ({_stop(arms['fast'])}) | |",
            f"| epoch time, s | {s['regular']['epoch_seconds']:.2f} | {s['fast']['epoch_seconds']:.2f} "
            f"| {ratio['epoch_time']:.2f}x |",
            f"| images/s | {s['regular']['images_per_second']:.2f} | {s['fast']['images_per_second']:.2f} "
            f"| {ratio['images_per_second']:.2f}x |",
            f"| data-wait share of step time | {100 * s['regular']['data_wait_share']:.1f}% "
            f"| {100 * s['fast']['data_wait_share']:.1f}% | |",
            f"| best validation mean Dice | {_dice(s['regular']['best_mean_dice'])} "
            f"| {_dice(s['fast']['best_mean_dice'])} | |",
            f"| training wall time, s | {s['regular']['elapsed_seconds']:.1f} | {s['fast']['elapsed_seconds']:.1f} | |",
        ]
        for threshold in s["fast"]["time_to_dice"]:
            cells = []
            for arm in ARMS:
                hit = s[arm]["time_to_dice"][threshold]
                cells.append(
                    f"{hit['seconds']:.1f} (epoch {hit['epoch']})"
                    if hit
                    else f"not reached ({s[arm]['epochs']} epochs)"
                )
            speed = f"{ratio['time_to_dice'][threshold]:.2f}x" if threshold in ratio["time_to_dice"] else "-"
            lines.append(f"| time to mean Dice >= {threshold}, s | {cells[0]} | {cells[1]} | {speed} |")
        lines += ["", "Plots: " + ", ".join(f"`{p}`" for p in PNGS) + "; run folders `regular/`, `fast/`.", ""]
    if "pipeline" in result:
        p = result["pipeline"]
        r, f = p["regular"], p["fast"]
        lines += [
            "## Input pipelines alone (no model)",
            "",
            "Each pipeline built fresh (cold cache), its first epoch of batches as warm-up, then the timed batches.",
            "",
            "| | regular | fast | speed-up (fast vs regular) |",
            "| --- | ---: | ---: | ---: |",
            f"| samples/s (steady state) | {r['samples_per_second']:.2f} | {f['samples_per_second']:.2f} "
            f"| {p['samples_per_second_ratio']:.2f}x |",
            f"| timed batches x batch size | {r['timed_batches']} x {r['batch_size']} "
            f"| {f['timed_batches']} x {f['batch_size']} | |",
            f"| time to first batch (cold), s | {r['first_batch_seconds']:.2f} | {f['first_batch_seconds']:.2f} | |",
            f"| first epoch (cold), s | {r['first_epoch_seconds']:.2f} ({r['epoch_batches']} batches) "
            f"| {f['first_epoch_seconds']:.2f} ({f['epoch_batches']} batches) | |",
            f"| cache | {r['cache']} | {f['cache']} | |",
            "",
        ]
    return "\n".join(lines)


def _settings(arm: dict) -> str:
    s = arm["settings"]
    return (
        f"{s['precision']}, batch {s['batch']} ({arm['global_batch']} global), {s['loss']} loss, "
        f"{s['optimizer']}, {arm['steps_per_epoch']} steps/epoch"
    )


def _stop(arm: dict) -> str:
    return arm["summary"].get("stop_reason", "?")


def _dice(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def plot_all(histories: dict, stats: dict, output_dir) -> list[Path]:
    """Writes the four comparison PNGs (`PNGS`) into `output_dir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(output_dir)
    paths = []
    for x_key, name, xlabel in (("epoch", PNGS[0], "epoch"), ("elapsed_seconds", PNGS[1], "wall time (s)")):
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        for arm in ARMS:
            records = histories[arm]
            axes[0].plot(
                [r[x_key] for r in records],
                [r["train_loss"] for r in records],
                "-o",
                ms=3,
                color=COLORS[arm],
                label=f"{arm} ({stats[arm]['loss']} loss)",
            )
            val = [r for r in records if _finite(r.get("val_mean_dice"))]
            axes[1].plot(
                [r[x_key] for r in val], [r["val_mean_dice"] for r in val], "-o", ms=4, color=COLORS[arm], label=arm
            )
        for t in stats["fast"]["time_to_dice"]:
            axes[1].axhline(float(t), color="grey", lw=0.6, ls=":")
        axes[0].set(title="training loss (each arm's own loss)", xlabel=xlabel)
        axes[1].set(title="validation mean Dice", xlabel=xlabel, ylim=(0, 1))
        for ax in axes:
            ax.legend(fontsize=8)
        paths.append(_save(fig, out / name))

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    for arm in ARMS:
        records = histories[arm]
        epochs = [r["epoch"] for r in records]
        axes[0].plot(
            epochs,
            [r["data_wait_seconds"] + r["compute_seconds"] for r in records],
            "-o",
            ms=3,
            color=COLORS[arm],
            label=f"{arm}: steps",
        )
        axes[0].plot(
            epochs,
            [r["data_wait_seconds"] for r in records],
            "--",
            color=COLORS[arm],
            label=f"{arm}: of which waiting for input",
        )
    axes[0].set(title="time per epoch (s), validation excluded", xlabel="epoch", ylim=(0, None))
    axes[0].legend(fontsize=8)
    for i, arm in enumerate(ARMS):
        total = stats[arm]["epoch_seconds"]
        wait = total * _steady_wait_share(histories[arm])
        axes[1].bar(i, total - wait, color=COLORS[arm], label="compute" if i == 0 else None)
        axes[1].bar(
            i,
            wait,
            bottom=total - wait,
            color=COLORS[arm],
            alpha=0.35,
            hatch="//",
            label="waiting for input" if i == 0 else None,
        )
        axes[1].text(i, total, f"{total:.2f} s", ha="center", va="bottom")
    axes[1].set(title="mean epoch time, epochs 2..N (s)", xticks=[0, 1], xticklabels=list(ARMS))
    axes[1].set_ylim(0, axes[1].get_ylim()[1] * 1.2)  # room for the labels and the legend
    axes[1].legend(fontsize=8, loc="upper right")
    paths.append(_save(fig, out / PNGS[2]))

    thresholds = list(stats["fast"]["time_to_dice"])
    fig, ax = plt.subplots(figsize=(max(6, 2 + 1.6 * len(thresholds)), 4.5))
    width = 0.38
    for j, arm in enumerate(ARMS):
        for i, t in enumerate(thresholds):
            hit = stats[arm]["time_to_dice"][t]
            x = i + (j - 0.5) * width
            if hit:
                ax.bar(x, hit["seconds"], width, color=COLORS[arm], label=arm if i == 0 else None)
                ax.text(x, hit["seconds"], f"{hit['seconds']:.0f} s", ha="center", va="bottom", fontsize=8)
            else:  # not reached: a hatched outline up to the arm's whole training time
                ax.bar(
                    x,
                    stats[arm]["elapsed_seconds"],
                    width,
                    fill=False,
                    edgecolor=COLORS[arm],
                    hatch="//",
                    label=arm if i == 0 else None,
                )
                ax.text(x, stats[arm]["elapsed_seconds"], "not\nreached", ha="center", va="bottom", fontsize=8)
    ax.set(
        title="wall time to reach a validation mean Dice (s); hatched: not reached in the arm's training time",
        xticks=range(len(thresholds)),
        xticklabels=[f">= {t}" for t in thresholds],
    )
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)  # room for the labels
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / PNGS[3]))
    return paths


def _steady_wait_share(records: list[dict]) -> float:
    steady = records[1:] or records
    busy = sum(r["data_wait_seconds"] + r["compute_seconds"] for r in steady)
    return sum(r["data_wait_seconds"] for r in steady) / max(busy, 1e-12)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with atomic_writer(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return path


def _device() -> str:
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            names = [tf.config.experimental.get_device_details(g).get("device_name", g.name) for g in gpus]
            return f"{len(gpus)} GPU(s) ({', '.join(names)}), {os.cpu_count()} CPU cores"
    except Exception:  # the device line is informative only
        pass
    return f"CPU only ({cpu}, {os.cpu_count()} cores)"


# ---------------------------------------------------------------- the whole benchmark


def _prepare_arm_dir(path: Path) -> None:
    """Removes an earlier benchmark's run folder of an arm; refuses to delete anything else."""
    if not path.exists():
        return
    known = {"config.yaml", "history.jsonl", ARM_FILE, "checkpoints", "training_data.json"}
    entries = {p.name for p in path.iterdir()}
    if entries and not entries & known:
        raise ValueError(f"{path} exists and is not a run folder of an earlier benchmark: choose another --output")
    shutil.rmtree(path)


def _spawn_arm(args, arm: str, output: Path) -> int:
    """Runs one arm in a fresh `python -m tfmis.benchmark --arm ...` process; its output goes to the
    terminal and to `<output>/<arm>.log`."""
    cmd = [
        sys.executable,
        "-m",
        "tfmis.benchmark",
        "--arm",
        arm,
        "--config",
        args.config,
        "--output",
        str(output),
        "--max-minutes",
        str(args.max_minutes),
    ]
    for override in args.overrides:
        cmd += ["--set", override]
    for override in args.regular_overrides:
        cmd += ["--regular-set", override]
    log = output / f"{arm}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        while chunk := proc.stdout.read1(1 << 14):
            f.write(chunk)
            f.flush()
            if not args.quiet:
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()
        return proc.wait()


def run_benchmark(args) -> dict:
    """Both arms (unless `--pipeline-only`), then the input pipelines alone (unless `--skip-pipeline`);
    writes benchmark.json, benchmark.md and the PNGs into `args.output` and returns the result."""
    import datetime

    from tfmis.config import load_config
    from tfmis.data.prepare import prepare_dataset

    config = load_config(args.config, args.overrides)  # config errors before anything runs
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    prepare_dataset(config.data, progress=not args.quiet)  # generates / converts once, for both arms
    result = {
        "config": args.config,
        "overrides": list(args.overrides),
        "regular_overrides": [*REGULAR_OVERRIDES, *args.regular_overrides],
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": None,
    }
    started = time.perf_counter()
    if not args.pipeline_only:
        arms, histories, stats = {}, {}, {}
        for i, arm in enumerate(ARMS, 1):
            folder = output / arm
            _prepare_arm_dir(folder)
            _say(args, f"[{i}/2] {arm} arm, up to {args.max_minutes:g} min (log: {output / f'{arm}.log'})")
            t0 = time.perf_counter()
            code = _spawn_arm(args, arm, output)
            if code != 0:
                raise RuntimeError(
                    f"the {arm} arm failed (exit status {code}); its output is in {output / f'{arm}.log'}"
                )
            arms[arm] = {**json.loads((folder / ARM_FILE).read_text()), "process_seconds": time.perf_counter() - t0}
            histories[arm] = read_history(folder)
            stats[arm] = {
                **arm_stats(histories[arm], config.training.dice_thresholds),
                "loss": arms[arm]["settings"]["loss"],
            }
        result["training"] = {
            "max_minutes": args.max_minutes or None,
            "arms": arms,
            "stats": stats,
            "ratios": compare(stats),
        }
        plot_all(histories, stats, output)
    if args.pipeline_only or not args.skip_pipeline:
        _say(args, "input pipelines alone (no model)")
        configs = {
            arm: arm_config(args.config, args.overrides, arm, output / arm, None, args.regular_overrides)
            for arm in ARMS
        }
        result["pipeline"] = pipeline_benchmark(configs, args.pipeline_batches, output, progress=not args.quiet)
    result["device"] = _device()
    result["seconds"] = time.perf_counter() - started
    atomic_write_json(output / "benchmark.json", result)
    with atomic_writer(output / "benchmark.md") as f:
        f.write(render_markdown(result))
    return result


def _say(args, message: str) -> None:
    if not args.quiet:
        print(message, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tools/benchmark.py",
        description="Regular vs fast training (MONAI's fast-training notebook, in TensorFlow): train the config's "
        "network twice with the same time budget, once with a regular input pipeline (NIfTI decoded and "
        "preprocessed on every read, no cache, float32, batch 1, Dice loss, Adam) and once with the fast "
        "one (TFRecords, cache, prefetch, the config's precision, loss, optimizer and batch), and compare "
        "epoch time, images/s, input wait and time to each Dice threshold.",
        epilog="Writes benchmark.md, benchmark.json, curves_vs_epoch.png, curves_vs_time.png, epoch_time.png, "
        "time_to_dice.png and the two run folders regular/ and fast/ into --output. Exit status 0 done, "
        "1 an arm or the data failed, 2 bad config or arguments.",
    )
    p.add_argument("--config", required=True, help="training YAML config, e.g. configs/demo.yaml")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=DEFAULT_MAX_MINUTES,
        help=f"wall-clock budget of each arm's training (training.max_minutes; default "
        f"{DEFAULT_MAX_MINUTES:g}); 0 = the config's epochs, however long",
    )
    p.add_argument("--output", default=DEFAULT_OUTPUT, help=f"output folder (default {DEFAULT_OUTPUT})")
    p.add_argument(
        "--pipeline-only",
        action="store_true",
        help="time the two input pipelines without a model (samples/s, cold first batch and epoch)",
    )
    p.add_argument("--skip-pipeline", action="store_true", help="after training, do not time the pipelines alone")
    p.add_argument(
        "--pipeline-batches",
        type=int,
        default=None,
        help="timed batches per pipeline after a warm-up epoch (default: two epochs' worth)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for both arms, e.g. --set training.epochs=20",
    )
    p.add_argument(
        "--regular-set",
        dest="regular_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for the regular arm only, after its defaults (" + ", ".join(REGULAR_OVERRIDES) + ")",
    )
    p.add_argument("--quiet", action="store_true", help="no progress output (the arms' logs are still written)")
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # internal: train one arm in this process
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from tfmis.config import ConfigError

    if args.max_minutes < 0 or (args.pipeline_batches is not None and args.pipeline_batches < 1):
        print("error: --max-minutes must be >= 0 and --pipeline-batches >= 1", file=sys.stderr)
        return 2
    try:
        if args.arm:  # one arm, in this (fresh) process; --output is the benchmark's folder
            config = arm_config(
                args.config,
                args.overrides,
                args.arm,
                Path(args.output) / args.arm,
                args.max_minutes,
                args.regular_overrides,
            )
            run_arm(config, args.arm)
            return 0
        result = run_benchmark(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, KeyError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(render_markdown(result))
    print(
        f"Results in {args.output}: benchmark.md, benchmark.json"
        + ("" if args.pipeline_only else ", " + ", ".join(PNGS) + ", regular/, fast/")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
