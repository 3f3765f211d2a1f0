"""Dataset fingerprint: the statistics later used for auto-configuration and the GPU-fit search.

Per case: original shape/spacing, preprocessed shape/spacing, raw intensity statistics per channel
over the labelled foreground (as nnU-Net does), class voxel counts, each channel's background value.
For the dataset: median spacing, median and 99.5th-percentile preprocessed shape, class totals/fractions,
intensity summaries, how many cases have a z-scored background (a non-zero border constant) per channel.

The foreground is `tfmis.data.preprocess.foreground_mask`'s, the one the conversion crops to: for MRI-like
channels the voxels that differ from the channel's background (the border constant, the value more than half of
the voxels on the volume's 6 faces hold, when it is not 0, e.g. -3.6 for a z-scored BraTS-style scan; else 0).
"""

from __future__ import annotations

import numpy as np

from tfmis.data.preprocess import channel_backgrounds, foreground_mask

PERCENTILES = (0.5, 50.0, 99.5)
FOREGROUND_SAMPLE = 10_000  # voxels per case for the CT window and CT normalisation


def body_mask(image: np.ndarray, ct_channels=()) -> np.ndarray:
    """The voxels of a case that are not background, before any CT window is known: `foreground_mask` of the
    MRI-like channels (each differs from its own background: a z-scored channel's border constant, else 0), or a
    CT channel's non-zero voxels (its window is measured from the sample this mask feeds)."""
    ct = [int(c) for c in ct_channels]
    other = [c for c in range(image.shape[-1]) if c not in ct]
    mask = foreground_mask(image, ("zscore",), None, channels=other)
    for c in ct:
        np.logical_or(mask, image[..., c] != 0, out=mask)
    return mask


def intensity_sample(
    image: np.ndarray, label: np.ndarray | None, max_voxels: int, rng: np.random.Generator, ct_channels=()
) -> np.ndarray:
    """Up to `max_voxels` raw voxel values (N, C) from the labelled foreground (else `body_mask`'s region)."""
    mask = label > 0 if label is not None and label.any() else body_mask(image, ct_channels)
    if mask.any():  # channel by channel: a mask of the array's own shape selects without the (K, 3) int64 index
        # arrays that `image[mask]` builds first (24 bytes a selected voxel: 354 MB for 14.7 M labelled voxels)
        values = np.stack([image[..., c][mask] for c in range(image.shape[-1])], axis=-1)
    else:
        values = image.reshape(-1, image.shape[-1])
    if len(values) > max_voxels:
        values = values[rng.choice(len(values), max_voxels, replace=False)]
    return values


def foreground_sample(image: np.ndarray, label: np.ndarray | None, ct_channels=()) -> np.ndarray:
    """The sample of a case's raw foreground intensities that the CT window and CT normalisation are measured
    from (`FOREGROUND_SAMPLE` voxels, seed 0): the conversion and the planner's first pass draw the same one."""
    return intensity_sample(image, label, FOREGROUND_SAMPLE, np.random.default_rng(0), ct_channels)


def case_background(image: np.ndarray, ct_channels=()) -> list[float | None]:
    """Per channel, the background value the crop and the z-score use (`channel_backgrounds`): a z-scored channel's
    border constant, 0 for the others, None for a CT channel (its window decides). Reads the 6 faces only."""
    ct = {int(c) for c in ct_channels}
    norms = tuple("ct" if c in ct else "zscore" for c in range(image.shape[-1]))
    return [None if b is None else float(b) for b in channel_backgrounds(image, norms)]


def ct_window(values: np.ndarray) -> tuple[float, float]:
    """The CT clipping window of labelled-foreground HU `values`: their 0.5 and 99.5 percentiles (nnU-Net's)."""
    lo, hi = np.percentile(values, [0.5, 99.5])
    return float(round(lo, 1)), float(round(hi, 1))


def class_voxels(label: np.ndarray, num_classes: int, chunk: int = 1 << 22) -> np.ndarray:
    """`np.bincount(label.ravel(), minlength=num_classes)`, counted `chunk` voxels at a time: bincount
    widens its input to int64, 8 bytes per voxel of a uint8 label map (8x the map, were it counted at once).

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


def case_intensity(image: np.ndarray, label: np.ndarray | None, ct_channels=()) -> list[dict]:
    """A case's raw intensity statistics per channel, over a seeded sample of its labelled foreground."""
    return intensity_stats(intensity_sample(image, label, 100_000, np.random.default_rng(0), ct_channels))


