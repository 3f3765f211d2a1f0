"""A small, realistic demo dataset in the Medical Segmentation Decathlon (MSD) layout.

Every case is the real anatomy of the MNI ICBM152 2009a template (shipped as the 2 mm asset
`assets/mni152_2mm.npz`, see `assets/MNI152_LICENSE.txt`), warped by a random smooth elastic
deformation and a small random affine, resampled onto a scanner-like grid, and given:

* two channels, channels last (X, Y, Z, 2): T1w (the template's own T1 contrast) and a T2w
  synthesised from the tissue probabilities (CSF bright, grey matter intermediate, white matter
  dark), each with a smooth bias field, a little noise and arbitrary scanner units;
* a label map: 0 background, 1 grey matter, 2 white matter, 3 lesion (one irregular blob in the
  white matter, dark on T1w and bright on T2w);
* the quirks of real data: isotropic and anisotropic voxels, RAS / LPS / LAS / permuted voxel
  orders with correct affines, int16 / big-endian int16 / float32 images, zero background outside
  the (skull-stripped) brain, a field of view larger than the brain.

Layout written:

```
DIR/dataset.json
DIR/imagesTr/demo_000.nii.gz ...   DIR/labelsTr/demo_000.nii.gz ...   DIR/imagesTs/demo_100.nii.gz ...
```

Example:
```python
from tfmis.data.demo import make_demo_dataset
root = make_demo_dataset("data/Task00_DemoBrain")   # no-op if present
```
or from a shell: `python -m tfmis.data.demo --output data/Task00_DemoBrain`.

BraTS size (`--size brats`, `generate_brats_case`): the same template, deformed and resampled at
1 mm onto the BraTS box (240 x 240 x 155, LPS, int16), with up to four channels (`--channels C`, the
first C of FLAIR, T1w, T1gd, T2w; contrasts synthesised from the tissue maps) and BraTS-like labels:
0 background, 1 edema, 2 non-enhancing tumor, 3 enhancing tumour (MSD Task01 names). One tumour per
case, its core radius log-uniform in 4-30 mm (many small ones), an enhancing rim 1.5-4 mm thick
around a non-enhancing core, irregular oedema reaching 1.4-2.6 radii along white matter (time and memory per
case: docs/converting.md, "Real-size variants"):

```bash
python -m tfmis.data.demo --size brats --output data/Task01_DemoBraTS --cases 6 --test-cases 0
```

Z-scored (`--zscore`, brats only; `generate_brats_case(..., zscore=True)`): the same cases written as many public
MRI sets come, float32, each channel (x - mean) / std over its body (the non-zero voxels), so the background is a
per-case, per-channel constant such as -3.6 instead of 0 (the anatomy, labels and affines are those of the raw
cases):

```bash
python -m tfmis.data.demo --size brats --zscore --output data/Task01_DemoBraTS_z --cases 6 --test-cases 0
```

Command line: `--output DIR` (required), `--cases N` (12), `--test-cases N` (3), `--seed S` (0),
`--overwrite`, `--size demo|brats` (demo), `--channels C` (brats: 2-4, default 4), `--spacing MM`
(brats: default 1.0; coarser only for tests, e.g. 2.0 gives 120 x 120 x 78), `--zscore` (brats: float32 z-scored).

Only numpy, scipy and nibabel are used; every case is a deterministic function of (seed, case number).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from importlib import resources
from pathlib import Path

import nibabel as nib
import numpy as np
from nibabel import orientations
from scipy import interpolate, ndimage

from tfmis.utils.io import atomic_save_nifti, atomic_writer

DATASET_NAME = "Task00_DemoBrain"
MODALITIES = {"0": "T1w", "1": "T2w"}
LABELS = {"0": "background", "1": "grey matter", "2": "white matter", "3": "lesion"}
FIRST_TEST_NUMBER = 100
TEMPLATE_ASSET = "mni152_2mm.npz"

DESCRIPTION = (
    "Synthetic demo dataset made by tfmis.data.demo: the anatomy is the MNI ICBM152 2009a nonlinear "
    "symmetric template (T1 and grey/white-matter probability maps, Copyright (C) 1993-2009 Louis "
    "Collins, McConnell Brain Imaging Centre, Montreal Neurological Institute, McGill University), "
    "randomly deformed per case; T2w contrast, bias fields, noise and one synthetic white-matter "
    "lesion per case are simulated. Not for clinical or research use."
)
REFERENCE = (
    "Fonov et al., NeuroImage 54(1):313-327, 2011 (doi:10.1016/j.neuroimage.2010.07.033); "
    "Fonov et al., NeuroImage 47(S1):S102, 2009 (doi:10.1016/S1053-8119(09)70884-5)"
)
LICENCE = (
    "MNI ICBM152 template notice: permission to use, copy, modify and distribute for any purpose "
    "without fee, provided the copyright notice appears in all copies (full text: "
    "tfmis/data/assets/MNI152_LICENSE.txt)"
)


# --------------------------------------------------------------------------------------------
# How each case is stored: a fixed, repeating schedule so that even 3 cases cover RAS, LPS and a
# big-endian image, and 12 cases cover everything.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StorageStyle:
    """How one case is written to disk.

    Args:
        axcodes: voxel axis directions of the stored array, e.g. ("L", "P", "S").
        dtype: on-disk image dtype (numpy spelling; `>i2` is big-endian int16).
        spacing: voxel size in mm along the R, A and S world directions (before any axis permutation).
    """

    axcodes: tuple[str, str, str]
    dtype: str
    spacing: tuple[float, float, float]


ISO = (2.5, 2.5, 2.5)
STORAGE_SCHEDULE = (
    StorageStyle(("R", "A", "S"), "<i2", ISO),
    StorageStyle(("L", "P", "S"), ">i2", ISO),  # DICOM-style voxel order, big-endian
    StorageStyle(("L", "P", "S"), "<i2", (2.0, 2.0, 3.0)),
    StorageStyle(("R", "A", "S"), "<f4", ISO),
    StorageStyle(("L", "A", "S"), "<i2", ISO),  # radiological convention
    StorageStyle(("R", "A", "S"), "<i2", (2.5, 2.5, 3.5)),
    StorageStyle(("L", "P", "S"), "<i2", ISO),
    StorageStyle(("A", "S", "L"), "<i2", ISO),  # permuted axes (sagittal-like slices)
    StorageStyle(("R", "A", "S"), "<i2", (2.0, 2.0, 3.0)),
    StorageStyle(("L", "P", "S"), "<i2", ISO),
    StorageStyle(("R", "A", "S"), "<i2", ISO),
    StorageStyle(("L", "P", "S"), "<i2", (2.5, 2.5, 3.5)),
)


def storage_style(case_number: int) -> StorageStyle:
    """The storage style of case `case_number` (training cases 0.., test cases 100..)."""
    return STORAGE_SCHEDULE[case_number % len(STORAGE_SCHEDULE)]


# --------------------------------------------------------------------------------------------
# Template
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Template:
    """The 2 mm MNI152 maps (T1, GM, WM, brain fraction) as float32 scaled to [0, 1], on one RAS grid."""

    t1: np.ndarray
    gm: np.ndarray
    wm: np.ndarray
    brain: np.ndarray
    affine: np.ndarray

    @property
    def brain_box_mm(self) -> tuple[np.ndarray, np.ndarray]:
        """World (mm) corners (min, max) of the brain's bounding box."""
        voxels = np.argwhere(self.brain >= 0.5)
        corners = np.stack([voxels.min(axis=0), voxels.max(axis=0)])
        world = corners @ self.affine[:3, :3].T + self.affine[:3, 3]
        return world.min(axis=0), world.max(axis=0)


