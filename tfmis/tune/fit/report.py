"""What a person reads after a GPU-fit search: one line per trial, the table, and the memory plot."""

from __future__ import annotations

from pathlib import Path

from tfmis.tune.fit.memory import model_parallel_of, train_line_name, validation_line_name
from tfmis.utils.table import text_table

VALUE_LABELS = (
    ("num_images_per_batch", "batch"),
    ("num_sw_batch_size", "sw batch"),
    ("validation_data_device", "placement"),
    ("recompute", "recompute"),
    ("model_parallel", "model parallel"),
)


def _mb(value) -> str:
    return f"{value:.0f}" if value else "-"


def measurement_status(record: dict, budget_mb: float) -> str:
    """A trial's status column: ok (chosen), pruned: reason, skipped: reason, FAILED: reason, over the margin."""
    if record["status"] in ("pruned", "skipped"):
        return f"{record['status']}: {record['reason']}"
    if record["status"] == "failed":
        return f"FAILED: {record['reason']}"
    if not record.get("within_margin", True):
        return f"ok, but peak over the safety margin ({record['peak_mb'] / budget_mb:.0%} of the budget)"
    return "ok (chosen)" if record.get("chosen") else "ok"


def trial_line(record: dict, budget_mb: float) -> str:
    """One trial as a line, printed as the search goes."""
    v = record["values"]
    parts = [
        f"trial {record['trial']:>3}",
        f"batch {v['num_images_per_batch']:>2}",
        f"sw {v['num_sw_batch_size']:>2}",
        f"{v['validation_data_device']:<11}",
        f"recompute {'on ' if v['recompute'] else 'off'}",
        f"model parallel {model_parallel_of(v):<10}",
    ]
    if record["status"] == "ok":
        parts.append(
            f"{record['images_per_second']:.1f} img/s, sw {record['sw_seconds']:.2f} s, "
            f"peak {record['peak_mb']:.0f} MB, epoch {record['epoch_seconds']:.1f} s"
        )
    parts.append(measurement_status(record, budget_mb))
    return "  ".join(parts)


def trials_table(report: dict) -> str:
    """The readable table: every trial with its values, measurements, prediction and status."""
    budget = report["budget_mb"]
    header = (
        "trial",
        "batch",
        "sw batch",
        "placement",
        "recompute",
        "model parallel",
        "img/s",
        "step s",
        "sw s",
        "peak MB",
        "predicted MB",
        "epoch s",
        "status",
    )
    rows = [header]
    for r in report["trials"]:
        v = r["values"]
        ok = r["status"] == "ok"
        rows.append(
            (
                str(r["trial"]),
                str(v["num_images_per_batch"]),
                str(v["num_sw_batch_size"]),
                v["validation_data_device"],
                "on" if v["recompute"] else "off",
                model_parallel_of(v),
                f"{r['images_per_second']:.2f}" if r.get("images_per_second") else "-",
                f"{r['step_seconds']:.3f}" if r.get("step_seconds") else "-",
                f"{r['sw_seconds']:.2f}" if ok else "-",
                _mb(r.get("peak_mb")),
                _mb(r.get("predicted_peak_mb")),
                f"{r['epoch_seconds']:.1f}" if ok else "-",
                measurement_status(r, budget),
            )
        )
    lines = text_table(rows)
    c = report["counts"]
    skipped = f", {c['skipped']} skipped (cannot run here)" if c.get("skipped") else ""
    lines.append(
        f"{c['run']} trials run ({c['ok']} ok, {c['failed']} failed), {c['pruned']} pruned by the memory "
        f"model{skipped}; budget {budget:.0f} MB on {report['device']['name']} ({report['device']['kind']})"
        + ("; read from the cache" if report["cache"]["hit"] else "")
    )
    chosen = report["chosen"]
    if chosen:
        v = chosen["values"]
        lines.append(
            f"chosen: trial {chosen['trial']}: batch {v['num_images_per_batch']}, sw batch "
            f"{v['num_sw_batch_size']}, placement {v['validation_data_device']}, recompute "
            f"{'on' if v['recompute'] else 'off'}, model parallel {model_parallel_of(v)}: "
            f"{chosen['images_per_second']:.2f} img/s, "
            f"{chosen['sw_seconds']:.2f} s per sliding window, peak {chosen['peak_mb']:.0f} MB "
            f"({chosen['peak_mb'] / budget:.0%} of the budget), estimated {chosen['epoch_seconds']:.1f} s/epoch"
        )
    else:
        lines.append("chosen: none (no configuration within the safety margin)")
    return "\n".join(lines)


