"""What a zoo dataset kind is (`Kind`) and how one is written to disk in the MSD layout (`make_dataset`).

A kind is a deterministic generator of cases: `kind.generate(number, seed)` returns `(image, label, affine)` with
`image` (X, Y, Z) or (X, Y, Z, C) in the stored dtype, `label` uint8 (X, Y, Z) and a 4x4 voxel-to-world affine (RAS
mm, as nibabel). Training cases are numbers 0..n-1, held-out test cases `TEST_FIRST`.. (a kind may map the numbers
onto its own sources, e.g. the real label maps of `real_anatomy`, but the mapping is fixed by the seed).

Layout written (`make_dataset`):

```
ROOT/dataset.json              MSD: name, modality, labels, training (image + label), test (images)
ROOT/imagesTr/<kind>_000.nii.gz ...   ROOT/labelsTr/<kind>_000.nii.gz ...
ROOT/imagesTs/<kind>_1000.nii.gz ...  ROOT/labelsTs/<kind>_1000.nii.gz ...   (the held-out test cases, with labels)
ROOT/zoo_dataset.json          the kind, seed, case counts, per-case shape/spacing/class shares, generation seconds
```

`dataset.json` and `zoo_dataset.json` are written last, so a folder holding them is complete: `make_dataset` on it
does nothing (the cache). A folder holding another kind, seed or case count is refused, never overwritten.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import nibabel as nib
import numpy as np

from tfmis.utils.io import atomic_save_nifti, atomic_write_json, atomic_writer

TEST_FIRST = 1000  # case numbers of the held-out test cases start here
MARKER = "zoo_dataset.json"


@dataclasses.dataclass(frozen=True)
class Kind:
    """One dataset kind of the zoo.

    Attributes:
        name: the kind's name (`--kinds`), also the case-file prefix.
        description: one line for the report and dataset.json.
        modalities: channel names, index = channel (MSD `modality`).
        labels: class names, index = label value, background first.
        spacing: the documented voxel size (mm, per array axis); cases may vary within `spacing_tolerance`.
        shape: the nominal array shape (X, Y, Z); cases may vary around it (see `shape_tolerance`).
        shares: {class name: (low, high)} the documented share of the voxels of each foreground class, per case.
        generate: (case number, seed) -> (image, label, affine).
        num_train, num_test: training cases (tfmis splits them into train/val/test itself) and held-out test cases.
        hand_patch: the hand recipe's `pipeline.patch_size` for this kind (`hand_patch` below: the rule).
        regions: label unions also scored (BraTS-like kinds), {name: [labels]}, or None.
        spacing_tolerance: relative tolerance of a case's spacing around `spacing`.
        shape_tolerance: relative tolerance of a case's shape around `shape`.
    """

    name: str
    description: str
    modalities: tuple[str, ...]
    labels: tuple[str, ...]
    spacing: tuple[float, float, float]
    shape: tuple[int, int, int]
    shares: dict
    generate: Callable[[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]
    num_train: int = 12
    num_test: int = 4
    hand_patch: tuple[int, int, int] = (48, 48, 48)
    regions: dict | None = None
    spacing_tolerance: float = 0.01
    shape_tolerance: float = 0.15

    def case_name(self, number: int) -> str:
        return f"{self.name}_{number:03d}"


def hand_patch(shape, spacing, median_spacing=None, base: int = 48, multiple: int = 8) -> tuple[int, int, int]:
    """The hand recipe's patch for a dataset: configs/demo.yaml's 48^3, each axis shrunk (never grown) to the
    dataset's median preprocessed extent on that axis rounded down to a multiple of 8 (the demo U-Net's three
    stride-2 levels), at least 8: e.g. 128x128x31 at 3x3x3 mm gives 48x48x24 (the 3 mm CT recipe).

    Args:
        shape, spacing: the kind's nominal array shape and voxel size.
        median_spacing: the spacing tfmis resamples to (default `spacing`: the median of the cases).
    """
    median_spacing = spacing if median_spacing is None else median_spacing
    extent = [n * s / m for n, s, m in zip(shape, spacing, median_spacing)]
    return tuple(int(max(multiple, min(base, multiple * int(e // multiple)))) for e in extent)


_ACCEPTED: dict = {}  # (generate, accept, seed, first) -> the candidate numbers accepted so far, in order


def nth_accepted(generate, accept, seed: int, first: int, index: int) -> int:
    """The `index`-th candidate number from `first` on (first, first + 1, ...) whose case `generate(number, seed)`
    passes `accept(case)`: a deterministic pick of a generator's cases (e.g. those holding a lesion); the numbers
    found are remembered per process."""
    found = _ACCEPTED.setdefault((generate, accept, seed, first), [])
    candidate = found[-1] + 1 if found else first
    while len(found) <= index:
        if accept(generate(candidate, seed)):
            found.append(candidate)
        candidate += 1
    return found[index]


def class_shares(label: np.ndarray, num_classes: int) -> np.ndarray:
    """The share of the voxels of each class 0..num_classes-1."""
    return np.bincount(label.ravel(), minlength=num_classes)[:num_classes] / label.size


def _nifti(data: np.ndarray, affine: np.ndarray) -> nib.Nifti1Image:
    img = nib.Nifti1Image(data, affine)
    img.set_data_dtype(data.dtype)
    img.set_qform(affine, code=1)
    img.set_sform(affine, code=1)
    img.header.set_xyzt_units("mm")
    return img


def dataset_complete(root, kind: Kind, seed: int, num_train: int, num_test: int) -> bool:
    """True when `root` holds this kind's finished dataset (same seed and case counts)."""
    marker = Path(root) / MARKER
    if not (marker.is_file() and (Path(root) / "dataset.json").is_file()):
        return False
    info = json.loads(marker.read_text())
    same = (info.get("kind"), info.get("seed"), info.get("num_train"), info.get("num_test")) == (
        kind.name,
        seed,
        num_train,
        num_test,
    )
    if not same:
        raise ValueError(
            f"{root} holds {info.get('kind')} seed {info.get('seed')} ({info.get('num_train')}+{info.get('num_test')} "
            f"cases), not {kind.name} seed {seed} ({num_train}+{num_test}): choose another folder"
        )
    return True