@functools.lru_cache(maxsize=1)
def load_template() -> Template:
    """Loads `assets/mni152_2mm.npz` (built by tools/build_demo_template.py) once per process."""
    asset = resources.files("tfmis.data") / "assets" / TEMPLATE_ASSET
    with asset.open("rb") as f, np.load(f) as npz:
        maps = {k: npz[k].astype(np.float32) / np.float32(255) for k in ("t1", "gm", "wm", "brain")}
        affine = npz["affine"].astype(np.float64)
    return Template(affine=affine, **maps)


# --------------------------------------------------------------------------------------------
# Random smooth fields and transforms
# --------------------------------------------------------------------------------------------


def smooth_random_field(rng: np.random.Generator, shape: tuple[int, ...], nodes: int, std: float) -> np.ndarray:
    """A smooth random field on `shape`: Gaussian values on a coarse `nodes`^3 grid, cubic-spline upsampled.

    Example:
        >>> smooth_random_field(np.random.default_rng(0), (40, 50, 30), nodes=4, std=1.0).shape
        (40, 50, 30)
    """
    coarse = rng.normal(0.0, std, size=(nodes,) * len(shape))
    # The spline is a tensor product: upsample one axis at a time with a (n, nodes) weight matrix,
    # much faster than a 3D spline evaluated at every voxel.
    field = coarse
    for axis, n in enumerate(shape):
        field = np.moveaxis(np.tensordot(_spline_weights(nodes, n), field, axes=([1], [axis])), 0, axis)
    return field.astype(np.float32)


@functools.lru_cache(maxsize=64)
def _spline_weights(nodes: int, n: int) -> np.ndarray:
    """(n, nodes) cubic-spline interpolation weights, first node on sample 0, last node on sample n-1."""
    spline = interpolate.make_interp_spline(np.linspace(0.0, 1.0, nodes), np.eye(nodes), k=3)
    return spline(np.linspace(0.0, 1.0, n))


def random_rotation(rng: np.random.Generator, max_degrees: float) -> np.ndarray:
    """A 3x3 rotation: product of rotations about x, y, z by uniform angles in ±max_degrees."""
    ax, ay, az = np.deg2rad(rng.uniform(-max_degrees, max_degrees, size=3))
    rx = np.array([[1, 0, 0], [0, np.cos(ax), -np.sin(ax)], [0, np.sin(ax), np.cos(ax)]])
    ry = np.array([[np.cos(ay), 0, np.sin(ay)], [0, 1, 0], [-np.sin(ay), 0, np.cos(ay)]])
    rz = np.array([[np.cos(az), -np.sin(az), 0], [np.sin(az), np.cos(az), 0], [0, 0, 1]])
    return rz @ ry @ rx


