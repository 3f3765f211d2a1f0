"""What a prediction reports: each case's `CaseResult`, predictions.csv (`write_csv`, its score columns
`score_columns`) and the table printed at the end (`results_table`). The label maps and probabilities themselves
are written by `tfmis.data.sources.label_maps.save_like`.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from tfmis.utils.io import atomic_writer
from tfmis.utils.table import text_table


@dataclasses.dataclass
class CaseResult:
    case_id: str
    status: str  # "ok" or "failed"
    shape: tuple = ()
    seconds: float = 0.0
    foreground_voxels: int = 0
    device: str = ""
    output: str = ""
    reason: str = ""
    dice: dict | None = None
    scores: dict | None = None  # the `score_columns` of a labelled case (regions, HD95, NSD when configured)
    region: str = ""  # a cascade: the box the fine stage saw
    postprocessing: str = ""  # the postprocessing applied to the label map ("" when none was configured)
    removed_voxels: int | None = None  # the foreground voxels it set to background (None without postprocessing)
    peak_rss_mb: float | None = None  # the process' peak resident memory while predicting this case


def score_keys(metrics) -> dict[str, str]:
    """predictions.csv column -> `SegmentationMetrics` case entry key, for the scores after the class Dice:
    `dice_<region>` and `dice_mean_regions` (with regions), `hd95_<class or region>` (hd95),
    `nsd_<class or region>` and `nsd_mean` (nsd; the mean over classes, NaN left out, like `dice_mean`)."""
    names = [metrics.class_names[c] for c in metrics.classes] + list(metrics.regions)
    keys = {f"dice_{r}": f"dice_{r}" for r in metrics.regions}
    if metrics.regions:
        keys["dice_mean_regions"] = "mean_region_dice"
    if metrics.hd95:
        keys.update({f"hd95_{n}": f"hd95_{n}" for n in names})
    if metrics.nsd:
        keys.update({f"nsd_{n}": f"nsd_{n}" for n in names})
        keys["nsd_mean"] = "mean_nsd"
    return keys


def score_columns(metrics) -> list[str]:
    """The columns predictions.csv appends after the class Dice for this `SegmentationMetrics`."""
    return list(score_keys(metrics))


def results_table(results: list[CaseResult]) -> str:
    """A readable table: case, shape, seconds, peak memory, foreground voxels, device, (a cascade's regions: their
    number and share of the scan; with postprocessing, the voxels it removed,) status."""
    cascade = any(r.region for r in results)
    postprocessed = any(r.removed_voxels is not None for r in results)
    rows = [
        (
            "case",
            "shape",
            "seconds",
            "peak MiB",
            "foreground",
            "device",
            *(("fine stage on",) if cascade else ()),
            *(("postprocessing removed",) if postprocessed else ()),
            "status",
        )
    ]
    for r in results:
        rows.append(
            (
                r.case_id,
                "x".join(map(str, r.shape)) if r.shape else "-",
                f"{r.seconds:.2f}",
                f"{r.peak_rss_mb:.0f}" if r.peak_rss_mb is not None else "-",
                str(r.foreground_voxels) if r.status == "ok" else "-",
                r.device or "-",
                *((r.region.split(":")[0] or "-",) if cascade else ()),  # the box sizes are in the CSV
                *((str(r.removed_voxels) if r.removed_voxels is not None else "-",) if postprocessed else ()),
                "ok" if r.status == "ok" else f"FAILED: {r.reason}",
            )
        )
    return "\n".join(text_table(rows, align="left"))


def dice_line(results: list[CaseResult], class_names) -> str:
    """One line: each foreground class's mean Dice over the cases whose label holds it, with how many
    labels lacked it (their Dice is NaN, MONAI ignore_empty), and the mean over classes.

    Example:
    ```python
    dice_line(results, ["background", "organ", "core"])
    # 'mean Dice over 2 case(s): organ 0.8333, core 1.0000 (absent from 1 of 2 labels); mean 0.9167'
    ```
    """
    scored = [r for r in results if r.dice]
    parts, means = [], []
    for name in class_names[1:]:
        values = [r.dice.get(name, math.nan) for r in scored]
        present = [v for v in values if not math.isnan(v)]
        mean = sum(present) / len(present) if present else math.nan
        means.append(mean)
        absent = len(values) - len(present)
        parts.append(f"{name} {mean:.4f}" + (f" (absent from {absent} of {len(values)} labels)" if absent else ""))
    valid = [m for m in means if not math.isnan(m)]
    overall = sum(valid) / len(valid) if valid else math.nan
    return f"mean Dice over {len(scored)} case(s): " + ", ".join(parts) + f"; mean {overall:.4f}"


def write_csv(results: list[CaseResult], path: Path, class_names: list[str], extra_columns=()) -> None:
    """predictions.csv: one row per case with timing, peak memory, device and (when labels exist) Dice per class.

    A class absent from a case's label has Dice `nan` (MONAI ignore_empty), is named in the
    `absent_from_label` column (`;`-separated) and is left out of `dice_mean`. `extra_columns`
    (`Predictor.score_columns`: regions' Dice, HD95, NSD) follow, from each result's `scores`; last, for a cascade,
    `region`: the box its fine stage saw; with postprocessing, `postprocessing` (what was applied) and
    `postprocessing_removed_voxels`.
    """
    import csv
    import io

    foreground = class_names[1:]
    cascade = any(r.region for r in results)
    postprocessed = any(r.removed_voxels is not None for r in results)
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(
        [
            "case",
            "status",
            "shape",
            "seconds",
            "peak_rss_mb",
            "foreground_voxels",
            "device",
            "output",
            "reason",
            *[f"dice_{n}" for n in foreground],
            "dice_mean",
            "absent_from_label",
            *extra_columns,
            *(["region"] if cascade else []),
            *(["postprocessing", "postprocessing_removed_voxels"] if postprocessed else []),
        ]
    )
    for r in results:
        dice = [r.dice.get(n, math.nan) for n in foreground] if r.dice else []
        mean = float(np.nanmean(dice)) if dice and not all(math.isnan(d) for d in dice) else ""
        absent = ";".join(n for n, d in zip(foreground, dice) if math.isnan(d))
        cells = [f"{d:.4f}" for d in dice] if dice else [""] * len(foreground)
        scores = r.scores or {}
        extra = [f"{scores[c]:.4f}" if c in scores else "" for c in extra_columns]
        writer.writerow(
            [
                r.case_id,
                r.status,
                "x".join(map(str, r.shape)),
                f"{r.seconds:.3f}",
                f"{r.peak_rss_mb:.1f}" if r.peak_rss_mb is not None else "",
                r.foreground_voxels,
                r.device,
                r.output,
                r.reason,
                *cells,
                mean,
                absent,
                *extra,
                *([r.region] if cascade else []),
                *([r.postprocessing, "" if r.removed_voxels is None else r.removed_voxels] if postprocessed else []),
            ]
        )
    with atomic_writer(path) as f:
        f.write(buffer.getvalue())
