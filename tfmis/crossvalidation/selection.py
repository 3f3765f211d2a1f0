"""Model selection from the out-of-fold predictions, as nnU-Net's `find_best_configuration` does: the cross-validation
Dice of every configuration and of every two configurations averaged, the best chosen by the foreground mean Dice;
then postprocessing decided on the chosen one's out-of-fold predictions (`choose_postprocessing`: a step is kept
only where it raised the Dice). The result: crossval.json, crossval.md, crossval_dice.csv, crossval_dice.png and
plan.yaml (the chosen configuration with its postprocessing, every decision commented with its measured effect).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from tfmis.config import Config, from_dict, to_dict
from tfmis.crossvalidation.experiment import (
    RESULTS_FILE,
    SCORES_FILE,
    VERSION,
    Definition,
    averaging_pairs,
    candidate_dir,
    fold_run_dir,
    pair_name,
    read_job_events,
)
from tfmis.errors import RunStateError
from tfmis.utils.io import atomic_write_json, atomic_writer

PLOT_FILE = "crossval_dice.png"
TABLE_FILE = "crossval.md"
CSV_FILE = "crossval_dice.csv"
PLAN_FILE = "plan.yaml"


def candidates(cv_dir: str | Path, definition: Definition) -> list[str]:
    """The configurations, then the pairs of them whose probabilities average (`averaging_pairs`); every one must be
    scored on every fold run (`RunStateError` naming the first one missing: choosing without it would be silent)."""
    out = list(definition.names) + [pair_name(a, b) for a, b in averaging_pairs(definition)]
    for candidate in out:
        for fold in definition.run_folds:
            if not (candidate_dir(cv_dir, candidate, fold) / SCORES_FILE).is_file():
                raise RunStateError(
                    f"{candidate} has no out-of-fold scores for fold {fold} "
                    f"({candidate_dir(cv_dir, candidate, fold) / SCORES_FILE}): rerun the same tfmis-crossval command "
                    "to predict it before choosing"
                )
    return out


def read_scores(cv_dir: str | Path, candidate: str, folds: list[int]) -> tuple[dict, list[tuple[str, str]]]:
    """Every out-of-fold case's Dice per structure ({case: {structure: dice}}) and the (prediction, reference) pairs."""
    cases, pairs = {}, []
    for fold in folds:
        folder = candidate_dir(cv_dir, candidate, fold)
        record = json.loads((folder / SCORES_FILE).read_text())
        cases.update(record["cases"])
        names = record.get("predictions", {})  # written since NRRD / MetaImage inputs; before, every map was NIfTI
        pairs += [(str(folder / names.get(case, f"{case}.nii.gz")), ref) for case, ref in record["references"].items()]
    return cases, pairs


def mean_per_structure(cases: dict) -> dict:
    """nnU-Net's means (`dice_summary`): per structure over the cases where it is defined, and `foreground_mean`
    the mean of those (NaN when a structure never has a Dice, as nnU-Net; such a candidate is never chosen)."""
    from tfmis.metrics.nnunet_scores import dice_summary

    per_case = [{k: math.nan if v is None else v for k, v in case.items()} for case in cases.values()]
    summary = dice_summary(per_case)
    return {**{k: float(v) for k, v in summary["mean"].items()}, "foreground_mean": float(summary["foreground_mean"])}


def select(cv_dir: str | Path, definition: Definition) -> dict:
    """The cross-validation result (crossval.json's content) with the chosen configuration(s) and postprocessing."""
    from tfmis.postprocessing import choose_postprocessing

    cv_dir = Path(cv_dir)
    table = {}
    for candidate in candidates(cv_dir, definition):
        cases, _ = read_scores(cv_dir, candidate, definition.run_folds)
        table[candidate] = {"dice": mean_per_structure(cases), "cases": len(cases)}
    best = max(table, key=lambda c: _finite(table[c]["dice"]["foreground_mean"]))
    chosen = best.split("+")
    config = from_dict(Config, definition.configuration(chosen[0]).config)
    _, pairs = read_scores(cv_dir, best, definition.run_folds)
    regions = dict(config.validation.regions) if config.model.output == "regions" else None
    names = class_names(config, cv_dir, chosen[0], definition.run_folds[0])
    spec, report = choose_postprocessing(pairs, list(range(1, len(names))), regions)
    return {
        "version": VERSION,
        "folds": definition.run_folds,
        "num_folds": definition.folds,
        "weights": definition.weights,
        "configurations": {
            c.name: {"folds": {str(f): str(fold_run_dir(cv_dir, c.name, f)) for f in definition.run_folds}}
            for c in definition.configurations
        },
        "candidates": table,
        "chosen": {
            "configurations": chosen,
            "candidate": best,
            "foreground_mean_dice": table[best]["dice"]["foreground_mean"],
            "postprocessing": to_dict(spec),
        },
        "postprocessing": report,
        "structure_names": {str(i): n for i, n in enumerate(names) if i > 0} | {r: r for r in regions or {}},
        "wall_seconds": wall_seconds(cv_dir),
    }