@dataclasses.dataclass(frozen=True)
class SubjectPose:
    """Maps template world (mm) to subject world (mm): p = centre + shift + rotation @ diag(scale) @ (q - centre)."""

    centre: np.ndarray
    rotation: np.ndarray
    scale: np.ndarray
    shift: np.ndarray

    @property
    def matrix(self) -> np.ndarray:
        return self.rotation @ np.diag(self.scale)

    def to_subject(self, template_mm: np.ndarray) -> np.ndarray:
        """(N, 3) template mm -> (N, 3) subject mm."""
        return (template_mm - self.centre) @ self.matrix.T + self.centre + self.shift


def random_pose(rng: np.random.Generator, template: Template) -> SubjectPose:
    """Rotation up to 10° per axis, scale ±8% per axis, shift up to 5 mm, about the brain centre."""
    low, high = template.brain_box_mm
    return SubjectPose(
        centre=(low + high) / 2,
        rotation=random_rotation(rng, 10.0),
        scale=rng.uniform(0.92, 1.08, size=3),
        shift=rng.uniform(-5.0, 5.0, size=3),
    )


def subject_grid(
    rng: np.random.Generator, template: Template, pose: SubjectPose, spacing: tuple[float, float, float]
) -> tuple[tuple[int, int, int], np.ndarray]:
    """An RAS voxel grid covering the deformed brain plus a random 6-20 mm margin on each side.

    Returns:
        (shape, 4x4 affine) of the grid; voxel axes point along R, A, S.
    """
    low, high = template.brain_box_mm
    corners = np.array([[x, y, z] for x in (low[0], high[0]) for y in (low[1], high[1]) for z in (low[2], high[2])])
    subject = pose.to_subject(corners)
    spacing_arr = np.asarray(spacing, dtype=np.float64)
    start = subject.min(axis=0) - rng.uniform(6.0, 20.0, size=3)
    stop = subject.max(axis=0) + rng.uniform(6.0, 20.0, size=3)
    shape = tuple(int(n) for n in np.ceil((stop - start) / spacing_arr).astype(int) + 1)
    affine = np.eye(4)
    affine[:3, :3] = np.diag(spacing_arr)
    affine[:3, 3] = np.round(start, 2)  # scanner-like round origin
    return shape, affine


def template_voxel_coordinates(
    rng: np.random.Generator, template: Template, pose: SubjectPose, shape: tuple[int, int, int], affine: np.ndarray
) -> np.ndarray:
    """For every subject voxel, the (fractional) template voxel it shows: (3, X, Y, Z) float32.

    The pose's inverse is applied to the voxel's world position, then a smooth elastic
    displacement of a few mm (random vectors on a 5^3 grid, spline-upsampled) is added.
    """
    # subject voxel -> subject mm -> (inverse pose) template mm -> template voxel, as one 4x4 matrix.
    subject_to_template_mm = np.eye(4)
    inverse = np.linalg.inv(pose.matrix)
    subject_to_template_mm[:3, :3] = inverse
    subject_to_template_mm[:3, 3] = pose.centre - inverse @ (pose.centre + pose.shift)
    voxel_map = np.linalg.inv(template.affine) @ subject_to_template_mm @ affine
    mm_to_template_voxel = np.linalg.inv(template.affine)[:3, :3]

    axes = [np.arange(n, dtype=np.float32) for n in shape]
    coords = np.empty((3, *shape), dtype=np.float32)
    for row in range(3):
        coords[row] = (
            voxel_map[row, 0] * axes[0][:, None, None]
            + voxel_map[row, 1] * axes[1][None, :, None]
            + voxel_map[row, 2] * axes[2][None, None, :]
            + voxel_map[row, 3]
        )
    displacement_mm = [smooth_random_field(rng, shape, nodes=5, std=2.5) for _ in range(3)]
    for row in range(3):
        coords[row] += sum(mm_to_template_voxel[row, k] * displacement_mm[k] for k in range(3))
    return coords


def warp_template(template: Template, coords: np.ndarray) -> dict[str, np.ndarray]:
    """Samples the template maps (trilinear, zero outside) at `coords`; returns float32 maps."""

    def sample(volume):
        return ndimage.map_coordinates(volume, coords, order=1, mode="constant", cval=0.0, output=np.float32)

    return {
        "t1": sample(template.t1),
        "gm": sample(template.gm),
        "wm": sample(template.wm),
        "brain": sample(template.brain),
    }


# --------------------------------------------------------------------------------------------
# Lesion, contrasts, labels
# --------------------------------------------------------------------------------------------


