"""CT kinds from tfmis's abdominal CT phantom (`tfmis.data.demos.ct`): int16 Hounsfield units, LPS voxel order,
partial-volume blur and 12 HU noise.

- `ct_3mm_thin`: the real-size anatomy (`full_case_layout`) on a 128 x 128 in-plane grid (2.8-3.6 mm pixels, the
  ~360-460 mm field of view of a real scan) with 28-34 slices of 3 mm (a thin ~90 mm slab through the upper
  abdomen: organs shifted along z by `THIN_Z_SHIFT_MM`, the kidneys raised by `THIN_KIDNEY_RAISE_MM`, the spleen
  x`THIN_SPLEEN_SCALE`, so the slab holds all three), 12 rows of air cut front and back (128 x 104 pixels).
  Labels 1 liver (its lesion included), 2 spleen, 3 kidney; the pancreas is drawn but unlabelled.
- `ct_thin_slice`: the same anatomy at 0.8 x 0.8 x 1 mm, a 128 x 128 x 96 voxel (102 x 102 x 96 mm) field of view
  around the left kidney and the spleen. Labels 1 spleen, 2 kidney.
- `ct_full_size`: `demo_ct --size full` as it is (512 x 512, 0.7-0.9 mm pixels), 60-72 slices (5 mm).
  Labels 1 liver, 2 spleen, 3 kidney, 4 pancreas, 5 lesion.
- `tiny_structure`: the small CT slab (`demo_ct.generate_case`, ~96 x 96 x 40, 0.7-0.9 mm pixels, 2-3 mm slices):
  1 spleen (~3 %), 2 a lesion inside it (~0.1 % of the voxels); only the phantom's cases that hold a lesion are used
  (the n-th case with a lesion, so every case has one).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from scipy import ndimage

from benchmarks.zoo.layout import TEST_FIRST, nth_accepted
from tfmis.data.demos import ct as demo_ct
from tfmis.data.demos.ct import FullCaseLayout, full_case_layout, generate_full_case

# the ct_3mm_thin slab: organs moved this far along z, the kidneys raised further (next to the liver), the spleen
# enlarged, and this many rows of air cut from the front and the back (128 x 104 in-plane)
THIN_Z_SHIFT_MM = -10.0
THIN_KIDNEY_RAISE_MM = 25.0
THIN_SPLEEN_SCALE = 1.25
THIN_CROP_AP = 12


@dataclasses.dataclass(frozen=True)
class _OffsetLayout(FullCaseLayout):
    """A layout whose grid is centred on `origin_mm` (LPS mm from the body's centre) instead of the body's centre:
    a small field of view inside the real-size anatomy."""

    origin_mm: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def axis_mm(self, axis: int) -> np.ndarray:
        return (super().axis_mm(axis) + np.float32(self.origin_mm[axis])).astype(np.float32)


def render(layout: FullCaseLayout, seed: int, number: int, scan_circle: bool = True):
    """A layout's image (int16 HU) and label: `demo_ct.generate_full_case`'s slab loop (blur, noise, the scan
    circle) on any layout."""
    nx, ny, nz = layout.shape
    image = np.empty(layout.shape, dtype=np.int16)
    label = np.empty(layout.shape, dtype=np.uint8)
    x, y = layout.axis_mm(0)[:, None], layout.axis_mm(1)[None, :]
    outside = np.hypot(x, y) > min(nx, ny) * layout.spacing[0] / 2 * 1.02
    halo, slab = demo_ct.HALO, demo_ct.SLAB_SLICES
    for index, z_lo in enumerate(range(0, nz, slab)):
        z_hi = min(z_lo + slab, nz)
        lo, hi = max(z_lo - halo, 0), min(z_hi + halo, nz)
        hu, lab = demo_ct.render_slab(layout, lo, hi)
        hu = ndimage.gaussian_filter(hu, sigma=demo_ct.BLUR)[:, :, z_lo - lo : z_hi - lo]
        noise_rng = np.random.default_rng([seed, number, 9512, index])
        hu += noise_rng.standard_normal(hu.shape, dtype=np.float32) * np.float32(demo_ct.NOISE_HU)
        if scan_circle:
            hu[outside] = demo_ct.HU["padding"]
        np.rint(hu, out=hu)
        np.clip(hu, -1024, 3071, out=hu)
        image[:, :, z_lo:z_hi] = hu
        label[:, :, z_lo:z_hi] = lab[:, :, z_lo - lo : z_hi - lo]
    return image, label


def _relabel(label: np.ndarray, mapping: dict) -> np.ndarray:
    lut = np.zeros(256, dtype=np.uint8)
    for old, new in mapping.items():
        lut[old] = new
    return lut[label]


def _shift_organs(layout: FullCaseLayout, dz: float) -> tuple:
    return tuple(dataclasses.replace(o, centre=o.centre + np.array([0.0, 0.0, dz])) for o in layout.organs)


def ct_3mm_thin(number: int, seed: int):
    layout = full_case_layout(number, seed, slices=(28, 34), in_plane=128)
    sxy = layout.spacing[0]
    organs = []
    for o in _shift_organs(layout, THIN_Z_SHIFT_MM):
        if o.label == 3:  # kidneys up into the slab, next to the liver and spleen
            o = dataclasses.replace(o, centre=o.centre + np.array([0.0, 0.0, THIN_KIDNEY_RAISE_MM]))
        if o.label == 2:
            o = dataclasses.replace(o, semi_axes=o.semi_axes * THIN_SPLEEN_SCALE)
        organs.append(o)
    layout = dataclasses.replace(layout, spacing=(sxy, sxy, 3.0), organs=tuple(organs))
    image, label = render(layout, seed, number)
    rows = slice(THIN_CROP_AP, 128 - THIN_CROP_AP)  # the body's anterior-posterior extent: air rows cut
    affine = layout.affine
    affine[1, 3] -= THIN_CROP_AP * sxy
    return image[:, rows], _relabel(label[:, rows], {1: 1, 2: 2, 3: 3, 5: 1}), affine


def ct_thin_slice(number: int, seed: int):
    base = full_case_layout(number, seed, slices=(96, 96), in_plane=512)
    organs = {o.label: o for o in base.organs}  # the left kidney (x > 0 in LPS) is the last kidney
    kidney = [o for o in base.organs if o.label == 3 and o.centre[0] > 0][0]
    spleen = organs[2]
    origin = tuple(float(v) for v in (0.6 * kidney.centre + 0.4 * spleen.centre))
    shape = (128, 128, 96)
    rng = np.random.default_rng([seed, number, 801])
    nodes = tuple(max(4, int(np.ceil(n * s / 60.0))) for n, s in zip(shape, (0.8, 0.8, 1.0)))
    layout = _OffsetLayout(
        shape=shape,
        spacing=(0.8, 0.8, 1.0),
        body_axes=base.body_axes,
        body_taper=base.body_taper,
        fat_mm=base.fat_mm,
        spine=base.spine,
        organs=base.organs,
        field=demo_ct.SmoothField(rng.normal(size=nodes).astype(np.float32), shape),
        origin_mm=origin,
    )
    image, label = render(layout, seed, number, scan_circle=False)
    affine = layout.affine
    affine[:3, 3] = [-(layout.axis_mm(0)[0]), -(layout.axis_mm(1)[0]), layout.axis_mm(2)[0]]
    return image, _relabel(label, {2: 1, 3: 2}), affine


def ct_full_size(number: int, seed: int):
    return generate_full_case(number, seed, slices=(60, 72), in_plane=512)


def _holds_lesion(case) -> bool:
    return int((case[1] == 2).sum()) >= 20


def tiny_structure(number: int, seed: int):
    """The n-th phantom case holding a lesion (>= 20 voxels): training cases draw from phantom numbers 0, 1, ...,
    test cases (numbers >= 1000) from 5000, 5001, ... (about 1.25 phantom cases per case)."""
    first, index = (5000, number - TEST_FIRST) if number >= TEST_FIRST else (0, number)
    return demo_ct.generate_case(nth_accepted(demo_ct.generate_case, _holds_lesion, seed, first, index), seed)
