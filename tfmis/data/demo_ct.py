"""A small CT-like dataset in the MSD layout: integer Hounsfield units, anisotropic voxels, small organs.

For tests and for trying the planner (`python -m tfmis.plan`) on CT-style data without a download.
Each case is an abdomen-like slab on a scanner grid:

* air -1000 HU inside the scan circle, -1024 padding outside it (as CT scanners write);
* a body (elliptic cylinder) of soft tissue ~40 HU under a subcutaneous fat layer ~-100 HU, a
  vertebra-like bone cylinder ~700 HU, a liver-like organ ~60 HU (not labelled);
* label 1 "spleen": an irregular blob ~100 HU (contrast-enhanced), label 2 "lesion": a small hypodense
  sphere ~30 HU inside it in most cases;
* partial-volume blur and Gaussian noise (sd 12 HU), stored as int16 (LPS voxel order, as DICOM
  converters write);
* anisotropic spacing varying per case: 0.7-0.9 mm in-plane, 2.0/2.5/3.0 mm slices.

Layout written: `DIR/dataset.json`, `DIR/imagesTr/ct_000.nii.gz`, `DIR/labelsTr/ct_000.nii.gz`,
`DIR/imagesTs/ct_900.nii.gz`. Every case is a deterministic function of (seed, case number).

Example:
```python
from tfmis.data.demo_ct import make_ct_dataset
root = make_ct_dataset("data/Task90_DemoCT", num_cases=20)     # about 0.2 s per case
```
or from a shell: `python -m tfmis.data.demo_ct --output data/Task90_DemoCT --cases 20`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
from scipy import ndimage

DATASET_NAME = "Task90_DemoCT"
MODALITIES = {"0": "CT"}
LABELS = {"0": "background", "1": "spleen", "2": "lesion"}
FIRST_TEST_NUMBER = 900
HU = {
    "air": -1000,
    "padding": -1024,
    "fat": -100,
    "soft_tissue": 40,
    "liver": 60,
    "spleen": 100,
    "lesion": 30,
    "bone": 700,
}
NOISE_HU = 12.0


def _smooth_field(rng: np.random.Generator, shape, sigma_voxels) -> np.ndarray:
    """A smooth random field with unit standard deviation."""
    field = ndimage.gaussian_filter(rng.normal(size=shape), sigma_voxels, mode="wrap")
    return field / max(float(field.std()), 1e-8)


def generate_case(case_number: int, seed: int = 0, shape=(96, 96, 40)) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One case: (image int16 (X, Y, Z) in HU, label uint8 (X, Y, Z), 4x4 LPS affine).

    Args:
        case_number: the case's number (any int; with `seed`, decides everything).
        seed: the dataset's seed.
        shape: the nominal voxel grid; each case varies it by a few voxels.
    """
    rng = np.random.default_rng([seed, case_number])
    sxy = float(np.round(rng.uniform(0.7, 0.9), 3))
    sz = float(rng.choice([2.0, 2.5, 2.5, 3.0]))
    n = np.array([shape[0] + rng.integers(-6, 7), shape[1] + rng.integers(-6, 7), shape[2] + rng.integers(-4, 5)])
    spacing = np.array([sxy, sxy, sz])
    # millimetre coordinates centred on the grid; x left-right, y anterior-posterior, z slices
    x, y, z = (((np.arange(k) - (k - 1) / 2) * s) for k, s in zip(n, spacing))
    X, Y, Z = np.meshgrid(x, y, z, indexing="ij")
    fov = min(n[0] * sxy, n[1] * sxy) / 2
    wobble = _smooth_field(rng, tuple(n), (6, 6, 3))

    a, b = fov * rng.uniform(0.80, 0.90), fov * rng.uniform(0.62, 0.72)  # body semi-axes
    body_r = np.sqrt((X / a) ** 2 + (Y / b) ** 2)
    body = body_r < 1.0
    fat_depth = rng.uniform(4.0, 7.0) / min(a, b)
    hu = np.full(tuple(n), float(HU["air"]))
    hu[body] = HU["soft_tissue"]
    hu[body & (body_r > 1.0 - fat_depth)] = HU["fat"]
    spine_c = np.array([rng.normal(0, 2), -0.62 * b])
    hu[np.hypot(X - spine_c[0], Y - spine_c[1]) < rng.uniform(6.0, 8.0)] = HU["bone"]
    liver_c = np.array([-0.38 * a, 0.15 * b, rng.normal(0, 5)])
    liver_ax = np.array([0.42 * a, 0.5 * b, 40.0]) * rng.uniform(0.85, 1.1, 3)
    liver = (
        ((X - liver_c[0]) / liver_ax[0]) ** 2
        + ((Y - liver_c[1]) / liver_ax[1]) ** 2
        + ((Z - liver_c[2]) / liver_ax[2]) ** 2
        + 0.25 * wobble
    ) < 1.0
    hu[liver & body] = HU["liver"]

    spleen_c = np.array([0.5 * a, -0.25 * b, rng.normal(0, 0.1 * n[2] * sz)]) + rng.normal(0, 3, 3)
    spleen_ax = np.array([rng.uniform(10, 15), rng.uniform(14, 20), rng.uniform(18, 30)])
    spleen_r = (
        ((X - spleen_c[0]) / spleen_ax[0]) ** 2
        + ((Y - spleen_c[1]) / spleen_ax[1]) ** 2
        + ((Z - spleen_c[2]) / spleen_ax[2]) ** 2
    )
    spleen = (spleen_r + 0.3 * _smooth_field(rng, tuple(n), (4, 4, 2)) < 1.0) & body & ~liver
    label = spleen.astype(np.uint8)
    hu[spleen] = HU["spleen"]
    if rng.random() < 0.8 and spleen.sum() > 50:  # most cases have a lesion inside the spleen
        inside = (
            np.argwhere(ndimage.binary_erosion(spleen, iterations=2)) if spleen.sum() > 400 else np.argwhere(spleen)
        )
        centre = inside[rng.integers(len(inside))]
        radius = rng.uniform(3.5, 6.0)
        lesion = (
            np.sqrt((X - x[centre[0]]) ** 2 + (Y - y[centre[1]]) ** 2 + (Z - z[centre[2]]) ** 2) < radius
        ) & spleen
        hu[lesion] = HU["lesion"]
        label[lesion] = 2
    # partial volume along each axis by its voxel size, then scanner noise
    hu = ndimage.gaussian_filter(hu, sigma=(0.6, 0.6, 0.4))
    hu += rng.normal(0.0, NOISE_HU, hu.shape)
    hu[np.hypot(X, Y) > fov * 1.02] = HU["padding"]  # outside the reconstruction circle
    image = np.clip(np.round(hu), -1024, 3071).astype(np.int16)
    affine = np.diag([-sxy, -sxy, sz, 1.0])  # LPS voxel order
    affine[:3, 3] = [x[-1], y[-1], z[0]]
    return image, label, affine


