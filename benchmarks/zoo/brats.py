"""BraTS-like kind: tfmis's BraTS-size demo (`tfmis.data.demos.brats.generate_brats_case`) on a 2.5 mm grid of the
240 x 240 x 155 mm BraTS box (96 x 96 x 62 voxels, LPS, int16), four channels (FLAIR, T1w, T1gd, T2w), labels 1 edema,
2 non-enhancing tumour, 3 enhancing tumour; scored per class and per region (whole tumour {1, 2, 3}, tumour core
{2, 3}, enhancing tumour {3})."""

from __future__ import annotations

import numpy as np

from benchmarks.zoo.layout import TEST_FIRST, nth_accepted
from tfmis.data.demos.brats import BRATS_LABELS, BRATS_MODALITIES, generate_brats_case

LABELS = tuple(BRATS_LABELS[str(i)] for i in range(len(BRATS_LABELS)))
MODALITIES = tuple(BRATS_MODALITIES[str(i)] for i in range(len(BRATS_MODALITIES)))
REGIONS = {"whole_tumour": [1, 2, 3], "tumour_core": [2, 3], "enhancing_tumour": [3]}
SPACING = 2.5


MIN_TUMOUR_SHARE = 0.004  # a case is used when its tumour holds >= 0.4 % of the voxels and every class


def _phantom(number: int, seed: int):
    case = generate_brats_case(number, seed, spacing=SPACING, channels=4)
    return case.image, case.label, case.affine


def _large_tumour(case) -> bool:
    counts = np.bincount(case[1].ravel(), minlength=4)
    return counts[1:].sum() >= MIN_TUMOUR_SHARE * case[1].size and int(counts[1:].min()) >= 20


def brats_like(number: int, seed: int):
    """The n-th BraTS-size phantom case (2.5 mm) whose tumour holds >= 0.4 % of the voxels and >= 20 voxels of each
    class (the phantom draws radii log-uniform in 4-30 mm: most are tiny at 2.5 mm; about a third pass): training
    cases from phantom numbers 0, 1, ..., test cases (numbers >= 1000) from 5000 on."""
    first, index = (5000, number - TEST_FIRST) if number >= TEST_FIRST else (0, number)
    return _phantom(nth_accepted(_phantom, _large_tumour, seed, first, index), seed)
