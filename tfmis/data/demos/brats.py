"""The demo's BraTS-size variant (`python -m tfmis.data.demos.brain --size brats`, `generate_brats_case`): the template
deformed onto the 240 x 240 x 155 mm BraTS box, one glioma-like tumour (oedema, non-enhancing core, enhancing rim),
FLAIR / T1w / T1gd / T2w contrasts, and the z-scored form many public MRI sets come in (`zscore_over_body`)."""

from __future__ import annotations

import numpy as np
from scipy import ndimage

from tfmis.data.demos.anatomy import (
    DemoCase,
    SubjectPose,
    Template,
    load_template,
    random_rotation,
    reorient,
    smooth_random_field,
    template_voxel_coordinates,
    warp_template,
)

# --------------------------------------------------------------------------------------------
# BraTS-size variant (`--size brats`): 1 mm, 240 x 240 x 155, FLAIR / T1w / T1gd / T2w, tumour labels
# --------------------------------------------------------------------------------------------

BRATS_DATASET_NAME = "Task01_DemoBraTS"
BRATS_MODALITIES = {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"}
BRATS_LABELS = {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"}
BRATS_BOX_MM = (240.0, 240.0, 155.0)
BRATS_DESCRIPTION = (
    "Synthetic BraTS-size demo dataset made by tfmis.data.demos.brain --size brats: the anatomy is the MNI "
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