def _save(data: np.ndarray, affine: np.ndarray, path: Path) -> None:
    img = nib.Nifti1Image(data, affine)
    img.set_data_dtype(data.dtype)
    img.header.set_xyzt_units("mm")
    tmp = path.with_name(path.name + ".tmp.nii.gz")
    nib.save(img, str(tmp))
    os.replace(tmp, path)


def case_name(case_number: int) -> str:
    return f"ct_{case_number:03d}"


def make_ct_dataset(
    root: str | Path, num_cases: int = 20, seed: int = 0, shape=(96, 96, 40), num_test: int = 1
) -> Path:
    """Writes the CT-like dataset in the MSD layout (cases already there are kept); returns `root`.

    Args:
        root: the dataset folder to write (dataset.json, imagesTr, labelsTr, imagesTs).
        num_cases: labelled training cases.
        seed: the dataset's seed.
        shape: nominal voxels per case (each case varies by a few voxels).
        num_test: unlabelled test cases.

    Example:
        >>> root = make_ct_dataset("/tmp/Task90_DemoCT", num_cases=4, shape=(48, 48, 20))
    """
    root = Path(root)
    for sub in ("imagesTr", "labelsTr", "imagesTs"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    training = []
    for i in range(num_cases):
        name = case_name(i)
        image_path, label_path = root / "imagesTr" / f"{name}.nii.gz", root / "labelsTr" / f"{name}.nii.gz"
        if not (image_path.is_file() and label_path.is_file()):
            image, label, affine = generate_case(i, seed, shape)
            _save(label, affine, label_path)
            _save(image, affine, image_path)
        training.append({"image": f"./imagesTr/{name}.nii.gz", "label": f"./labelsTr/{name}.nii.gz"})
    test = []
    for i in range(FIRST_TEST_NUMBER, FIRST_TEST_NUMBER + num_test):
        path = root / "imagesTs" / f"{case_name(i)}.nii.gz"
        if not path.is_file():
            image, _, affine = generate_case(i, seed, shape)
            _save(image, affine, path)
        test.append(f"./imagesTs/{case_name(i)}.nii.gz")
    meta = {
        "name": root.name,
        "description": "Synthetic CT-like abdomen slabs made by tfmis.data.demo_ct (integer "
        "HU, anisotropic voxels, a spleen-like organ with a small lesion)",
        "tensorImageSize": "3D",
        "reference": "synthetic",
        "licence": "CC0",
        "release": "1.0",
        "modality": MODALITIES,
        "labels": LABELS,
        "numTraining": num_cases,
        "numTest": num_test,
        "training": training,
        "test": test,
    }
    tmp = root / "dataset.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, root / "dataset.json")
    return root


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tfmis.data.demo_ct", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default=f"data/{DATASET_NAME}", help=f"dataset folder (default data/{DATASET_NAME})")
    p.add_argument("--cases", type=int, default=20, help="labelled training cases (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", default="96,96,40", help="nominal voxels per case X,Y,Z (default 96,96,40)")
    args = p.parse_args(argv)
    shape = tuple(int(v) for v in args.shape.split(","))
    root = make_ct_dataset(args.output, args.cases, args.seed, shape)
    print(f"{root}: {args.cases} CT-like training cases (nominal {args.shape} voxels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
