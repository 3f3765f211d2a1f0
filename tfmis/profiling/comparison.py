"""Comparing the two arms of the regular-vs-fast benchmark (`tfmis.benchmark`) from their run folders: epoch
time, images/s, input wait and time to each Dice threshold from `history.jsonl`, the speed-up ratios,
`benchmark.md` and the PNGs. Reads files only: no TensorFlow, no training.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tfmis.errors import MissingInput
from tfmis.utils.io import atomic_writer

ARMS = ("regular", "fast")
PNGS = ("curves_vs_epoch.png", "curves_vs_time.png", "epoch_time.png", "time_to_dice.png")
COLORS = {"regular": "tab:red", "fast": "tab:blue"}


def read_history(run_dir) -> list[dict]:
    """The epoch records of a run folder's `history.jsonl`."""
    path = Path(run_dir) / "history.jsonl"
    if not path.is_file():
        raise MissingInput(f"{path}: not found; did the arm's training run (see {Path(run_dir)}.log)?")
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
            f"({budget}) and the same images per epoch"
            + (
                ", each fitting its learning-rate schedule to the budget from its own epoch time (the slower arm "
                "trains fewer epochs, both schedules end)"
                if t["max_minutes"]
                else ""
            )
            + f". regular: NIfTI decoded and preprocessed on every read, no "
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
