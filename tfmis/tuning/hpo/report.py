"""What a person reads after a hyperparameter search: every trial collected from the search folder, the table
and `hpo_dice.png`."""

from __future__ import annotations

import json
from pathlib import Path

from tfmis.tuning.hpo.folder import BEST_FILE, TRIALS_DIR, oracle_trials, read_events
from tfmis.tuning.hpo.space import Objective, SearchSpace
from tfmis.tuning.kt import trial_order
from tfmis.utils.io import atomic_writer
from tfmis.utils.table import text_table


def short(value) -> str:
    """A hyperparameter value as the table shows it: 0.001, [48, 48, 48], true."""
    return (
        f"{value:g}"
        if isinstance(value, float)
        else json.dumps(value)
        if isinstance(value, (list, dict))
        else str(value).lower()
        if isinstance(value, bool)
        else str(value)
    )


def collect_trials(output_dir: Path, space: SearchSpace, objective: Objective) -> list[dict]:
    """Every trial: the oracle's status and values, the workers' start/end records, the run folder's results.

    A trial's `status` is "ok", "failed" or "interrupted" (running when the search stopped; rerun on resume).
    """
    from tfmis.engine.history import History

    output_dir = Path(output_dir)
    events = read_events(output_dir)
    records = []
    for trial_id, state in sorted(oracle_trials(output_dir).items(), key=lambda kv: trial_order(kv[0])):
        starts = [e for e in events if e["event"] == "start" and e["trial_id"] == trial_id]
        last = starts[-1] if starts else {}
        end = next(
            (
                e
                for e in events
                if e["event"] == "end" and e["trial_id"] == trial_id and e.get("attempt") == last.get("attempt")
            ),
            {},
        )
        status = {"COMPLETED": "ok", "FAILED": "failed"}.get(state["status"], "interrupted")
        run_dir = output_dir / TRIALS_DIR / trial_id
        summary = {}
        if (run_dir / "summary.json").is_file():
            summary = json.loads((run_dir / "summary.json").read_text())
        history = History(run_dir).records if status != "interrupted" and run_dir.is_dir() else []
        record = {
            "trial_id": trial_id,
            "hyperparameters": space.decode(state["values"]),
            "status": status,
            "objective": state.get("score") if status == "ok" else None,
            "objective_display": objective.display(state.get("score")) if status == "ok" else None,
            "best_mean_dice": summary.get("best_mean_dice"),
            "best_epoch": summary.get("best_epoch"),
            "epochs": summary.get("epochs") if summary else (len(history) or None),
            "seconds": end.get("seconds"),
            "train_seconds": summary.get("elapsed_seconds"),
            "start": last.get("time"),
            "end": end.get("time"),
            "tuner_id": last.get("tuner_id"),
            "cpus": last.get("cpus"),
            "child_cpus": last.get("child_cpus"),
            "gpus": last.get("gpus"),
            "attempts": len(starts),
            "rerun": len(starts) > 1,
            "exit_code": end.get("exit_code"),
            "reason": end.get("reason") or (_first_line(state.get("message")) if status == "failed" else None),
            "thresholds_reached": summary.get("thresholds_reached"),
            "val_mean_dice": [[r["epoch"], r["val_mean_dice"]] for r in history if r.get("val_mean_dice") is not None],
            "run_dir": str(run_dir),
        }
        records.append(record)
    return records


def _first_line(message: str | None) -> str | None:
    if not message:
        return None
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


def peak_concurrency(records: list[dict]) -> int:
    """The most trials whose [start, end] intervals overlap at one moment."""
    points = []
    for r in records:
        if r.get("start") is not None and r.get("end") is not None:
            points += [(r["start"], 1), (r["end"], -1)]
    peak = running = 0
    for _, step in sorted(points, key=lambda p: (p[0], p[1])):
        running += step
        peak = max(peak, running)
    return peak


def run_status(record: dict) -> str:
    """A trial's status column: ok (best), FAILED: reason, interrupted."""
    if record["status"] == "failed":
        return f"FAILED: {record['reason']}"
    if record["status"] == "interrupted":
        return "interrupted (rerun on resume)"
    text = "ok (best)" if record.get("best") else "ok"
    return text + (", rerun after an interruption" if record["rerun"] else "")


def trials_table(report: dict) -> str:
    """The readable table: trial, worker, each hyperparameter, objective, epochs, seconds, time span, status."""
    keys = list(report["space"])
    starts = [r["start"] for r in report["trials"] if r.get("start") is not None]
    t0 = min(starts) if starts else 0.0
    header = (
        "trial",
        "worker",
        *keys,
        report["objective"]["name"],
        "epochs",
        "seconds",
        "ran (s from start)",
        "status",
    )
    rows = [header]
    for r in report["trials"]:
        span = (
            f"{r['start'] - t0:.0f}-{r['end'] - t0:.0f}"
            if r.get("start") is not None and r.get("end") is not None
            else "-"
        )
        rows.append(
            (
                r["trial_id"],
                r.get("tuner_id") or "-",
                *(short(r["hyperparameters"].get(k)) for k in keys),
                r["objective_display"] or "-",
                str(r["epochs"]) if r["epochs"] is not None else "-",
                f"{r['seconds']:.1f}" if r.get("seconds") is not None else "-",
                span,
                run_status(r),
            )
        )
    lines = text_table(rows)
    c = report["counts"]
    lines.append(
        f"{sum(c.values())} trials ({c['ok']} ok, {c['failed']} failed, {c['interrupted']} interrupted) of "
        f"{report['num_trials']}, {report['strategy']} search, {report['workers']} worker(s), at most "
        f"{report['peak_concurrency']} at once; this run took {report['elapsed_seconds']:.0f} s"
    )
    best = report["best"]
    if best:
        hps = ", ".join(f"{k}={short(v)}" for k, v in best["hyperparameters"].items())
        lines.append(
            f"best: trial {best['trial_id']} ({hps}): {report['objective']['name']} "
            f"{next(r['objective_display'] for r in report['trials'] if r['best'])}; config in {BEST_FILE}, "
            f"run folder {best['run_dir']}"
        )
    else:
        lines.append("best: none (no trial finished)")
    return "\n".join(lines)


def plot_dice(report: dict, path) -> Path:
    """hpo_dice.png: the validation mean Dice per epoch of every trial, one line each, the best highlighted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(9, 5.5))
    plotted = False
    for r in report["trials"]:
        if not r["val_mean_dice"]:
            continue
        epochs, dice = zip(*r["val_mean_dice"])
        hps = ", ".join(f"{k.split('.')[-1]}={short(v)}" for k, v in r["hyperparameters"].items())
        label = (
            f"trial {r['trial_id']}: {hps}"
            + (" (best)" if r["best"] else "")
            + (" FAILED" if r["status"] == "failed" else "")
        )
        if r["best"]:
            ax.plot(epochs, dice, "-o", color="crimson", lw=2.8, ms=5, zorder=3, label=label)
        else:
            ax.plot(
                epochs, dice, marker=".", lw=1.1, alpha=0.6, ls="--" if r["status"] == "failed" else "-", label=label
            )
        plotted = True
    if not plotted:
        ax.text(0.5, 0.5, "no trial validated yet", ha="center", va="center", transform=ax.transAxes)
    ax.set(
        xlabel="epoch",
        ylabel="validation mean Dice",
        ylim=(0, 1),
        title=f"{report['strategy']} search, {report['counts']['ok']} trials, objective {report['objective']['name']}",
    )
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if plotted:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    with atomic_writer(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return Path(path)
