"""A conversion's work on the cases: preprocessing one case in a worker process (`process_case`: numpy, scipy and
the image readers only, no TensorFlow), the labels a case holds (`label_classes`, for stratified folds), and the
measurements made over the dataset's cases before the conversion is planned (median header spacing, CT foreground
statistics).

The worker functions take one picklable task tuple each and never raise: a bad case comes back skipped, with its
reason, so it never stops the others.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from tfmis.data import case_stats
from tfmis.data.case_pool import LOAD_PEAK_FACTOR, CasePool
from tfmis.data.preprocess import preprocess, ras_spacing
from tfmis.data.sources.cases import CT_MODALITIES, Case, SegmentationDataset, load_case
from tfmis.data.sources.errors import CaseError, DatasetError, UnreadableImage
from tfmis.data.sources.image_io import read_affine, read_image
from tfmis.data.sources.layouts import open_dataset


def header_spacing(case: Case, dataset: SegmentationDataset) -> np.ndarray:
    """RAS voxel spacing from the (first channel's) image header alone (no voxel data read)."""
    if case.problem:
        raise CaseError(case.case_id, case.problem)
    path = dataset.resolve(case, case.image_files[0])
    if not Path(path).is_file():
        raise CaseError(case.case_id, f"image file {path} does not exist")
    try:
        return ras_spacing(read_affine(path))
    except (UnreadableImage, ValueError, np.linalg.LinAlgError) as e:  # the worker reports it with the reason
        raise CaseError(case.case_id, f"cannot read header of {path}: {e}") from e


# ---------------------------------------------------------------- worker side (no TensorFlow here)


def process_case(task: tuple) -> dict:
    case, source_dir, prep = task
    try:
        dataset = open_dataset(source_dir)
        loaded = load_case(case, dataset)
        # the raw intensities are sampled first: preprocess then normalises in the loaded image's own memory
        ct = _ct_channels(dataset)
        intensity = case_stats.case_intensity(loaded.image, loaded.label, ct)
        background = case_stats.case_background(
            loaded.image, ct
        )  # what preprocess's foreground_mask finds (6 faces read)
        image, label, geometry = preprocess(loaded.image, loaded.label, loaded.affine, prep, overwrite_image=True)
        warnings = []
        if label is not None and not (label > 0).any():
            warnings.append("label has no foreground voxels")
        return {
            "case_id": case.case_id,
            "status": "ok",
            "image": image,
            "label": label,
            "geometry": geometry.to_dict(),
            "warnings": warnings,
            "disk_dtype": loaded.header_dtype,
            "fingerprint": case_stats.case_fingerprint(
                None,
                loaded.label,
                ras_spacing(loaded.affine),
                geometry,
                label,
                dataset.num_classes,
                intensity,
                background,
            ),
        }
    except CaseError as e:
        return {"case_id": case.case_id, "status": "skipped", "reason": e.reason}
    except Exception as e:  # never let one case stop the others
        return {"case_id": case.case_id, "status": "skipped", "reason": f"unexpected {type(e).__name__}: {e}"}


def label_classes(task: tuple) -> list[int]:
    """The foreground label values a case's label file holds (read once, nothing else); [] if it cannot be read
    (the main pass reports the case)."""
    case, source_dir = task
    try:
        dataset = open_dataset(source_dir)
        label = read_image(dataset.resolve(case, case.label)).array
        if label.dtype == np.uint8:
            values = np.flatnonzero(np.bincount(label.ravel(), minlength=1))
        else:
            values = np.unique(label)
        return sorted({int(v) for v in values if 0 < v < dataset.num_classes and float(v).is_integer()})
    except Exception:
        return []


def case_foreground_sample(task: tuple) -> np.ndarray | None:
    case, source_dir = task
    try:
        dataset = open_dataset(source_dir)
        loaded = load_case(case, dataset)
        return case_stats.foreground_sample(loaded.image, loaded.label, _ct_channels(dataset))
    except Exception:
        return None  # reported by the main pass


def _ct_channels(dataset: SegmentationDataset) -> list[int]:
    return [i for i, m in enumerate(dataset.modalities) if str(m).upper() in CT_MODALITIES]


# ---------------------------------------------------------------- main side: the dataset's cases measured


def dataset_median_spacing(dataset: SegmentationDataset) -> tuple[float, float, float] | None:
    spacings = []
    for case in dataset.training:
        try:
            spacings.append(header_spacing(case, dataset))
        except CaseError:
            pass  # the worker reports this case with its reason
    return tuple(float(s) for s in np.round(np.median(spacings, axis=0), 4)) if spacings else None


def first_unreadable(dataset: SegmentationDataset) -> str:
    """The first training case whose image header cannot be read, with the reason (`case_id: why`)."""
    for case in dataset.training:
        try:
            header_spacing(case, dataset)
        except CaseError as e:
            return f"{case.case_id}: {e.reason}"
    return "none"


def ct_foreground_statistics(
    dataset: SegmentationDataset, workers: int | None
) -> tuple[tuple[float, float], tuple[float, float]]:
    """((0.5, 99.5) percentiles, (mean, std)) of the CT channels' labelled foreground intensities, sampled from
    every training case (nnU-Net's foreground intensity properties); `workers` at most (None: the CPUs), fewer
    when the memory holds fewer cases (`CasePool`)."""
    tasks = [(c, str(dataset.root)) for c in dataset.training]
    pool = CasePool("Measuring the CT window", dataset, LOAD_PEAK_FACTOR, asked=workers)
    print(pool.describe(), file=sys.stderr)
    samples = [s for s in pool.run(case_foreground_sample, tasks, lambda case_id, reason: None) if s is not None]
    if not samples:
        raise DatasetError(f"{dataset.root}: no readable case to measure the CT window from; pass --ct-window")
    ct_channels = [i for i, m in enumerate(dataset.modalities) if m.upper() == "CT"]
    values = np.concatenate([s[:, ct_channels].ravel() for s in samples]).astype(np.float64)
    return case_stats.ct_window(values), (float(values.mean()), float(values.std()))
