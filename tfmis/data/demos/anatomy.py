"""The demo's anatomy: the MNI ICBM152 2009a template (`assets/mni152_2mm.npz`), a random pose, grid and smooth
elastic deformation per case, and the demo brain drawn on it: tissue labels, one white-matter lesion, T1w and T2w
contrasts with bias fields and noise. Also the generated case (`DemoCase`) and its reorientation to a storage
voxel order, shared by `tfmis.data.demos.brain` and the BraTS-size variant (`tfmis.data.demos.brats`).

Only numpy, scipy and nibabel; every function takes its random generator, so a case is a deterministic function of
its seed.
"""

from __future__ import annotations

import dataclasses
import functools
from importlib import resources

import numpy as np
from nibabel import orientations
from scipy import interpolate, ndimage

TEMPLATE_ASSET = "mni152_2mm.npz"


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
        >>> orientations.aff2axcodes(affine)
        ('L', 'P', 'S')
    """
    transform = orientations.ornt_transform(
        orientations.axcodes2ornt(("R", "A", "S")), orientations.axcodes2ornt(axcodes)
    )
    new_affine = affine @ orientations.inv_ornt_aff(transform, arrays[0].shape[:3])
    return [np.ascontiguousarray(orientations.apply_orientation(a, transform)) for a in arrays], new_affine