def case_fingerprint(
    image: np.ndarray,
    label: np.ndarray | None,
    original_spacing,
    geometry,
    out_label: np.ndarray | None,
    num_classes: int,
    intensity: list[dict] | None = None,
    background: list[float | None] | None = None,
) -> dict:
    """The fingerprint entry of one case (raw `image`/`label`, preprocessed `out_label`).

    `image` may be None when `intensity` (`case_intensity` of the raw image and label) is given; `background`:
    the case's `case_background` (recorded when given).
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
        "label_pieces": label_pieces(out_label, geometry.spacing) if out_label is not None else None,
        **({"background": background} if background is not None else {}),
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


PIECE_CELL_MM = 4.0  # the grid the labels' connected pieces are found on: about a coarse stage's voxel


def label_pieces(label: np.ndarray, spacing, cell_mm: float = PIECE_CELL_MM) -> dict:
    """The connected pieces of the labelled voxels (26-connected, classes that touch are one piece), found on cells
    of about `cell_mm` (each cell labelled when any of its voxels is): {"cell_mm": [x, y, z], "shape": cells per
    axis, "pieces": [[start, stop], ...] boxes in cells, "voxels": {"spacing", "shape", "pieces"}: the same pieces
    as boxes on the label's own voxel grid, each the box of the labelled voxels inside its cells' box}. Cheap at any
    scan size (a 512x512x600 CT has about 100x100x300 cells); what a cascade's coarse stage would find if it found
    the labels.

    Example:
        >>> lab = np.zeros((40, 40, 20), np.uint8); lab[0:8, 0:8, 0:4] = 1; lab[30:32, 30:32, 15] = 2
        >>> found = label_pieces(lab, (1.0, 1.0, 2.0))
        >>> found["cell_mm"], found["shape"], found["pieces"]
        ([4.0, 4.0, 4.0], [10, 10, 10], [[[0, 0, 0], [2, 2, 2]], [[7, 7, 7], [8, 8, 8]]])
        >>> found["voxels"]["spacing"], found["voxels"]["shape"], found["voxels"]["pieces"]
        ([1.0, 1.0, 2.0], [40, 40, 20], [[[0, 0, 0], [8, 8, 4]], [[30, 30, 15], [32, 32, 16]]])
    """
    from scipy import ndimage

    factors = [max(1, int(round(cell_mm / float(s)))) for s in spacing]
    cells = [-(-n // f) for n, f in zip(label.shape[:3], factors)]
    pooled = np.zeros(cells, dtype=bool)
    for z in range(0, label.shape[2], factors[2]):  # a slab of cells at a time: no copy of the whole label
        slab = label[:, :, z : z + factors[2]] > 0
        padded = np.zeros((cells[0] * factors[0], cells[1] * factors[1], factors[2]), dtype=bool)
        padded[: slab.shape[0], : slab.shape[1], : slab.shape[2]] = slab
        pooled[:, :, z // factors[2]] = padded.reshape(cells[0], factors[0], cells[1], factors[1], -1).any(
            axis=(1, 3, 4)
        )
    labelled, _ = ndimage.label(pooled, structure=np.ones((3, 3, 3), bool))
    boxes = [[[s.start for s in b], [s.stop for s in b]] for b in ndimage.find_objects(labelled) if b is not None]
    voxel_boxes = []
    for start, stop in boxes:  # the labelled voxels' box inside the piece's cells (one axis projection at a time)
        first = [a * f for a, f in zip(start, factors)]
        inside = label[tuple(slice(a, b * f) for a, b, f in zip(first, stop, factors))] > 0
        low, high = [], []
        for axis in range(3):
            hit = np.flatnonzero(inside.any(axis=tuple(a for a in range(3) if a != axis)))
            low.append(int(first[axis] + hit[0]))
            high.append(int(first[axis] + hit[-1] + 1))
        voxel_boxes.append([low, high])
    return {
        "cell_mm": [float(f * s) for f, s in zip(factors, spacing)],
        "shape": cells,
        "pieces": boxes,
        "voxels": {
            "spacing": [float(s) for s in spacing],
            "shape": [int(n) for n in label.shape[:3]],
            "pieces": voxel_boxes,
        },
    }


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
        "background": background_summary(cases, modalities),
    }


def background_summary(cases: dict[str, dict], modalities: list[str]) -> list[dict]:
    """Per channel: how many of the cases that record a `background` have a z-scored one (a non-zero border
    constant), and the range of those constants.

    Example:
        >>> cases = {"a": {"background": [-3.6, 0.0]}, "b": {"background": [-3.2, 0.0]}, "c": {}}
        >>> flair, t1 = background_summary(cases, ["FLAIR", "T1w"])
        >>> flair["num_cases"], flair["border_constant_cases"], flair["border_constants"], t1["border_constants"]
        (2, 2, [-3.6, -3.2], None)
    """
    recorded = [c["background"] for c in cases.values() if c.get("background") is not None]
    out = []
    for ch, name in enumerate(modalities):
        constants = [b[ch] for b in recorded if b[ch] is not None and b[ch] != 0]
        out.append(
            {
                "channel": ch,
                "modality": name,
                "num_cases": len(recorded),
                "border_constant_cases": len(constants),
                "border_constants": [min(constants), max(constants)] if constants else None,
            }
        )
    return out


def background_lines(summary: list[dict] | None) -> list[str]:
    """One line per channel whose background is a non-zero border constant in some case (`background_summary`), e.g.
    "background: channel 0 FLAIR is the border constant -3.6 (not 0) in 4 of 4 cases"; none when every background
    is 0 (or CT, or not recorded)."""
    lines = []
    for c in summary or []:
        if not c["border_constant_cases"]:
            continue
        lo, hi = c["border_constants"]
        value = f"{lo:.3g}" if lo == hi else f"{lo:.3g} to {hi:.3g}"
        lines.append(
            f"background: channel {c['channel']} {c['modality']} is the border constant {value} (not 0) in "
            f"{c['border_constant_cases']} of {c['num_cases']} cases: the crop and the z-score use it"
        )
    return lines
