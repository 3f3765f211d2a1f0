"""The `real_anatomy` kind: T1-like scans synthesised from 12 REAL manual brain label maps (SynthSeg's training label
maps, 256^3 at 1 mm, FreeSurfer labels; read from `label_maps_dir()`, never copied into the repository).

Each case (SynthSeg's idea, a fixed draw per seed): every label gets a T1-like intensity (`T1_MEANS`, x0.92-1.08 per
case and label; the extra-cerebral labels (> 500) and the unnamed ones a random tissue intensity 5-130 per case),
a texture within each structure (sd 2-6), partial-volume blur (Gaussian, sigma 0.4-0.8 mm), a smooth bias field
(x exp(N(0, 0.15)) on a 4^3 spline grid), then the scan is resampled from 1 mm to 1.5 mm (linear; the label map
nearest-neighbour) on the box of the 12 structures plus 9 mm, gets noise (sd 1.5-3.5 % of the white matter) and is
stored int16 in RAS. About 100-120 voxels per axis.

Labels (left and right merged): 1 cerebral white matter, 2 cerebral cortex, 3 lateral ventricle (inferior lateral
included), 4 cerebellum white matter, 5 cerebellum cortex, 6 thalamus, 7 caudate, 8 putamen, 9 pallidum,
10 hippocampus, 11 amygdala, 12 brain-stem; everything else (CSF, 3rd/4th ventricles, accumbens, ventral DC, vessels,
the extra-cerebral tissues) is background but keeps its own intensity.

Split: the seed permutes the 12 subjects; the first 8 are the training cases (numbers 0-7), the last 4 the
held-out test cases (numbers 1000-1003).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import nibabel as nib
import numpy as np
from scipy import ndimage

from tfmis.data.demos.anatomy import smooth_random_field

REPO = Path(__file__).resolve().parents[2]
ENV_VAR = "ZOO_BRAIN_LABEL_MAPS"
SUBJECTS = 12
NUM_TRAIN, NUM_TEST = 8, 4
SPACING = 1.5
MARGIN_MM = 9.0

LABELS = (
    "background",
    "cerebral white matter",
    "cerebral cortex",
    "lateral ventricle",
    "cerebellum white matter",
    "cerebellum cortex",
    "thalamus",
    "caudate",
    "putamen",
    "pallidum",
    "hippocampus",
    "amygdala",
    "brain-stem",
)
MERGE = {
    2: 1, 41: 1,
    3: 2, 42: 2,
    4: 3, 43: 3, 5: 3, 44: 3,
    7: 4, 46: 4,
    8: 5, 47: 5,
    10: 6, 49: 6,
    11: 7, 50: 7,
    12: 8, 51: 8,
    13: 9, 52: 9,
    17: 10, 53: 10,
    18: 11, 54: 11,
    16: 12,
}  # fmt: skip
# T1-like means (white matter 110): FreeSurfer label -> intensity
T1_MEANS = {
    0: 0.0,
    2: 110.0, 41: 110.0,  # cerebral white matter
    3: 70.0, 42: 70.0,  # cortex
    4: 25.0, 43: 25.0, 5: 25.0, 44: 25.0, 14: 25.0, 15: 25.0, 72: 25.0,  # ventricles
    24: 22.0,  # CSF
    7: 100.0, 46: 100.0,  # cerebellum white matter
    8: 68.0, 47: 68.0,  # cerebellum cortex
    10: 92.0, 49: 92.0,  # thalamus
    11: 78.0, 50: 78.0,  # caudate
    12: 84.0, 51: 84.0,  # putamen
    13: 98.0, 52: 98.0,  # pallidum
    16: 98.0,  # brain-stem
    17: 68.0, 53: 68.0,  # hippocampus
    18: 70.0, 54: 70.0,  # amygdala
    26: 76.0, 58: 76.0,  # accumbens
    28: 95.0, 60: 95.0,  # ventral DC
}  # fmt: skip


def label_maps_dir() -> Path:
    """Where the 12 label maps are: $ZOO_BRAIN_LABEL_MAPS, else shared/data/brain_label_maps beside the repository
    (as the project's machines and CI lay it), else /work/shared/data/brain_label_maps."""
    candidates = [os.environ.get(ENV_VAR)] if os.environ.get(ENV_VAR) else []
    candidates += [REPO.parent / "shared" / "data" / "brain_label_maps", Path("/work/shared/data/brain_label_maps")]
    for path in map(Path, candidates):
        if (path / "training_seg_01.nii.gz").is_file():
            return path
    raise FileNotFoundError(
        f"the brain label maps (training_seg_01.nii.gz ... _12) are in none of {[str(c) for c in candidates]}; "
        f"set {ENV_VAR}"
    )


def subject_of(number: int, seed: int) -> int:
    """The subject (1-12) of case `number` (training 0-7, test 1000-1003) for `seed`."""
    order = np.random.default_rng([seed, 4242]).permutation(SUBJECTS) + 1
    index = number - 1000 + NUM_TRAIN if number >= 1000 else number
    if not 0 <= index < SUBJECTS:
        raise ValueError(f"real_anatomy has {NUM_TRAIN} training (0-7) and {NUM_TEST} test cases (1000-1003)")
    return int(order[index])


@functools.lru_cache(maxsize=2)
def _label_map(subject: int) -> tuple[np.ndarray, np.ndarray]:
    """A subject's label map in RAS order (int16) and its affine, cropped to its segmented structures + the margin."""
    img = nib.as_closest_canonical(nib.load(label_maps_dir() / f"training_seg_{subject:02d}.nii.gz"))
    labels = np.rint(np.asarray(img.dataobj)).astype(np.int16)
    brain = np.isin(labels, list(MERGE))
    margin = int(np.ceil(MARGIN_MM / float(min(nib.affines.voxel_sizes(img.affine)))))
    nz = np.argwhere(brain)
    lo = np.maximum(nz.min(axis=0) - margin, 0)
    hi = np.minimum(nz.max(axis=0) + 1 + margin, labels.shape)
    affine = img.affine.copy()
    affine[:3, 3] = img.affine[:3, :3] @ lo + img.affine[:3, 3]
    return np.ascontiguousarray(labels[tuple(slice(a, b) for a, b in zip(lo, hi))]), affine


def real_anatomy(number: int, seed: int):
    """One case: (image int16 (X, Y, Z) RAS at 1.5 mm, label uint8 (12 structures), affine)."""
    subject = subject_of(number, seed)
    labels, affine = _label_map(subject)
    rng = np.random.default_rng([seed, number, subject, 1515])
    values = np.unique(labels)
    lut = np.zeros(int(values.max()) + 1, dtype=np.float32)
    texture = np.zeros_like(lut)
    for v in values.tolist():
        if v == 0:
            continue
        mean = T1_MEANS.get(v)
        lut[v] = rng.uniform(5.0, 130.0) if mean is None else mean * rng.uniform(0.92, 1.08)
        texture[v] = rng.uniform(2.0, 6.0)
    image = lut[labels] + texture[labels] * rng.standard_normal(labels.shape, dtype=np.float32)
    image = ndimage.gaussian_filter(image, sigma=rng.uniform(0.4, 0.8))
    image *= np.exp(smooth_random_field(rng, labels.shape, nodes=4, std=0.15))
    # 1 mm -> 1.5 mm: anti-aliasing blur, then linear sampling; the labels nearest-neighbour on the same points
    step = SPACING / float(nib.affines.voxel_sizes(affine)[0])
    shape = tuple(int(np.floor((n - 1) / step)) + 1 for n in labels.shape)
    coords = np.meshgrid(*[np.arange(n, dtype=np.float32) * np.float32(step) for n in shape], indexing="ij")
    image = ndimage.map_coordinates(ndimage.gaussian_filter(image, sigma=0.5), coords, order=1, output=np.float32)
    label = ndimage.map_coordinates(labels, coords, order=0, output=np.int16)
    del coords
    image += rng.normal(0.0, rng.uniform(1.5, 3.5) * 1.1, size=shape).astype(np.float32)
    image = np.clip(np.rint(image * np.float32(rng.uniform(5.0, 20.0))), 0, np.iinfo(np.int16).max).astype(np.int16)
    merged = np.zeros(int(max(label.max(), 1)) + 1, dtype=np.uint8)
    for old, new in MERGE.items():
        if old < merged.size:
            merged[old] = new
    out_affine = affine.copy()
    out_affine[:3, :3] = affine[:3, :3] * step
    return image, merged[label], out_affine
