"""Brain tissue kinds from tfmis's demo anatomy (the MNI ICBM152 template, `tfmis.data.demos.anatomy`): a random pose
and elastic deformation per case, drawn on a grid of any spacing and field of view.

Labels: 0 background (outside the skull-stripped brain), 1 CSF, 2 grey matter, 3 white matter (the argmax of the
warped tissue fractions inside the brain). One channel: T1w (the template's T1) or T2w (CSF bright, GM
intermediate, WM dark), each with a smooth bias field, noise and arbitrary scanner units, int16, zero outside the
brain. Thick slices (`slice_profile`) average `slice_profile` thin sub-slices per slice: partial volume along z.
"""

from __future__ import annotations

import numpy as np

from tfmis.data.demos.anatomy import (
    load_template,
    random_pose,
    reorient,
    smooth_random_field,
    subject_grid,
    template_voxel_coordinates,
    warp_template,
)

LABELS = ("background", "CSF", "grey matter", "white matter")


def _fov_grid(rng, template, pose, spacing, fov_mm):
    """A grid of `fov_mm` (per axis) at `spacing`, centred on the deformed brain's centre ±3 mm (RAS)."""
    spacing = np.asarray(spacing, dtype=np.float64)
    shape = tuple(int(round(f / s)) for f, s in zip(fov_mm, spacing))
    centre = pose.centre + pose.shift + rng.uniform(-3.0, 3.0, size=3)
    affine = np.diag([*spacing, 1.0])
    affine[:3, 3] = np.round(centre - (np.array(shape) - 1) / 2 * spacing, 2)
    return shape, affine


def brain_case(
    number: int,
    seed: int,
    spacing,
    fov_mm=None,
    contrast: str = "T1w",
    slice_profile: int = 1,
    axcodes=("R", "A", "S"),
    tag: int = 1,
):
    """One brain case: (image int16 (X, Y, Z), label uint8, affine); deterministic in (seed, number, tag).

    Args:
        spacing: voxel size (mm) along R, A, S.
        fov_mm: the grid's extent (mm) around the brain's centre; None: the whole brain plus a 6-20 mm margin.
        contrast: "T1w" or "T2w".
        slice_profile: thin sub-slices averaged per (thick) slice along the third axis.
        axcodes: the stored voxel order.
    """
    rng = np.random.default_rng([seed, number, 7301, tag])
    template = load_template()
    pose = random_pose(rng, template)
    if fov_mm is None:
        shape, affine = subject_grid(rng, template, pose, spacing)
    else:
        shape, affine = _fov_grid(rng, template, pose, spacing, fov_mm)
    fine_shape, fine_affine = shape, affine
    if slice_profile > 1:  # sample sub-slices centred within each thick slice
        fine_shape = (shape[0], shape[1], shape[2] * slice_profile)
        fine_affine = affine.copy()
        fine_affine[:3, 2] = affine[:3, 2] / slice_profile
        fine_affine[:3, 3] = affine[:3, 3] - affine[:3, 2] * (slice_profile - 1) / (2 * slice_profile)
    maps = warp_template(template, template_voxel_coordinates(rng, template, pose, fine_shape, fine_affine))
    if slice_profile > 1:
        maps = {k: v.reshape(*shape, slice_profile).mean(axis=-1) for k, v in maps.items()}
    brain = maps["brain"] >= 0.5
    fraction = np.maximum(maps["brain"], 1e-3)
    gm = np.clip(maps["gm"] / fraction, 0, 1)
    wm = np.clip(maps["wm"] / fraction, 0, 1)
    csf = np.clip(1.0 - gm - wm, 0, 1)
    label = (np.argmax(np.stack([csf, gm, wm]), axis=0) + 1).astype(np.uint8)
    label[~brain] = 0
    if contrast == "T1w":
        signal, (low, high) = maps["t1"], (500.0, 3000.0)
    elif contrast == "T2w":
        signal, (low, high) = 1.0 * csf + 0.55 * gm + 0.28 * wm, (300.0, 2500.0)
    else:
        raise ValueError(f"contrast must be T1w or T2w, got {contrast!r}")
    bias = np.exp(smooth_random_field(rng, shape, nodes=4, std=0.12))
    noise = rng.normal(0.0, rng.uniform(0.015, 0.03), size=shape).astype(np.float32)
    scanner = (signal * bias + noise) * np.float32(rng.uniform(low, high))
    image = np.where(brain, np.clip(np.rint(scanner), 1, np.iinfo(np.int16).max), 0).astype(np.int16)
    (image, label), affine = reorient([image, label], affine, axcodes)
    return image, label, affine


def brain_1mm(number: int, seed: int):
    """1 mm isotropic T1w, a 112 x 128 x 96 mm field of view around the brain's centre (most of the cerebrum)."""
    return brain_case(number, seed, (1.0, 1.0, 1.0), fov_mm=(112.0, 128.0, 96.0), tag=1)


def brain_2mm(number: int, seed: int):
    """2 mm isotropic T1w, the whole brain plus a 6-20 mm margin (about 90 x 105 x 90 voxels), LPS."""
    return brain_case(number, seed, (2.0, 2.0, 2.0), axcodes=("L", "P", "S"), tag=2)


def mr_thick(number: int, seed: int):
    """Thick-slice T2w MR: 0.5 x 0.5 mm pixels, 5 mm slices (each the mean of 5 thin sub-slices), a 64 x 64 x 120 mm
    field of view around the brain's centre (128 x 128 x 24 voxels)."""
    return brain_case(number, seed, (0.5, 0.5, 5.0), fov_mm=(64.0, 64.0, 120.0), contrast="T2w", slice_profile=5, tag=3)