def lesion_map(
    rng: np.random.Generator, white_matter: np.ndarray, spacing: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One irregular blob (a bumpy, rotated ellipsoid, semi-axes 7-12 mm) centred deep in white matter.

    Args:
        white_matter: warped WM probability on the subject grid.
        spacing: voxel size in mm (RAS grid).

    Returns:
        (hard mask bool, soft membership float32 in [0, 1]) on the subject grid.
    """
    inside = white_matter > 0.5
    depth_mm = ndimage.distance_transform_edt(inside, sampling=spacing)
    candidates = np.argwhere(depth_mm >= min(5.0, depth_mm.max()))
    centre_mm = candidates[rng.integers(len(candidates))] * spacing

    semi_axes = rng.uniform(7.0, 12.0, size=3)
    rotation = random_rotation(rng, 180.0)
    # The blob is small: evaluate it only in a box around its centre.
    reach = int(np.ceil(1.6 * semi_axes.max() / spacing.min()))
    centre_voxel = np.round(centre_mm / spacing).astype(int)
    lo = np.maximum(centre_voxel - reach, 0)
    hi = np.minimum(centre_voxel + reach + 1, white_matter.shape)
    grids = np.meshgrid(*[np.arange(a, b) * s for a, b, s in zip(lo, hi, spacing)], indexing="ij")
    offsets = np.stack([g - c for g, c in zip(grids, centre_mm)], axis=-1)
    local = offsets @ rotation / semi_axes
    radius = np.linalg.norm(local, axis=-1)
    direction = local / np.maximum(radius, 1e-6)[..., None]
    # Irregular but smooth outline: a random quadratic form of the direction reshapes the ellipsoid
    # (lobes, dents), and a coarse random field wobbles the boundary locally.
    bumps = direction @ rng.normal(0, 0.12, size=3) + np.einsum(
        "...i,ij,...j->...", direction, rng.normal(0, 0.15, size=(3, 3)), direction
    )
    bumpy_radius = radius * (1.0 + bumps) + smooth_random_field(rng, radius.shape, nodes=5, std=0.25)

    soft = np.zeros(white_matter.shape, dtype=np.float32)
    box = tuple(slice(a, b) for a, b in zip(lo, hi))
    soft[box] = np.clip((1.0 - bumpy_radius) / 0.25 + 0.5, 0.0, 1.0)  # ~1.5 mm partial-volume rim
    hard = np.zeros(white_matter.shape, dtype=bool)
    hard[box] = bumpy_radius < 1.0
    return hard, soft


def tissue_labels(maps: dict[str, np.ndarray], brain: np.ndarray, lesion: np.ndarray) -> np.ndarray:
    """argmax(1 - pGM - pWM, pGM, pWM) inside the brain, lesion (3) overriding; uint8."""
    background = 1.0 - maps["gm"] - maps["wm"]
    labels = np.argmax(np.stack([background, maps["gm"], maps["wm"]]), axis=0).astype(np.uint8)
    labels[lesion] = 3
    labels[~brain] = 0
    return labels


def synthesise_channels(
    rng: np.random.Generator,
    maps: dict[str, np.ndarray],
    brain: np.ndarray,
    lesion_soft: np.ndarray,
    integer_output: bool,
) -> np.ndarray:
    """T1w and T2w in scanner units, (X, Y, Z, 2) float32, exactly 0 outside `brain`.

    T1w is the template T1; T2w mixes tissue fractions (CSF 1.0, GM 0.55, WM 0.28, all relative
    to the brain fraction so the brain edge is not darkened). The lesion pulls T1w down to half
    and T2w up to 0.8 (CSF stays brighter). Each channel then gets its own bias field, noise and scale.
    """
    fraction = np.maximum(maps["brain"], 1e-3)
    gm = np.clip(maps["gm"] / fraction, 0, 1)
    wm = np.clip(maps["wm"] / fraction, 0, 1)
    csf = np.clip(1.0 - gm - wm, 0, 1)
    t1 = maps["t1"] * (1.0 - 0.5 * lesion_soft)
    t2 = (1.0 * csf + 0.55 * gm + 0.28 * wm) * (1.0 - lesion_soft) + 0.8 * lesion_soft

    channels = []
    for contrast, (low, high) in ((t1, (500.0, 3000.0)), (t2, (300.0, 2500.0))):
        bias = np.exp(smooth_random_field(rng, brain.shape, nodes=4, std=0.12))
        noise = rng.normal(0.0, rng.uniform(0.015, 0.03), size=brain.shape).astype(np.float32)
        scanner = (contrast * bias + noise) * np.float32(rng.uniform(low, high))
        floor = 1.0 if integer_output else 1e-3  # keep the brain non-zero: zero means "outside"
        channels.append(np.where(brain, np.maximum(scanner, floor), 0.0).astype(np.float32))
    return np.stack(channels, axis=-1)


# --------------------------------------------------------------------------------------------
# Cases and files
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class DemoCase:
    """One generated case, already in its storage orientation.

    Attributes:
        image: (X, Y, Z, 2) array in the on-disk dtype.
        label: (X, Y, Z) uint8.
        affine: 4x4 voxel-to-world (RAS mm), shared by image and label.
    """

    image: np.ndarray
    label: np.ndarray
    affine: np.ndarray


def reorient(arrays: list[np.ndarray], affine: np.ndarray, axcodes: tuple[str, str, str]):
    """Flips/permutes the first 3 axes of RAS-ordered arrays to `axcodes`; returns (arrays, new affine).

    Example:
        >>> arrays, affine = reorient([np.zeros((2, 3, 4))], np.eye(4), ("L", "P", "S"))
        >>> nib.aff2axcodes(affine)
        ('L', 'P', 'S')
    """
    transform = orientations.ornt_transform(
        orientations.axcodes2ornt(("R", "A", "S")), orientations.axcodes2ornt(axcodes)
    )
    new_affine = affine @ orientations.inv_ornt_aff(transform, arrays[0].shape[:3])
    return [np.ascontiguousarray(orientations.apply_orientation(a, transform)) for a in arrays], new_affine


def generate_case(case_number: int, seed: int = 0) -> DemoCase:
    """Generates one case; a deterministic function of (seed, case_number).

    Example:
        >>> case = generate_case(0)
        >>> case.image.shape[-1], case.label.dtype
        (2, dtype('uint8'))
    """
    rng = np.random.default_rng([seed, case_number])
    style = storage_style(case_number)
    template = load_template()
    pose = random_pose(rng, template)
    shape, affine = subject_grid(rng, template, pose, style.spacing)
    maps = warp_template(template, template_voxel_coordinates(rng, template, pose, shape, affine))
    brain = maps["brain"] >= 0.5

    lesion, lesion_soft = lesion_map(rng, maps["wm"], np.asarray(style.spacing))
    lesion &= brain
    label = tissue_labels(maps, brain, lesion)
    integer_output = np.dtype(style.dtype).kind == "i"
    image = synthesise_channels(rng, maps, brain, lesion_soft, integer_output)
    if integer_output:
        image = np.clip(np.rint(image), 0, np.iinfo(np.int16).max)
    (image, label), affine = reorient([image, label], affine, style.axcodes)
    return DemoCase(image=image.astype(style.dtype), label=label.astype(np.uint8), affine=affine)


# --------------------------------------------------------------------------------------------
# BraTS-size variant (`--size brats`): 1 mm, 240 x 240 x 155, FLAIR / T1w / T1gd / T2w, tumour labels
# --------------------------------------------------------------------------------------------

BRATS_DATASET_NAME = "Task01_DemoBraTS"
BRATS_MODALITIES = {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"}
BRATS_LABELS = {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"}
BRATS_BOX_MM = (240.0, 240.0, 155.0)
BRATS_DESCRIPTION = (
    "Synthetic BraTS-size demo dataset made by tfmis.data.demo --size brats: the anatomy is the MNI "
    "ICBM152 2009a nonlinear symmetric template (Copyright (C) 1993-2009 Louis Collins, McConnell Brain "
    "Imaging Centre, Montreal Neurological Institute, McGill University), randomly deformed per case on a "
    "1 mm 240 x 240 x 155 grid; FLAIR, T1w, T1gd and T2w contrasts and one synthetic glioma-like tumour "
    "(oedema, non-enhancing core, enhancing rim) per case are simulated. Not for clinical or research use."
)
# Relative intensity of (healthy, oedema, enhancing rim, non-enhancing core) per contrast; "healthy"
# is a tissue mix (CSF, GM, WM) or the template's own T1.
_BRATS_CONTRASTS = {
    "FLAIR": ((0.15, 0.6, 0.45), 0.95, 0.75, 0.4),
    "T1w": ("t1", 0.8, 0.65, 0.35),  # multiplies the template T1
    "t1gd": ("t1", 0.8, 1.5, 0.35),
    "T2w": ((1.0, 0.55, 0.28), 0.8, 0.6, 0.95),
}


def brats_pose(rng: np.random.Generator, template: Template) -> SubjectPose:
    """A milder pose than `random_pose` (BraTS scans are co-registered): 5°, scale 0.92-1.04 (z 0.9-1.0)."""
    low, high = template.brain_box_mm
    return SubjectPose(
        centre=(low + high) / 2,
        rotation=random_rotation(rng, 5.0),
        scale=np.array([rng.uniform(0.92, 1.04), rng.uniform(0.92, 1.04), rng.uniform(0.9, 1.0)]),
        shift=rng.uniform(-3.0, 3.0, size=3),
    )


def brats_grid(
    rng: np.random.Generator, template: Template, pose: SubjectPose, spacing: float
) -> tuple[tuple[int, int, int], np.ndarray]:
    """The fixed BraTS box (240 x 240 x 155 mm) on an RAS grid of `spacing` mm, centred on the brain ±2 mm."""
    shape = tuple(int(round(mm / spacing)) for mm in BRATS_BOX_MM)
    centre = pose.centre + pose.shift + rng.uniform(-2.0, 2.0, size=3)
    affine = np.diag([spacing, spacing, spacing, 1.0])
    affine[:3, 3] = np.round(centre - (np.array(shape) - 1) / 2 * spacing, 1)
    return shape, affine


def tumour_maps(
    rng: np.random.Generator, maps: dict[str, np.ndarray], brain: np.ndarray, spacing: float
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One glioma-like tumour: an enhancing rim around a non-enhancing core inside irregular oedema.

    The core's radius is log-uniform in 4-30 mm (many small tumours), the rim 1.5-4 mm thick (at most
    half the radius, so a core always remains), the oedema reaches 1.4-2.6 radii along white matter.

    Returns:
        (label uint8: 1 oedema, 2 non-enhancing core, 3 enhancing rim, 0 elsewhere;
         partial-volume memberships {"edema", "enhancing", "core"} float32 summing to <= 1).
    """
    shape = brain.shape
    step = max(1, int(round(2.0 / spacing)))  # the depth map on a ~2 mm grid is plenty, on 1/step^3 of the voxels
    coarse_wm = maps["wm"][::step, ::step, ::step] > 0.5
    depth = ndimage.distance_transform_edt(brain[::step, ::step, ::step], sampling=step * spacing)
    deep = coarse_wm & (depth >= min(15.0, depth.max()))
    candidates = np.argwhere(deep if deep.any() else depth >= depth.max())
    centre_mm = (candidates[rng.integers(len(candidates))] * step + rng.integers(0, step, size=3)) * spacing

    radius = float(np.exp(rng.uniform(np.log(4.0), np.log(30.0))))
    semi_axes = radius * rng.uniform(0.8, 1.2, size=3)
    rim_mm = min(rng.uniform(1.5, 4.0), 0.5 * radius)
    edema_factor = rng.uniform(1.4, 2.6)
    rotation = random_rotation(rng, 180.0)

    reach = int(np.ceil((edema_factor + 0.8) * semi_axes.max() / spacing))
    centre_voxel = np.round(centre_mm / spacing).astype(int)
    lo = np.maximum(centre_voxel - reach, 0)
    hi = np.minimum(centre_voxel + reach + 1, shape)
    box = tuple(slice(a, b) for a, b in zip(lo, hi))
    grids = np.meshgrid(*[np.arange(a, b, dtype=np.float32) * spacing for a, b in zip(lo, hi)], indexing="ij")
    local = np.stack([g - c for g, c in zip(grids, centre_mm)], axis=-1) @ rotation / semi_axes
    del grids
    rho = np.linalg.norm(local, axis=-1)
    direction = local / np.maximum(rho, 1e-6)[..., None]
    bumps = direction @ rng.normal(0, 0.1, size=3) + np.einsum(
        "...i,ij,...j->...", direction, rng.normal(0, 0.12, size=(3, 3)), direction
    )
    del local, direction
    tumour_rho = rho * (1.0 + bumps) + smooth_random_field(rng, rho.shape, nodes=5, std=0.12)
    edema_rho = rho * (1.0 + 1.5 * bumps) + smooth_random_field(rng, rho.shape, nodes=6, std=0.35)
    inner = 1.0 - rim_mm / radius

    in_brain = brain[box]
    along_wm = (maps["wm"][box] > 0.3) | (tumour_rho < 1.3)
    core = (tumour_rho < inner) & in_brain
    rim = (tumour_rho < 1.0) & ~core & in_brain
    edema = (edema_rho < edema_factor) & ~core & ~rim & along_wm & in_brain
    label = np.zeros(shape, dtype=np.uint8)
    label[box][edema] = 1
    label[box][core] = 2
    label[box][rim] = 3

    memberships = {}
    for name, mask in (("edema", edema), ("enhancing", rim), ("core", core)):
        soft = np.zeros(shape, dtype=np.float32)
        soft[box] = ndimage.gaussian_filter(mask.astype(np.float32), sigma=0.6 / spacing)
        memberships[name] = soft
    return label, memberships


def synthesise_brats_channels(
    rng: np.random.Generator,
    maps: dict[str, np.ndarray],
    brain: np.ndarray,
    memberships: dict[str, np.ndarray],
    modalities: list[str],
) -> np.ndarray:
    """(X, Y, Z, C) float32 scanner units, 0 outside `brain`, >= 1 inside; C = len(modalities)."""
    fraction = np.maximum(maps["brain"], 1e-3)
    gm = np.clip(maps["gm"] / fraction, 0, 1)
    wm = np.clip(maps["wm"] / fraction, 0, 1)
    csf = np.clip(1.0 - gm - wm, 0, 1)
    tumour = np.clip(memberships["edema"] + memberships["enhancing"] + memberships["core"], 0, 1)
    channels = []
    for name in modalities:
        healthy, edema, enhancing, core = _BRATS_CONTRASTS[name]
        if healthy == "t1":
            base = maps["t1"]
            contrast = (
                base * (1.0 - tumour)
                + base * (edema * memberships["edema"] + core * memberships["core"])
                + np.float32(enhancing * 0.75) * memberships["enhancing"]
            )  # rim relative to WM (~0.75)
        else:
            base = healthy[0] * csf + healthy[1] * gm + healthy[2] * wm
            contrast = base * (1.0 - tumour) + (
                edema * memberships["edema"] + enhancing * memberships["enhancing"] + core * memberships["core"]
            )
        bias = np.exp(smooth_random_field(rng, brain.shape, nodes=4, std=0.1))
        noise = rng.standard_normal(brain.shape, dtype=np.float32) * np.float32(rng.uniform(0.015, 0.03))
        scanner = (contrast * bias + noise) * np.float32(rng.uniform(300.0, 3000.0))
        channels.append(np.where(brain, np.maximum(scanner, 1.0), 0.0).astype(np.float32))
        del bias, noise, scanner, contrast
    return np.stack(channels, axis=-1)


def generate_brats_case(
    case_number: int, seed: int = 0, spacing: float = 1.0, channels: int = 4, zscore: bool = False
) -> DemoCase:
    """One BraTS-size case (LPS, int16, `spacing` mm; 1 mm gives 240 x 240 x 155); deterministic in (seed, case).

    Args:
        channels: 2-4, the first of FLAIR, T1w, T1gd, T2w.
        zscore: float32, each channel z-scored over its body (`zscore_over_body`): the background becomes a
            non-zero constant per channel (e.g. -3.6), as in many public MRI sets; same anatomy and label.

    Example:
        >>> case = generate_brats_case(0, spacing=4.0, channels=2)
        >>> case.image.shape, case.image.dtype, sorted(np.unique(case.label).tolist())
        ((60, 60, 39, 2), dtype('int16'), [0, 1, 2, 3])
    """
    if not 1 <= channels <= len(BRATS_MODALITIES):
        raise ValueError(f"channels must be 1-{len(BRATS_MODALITIES)}, got {channels}")
    rng = np.random.default_rng([seed, case_number, 240])
    template = load_template()
    pose = brats_pose(rng, template)
    shape, affine = brats_grid(rng, template, pose, spacing)
    maps = warp_template(template, template_voxel_coordinates(rng, template, pose, shape, affine))
    brain = maps["brain"] >= 0.5
    label, memberships = tumour_maps(rng, maps, brain, spacing)
    modalities = [BRATS_MODALITIES[str(c)] for c in range(channels)]
    image = synthesise_brats_channels(rng, maps, brain, memberships, modalities)
    del maps, memberships
    image = np.clip(np.rint(image), 0, np.iinfo(np.int16).max).astype(np.int16)
    if zscore:
        image = zscore_over_body(image)
    (image, label), affine = reorient([image, label], affine, ("L", "P", "S"))
    return DemoCase(image=image, label=label, affine=affine)


def zscore_over_body(image: np.ndarray) -> np.ndarray:
    """(X, Y, Z, C) float32: per channel (x - mean) / std, mean and std over the body (its non-zero voxels); the
    zero background becomes the constant -mean / std of that channel, as in z-scored public MRI sets.

    Example:
        >>> x = np.zeros((4, 4, 4, 1), np.int16); x[1:3, 1:3, 1:3, 0] = [[[1, 3], [1, 3]], [[1, 3], [1, 3]]]
        >>> z = zscore_over_body(x); float(z[0, 0, 0, 0]), float(z[1, 1, 1, 0]), float(z[1, 1, 2, 0])
        (-2.0, -1.0, 1.0)
    """
    out = np.empty(image.shape, dtype=np.float32)
    for c in range(image.shape[-1]):
        x = image[..., c].astype(np.float64)
        body = x[x != 0]
        out[..., c] = (x - body.mean()) / max(float(body.std()), 1e-8)
    return out


def _nifti(data: np.ndarray, affine: np.ndarray) -> nib.Nifti1Image:
    """A NIfTI image storing `data` in its own dtype and byte order, with scanner qform/sform."""
    header = nib.Nifti1Header(endianness=data.dtype.byteorder if data.dtype.byteorder in "<>" else "=")
    header.set_data_dtype(data.dtype)
    img = nib.Nifti1Image(data, affine, header=header)
    img.set_qform(affine, code=1)
    img.set_sform(affine, code=1)
    img.header.set_xyzt_units("mm")
    img.header["descrip"] = b"tfmis demo (MNI ICBM152 2009a)"
    return img


def case_name(case_number: int) -> str:
    return f"demo_{case_number:03d}"


def make_demo_dataset(
    output_dir: str | Path,
    num_training: int = 12,
    num_test: int = 3,
    seed: int = 0,
    overwrite: bool = False,
    size: str = "demo",
    channels: int = 4,
    spacing: float = 1.0,
    zscore: bool = False,
) -> Path:
    """Writes the demo dataset (MSD layout) to `output_dir`, unless it already holds a dataset.json.

    Args:
        output_dir: dataset folder to create (parents are created too).
        num_training: labelled cases, written as imagesTr/labelsTr demo_000, demo_001, ...
        num_test: unlabelled cases, written as imagesTs demo_100, demo_101, ...
        seed: every case is a deterministic function of (seed, case number).
        overwrite: regenerate even if `output_dir/dataset.json` exists.
        size: "demo" (the small two-channel tissue dataset) or "brats" (1 mm 240 x 240 x 155,
            FLAIR/T1w/T1gd/T2w, tumour labels; see `generate_brats_case`).
        channels: with size="brats", how many of FLAIR, T1w, T1gd, T2w (2-4; default all).
        spacing: with size="brats", the voxel size in mm (1.0 as BraTS; coarser only for tests).
        zscore: with size="brats", write float32 images z-scored per channel over the body (background a
            non-zero constant per case and channel; see `zscore_over_body`).

    Returns:
        The dataset folder as a `Path`.

    Example:
        >>> root = make_demo_dataset("/tmp/Task00_DemoBrain", num_training=3, num_test=1)
        >>> sorted(p.name for p in root.iterdir())
        ['dataset.json', 'imagesTr', 'imagesTs', 'labelsTr']
    """
    if size not in ("demo", "brats"):
        raise ValueError(f"size must be 'demo' or 'brats', got {size!r}")
    if zscore and size != "brats":
        raise ValueError("zscore is for size='brats'")
    if size == "brats" and not 2 <= channels <= len(BRATS_MODALITIES):
        raise ValueError(f"channels must be 2-{len(BRATS_MODALITIES)}, got {channels}")
    if num_training < 1 or num_test < 0:
        raise ValueError(f"need num_training >= 1 and num_test >= 0, got {num_training} and {num_test}")
    root = Path(output_dir)
    manifest = root / "dataset.json"
    if manifest.exists() and not overwrite:
        return root
    # Drop the old manifest first: an interrupted rewrite must not look like a finished dataset.
    manifest.unlink(missing_ok=True)
    for folder in ("imagesTr", "labelsTr", "imagesTs"):
        (root / folder).mkdir(parents=True, exist_ok=True)

    training_numbers = list(range(num_training))
    first_test = max(FIRST_TEST_NUMBER, num_training)
    test_numbers = list(range(first_test, first_test + num_test))
    for number in training_numbers + test_numbers:
        if size == "brats":
            case = generate_brats_case(number, seed, spacing, channels, zscore)
        else:
            case = generate_case(number, seed)
        is_test = number >= first_test
        image_dir = root / ("imagesTs" if is_test else "imagesTr")
        atomic_save_nifti(_nifti(case.image, case.affine), image_dir / f"{case_name(number)}.nii.gz")
        if not is_test:
            atomic_save_nifti(_nifti(case.label, case.affine), root / "labelsTr" / f"{case_name(number)}.nii.gz")

    if size == "brats":
        meta = dataset_json(training_numbers, test_numbers, brats_channels=channels, zscored=zscore)
    else:
        meta = dataset_json(training_numbers, test_numbers)
    with atomic_writer(manifest) as f:
        f.write(json.dumps(meta, indent=4) + "\n")
    return root


def dataset_json(
    training_numbers: list[int], test_numbers: list[int], brats_channels: int = 0, zscored: bool = False
) -> dict:
    """The dataset.json content, in the shape of the real MSD ones (`brats_channels` > 0: the BraTS-size one;
    `zscored`: its images are z-scored, which the description says)."""
    brats = brats_channels > 0
    description = BRATS_DESCRIPTION if brats else DESCRIPTION
    if zscored:
        description += " Images z-scored per channel over the brain (background a non-zero constant)."
    return {
        "name": BRATS_DATASET_NAME if brats else DATASET_NAME,
        "description": description,
        "reference": REFERENCE,
        "licence": LICENCE,
        "release": "1.0",
        "tensorImageSize": "4D",
        "modality": {str(c): BRATS_MODALITIES[str(c)] for c in range(brats_channels)} if brats else MODALITIES,
        "labels": BRATS_LABELS if brats else LABELS,
        "numTraining": len(training_numbers),
        "numTest": len(test_numbers),
        "training": [
            {"image": f"./imagesTr/{case_name(n)}.nii.gz", "label": f"./labelsTr/{case_name(n)}.nii.gz"}
            for n in training_numbers
        ],
        "test": [f"./imagesTs/{case_name(n)}.nii.gz" for n in test_numbers],
    }


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _folder_size_mb(root: Path) -> float:
    return sum(p.stat().st_size for p in root.rglob("*.nii.gz")) / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tfmis.data.demo",
        description="Write a small two-channel (T1w, T2w) brain MRI segmentation dataset in the Medical "
        "Segmentation Decathlon layout (dataset.json, imagesTr/, labelsTr/, imagesTs/). "
        "Labels: 0 background, 1 grey matter, 2 white matter, 3 lesion. The anatomy is the MNI "
        "ICBM152 2009a template, randomly deformed per case. Does nothing if DIR/dataset.json "
        "already exists (use --overwrite to regenerate).",
        epilog="Example: python -m tfmis.data.demo --output data/Task00_DemoBrain --cases 12 --test-cases 3",
    )
    parser.add_argument("--output", required=True, type=Path, metavar="DIR", help="dataset folder to write")
    parser.add_argument(
        "--cases", type=int, default=12, metavar="N", help="number of labelled training cases (default: 12)"
    )
    parser.add_argument(
        "--test-cases", type=int, default=3, metavar="N", help="number of unlabelled test cases (default: 3)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, metavar="S", help="random seed; same seed, same data (default: 0)"
    )
    parser.add_argument("--overwrite", action="store_true", help="regenerate even if DIR/dataset.json exists")
    parser.add_argument(
        "--size",
        choices=("demo", "brats"),
        default="demo",
        help="demo: the small two-channel tissue dataset (default); brats: BraTS size, 1 mm 240 x 240 x 155, "
        "FLAIR/T1w/T1gd/T2w, labels 1 edema, 2 non-enhancing tumor, 3 enhancing tumour",
    )
    parser.add_argument(
        "--channels",
        type=int,
        default=4,
        metavar="C",
        help="brats: the first C of FLAIR, T1w, T1gd, T2w (2-4; default 4)",
    )
    parser.add_argument(
        "--spacing", type=float, default=1.0, metavar="MM", help="brats: voxel size in mm (default 1.0, as BraTS)"
    )
    parser.add_argument(
        "--zscore",
        action="store_true",
        help="brats: write float32 images z-scored per channel over the brain, so the background is a non-zero "
        "constant per case and channel (e.g. -3.6), as in many public MRI sets",
    )
    args = parser.parse_args(argv)

    if (args.output / "dataset.json").exists() and not args.overwrite:
        print(f"{args.output}/dataset.json already exists; nothing to do (pass --overwrite to regenerate)")
        return 0
    start = time.perf_counter()
    try:
        root = make_demo_dataset(
            args.output,
            args.cases,
            args.test_cases,
            args.seed,
            overwrite=args.overwrite,
            size=args.size,
            channels=args.channels,
            spacing=args.spacing,
            zscore=args.zscore,
        )
    except ValueError as e:
        parser.error(str(e))
    name = BRATS_DATASET_NAME if args.size == "brats" else DATASET_NAME
    print(
        f"wrote {name} to {root.resolve()}: {args.cases} training + {args.test_cases} test cases, "
        f"{_folder_size_mb(root):.1f} MB, in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