def make_dataset(root, kind: Kind, seed: int, num_train: int | None = None, num_test: int | None = None) -> dict:
    """Writes `kind`'s dataset for `seed` to `root` (MSD layout, held-out test labels in labelsTs) unless it is
    already there; returns the contents of `zoo_dataset.json` (per case: shape, spacing, class shares; seconds).

    Args:
        num_train, num_test: case counts (default the kind's; smaller ones for tests).
    """
    root = Path(root)
    num_train = kind.num_train if num_train is None else num_train
    num_test = kind.num_test if num_test is None else num_test
    if dataset_complete(root, kind, seed, num_train, num_test):
        return json.loads((root / MARKER).read_text())
    start = time.perf_counter()
    (root / "dataset.json").unlink(missing_ok=True)  # an interrupted rewrite must not look finished
    for sub in ("imagesTr", "labelsTr", "imagesTs", "labelsTs"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    cases = []
    numbers = [(n, False) for n in range(num_train)] + [(TEST_FIRST + n, True) for n in range(num_test)]
    for number, is_test in numbers:
        name = kind.case_name(number)
        image_dir, label_dir = ("imagesTs", "labelsTs") if is_test else ("imagesTr", "labelsTr")
        image, label, affine = kind.generate(number, seed)
        atomic_save_nifti(
            _nifti(np.ascontiguousarray(label.astype(np.uint8)), affine), root / label_dir / f"{name}.nii.gz"
        )
        atomic_save_nifti(_nifti(np.ascontiguousarray(image), affine), root / image_dir / f"{name}.nii.gz")
        shares = class_shares(label, len(kind.labels))
        cases.append(
            {
                "case": name,
                "test": is_test,
                "shape": list(image.shape),
                "dtype": str(image.dtype),
                "spacing": [round(float(s), 4) for s in nib.affines.voxel_sizes(affine)],
                "axcodes": "".join(nib.aff2axcodes(affine)),
                "shares": {n: float(s) for n, s in zip(kind.labels, shares)},
            }
        )
    meta = {
        "name": f"Zoo_{kind.name}",
        "description": kind.description,
        "reference": "synthetic (benchmarks/zoo)",
        "licence": "see benchmarks/zoo",
        "release": "1.0",
        "tensorImageSize": "4D" if len(kind.modalities) > 1 else "3D",
        "modality": {str(i): m for i, m in enumerate(kind.modalities)},
        "labels": {str(i): n for i, n in enumerate(kind.labels)},
        "numTraining": num_train,
        "numTest": num_test,
        "training": [
            {"image": f"./imagesTr/{c['case']}.nii.gz", "label": f"./labelsTr/{c['case']}.nii.gz"}
            for c in cases
            if not c["test"]
        ],
        "test": [f"./imagesTs/{c['case']}.nii.gz" for c in cases if c["test"]],
    }
    info = {
        "kind": kind.name,
        "seed": seed,
        "num_train": num_train,
        "num_test": num_test,
        "labels": list(kind.labels),
        "regions": kind.regions,
        "seconds": time.perf_counter() - start,
        "cases": cases,
    }
    with atomic_writer(root / "dataset.json") as f:
        f.write(json.dumps(meta, indent=2) + "\n")
    atomic_write_json(root / MARKER, info)
    return info
