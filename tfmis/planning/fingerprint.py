"""The dataset fingerprint a plan is made from: spacings, cropped shapes, class frequencies, CT window.

Two sources:

- `fingerprint_msd(source_dir)`: a first pass straight over an MSD folder, before any conversion. Each
  case is read once (in worker processes, numpy and the image readers only) and reduced to what planning needs: its
  RAS spacing, the crop box the conversion will cut (foreground = `tfmis.data.preprocess.foreground_mask`:
  for MRI-like channels the voxels that differ from the channel's background, which is the border constant
  (the value more than half of the volume's 6 faces hold) when it is not 0 (a z-scored scan), else 0;
  above the CT window's low end for CT channels; or labelled; kept as per-slice projections, so the box is
  exact for any window), each channel's background, its class voxel counts and a foreground intensity
  sample. The CT window is the 0.5/99.5 percentiles of the labelled-foreground sample, the same numbers
  `tfmis.data.convert` measures (same sample, same seed).
- `fingerprint_from_conversion(dataset_dir)`: the `fingerprint.json` a conversion wrote (and its
  resolved spacing and CT window); cropped shapes are the converted shapes scaled back to each case's
  original spacing.

Example:
```python
fingerprint = fingerprint_msd("data/Task09_Spleen")
print(fingerprint.median_spacing, fingerprint.median_shape_at(fingerprint.median_spacing), fingerprint.ct_window)
```
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from tfmis.data import case_stats
from tfmis.data.case_pool import FINGERPRINT_PEAK_FACTOR, CasePool
from tfmis.data.preprocess import foreground_mask, reorient_to_ras, spacing_of
from tfmis.data.sources.cases import CT_MODALITIES, load_case
from tfmis.data.sources.errors import CaseError, DatasetError
from tfmis.data.sources.layouts import open_dataset
from tfmis.errors import MissingInput


@dataclasses.dataclass
class DatasetFingerprint:
    """What the planner knows about a dataset.

    Attributes:
        name, modalities, labels: from dataset.json.
        case_ids: the readable training cases.
        spacings: (N, 3) original voxel spacing in mm, RAS order.
        crop_shapes: (N, 3) voxels of the foreground crop on the original (RAS) grid.
        class_voxels: voxels per label value over all cases.
        ct_window: (low, high) HU: 0.5/99.5 percentiles of the labelled foreground over CT channels; None
            without CT channels.
        intensity: per channel {modality, p00_5, p99_5, median_of_means, median_of_stds} of the foreground.
        cases_without_foreground: case ids whose label is all background.
        skipped: case id -> reason, for unreadable cases.
        source: where the numbers come from ("first pass over DIR" or "conversion in DIR").
        source_dir: the MSD folder (None when unknown).
        class_volumes_mm3: (N, K) volume of each label value per case in mm^3 (None when unknown).
        label_extents_mm: (N, 3) size in mm of the box around each case's labelled voxels, NaN for a case with
            none (None when unknown, e.g. a conversion written before tfmis recorded it).
        label_pieces: per case, the connected pieces of its labels on a grid of about 4 mm cells and on the label's
            voxel grid (`tfmis.data.case_stats.label_pieces`; None when unknown): what a cascade's regions are made
            from. From a first pass the voxel grid is the whole RAS image and `["voxels"]["crop"]` the foreground crop
            box on it; from a conversion the voxel grid is the converted (cropped) case itself. Conversions written
            before the voxel boxes were recorded have the cells only.
        background: per channel {channel, modality, num_cases, border_constant_cases, border_constants}: how many
            cases have a z-scored background (most of their border is one non-zero constant, the value the crop
            and the z-score then treat as background; `tfmis.data.case_stats.background_summary`); None when unknown.
        regions: the region labels of an nnU-Net v2 dataset.json as `validation.regions` ({name: [labels]}, largest
            first); None when it declares classes.
    """

    name: str
    modalities: list[str]
    labels: list[str]
    case_ids: list[str]
    spacings: np.ndarray
    crop_shapes: np.ndarray
    class_voxels: list[int]
    ct_window: tuple[float, float] | None
    intensity: list[dict]
    cases_without_foreground: list[str]
    skipped: dict[str, str]
    source: str
    source_dir: str | None = None
    class_volumes_mm3: np.ndarray | None = None
    label_extents_mm: np.ndarray | None = None
    background: list[dict] | None = None
    label_pieces: list[dict | None] | None = None
    regions: dict[str, list[int]] | None = None

    @property
    def num_cases(self) -> int:
        return len(self.case_ids)

    @property
    def ct_channels(self) -> list[int]:
        return [i for i, m in enumerate(self.modalities) if str(m).upper() in CT_MODALITIES]

    @property
    def background_lines(self) -> list[str]:
        """One line per channel whose background is a non-zero border constant in some case (none otherwise)."""
        return case_stats.background_lines(self.background)

    @property
    def median_spacing(self) -> np.ndarray:
        return np.median(self.spacings, axis=0)

    @property
    def class_fraction(self) -> list[float]:
        total = max(sum(self.class_voxels), 1)
        return [c / total for c in self.class_voxels]

    def shapes_at(self, spacing) -> np.ndarray:
        """(N, 3) preprocessed shapes at `spacing`, rounded as `tfmis.data.preprocess.preprocess` rounds them."""
        spacing = np.asarray(spacing, dtype=np.float64)
        return np.maximum(np.round(self.crop_shapes * self.spacings / spacing), 1).astype(int)

    def median_shape_at(self, spacing) -> np.ndarray:
        return np.median(self.shapes_at(spacing), axis=0)

    def to_dict(self) -> dict:
        """JSON-friendly."""
        d = dataclasses.asdict(self)
        d["spacings"] = self.spacings.tolist()
        d["crop_shapes"] = self.crop_shapes.tolist()
        d["ct_window"] = list(self.ct_window) if self.ct_window else None
        d["median_spacing"] = self.median_spacing.tolist()
        d["class_fraction"] = self.class_fraction
        d["background_lines"] = self.background_lines
        for key in ("class_volumes_mm3", "label_extents_mm"):
            d[key] = getattr(self, key).tolist() if getattr(self, key) is not None else None
        return d


# ---------------------------------------------------------------- first pass over an MSD folder (worker side)


def case_summary(task: tuple) -> dict:
    """One case reduced to what planning needs (runs in a worker process; no TensorFlow)."""
    case, root = task
    try:
        dataset = open_dataset(root)
        loaded = load_case(case, dataset)
        # views (flipped/transposed strides): everything below only reads them, and a copy would double the volume
        image, affine = reorient_to_ras(loaded.image, loaded.affine, copy=False)
        label = reorient_to_ras(loaded.label, loaded.affine, copy=False)[0] if loaded.label is not None else None
        ct = [i for i, m in enumerate(dataset.modalities) if str(m).upper() in CT_MODALITIES]
        other = [i for i in range(image.shape[-1]) if i not in ct]
        # the conversion's foreground of the MRI-like channels (each against its own background), once
        body = foreground_mask(image, ("zscore",), None, channels=other) if other else None
        projections = []
        for axis in range(3):
            spatial = tuple(a for a in range(3) if a != axis)
            # channel by channel: `image[..., ct]` would copy the whole image (a list index copies)
            ct_max = np.max([image[..., c].max(axis=spatial) for c in ct], axis=0) if ct else None
            projections.append(
                {
                    "ct_max": ct_max.tolist() if ct else None,
                    "foreground": body.any(axis=spatial).tolist() if body is not None else None,
                    "label": (label > 0).any(axis=spatial).tolist() if label is not None else None,
                }
            )
        del body
        sample = case_stats.foreground_sample(loaded.image, loaded.label, ct)
        counts = case_stats.class_voxels(loaded.label, dataset.num_classes) if loaded.label is not None else None
        return {
            "case_id": case.case_id,
            "status": "ok",
            "spacing": spacing_of(affine).tolist(),
            "ras_shape": list(image.shape[:3]),
            "projections": projections,
            "sample": sample,
            "background": case_stats.case_background(image, ct),
            "class_voxels": counts.tolist() if counts is not None else None,
            "label_pieces": case_stats.label_pieces(label, spacing_of(affine)) if label is not None else None,
        }
    except CaseError as e:
        return {"case_id": case.case_id, "status": "skipped", "reason": e.reason}
    except Exception as e:  # noqa: BLE001 - one bad case never stops the others
        return {"case_id": case.case_id, "status": "skipped", "reason": f"unexpected {type(e).__name__}: {e}"}


def crop_shape(projections: list[dict], ct_window, margin: int = 0) -> list[int]:
    """Shape of the box `tfmis.data.preprocess` crops (foreground mask or label, grown by `margin`); see
    `planned_crop_box`."""
    start, stop = planned_crop_box(projections, ct_window, margin)
    return [b - a for a, b in zip(start, stop)]


def planned_crop_box(projections: list[dict], ct_window, margin: int = 0) -> tuple[list[int], list[int]]:
    """(start, stop) voxels of the box `tfmis.data.preprocess` crops (foreground mask or label, grown by `margin`),
    on the case's RAS grid; an axis with no foreground is kept whole.

    Args:
        projections: per axis {"ct_max": per-slice max of the CT channels, "foreground": per-slice any voxel of the
            other channels' `foreground_mask` (differs from its background), "label": per-slice any labelled voxel}
            (entries may be None).
        ct_window: (low, high); CT voxels above `low` are foreground.
        margin: voxels kept around the box.
    """
    start, stop = [], []
    for p in projections:
        n = len(next(v for v in p.values() if v is not None))
        keep = np.zeros(n, dtype=bool)
        if p["ct_max"] is not None:
            keep |= np.asarray(p["ct_max"]) > ct_window[0]
        if p["foreground"] is not None:
            keep |= np.asarray(p["foreground"], dtype=bool)
        if p["label"] is not None:
            keep |= np.asarray(p["label"], dtype=bool)
        if not keep.any():
            start.append(0)
            stop.append(n)
            continue
        nz = np.flatnonzero(keep)
        start.append(int(max(nz[0] - margin, 0)))
        stop.append(int(min(nz[-1] + 1 + margin, n)))
    return start, stop


def fingerprint_msd(
    source_dir: str | Path,
    workers: int | None = None,
    progress: bool = True,
    ct_window: tuple[float, float] | None = None,
    crop_foreground: bool = True,
    crop_margin: int = 0,
) -> DatasetFingerprint:
    """The first-pass fingerprint of an MSD folder (every training case read once, nothing written).

    Args:
        source_dir: the MSD folder (with dataset.json).
        workers: parallel reader processes at most (default `hardware.case_workers()`: the usable CPUs, at most 8);
            fewer when the usable memory holds fewer cases at once (`tfmis.data.case_pool.CasePool`, one line says
            how many and why). A case larger than the memory is skipped with its reason, as is one whose worker the
            kernel kills even alone.
        progress: show progress.
        ct_window: a fixed CT window instead of the measured percentiles (as `--ct-window` would set).
        crop_foreground, crop_margin: the conversion's crop options.

    Raises:
        DatasetError: dataset.json is unusable, or no case could be read.
    """

    from tfmis.utils.progress import progress_bar

    dataset = open_dataset(source_dir)
    pool = CasePool("Fingerprinting", dataset, FINGERPRINT_PEAK_FACTOR, asked=workers)
    if progress:
        print(pool.describe(), file=sys.stderr)
    tasks = [(case, str(dataset.root)) for case in dataset.training]
    bar = progress_bar(len(tasks), f"Fingerprinting {dataset.name}", "case", disable=not progress)
    summaries, skipped = [], {}
    lost = lambda case_id, reason: {"case_id": case_id, "status": "skipped", "reason": reason}  # noqa: E731
    for result in pool.run(case_summary, tasks, lost, say=lambda line: bar.write(line, file=sys.stderr)):
        if result["status"] == "ok":
            summaries.append(result)
        else:
            skipped[result["case_id"]] = result["reason"]
            bar.write(f"  {result['case_id']}: skipped: {result['reason']}")
        bar.update(1)
    bar.close()
    if not summaries:
        raise DatasetError(
            f"{dataset.root}: no training case could be read ({len(skipped)} skipped, e.g. "
            f"{next(iter(skipped.items()), ('', ''))[1]})"
        )
    ct = [i for i, m in enumerate(dataset.modalities) if str(m).upper() in CT_MODALITIES]
    if ct and ct_window is None:  # as the conversion measures it, on the same samples
        ct_window = case_stats.ct_window(np.concatenate([s["sample"][:, ct].ravel() for s in summaries]))
    if not ct:
        ct_window = None
    boxes = [
        planned_crop_box(s["projections"], ct_window, crop_margin)
        if crop_foreground
        else ([0, 0, 0], list(s["ras_shape"]))
        for s in summaries
    ]
    crops = [[b - a for a, b in zip(start, stop)] for start, stop in boxes]
    for s, box in zip(summaries, boxes):  # the label pieces are on the whole RAS grid: where its crop lies on it
        if s["label_pieces"] is not None:
            s["label_pieces"]["voxels"]["crop"] = [list(box[0]), list(box[1])]
    counts = [s["class_voxels"] for s in summaries if s["class_voxels"] is not None]
    totals = np.sum(counts, axis=0).astype(int).tolist() if counts else [0] * dataset.num_classes
    per_case = {
        s["case_id"]: {
            "intensity": case_stats.intensity_stats(s["sample"]),
            "class_voxels": s["class_voxels"],
            "original_spacing": s["spacing"],
            "shape": crop,
            "background": s["background"],
        }
        for s, crop in zip(summaries, crops)
    }
    summary = case_stats.summarize(per_case, dataset.labels, dataset.modalities)
    for line in case_stats.background_lines(summary["background"]) if progress else []:
        print(line, file=sys.stderr)
    return DatasetFingerprint(
        name=dataset.name,
        modalities=list(dataset.modalities),
        labels=list(dataset.labels),
        case_ids=[s["case_id"] for s in summaries],
        spacings=np.array([s["spacing"] for s in summaries], dtype=np.float64),
        crop_shapes=np.array(crops, dtype=np.float64),
        class_voxels=totals,
        ct_window=ct_window,
        intensity=summary["intensity"],
        cases_without_foreground=sorted(
            s["case_id"] for s in summaries if s["class_voxels"] is not None and sum(s["class_voxels"][1:]) == 0
        ),
        skipped=skipped,
        source=f"first pass over {len(summaries)} cases of {dataset.root}",
        source_dir=str(source_dir),
        class_volumes_mm3=_class_volumes([s["class_voxels"] for s in summaries], [s["spacing"] for s in summaries]),
        label_extents_mm=np.array([_label_extent(s["projections"], s["spacing"]) for s in summaries], dtype=np.float64),
        background=summary["background"],
        label_pieces=[s["label_pieces"] for s in summaries],
        regions=dataset.regions,
    )


def _class_volumes(counts: list, spacings: list) -> np.ndarray | None:
    """(N, K) mm^3 per label value from voxel counts and spacings; None if any case has no label."""
    if not counts or any(c is None for c in counts):
        return None
    return np.array(counts, dtype=np.float64) * np.prod(np.asarray(spacings, dtype=np.float64), axis=1)[:, None]


def _label_extent(projections: list[dict], spacing) -> list[float]:
    """Size in mm of the labelled voxels' box from the per-axis label projections; NaN when none."""
    sizes = []
    for axis, p in enumerate(projections):
        hit = np.flatnonzero(np.asarray(p["label"], dtype=bool)) if p["label"] is not None else []
        if not len(hit):
            return [float("nan")] * 3
        sizes.append(float((hit[-1] + 1 - hit[0]) * spacing[axis]))
    return sizes


# ---------------------------------------------------------------- from a finished conversion


def has_conversion(dataset_dir: str | Path) -> bool:
    """True when `dataset_dir` holds a finished conversion with its fingerprint."""
    d = Path(dataset_dir)
    return all((d / name).is_file() for name in ("fingerprint.json", "index.json", "conversion.json"))


def fingerprint_from_conversion(dataset_dir: str | Path) -> DatasetFingerprint:
    """The fingerprint a conversion wrote (`fingerprint.json`, `index.json`, `conversion.json`).

    The foreground-cropped shapes on the original grids are the converted shapes scaled by the converted
    spacing over each case's original spacing (exact up to the conversion's rounding).
    """
    d = Path(dataset_dir)
    if not has_conversion(d):
        raise MissingInput(
            f"{d}: no finished conversion (fingerprint.json, index.json and conversion.json "
            "are written by tfmis-convert)"
        )
    fingerprint = json.loads((d / "fingerprint.json").read_text())
    index = json.loads((d / "index.json").read_text())
    resolved = json.loads((d / "conversion.json").read_text()).get("resolved", {})
    cases = fingerprint["cases"]
    ids = sorted(cases)
    spacings = np.array([cases[c]["original_spacing"] for c in ids], dtype=np.float64)
    converted_spacing = np.array([cases[c]["spacing"] for c in ids], dtype=np.float64)
    shapes = np.array([cases[c]["shape"] for c in ids], dtype=np.float64)
    summary = fingerprint["dataset"]
    labels = list(index["source"]["labels"])
    ct_window = resolved.get("ct_window")
    return DatasetFingerprint(
        name=index["source"]["name"],
        modalities=list(index["source"]["modalities"]),
        labels=labels,
        case_ids=ids,
        spacings=spacings,
        crop_shapes=shapes * converted_spacing / spacings,
        class_voxels=[int(summary["class_voxels"].get(name, 0)) for name in labels],
        ct_window=tuple(ct_window) if ct_window else None,
        intensity=summary.get("intensity", []),
        cases_without_foreground=list(summary.get("cases_without_foreground", [])),
        skipped={s["case_id"]: s["reason"] for s in index.get("skipped", [])},
        source=f"conversion in {d}",
        source_dir=index["source"].get("dir"),
        class_volumes_mm3=_class_volumes([cases[c]["class_voxels"] for c in ids], [cases[c]["spacing"] for c in ids]),
        label_extents_mm=np.array([cases[c]["label_extent_mm"] or [float("nan")] * 3 for c in ids], dtype=np.float64)
        if all("label_extent_mm" in cases[c] for c in ids)
        else None,
        background=summary.get("background"),
        label_pieces=[cases[c]["label_pieces"] for c in ids] if all("label_pieces" in cases[c] for c in ids) else None,
        regions=index["source"].get("regions"),
    )
