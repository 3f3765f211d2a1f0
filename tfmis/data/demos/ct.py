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
from tfmis.data.demos.ct import make_ct_dataset
root = make_ct_dataset("data/Task90_DemoCT", num_cases=20)
```
or from a shell: `python -m tfmis.data.demos.ct --output data/Task90_DemoCT --cases 20`.

Real size (`--size full`, `generate_full_case`): abdominal CT as users have it, 512 x 512 x 100-600
(slices drawn per case from `--slices MIN,MAX`), 0.7-0.9 mm pixels, 1.5/2/2.5/3/5 mm slices (one
that gives a 300-950 mm scan), int16 HU, LPS. A body whose outline changes along z, subcutaneous
fat, spine, lung bases at the top of long scans, and labels of very different sizes: 1 liver
(~1.5 l), 2 spleen, 3 kidney (both), 4 pancreas (a thin elongated organ), 5 lesion (a hypodense
liver lesion, radius 4-30 mm, often small; absent when outside the scanned range). Cases are built
32 slices at a time, so the memory beyond the finished image and label (int16 and uint8) is a few slabs,
whatever Z is (time and memory per case: docs/converting.md, "Real-size variants"):

```bash
python -m tfmis.data.demos.ct --size full --output data/Task91_DemoCTFull --cases 20 --slices 100,600
```

Structures far apart (`--size full --anatomy far`, `anatomy="far"`, default name Task92_DemoCTFar),
for coarse-to-fine cascades: the same body, fat, spine, noise, int16 HU, LPS order and pixels, but a
long scan from the lung bases to the pelvis (slices of 1.0-5 mm, the thin 1.0/1.25 mm ones included:
any that gives a 560-700 mm scan, else the one nearest 630 mm; 450-600 slices give 1.0-1.5 mm). The
liver is at the top end, label 6 "bladder" (a fluid-filled ellipsoid, 10-20 HU, ~0.2 l, centre ~340
mm below the liver's) at the bottom end, so one box around all foreground covers most of the scan.
Label 5 "lesion" is in the LEFT kidney instead of the liver (a hypodense sphere, 20 HU, radius 4-12
mm, surrounded by kidney): a small piece away from the big organs. A scan shorter than the lung bases
to the pelvis (~470-570 mm) loses both ends equally.

```bash
python -m tfmis.data.demos.ct --size full --anatomy far --cases 6 --slices 450,600
```

Command line: `--output DIR`, `--cases N` (default 20), `--test-cases N` (default 1), `--seed S`,
`--size small|full` (default small), `--shape X,Y,Z` (small only, default 96,96,40),
`--slices MIN,MAX` (full only, default 100,600), `--in-plane N` (full only, default 512; smaller
values scale the pixel size up and keep the anatomy, for tests), `--anatomy abdomen|far` (full only,
default abdomen: the labels and cases above, unchanged).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import nibabel as nib
import numpy as np
from scipy import interpolate, ndimage

from tfmis.utils.io import atomic_save_nifti, atomic_writer

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
SMALL_DESCRIPTION = (
    "Synthetic CT-like abdomen slabs made by tfmis.data.demos.ct (integer "
    "HU, anisotropic voxels, a spleen-like organ with a small lesion)"
)
FULL_DESCRIPTION = (
    "Synthetic real-size abdominal CT made by tfmis.data.demos.ct --size full (512 x 512 x 100-600, "
    "integer HU, 0.7-0.9 mm pixels, 1.5-5 mm slices; liver, spleen, kidneys, pancreas, a liver lesion)"
)


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


# --------------------------------------------------------------------------------------------
# Real-size CT (`--size full`): 512 x 512 x 100-600, generated slab by slab
# --------------------------------------------------------------------------------------------

FULL_DATASET_NAME = "Task91_DemoCTFull"
FULL_LABELS = {"0": "background", "1": "liver", "2": "spleen", "3": "kidney", "4": "pancreas", "5": "lesion"}
FULL_HU = {"kidney": 150, "pancreas": 80, "liver_lesion": 25, "lung": -850, "kidney_lesion": 20}
FULL_SLICE_MM = (1.5, 2.0, 2.5, 3.0, 5.0)
ANATOMIES = ("abdomen", "far")  # `anatomy=` of the real-size cases; "abdomen" is the default
FAR_DATASET_NAME = "Task92_DemoCTFar"
FAR_LABELS = {**FULL_LABELS, "6": "bladder"}
# the far anatomy's slices: the usual ones and the thin (1.0/1.25 mm) ones of chest-abdomen-pelvis scans,
# the scan lengths it prefers (lung bases to pelvis is ~470-570 mm) and the one it takes when none fits
FAR_SLICE_MM = (1.0, 1.25) + FULL_SLICE_MM
FAR_SCAN_MM = (560.0, 700.0, 630.0)
FAR_DESCRIPTION = (
    "Synthetic real-size CT from the lung bases to the pelvis made by tfmis.data.demos.ct --size full "
    "--anatomy far (512 x 512 x Z, integer HU, 0.7-0.9 mm pixels, 1-5 mm slices, ~560-700 mm scans; liver, "
    "spleen, kidneys, pancreas, a lesion in the left kidney, a bladder ~340 mm below the liver)"
)
FULL_IN_PLANE = 512
FULL_SLICES = (100, 600)
SLAB_SLICES = 32  # slices generated at a time; part of the recipe (the noise is drawn per slab)
BLUR = (0.6, 0.6, 0.4)
HALO = 2  # slices either side of a slab that the z blur (sigma 0.4, truncate 4) reaches


@functools.lru_cache(maxsize=32)
def _spline_weights(nodes: int, n: int) -> np.ndarray:
    """(n, nodes) float32 cubic-spline weights, first node on sample 0, last on sample n-1."""
    spline = interpolate.make_interp_spline(np.linspace(0.0, 1.0, nodes), np.eye(nodes), k=3)
    return spline(np.linspace(0.0, 1.0, n)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class SmoothField:
    """A smooth random field (unit-ish sd) on a coarse grid, evaluated on any box of the volume."""

    coarse: np.ndarray
    shape: tuple[int, int, int]

    def box(self, xs: slice, ys: slice, zs: slice) -> np.ndarray:
        wx, wy, wz = (_spline_weights(c, n)[s] for c, n, s in zip(self.coarse.shape, self.shape, (xs, ys, zs)))
        field = np.tensordot(self.coarse, wz, axes=([2], [1]))  # (cx, cy, z)
        field = np.einsum("yj,ijz->iyz", wy, field)
        return np.einsum("xi,iyz->xyz", wx, field)


@dataclasses.dataclass(frozen=True)
class _Organ:
    """An ellipsoid (semi-axes mm, turned by `angle` about the slice axis) with a wobbly outline."""

    label: int
    hu: float
    centre: np.ndarray  # mm from the grid centre along L, P, S (the voxel axes: LPS order)
    semi_axes: np.ndarray
    angle: float
    wobble: float
    inside: int = 0  # only painted over this label (0: over background only)


@dataclasses.dataclass(frozen=True)
class FullCaseLayout:
    """Everything random about one real-size case except the noise: grid, body and organs."""

    shape: tuple[int, int, int]
    spacing: tuple[float, float, float]
    body_axes: tuple[float, float]
    body_taper: tuple[float, float]  # relative change of the body axes per 100 mm along z, and its phase
    fat_mm: float
    spine: tuple[float, float, float]  # x, y, radius mm
    organs: tuple[_Organ, ...]
    field: SmoothField

    def axis_mm(self, axis: int) -> np.ndarray:
        n, s = self.shape[axis], self.spacing[axis]
        return ((np.arange(n) - (n - 1) / 2) * s).astype(np.float32)

    @property
    def affine(self) -> np.ndarray:
        sxy, _, sz = self.spacing
        affine = np.diag([-sxy, -sxy, sz, 1.0])  # LPS voxel order
        affine[:3, 3] = [self.axis_mm(0)[-1], self.axis_mm(1)[-1], self.axis_mm(2)[0]]
        return affine


def full_case_layout(
    case_number: int,
    seed: int = 0,
    slices: tuple[int, int] = FULL_SLICES,
    in_plane: int = FULL_IN_PLANE,
    anatomy: str = "abdomen",
) -> FullCaseLayout:
    """Draws the grid and anatomy of real-size case `case_number`.

    Args:
        slices: (min, max) slices per case, inclusive; each case draws its own count.
        in_plane: voxels per in-plane axis; 512 gives 0.7-0.9 mm pixels, smaller values scale the
            pixel size up so the same ~360-460 mm field of view (and anatomy) fits (for tests).
        anatomy: "abdomen" (liver lesion, no bladder) or "far" (lung bases to pelvis: a bladder,
            label 6, at the bottom and the lesion in the left kidney; see the module docstring).
    """
    if anatomy not in ANATOMIES:
        raise ValueError(f"anatomy must be one of {ANATOMIES}, got {anatomy!r}")
    far = anatomy == "far"
    rng = np.random.default_rng([seed, case_number, 512])
    n_z = int(rng.integers(slices[0], slices[1] + 1))
    sxy = float(np.round(rng.uniform(0.7, 0.9), 3)) * FULL_IN_PLANE / in_plane
    # slice thickness: any of the usual ones that gives a 300-950 mm scan (far: 560-700 mm), else the nearest
    thicknesses, (shortest, longest, nearest) = (FAR_SLICE_MM, FAR_SCAN_MM) if far else (FULL_SLICE_MM, (300, 950, 600))
    lengths = np.array(thicknesses) * n_z
    fits = [s for s, length in zip(thicknesses, lengths) if shortest <= length <= longest]
    sz = float(rng.choice(fits)) if fits else float(thicknesses[int(np.argmin(np.abs(lengths - nearest)))])
    shape = (in_plane, in_plane, n_z)
    fov = in_plane * sxy / 2
    a, b = fov * rng.uniform(0.78, 0.88), fov * rng.uniform(0.58, 0.68)
    # anatomical z: 0 near the first lumbar vertebra; the scan centre sits a little above it
    z0 = -rng.uniform(0.0, 40.0)  # the anatomy's 0 in scan mm

    def jitter(*values):
        return np.array(values, dtype=np.float64) * rng.uniform(0.85, 1.15, len(values))

    organs = [
        _Organ(
            1,
            HU["liver"],
            np.array([-0.35 * a, -0.1 * b, z0 + 60]) + rng.normal(0, 5, 3),
            jitter(0.42 * a, 0.55 * b, 85),
            rng.uniform(-0.3, 0.3),
            0.25,
        ),
        _Organ(
            2,
            HU["spleen"],
            np.array([0.55 * a, 0.3 * b, z0 + 45]) + rng.normal(0, 5, 3),
            jitter(25, 45, 50) * rng.uniform(0.7, 1.2),
            rng.uniform(-0.6, 0.6),
            0.3,
        ),
    ]
    for side in (-1, 1):  # two kidneys, one label
        organs.append(
            _Organ(
                3,
                FULL_HU["kidney"],
                np.array([side * 0.3 * a, 0.45 * b, z0 - 25 + side * 8]) + rng.normal(0, 4, 3),
                jitter(25, 28, 52),
                side * rng.uniform(0.2, 0.5),
                0.15,
            )
        )
    organs.append(
        _Organ(
            4,
            FULL_HU["pancreas"],
            np.array([0.1 * a, 0.05 * b, z0 + 10]) + rng.normal(0, 5, 3),
            jitter(65, 11, 12),
            rng.uniform(-0.4, 0.1),
            0.35,
        )
    )
    if far:
        organs = _far_organs(rng, organs, b, n_z, sz)
    else:
        # a liver lesion of very varying size (4-30 mm radius, log-uniform: many small ones)
        liver = organs[0]
        radius = float(np.exp(rng.uniform(np.log(4.0), np.log(30.0))))
        offset = rng.uniform(-0.45, 0.45, 3) * (liver.semi_axes - radius).clip(0)
        organs.append(
            _Organ(5, FULL_HU["liver_lesion"], liver.centre + offset, np.full(3, radius), 0.0, 0.15, inside=1)
        )
    nodes = tuple(max(4, int(np.ceil(n * s / 60.0))) for n, s in zip(shape, (sxy, sxy, sz)))
    return FullCaseLayout(
        shape=shape,
        spacing=(sxy, sxy, sz),
        body_axes=(a, b),
        body_taper=(rng.uniform(0.02, 0.06), rng.uniform(0, 2 * np.pi)),
        fat_mm=rng.uniform(5.0, 25.0),
        spine=(rng.normal(0, 2), 0.62 * b, rng.uniform(14.0, 20.0)),
        organs=tuple(organs),
        field=SmoothField(rng.normal(size=nodes).astype(np.float32), shape),
    )


def _far_organs(rng: np.random.Generator, organs: list[_Organ], b: float, n_z: int, sz: float) -> list[_Organ]:
    """The far anatomy from the abdomen's organs [liver, spleen, right kidney, left kidney, pancreas].

    Adds a lesion inside the left kidney and a bladder in the pelvis, then moves everything along z so
    the scan runs from the lung bases (above the liver) to below the bladder. The left kidney and its
    lesion are painted before the spleen, so the spleen never cuts into the kidney around the lesion.
    """
    liver, spleen, right_kidney, left_kidney, pancreas = organs
    # a hypodense lesion well inside the left kidney: its edge at most ~0.45 of the kidney's semi-axes from the
    # kidney's centre (0.56 for the largest lesion in the smallest kidney), clear of the kidney's wobbly outline
    radius = float(np.exp(rng.uniform(np.log(4.0), np.log(12.0))))
    budget = max(0.0, 0.45 - 1.15 * radius / float(left_kidney.semi_axes.min()))
    u, v, w = rng.uniform(-1.0, 1.0, 3) * budget / np.sqrt(3.0) * left_kidney.semi_axes  # mm, the kidney's frame
    c, s = np.cos(left_kidney.angle), np.sin(left_kidney.angle)
    centre = left_kidney.centre + np.array([c * u - s * v, s * u + c * v, w])
    lesion = _Organ(5, FULL_HU["kidney_lesion"], centre, np.full(3, radius), 0.0, 0.1, inside=3)
    # the bladder: midline, anterior, ~340 mm below the liver's centre (L1 to the pubis)
    bladder = _Organ(
        6,
        rng.uniform(10.0, 20.0),
        np.array([0.0, -0.25 * b, liver.centre[2] - 340.0]) + rng.normal(0, [5, 5, 10]),
        np.array([45.0, 35.0, 35.0]) * rng.uniform(0.8, 1.2, 3),
        rng.uniform(-0.2, 0.2),
        0.1,
    )
    # along z: from the lung bases (30-70 mm of lung) to 20-50 mm below the bladder; the spare length of
    # a longer scan is 10-50 % above (chest), the rest below (thighs); a shorter scan loses both ends
    top = liver.centre[2] + 0.6 * liver.semi_axes[2] + rng.uniform(30.0, 70.0)
    bottom = bladder.centre[2] - bladder.semi_axes[2] - rng.uniform(20.0, 50.0)
    half, above = (n_z - 1) / 2 * sz, rng.uniform(0.1, 0.5)
    slack = 2 * half - (top - bottom)
    shift = half - above * slack - top if slack >= 0 else -(top + bottom) / 2
    painted = [liver, right_kidney, left_kidney, lesion, spleen, pancreas, bladder]  # liver first: the lungs need it
    return [dataclasses.replace(o, centre=o.centre + np.array([0.0, 0.0, shift])) for o in painted]


def _organ_boxes(layout: FullCaseLayout, organ: _Organ) -> tuple[slice, slice, slice]:
    """The voxel box that can hold `organ` (its semi-axes plus room for the wobble)."""
    reach = 1.4 * organ.semi_axes.max()
    boxes = []
    for axis in range(3):
        mm = layout.axis_mm(axis)
        lo, hi = np.searchsorted(mm, [organ.centre[axis] - reach, organ.centre[axis] + reach])
        boxes.append(slice(int(lo), int(hi)))
    return tuple(boxes)


def render_slab(layout: FullCaseLayout, z_lo: int, z_hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Noise-free HU (float32) and labels (uint8) of slices [z_lo, z_hi)."""
    x, y = layout.axis_mm(0)[:, None, None], layout.axis_mm(1)[None, :, None]
    z = layout.axis_mm(2)[None, None, z_lo:z_hi]
    nx, ny, nz = layout.shape[0], layout.shape[1], z_hi - z_lo
    a, b = (np.float32(v) for v in layout.body_axes)
    taper, phase = (np.float32(v) for v in layout.body_taper)
    scale = np.float32(1.0) + taper * np.sin(z / np.float32(100.0) + phase)
    body_r = np.sqrt((x / (a * scale)) ** 2 + (y / (b * scale)) ** 2)  # (X, Y, k) float32
    hu = np.full((nx, ny, nz), np.float32(HU["air"]), dtype=np.float32)
    body = body_r < 1.0
    hu[body] = HU["soft_tissue"]
    hu[body & (body_r > 1.0 - layout.fat_mm / min(a, b))] = HU["fat"]
    del body_r
    sx, sy, sr = layout.spine
    hu[np.broadcast_to((x - sx) ** 2 + (y - sy) ** 2 < sr**2, hu.shape)] = HU["bone"]
    # lung bases: the top of long scans, above the liver dome
    liver = layout.organs[0]
    lung_top = liver.centre[2] + 0.6 * liver.semi_axes[2]
    if z[0, 0, -1] > lung_top:
        lung = (((np.abs(x) - 0.45 * a) / (0.35 * a)) ** 2 + (y / (0.7 * b)) ** 2 < 1.0) & (z > lung_top) & body
        hu[lung] = FULL_HU["lung"]
    del body
    label = np.zeros((nx, ny, nz), dtype=np.uint8)
    for organ in layout.organs:
        xs, ys, zs = _organ_boxes(layout, organ)
        zs = slice(max(zs.start, z_lo), min(zs.stop, z_hi))
        if xs.start >= xs.stop or ys.start >= ys.stop or zs.start >= zs.stop:
            continue
        centre, axes = organ.centre.astype(np.float32), organ.semi_axes.astype(np.float32)
        dx = layout.axis_mm(0)[xs, None, None] - centre[0]
        dy = layout.axis_mm(1)[None, ys, None] - centre[1]
        dz = layout.axis_mm(2)[None, None, zs] - centre[2]
        c, s = np.float32(np.cos(organ.angle)), np.float32(np.sin(organ.angle))
        q = ((c * dx + s * dy) / axes[0]) ** 2 + ((c * dy - s * dx) / axes[1]) ** 2  # (X, Y, 1) in-plane
        q = q + (dz / axes[2]) ** 2
        q += np.float32(organ.wobble) * layout.field.box(xs, ys, zs)
        local = (xs, ys, slice(zs.start - z_lo, zs.stop - z_lo))
        inside = label[local] == organ.inside
        mask = (q < 1.0) & inside & (hu[local] > HU["fat"]) & (hu[local] < HU["bone"])
        label[local][mask] = organ.label
        hu[local][mask] = organ.hu
    return hu, label


def generate_full_case(
    case_number: int,
    seed: int = 0,
    slices: tuple[int, int] = FULL_SLICES,
    in_plane: int = FULL_IN_PLANE,
    anatomy: str = "abdomen",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One real-size case: (image int16 (X, Y, Z) HU, label uint8 (X, Y, Z), 4x4 LPS affine).

    Deterministic in (seed, case_number, slices, in_plane, anatomy); `anatomy="far"` gives the lung
    bases to pelvis scan with a bladder (label 6) and a left-kidney lesion (module docstring). Built
    `SLAB_SLICES` slices at a time, so the working memory beyond the returned arrays is a few slabs
    (~50 MB at 512 x 512), whatever Z is.

    Example:
        >>> image, label, affine = generate_full_case(0, slices=(20, 20), in_plane=64)
        >>> image.shape, image.dtype, label.dtype
        ((64, 64, 20), dtype('int16'), dtype('uint8'))
    """
    layout = full_case_layout(case_number, seed, slices, in_plane, anatomy)
    nx, ny, nz = layout.shape
    image = np.empty(layout.shape, dtype=np.int16)
    label = np.empty(layout.shape, dtype=np.uint8)
    x, y = layout.axis_mm(0)[:, None], layout.axis_mm(1)[None, :]
    outside_circle = np.hypot(x, y) > min(nx, ny) * layout.spacing[0] / 2 * 1.02
    for index, z_lo in enumerate(range(0, nz, SLAB_SLICES)):
        z_hi = min(z_lo + SLAB_SLICES, nz)
        lo, hi = max(z_lo - HALO, 0), min(z_hi + HALO, nz)
        hu, lab = render_slab(layout, lo, hi)
        # partial volume (a volume-wide blur: the halo makes slab edges exact), then scanner noise
        hu = ndimage.gaussian_filter(hu, sigma=BLUR)[:, :, z_lo - lo : z_hi - lo]
        noise_rng = np.random.default_rng([seed, case_number, 512, index])
        hu += noise_rng.standard_normal(hu.shape, dtype=np.float32) * np.float32(NOISE_HU)
        hu[outside_circle] = HU["padding"]
        np.rint(hu, out=hu)
        np.clip(hu, -1024, 3071, out=hu)
        image[:, :, z_lo:z_hi] = hu
        label[:, :, z_lo:z_hi] = lab[:, :, z_lo - lo : z_hi - lo]
    return image, label, layout.affine


def save_volume(data: np.ndarray, affine: np.ndarray, path: Path) -> None:
    img = nib.Nifti1Image(data, affine)
    img.set_data_dtype(data.dtype)
    img.header.set_xyzt_units("mm")
    atomic_save_nifti(img, path)


def case_name(case_number: int) -> str:
    return f"ct_{case_number:03d}"


def make_ct_dataset(
    root: str | Path,
    num_cases: int = 20,
    seed: int = 0,
    shape=(96, 96, 40),
    num_test: int = 1,
    size: str = "small",
    slices: tuple[int, int] = FULL_SLICES,
    in_plane: int = FULL_IN_PLANE,
    anatomy: str = "abdomen",
) -> Path:
    """Writes the CT-like dataset in the MSD layout (cases already there are kept); returns `root`.

    Args:
        root: the dataset folder to write (dataset.json, imagesTr, labelsTr, imagesTs).
        num_cases: labelled training cases.
        seed: the dataset's seed.
        shape: nominal voxels per case (each case varies by a few voxels).
        num_test: unlabelled test cases.
        size: "small" (the slabs above; `shape` applies) or "full" (real-size abdominal CT from
            `generate_full_case`: 512 x 512 x `slices`, labels liver, spleen, kidney, pancreas, lesion).
        slices: with size="full", the (min, max) slices per case.
        in_plane: with size="full", voxels per in-plane axis (512; smaller only for tests).
        anatomy: with size="full", "abdomen" (default) or "far" (lung bases to pelvis, labels 1-6 with
            6 bladder, the lesion in the left kidney; see the module docstring).

    Example:
        >>> root = make_ct_dataset("/tmp/Task90_DemoCT", num_cases=4, shape=(48, 48, 20))
    """
    if size not in ("small", "full"):
        raise ValueError(f"size must be 'small' or 'full', got {size!r}")
    if anatomy not in ANATOMIES:
        raise ValueError(f"anatomy must be one of {ANATOMIES}, got {anatomy!r}")
    if anatomy != "abdomen" and size != "full":
        raise ValueError(f"anatomy={anatomy!r} needs size='full'")

    def generate(number):
        if size == "full":
            return generate_full_case(number, seed, slices, in_plane, anatomy)
        return generate_case(number, seed, shape)

    root = Path(root)
    for sub in ("imagesTr", "labelsTr", "imagesTs"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    training = []
    for i in range(num_cases):
        name = case_name(i)
        image_path, label_path = root / "imagesTr" / f"{name}.nii.gz", root / "labelsTr" / f"{name}.nii.gz"
        if not (image_path.is_file() and label_path.is_file()):
            image, label, affine = generate(i)
            save_volume(label, affine, label_path)
            save_volume(image, affine, image_path)
        training.append({"image": f"./imagesTr/{name}.nii.gz", "label": f"./labelsTr/{name}.nii.gz"})
    test = []
    for i in range(FIRST_TEST_NUMBER, FIRST_TEST_NUMBER + num_test):
        path = root / "imagesTs" / f"{case_name(i)}.nii.gz"
        if not path.is_file():
            image, _, affine = generate(i)
            save_volume(image, affine, path)
        test.append(f"./imagesTs/{case_name(i)}.nii.gz")
    if anatomy == "far":
        description, labels = FAR_DESCRIPTION, FAR_LABELS
    else:
        description, labels = (FULL_DESCRIPTION, FULL_LABELS) if size == "full" else (SMALL_DESCRIPTION, LABELS)
    meta = {
        "name": root.name,
        "description": description,
        "tensorImageSize": "3D",
        "reference": "synthetic",
        "licence": "CC0",
        "release": "1.0",
        "modality": MODALITIES,
        "labels": labels,
        "numTraining": num_cases,
        "numTest": num_test,
        "training": training,
        "test": test,
    }
    with atomic_writer(root / "dataset.json") as f:
        f.write(json.dumps(meta, indent=2))
    return root


def _pair(text: str) -> tuple[int, int]:
    values = [int(v) for v in text.split(",")]
    if len(values) == 1:
        values *= 2
    if len(values) != 2 or not 1 <= values[0] <= values[1]:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 1 <= MIN <= MAX (or one number), got {text!r}")
    return values[0], values[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tfmis.data.demos.ct", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--output",
        default=None,
        help=f"dataset folder (default data/{DATASET_NAME}, or data/{FULL_DATASET_NAME} with --size full, "
        f"data/{FAR_DATASET_NAME} with --anatomy far)",
    )
    p.add_argument("--cases", type=int, default=20, help="labelled training cases (default 20)")
    p.add_argument("--test-cases", type=int, default=1, help="unlabelled test cases (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--size",
        choices=("small", "full"),
        default="small",
        help="small: slabs of --shape voxels (default); full: real-size 512 x 512 x --slices",
    )
    p.add_argument("--shape", default="96,96,40", help="small: nominal voxels per case X,Y,Z (default 96,96,40)")
    p.add_argument(
        "--slices",
        type=_pair,
        default=FULL_SLICES,
        metavar="MIN,MAX",
        help="full: slices per case, drawn per case in [MIN, MAX] (default 100,600)",
    )
    p.add_argument(
        "--in-plane",
        type=int,
        default=FULL_IN_PLANE,
        metavar="N",
        help="full: voxels per in-plane axis (default 512; smaller keeps the anatomy, for tests)",
    )
    p.add_argument(
        "--anatomy",
        choices=ANATOMIES,
        default="abdomen",
        help="full: abdomen (default: liver lesion) or far (a long scan from the lung bases to the pelvis: "
        "label 6 bladder at the bottom, the lesion in the left kidney)",
    )
    args = p.parse_args(argv)
    if args.anatomy != "abdomen" and args.size != "full":
        p.error(f"--anatomy {args.anatomy} needs --size full")
    shape = tuple(int(v) for v in args.shape.split(","))
    names = {"small": DATASET_NAME, "full": FULL_DATASET_NAME if args.anatomy == "abdomen" else FAR_DATASET_NAME}
    output = args.output or f"data/{names[args.size]}"
    start = time.perf_counter()
    root = make_ct_dataset(
        output,
        args.cases,
        args.seed,
        shape,
        args.test_cases,
        size=args.size,
        slices=args.slices,
        in_plane=args.in_plane,
        anatomy=args.anatomy,
    )
    nominal = (
        args.shape if args.size == "small" else f"{args.in_plane},{args.in_plane},{args.slices[0]}-{args.slices[1]}"
    )
    print(
        f"{root}: {args.cases} CT-like training cases (nominal {nominal} voxels) in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
