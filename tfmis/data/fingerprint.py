"""Dataset fingerprint: the statistics later used for auto-configuration and the GPU-fit search.

Per case: original shape/spacing, preprocessed shape/spacing, raw intensity statistics per channel
over the labelled foreground (as nnU-Net does), class voxel counts. For the dataset: median spacing,
median and 99.5th-percentile preprocessed shape, class totals/fractions, intensity summaries.
"""

from __future__ import annotations

import numpy as np

PERCENTILES = (0.5, 50.0, 99.5)
FOREGROUND_SAMPLE = 10_000  # voxels per case for the CT window and CT normalisation


def intensity_sample(
    image: np.ndarray, label: np.ndarray | None, max_voxels: int, rng: np.random.Generator
) -> np.ndarray:
    """Up to `max_voxels` raw voxel values (N, C) from the labelled foreground (else nonzero region)."""
    mask = label > 0 if label is not None and label.any() else np.any(image != 0, axis=-1)
    values = image[mask] if mask.any() else image.reshape(-1, image.shape[-1])
    if len(values) > max_voxels:
        values = values[rng.choice(len(values), max_voxels, replace=False)]
    return values


def foreground_sample(image: np.ndarray, label: np.ndarray | None) -> np.ndarray:
    """The sample of a case's raw foreground intensities that the CT window and CT normalisation are measured
    from (`FOREGROUND_SAMPLE` voxels, seed 0): the conversion and the planner's first pass draw the same one."""
    return intensity_sample(image, label, FOREGROUND_SAMPLE, np.random.default_rng(0))


def ct_window(values: np.ndarray) -> tuple[float, float]:
    """The CT clipping window of labelled-foreground HU `values`: their 0.5 and 99.5 percentiles (nnU-Net's)."""
    lo, hi = np.percentile(values, [0.5, 99.5])
    return float(round(lo, 1)), float(round(hi, 1))


def class_voxels(label: np.ndarray, num_classes: int, chunk: int = 1 << 22) -> np.ndarray:
    """`np.bincount(label.ravel(), minlength=num_classes)`, counted `chunk` voxels at a time: bincount
    widens its input to int64, 8 bytes per voxel of a uint8 label map (160 MB for a 512 x 512 x 150 case).

    Example:
        >>> class_voxels(np.array([[0, 2], [2, 2]], dtype=np.uint8), 4).tolist()
        [1, 0, 3, 0]
    """
    flat = label.reshape(-1)
    counts = np.zeros(num_classes, dtype=np.int64)
    for start in range(0, flat.size, chunk):
        part = np.bincount(flat[start : start + chunk], minlength=num_classes)
        if len(part) > len(counts):
            counts = np.concatenate([counts, np.zeros(len(part) - len(counts), dtype=np.int64)])
        counts[: len(part)] += part
    return counts


def intensity_stats(values: np.ndarray) -> list[dict]:
    """Per-channel percentiles, mean and std of (N, C) values."""
    stats = []
    for c in range(values.shape[1]):
        v = values[:, c].astype(np.float64)
        p = np.percentile(v, PERCENTILES) if len(v) else [float("nan")] * len(PERCENTILES)
        stats.append(
            {
                "p00_5": float(p[0]),
                "p50": float(p[1]),
                "p99_5": float(p[2]),
                "mean": float(v.mean()) if len(v) else float("nan"),
                "std": float(v.std()) if len(v) else float("nan"),
            }
        )
    return stats


def case_intensity(image: np.ndarray, label: np.ndarray | None) -> list[dict]:
    """A case's raw intensity statistics per channel, over a seeded sample of its labelled foreground."""
    return intensity_stats(intensity_sample(image, label, 100_000, np.random.default_rng(0)))


def case_fingerprint(
    image: np.ndarray,
    label: np.ndarray | None,
    original_spacing,
    geometry,
    out_label: np.ndarray | None,
    num_classes: int,
    intensity: list[dict] | None = None,
) -> dict:
    """The fingerprint entry of one case (raw `image`/`label`, preprocessed `out_label`).

    `image` may be None when `intensity` (`case_intensity` of the raw image and label) is given.
    """
    counts = class_voxels(out_label, num_classes) if out_label is not None else None
    return {
        "original_shape": [int(s) for s in geometry.original_shape],
        "original_spacing": [float(s) for s in original_spacing],
        "shape": list(geometry.shape),
        "spacing": list(geometry.spacing),
        "intensity": intensity if intensity is not None else case_intensity(image, label),
        "class_voxels": [int(c) for c in counts] if counts is not None else None,
        "label_extent_mm": label_extent_mm(out_label, geometry.spacing) if out_label is not None else None,
    }


def label_extent_mm(label: np.ndarray, spacing) -> list[float] | None:
    """Size in mm of the box around the labelled (non-zero) voxels along each axis; None when nothing is labelled.

    Example:
        >>> lab = np.zeros((10, 10, 10), np.uint8); lab[2:5, 3:4, 0:10] = 1
        >>> label_extent_mm(lab, (1.0, 2.0, 0.5))
        [3.0, 2.0, 5.0]
    """
    sizes = []
    for axis in range(3):
        hit = np.flatnonzero(np.any(label, axis=tuple(a for a in range(3) if a != axis)))
        if not len(hit):
            return None
        sizes.append(float((hit[-1] + 1 - hit[0]) * spacing[axis]))
    return sizes


def summarize(cases: dict[str, dict], labels: list[str], modalities: list[str]) -> dict:
    """The dataset-level part of the fingerprint from the per-case entries."""
    if not cases:
        return {"num_cases": 0}
    shapes = np.array([c["shape"] for c in cases.values()])
    spacings = np.array([c["original_spacing"] for c in cases.values()])
    counts = np.array([c["class_voxels"] for c in cases.values() if c["class_voxels"] is not None])
    totals = counts.sum(axis=0) if len(counts) else np.zeros(len(labels))
    intensity = []
    for ch, name in enumerate(modalities):
        per_case = [c["intensity"][ch] for c in cases.values()]
        intensity.append(
            {
                "modality": name,
                "p00_5": float(np.min([s["p00_5"] for s in per_case])),
                "p99_5": float(np.max([s["p99_5"] for s in per_case])),
                "median_of_means": float(np.median([s["mean"] for s in per_case])),
                "median_of_stds": float(np.median([s["std"] for s in per_case])),
            }
        )
    return {
        "num_cases": len(cases),
        "median_original_spacing": np.median(spacings, axis=0).tolist(),
        "median_shape": np.median(shapes, axis=0).tolist(),
        "shape_p99_5": np.ceil(np.percentile(shapes, 99.5, axis=0)).astype(int).tolist(),
        "max_shape": shapes.max(axis=0).tolist(),
        "class_voxels": {name: int(t) for name, t in zip(labels, totals)},
        "class_fraction": {name: float(t / max(totals.sum(), 1)) for name, t in zip(labels, totals)},
        "cases_without_foreground": sorted(
            k for k, c in cases.items() if c["class_voxels"] is not None and sum(c["class_voxels"][1:]) == 0
        ),
        "intensity": intensity,
    }