def _finite(value: float) -> float:
    return value if value is not None and math.isfinite(value) else -1.0


def class_names(config, cv_dir, name: str, fold: int) -> list[str]:
    """The class names of the configuration's run, background first (from its data info, also without the
    TFRecords)."""
    from tfmis.data.records import load_training_data_info

    info = load_training_data_info(fold_run_dir(cv_dir, name, fold), config.data.dataset_dir)
    labels = info["source"]["labels"]
    return [labels[str(i)] if isinstance(labels, dict) else labels[i] for i in range(len(labels))]


def wall_seconds(cv_dir: str | Path) -> dict:
    """From jobs.jsonl: the seconds of every training and out-of-fold prediction (the last attempt of each), their
    sum (each as it ran, on its worker's share) and the wall time from the first start to the last end of this
    command's runs."""
    events = read_job_events(cv_dir)
    jobs = {}
    for e in events:
        if e["event"] == "end":
            key = f"{e['job']} {e.get('configuration', '')} fold {e['fold']}".replace("  ", " ")
            jobs[key] = jobs.get(key, 0.0) + e["seconds"]
    starts = [e["time"] for e in events if e["event"] == "start"]
    ends = [e["time"] for e in events if e["event"] == "end"]
    return {
        "jobs": jobs,
        "sum": float(sum(jobs.values())),
        "span": float(max(ends) - min(starts)) if starts and ends else 0.0,
    }


def write_results(cv_dir: str | Path, definition: Definition, result: dict) -> list[Path]:
    """crossval.json, crossval.md, crossval_dice.csv, crossval_dice.png and plan.yaml; their paths."""
    cv_dir = Path(cv_dir)
    atomic_write_json(cv_dir / RESULTS_FILE, result)
    with atomic_writer(cv_dir / TABLE_FILE) as f:
        f.write(markdown(result))
    with atomic_writer(cv_dir / CSV_FILE) as f:
        structures = [k for k in next(iter(result["candidates"].values()))["dice"]]
        f.write("candidate," + ",".join(structures) + "\n")
        for name, row in result["candidates"].items():
            f.write(name + "," + ",".join(f"{row['dice'][s]:.4f}" for s in structures) + "\n")
    plot(result, cv_dir / PLOT_FILE)
    write_plan(cv_dir, definition, result)
    return [cv_dir / n for n in (RESULTS_FILE, TABLE_FILE, CSV_FILE, PLOT_FILE, PLAN_FILE)]


def table_text(result: dict) -> str:
    """The out-of-fold Dice per structure of every candidate, the chosen one marked."""
    rows = list(result["candidates"].items())
    structures = list(rows[0][1]["dice"])
    names = result.get("structure_names", {})
    header = ["candidate", "cases", *(names.get(s, s) for s in structures)]
    lines = [header]
    for name, row in rows:
        mark = " *" if name == result["chosen"]["candidate"] else ""
        lines.append([name + mark, str(row["cases"]), *(_number(row["dice"][s]) for s in structures)])
    after = postprocessed_dice(result)
    lines.append(
        [f"{result['chosen']['candidate']} + postprocessing", "", *(_number(after.get(s)) for s in structures)]
    )
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in lines)


def _number(value, digits: int = 4) -> str:
    return "nan" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def postprocessed_dice(result: dict) -> dict:
    """The chosen candidate's out-of-fold Dice per structure and foreground mean after the chosen postprocessing."""
    final = result["postprocessing"]["final"]
    after = final.get("regions", final["classes"])["after"]
    return {**after["dice"], "foreground_mean": after["foreground_mean"]}


