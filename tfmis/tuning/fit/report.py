"""What a GPU-fit search reports: one line per trial as it goes, the report (fit_report.json) and the fitted config
(fit.yaml) it writes, the table, and the memory plot (memory.png).

- `trial_line`, `update_progress`: a trial's line and the progress bar's, while the search runs;
- `search_report`: the report of a search (its trials, counts, the choice, the memory model, the cache);
- `write_outputs`: fit.yaml (the config with the chosen values), fit_report.json, memory.png and the table;
- `trials_table`, `plot_memory`: the table and the plot.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from tfmis.config import save_config
from tfmis.tuning.fit.candidates import OBJECTIVE, choose, fitted_config
from tfmis.tuning.fit.memory import model_parallel_of, train_line_name, validation_line_name
from tfmis.tuning.fit.specs import specs_to_dict
from tfmis.utils.io import atomic_write_json
from tfmis.utils.table import text_table

REPORT_FILE = "fit_report.json"
CONFIG_FILE = "fit.yaml"
PLOT_FILE = "memory.png"

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


def update_progress(bar, record: dict, records: list[dict], budget_mb: float, margin: float, strategy: str) -> None:
    """Writes the trial's line above the progress bar `bar`, counts it (a run, or any grid point) and shows the
    best trial so far (`choose` over `records`)."""
    bar.write(trial_line(record, budget_mb))
    if record["status"] in ("ok", "failed") or strategy == "grid":  # the bar counts runs, or grid points
        bar.update(1)
    best = choose(records, budget_mb, margin)
    if best is not None:
        bar.set_postfix(best=f"trial {best['trial']}: {best[OBJECTIVE]:.1f} s/epoch")


def search_report(search, from_cache: bool, cache_file: Path, elapsed: float) -> dict:
    """The report of a `GpuFitSearch` (fit_report.json, and its cache): marks each record `chosen` or not, counts
    the statuses, and names the device, budget, specs, context, objective, choice, memory model and cache."""
    chosen = choose(search.records, search.budget_mb, search.specs.memory_margin)
    for r in search.records:
        r["chosen"] = chosen is not None and r["trial"] == chosen["trial"]
    statuses = ("ok", "failed", "pruned", "skipped")
    counts = {status: sum(r["status"] == status for r in search.records) for status in statuses}
    counts["run"] = counts["ok"] + counts["failed"]
    return {
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": search.device,
        "budget_mb": search.budget_mb,
        "memory_margin": search.specs.memory_margin,
        "strategy": search.strategy,
        "specs": specs_to_dict(search.specs),
        "context": search.context,
        "objective": f"{OBJECTIVE}: training patches per epoch / images per second + validation cases x "
        "sliding-window seconds / val_interval (minimised)",
        "trials": search.records,
        "counts": counts,
        "chosen": None
        if chosen is None
        else {
            k: chosen.get(k)
            for k in ("trial", "values", OBJECTIVE, "images_per_second", "step_seconds", "sw_seconds", "peak_mb")
        },
        "memory_model": search.model.summary(),
        "cache": {"key": search.key, "file": str(cache_file), "hit": from_cache},
        "elapsed_seconds": elapsed,
    }


def fitted_keys(fitted) -> dict:
    """The config keys a search sets, with their values in the fitted config (the report's "fitted")."""
    keys = {
        "pipeline.num_images_per_batch": fitted.pipeline.num_images_per_batch,
        "validation.num_sw_batch_size": fitted.validation.num_sw_batch_size,
        "validation.validation_data_device": fitted.validation.validation_data_device,
        "model.recompute": fitted.model.recompute,
        "runtime.model_parallel.mode": fitted.runtime.model_parallel.mode,
    }
    if fitted.runtime.model_parallel.enabled:
        keys["runtime.model_parallel.devices"] = fitted.runtime.model_parallel.devices
        keys["runtime.distribution"] = fitted.runtime.distribution
    if getattr(fitted.validation, "cpu_from_voxels", None) is not None:
        keys["validation.cpu_from_voxels"] = fitted.validation.cpu_from_voxels
    return keys


def write_outputs(search, report: dict) -> None:
    """Writes a `GpuFitSearch`'s outputs into its `output_dir`: fit.yaml (the config with the chosen values, when
    a trial was chosen; its keys also go into the report's "fitted"), fit_report.json and memory.png; prints the
    table."""
    search.output_dir.mkdir(parents=True, exist_ok=True)
    chosen = next((r for r in search.records if r.get("chosen")), None)
    if chosen is not None:
        fitted = fitted_config(search.config, chosen, search.records, search.context)
        report["fitted"] = fitted_keys(fitted)
        save_config(fitted, search.output_dir / CONFIG_FILE)
    atomic_write_json(search.output_dir / REPORT_FILE, report)
    plot_memory(report, search.output_dir / PLOT_FILE)
    print(trials_table(report))


def no_fit_message(records: list[dict], margin: float, budget_mb: float, report_path: Path) -> str:
    """Why no configuration was chosen, with the smallest measured peak and what to change."""
    smallest = min((r for r in records if r.get("peak_mb")), key=lambda r: r["peak_mb"], default=None)
    hint = (
        f"; the smallest measured peak was {smallest['peak_mb']:.0f} MB (trial {smallest['trial']})" if smallest else ""
    )
    return (
        f"no configuration fits within {margin:.0%} of the {budget_mb:.0f} MB memory "
        f"budget{hint}. Lower pipeline.patch_size, try model.recompute or training.precision=mixed_float16, "
        f"or raise --memory-budget-mb. Details: {report_path}"
    )


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