def plot_memory(report: dict, path: str | Path) -> Path:
    """memory.png: measured peak vs batch size (per recompute and model-parallel setting) and vs sw batch size
    (per placement and model-parallel setting), the fitted lines of the memory model, the budget and the safety
    margin; failures marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tfmis.utils.io import atomic_writer

    budget, margin = report["budget_mb"], report["memory_margin"]
    trials = [t for t in report["trials"] if t["status"] != "skipped"]  # skipped: nothing measured
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    panels = (
        ("num_images_per_batch", "train_peak_mb", "training", "batch size (per replica)", "recompute"),
        (
            "num_sw_batch_size",
            "validation_peak_mb",
            "validation",
            "sliding-window batch size",
            "validation_data_device",
        ),
    )
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (x_key, y_key, phase, xlabel, group_key) in zip(axes, panels):

        def group_of(t, group_key=group_key):  # one colour (and one memory-model line) per group
            return str(t["values"][group_key]), model_parallel_of(t["values"])

        groups = sorted({group_of(t) for t in trials})
        several_mp = len({mp for _, mp in groups}) > 1
        for colour, (group, model_parallel) in zip(colours, groups):
            members = [t for t in trials if group_of(t) == (group, model_parallel)]
            label = f"{group_key.replace('validation_data_device', 'placement')}={group}"
            if several_mp:
                label += f", model parallel {model_parallel}"
            ok = [t for t in members if t.get(y_key) and t.get("failed_phase") != phase]
            ax.scatter(
                [t["values"][x_key] for t in ok], [t[y_key] for t in ok], color=colour, label=f"{label} measured"
            )
            failed = [t for t in members if t["status"] == "failed" and t.get("failed_phase") == phase]
            ax.scatter(
                [t["values"][x_key] for t in failed],
                [budget] * len(failed),
                color=colour,
                marker="x",
                s=60,
                label=f"{label} failed (out of memory / over budget)" if failed else None,
            )
            # a pruned candidate belongs to the phase its reason names (validation), else to training
            pruned = [
                t
                for t in members
                if t["status"] == "pruned" and ("in validation" in (t["reason"] or "")) == (phase == "validation")
            ]
            ax.scatter(
                [t["values"][x_key] for t in pruned],
                [t.get("predicted_peak_mb") or budget for t in pruned],
                facecolors="none",
                edgecolors=colour,
                marker="o",
                s=50,
                label=f"{label} pruned (predicted)" if pruned else None,
            )
            line = report["memory_model"]["lines"].get(
                train_line_name(group == "True", model_parallel)
                if phase == "training"
                else validation_line_name(group, model_parallel)
            )
            xs = [t["values"][x_key] for t in members]
            if line and xs:
                grid = [min(xs), max(xs)]
                ax.plot(
                    grid,
                    [line["intercept_mb"] + line["slope_mb"] * g for g in grid],
                    color=colour,
                    linestyle="--",
                    label=f"{label} fitted line",
                )
        ax.axhline(budget, color="black", linewidth=1.2, label=f"budget {budget:.0f} MB")
        ax.axhline(margin * budget, color="grey", linestyle=":", label=f"{margin:.0%} margin")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"peak memory in {phase} (MB)")
        ax.set_title(f"{phase}: measured peak memory")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"GPU-fit search on {report['device']['name']} ({report['device']['kind']})")
    fig.tight_layout()
    with atomic_writer(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return Path(path)