def postprocessing_lines(result: dict) -> list[str]:
    """One line per postprocessing step tried: the structure, the Dice before and after, kept or not."""
    names = result.get("structure_names", {})
    out = []
    for step in result["postprocessing"]["steps"]:
        if step["structure"] in step["before"]["dice"]:
            what, key = names.get(step["structure"], step["structure"]), None
        else:
            what, key = "all foreground as one", "foreground_mean"
        before = step["before"][key] if key else step["before"]["dice"][step["structure"]]
        after = step["after"][key] if key else step["after"]["dice"][step["structure"]]
        measure = "foreground mean Dice" if key else "Dice"
        out.append(
            f"largest component of {what}: {measure} {_number(before, 5)} -> {_number(after, 5)} "
            f"({step['voxels_removed']} voxels removed in {step['cases_changed']} cases; "
            f"{'kept' if step['kept'] else 'not kept'})"
        )
    return out


def weights_phrase(result: dict) -> str:
    """How the held-out folds were predicted, in words (crossval.json's `weights`; older files: best)."""
    if result.get("weights", "best") == "final":
        return "each fold predicted with the weights its training ended with (the held-out fold chose nothing)"
    return (
        "each fold predicted with the weights of its best epoch on that same held-out fold (--val-best: optimistic, "
        "the held-out fold chose the weights)"
    )


def markdown(result: dict) -> str:
    chosen = result["chosen"]
    wall = result["wall_seconds"]
    return "\n".join(
        [
            f"# Cross-validation ({result['num_folds']} folds; folds run: {result['folds']})",
            "",
            "Out-of-fold Dice per structure (nnU-Net's means: NaN cases left out; * = chosen), "
            f"{weights_phrase(result)}:",
            "",
            "```",
            table_text(result),
            "```",
            "",
            f"Chosen: {' + '.join(chosen['configurations'])} (foreground mean Dice "
            f"{chosen['foreground_mean_dice']:.4f}).",
            "",
            "Postprocessing (kept only where it raised the out-of-fold Dice):",
            "",
            *[f"- {line}" for line in postprocessing_lines(result)],
            "",
            f"Wall time: {wall['span'] / 60:.1f} min from the first job's start to the last one's end; the jobs' "
            f"own times (each on its worker's share of the machine) add up to {wall['sum'] / 60:.1f} min.",
            "",
        ]
    )


def plot(result: dict, path: Path) -> None:
    """Bars: the out-of-fold Dice per structure of every candidate, and the chosen one after postprocessing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {name: row["dice"] for name, row in result["candidates"].items()}
    rows[f"{result['chosen']['candidate']} + postprocessing"] = postprocessed_dice(result)
    structures = list(next(iter(result["candidates"].values()))["dice"])
    names = result.get("structure_names", {})
    x = np.arange(len(structures))
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(structures) * max(1, len(rows) / 2)), 4))
    for i, (name, dice) in enumerate(rows.items()):
        values = [np.nan if dice.get(s) is None else dice[s] for s in structures]
        ax.bar(x + i * width - 0.4 + width / 2, values, width, label=name)
    ax.set_xticks(x, [names.get(s, s) for s in structures], rotation=20)
    ax.set_ylabel("out-of-fold Dice")
    ax.set_ylim(0, 1)
    ax.set_title(f"{result['num_folds']}-fold cross-validation (chosen: {result['chosen']['candidate']})")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    with atomic_writer(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


def write_plan(cv_dir: Path, definition: Definition, result: dict) -> Path:
    """plan.yaml: the chosen configuration's config with the chosen postprocessing, the decisions as comments."""
    import yaml

    chosen = result["chosen"]
    config = from_dict(Config, definition.configuration(chosen["configurations"][0]).config)
    config.postprocessing = from_dict(type(config.postprocessing), chosen["postprocessing"])
    lines = [
        f"# Chosen by {result['num_folds']}-fold cross-validation (tfmis-crossval; crossval.md has the tables):",
        f"# out-of-fold foreground mean Dice of each candidate, {weights_phrase(result)}:",
        *[f"#   {name}: {_number(row['dice']['foreground_mean'])}" for name, row in result["candidates"].items()],
        "# postprocessing (nnU-Net's largest connected component, kept where the out-of-fold Dice rose):",
        *[f"#   {line}" for line in postprocessing_lines(result) or ["nothing tried"]],
        f"# Predict with the folds' ensemble: python -m tfmis.predict --checkpoint {cv_dir} --input ... --output ...",
        "",
    ]
    with atomic_writer(cv_dir / PLAN_FILE) as f:
        f.write("\n".join(lines))
        yaml.safe_dump(to_dict(config), f, sort_keys=False)
    return cv_dir / PLAN_FILE
