"""The planner zoo's dataset kinds (`benchmarks/planner_zoo.py`): small, deterministic MSD datasets of very different
spacings, shapes, channels and class sizes, each a function of a seed.

| kind | family | voxels (X x Y x Z) | spacing, mm | channels | classes: share of the voxels per case (seed 0) |
| --- | --- | --- | --- | --- | --- |
| brain_1mm | `brain` | 112 x 128 x 96 | 1 x 1 x 1 | T1w | CSF 4-5 %, GM 48-51 %, WM 32-38 % |
| brain_2mm | `brain` | 91-109 x 111-125 x 86-112, LPS | 2 x 2 x 2 | T1w | CSF ~1 %, GM 10-14 %, WM 5-8 % |
| ct_3mm_thin | `ct` | 128 x 104 x 28-34, LPS, HU | 2.8-3.6 (xy) x 3 | CT | liver 5-11, spleen 2-6, kidney 1-2.5 % |
| ct_thin_slice | `ct` | 128 x 128 x 96, LPS, HU | 0.8 x 0.8 x 1 | CT | spleen 5-22 %, kidney 10-17 % |
| mr_thick | `brain` | 128 x 128 x 24 | 0.5 x 0.5 x 5 | T2w | CSF 7-8 %, GM 42-47 %, WM 34-38 % |
| brats_like | `brats` | 96 x 96 x 62, LPS | 2.5 x 2.5 x 2.5 | 4 MR | edema 0.45-5.5, core 0.02-1, enh. 0.03-0.4 % |
| ct_full_size | `ct` | 512 x 512 x 60-72, LPS, HU | 0.7-0.9 x 0.7-0.9 x 5 | CT | liver 2-3.7 %, 4 others 0.001-0.8 % |
| tiny_structure | `ct` | 91-102 x 90-95 x 36-44, HU | 0.7-0.9 x 0.7-0.9 x 2-3 | CT | spleen 2-5 %, lesion 0.03-0.11 % |
| real_anatomy | `real_anatomy` | 95-109 x 116-136 x 100-108 | 1.5 x 1.5 x 1.5 | T1-like | 12 structures, 0.04-11.6 % |

The documented class shares are `Kind.shares` below (measured on seed 0, every case of the kind; the unit test checks
them). Every kind has 12 training cases (tfmis splits them 0.7/0.15/0.15 into train/val/test itself) and 4 held-out
test cases with labels (labelsTs), except ct_full_size (6 + 2: real size) and real_anatomy (8 + 4: the 12 real maps).
"""

from __future__ import annotations

from benchmarks.zoo import brain, brats, ct, real_anatomy
from benchmarks.zoo.layout import TEST_FIRST, Kind, class_shares, dataset_complete, hand_patch, make_dataset

CT_LABELS_3 = ("background", "liver", "spleen", "kidney")

KINDS: dict[str, Kind] = {
    k.name: k
    for k in [
        Kind(
            name="brain_1mm",
            description="brain tissue (CSF, grey and white matter), T1w, 1 mm isotropic, 112x128x96 mm around the "
            "brain's centre (tfmis.data.demos.anatomy)",
            modalities=("T1w",),
            labels=brain.LABELS,
            spacing=(1.0, 1.0, 1.0),
            shape=(112, 128, 96),
            shares={"CSF": (0.02, 0.08), "grey matter": (0.40, 0.60), "white matter": (0.25, 0.45)},
            generate=brain.brain_1mm,
            hand_patch=hand_patch((112, 128, 96), (1.0, 1.0, 1.0)),
            shape_tolerance=0.0,
        ),
        Kind(
            name="brain_2mm",
            description="brain tissue (CSF, grey and white matter), T1w, 2 mm isotropic, the whole brain, LPS",
            modalities=("T1w",),
            labels=brain.LABELS,
            spacing=(2.0, 2.0, 2.0),
            shape=(100, 118, 99),
            shares={"CSF": (0.005, 0.02), "grey matter": (0.08, 0.18), "white matter": (0.04, 0.10)},
            generate=brain.brain_2mm,
            hand_patch=hand_patch((100, 118, 99), (2.0, 2.0, 2.0)),
            shape_tolerance=0.2,
        ),
        Kind(
            name="ct_3mm_thin",
            description="abdominal CT, int16 HU, LPS, ~3.2 mm pixels (128x128), 28-34 slices of 3 mm: liver, spleen, "
            "kidneys (tfmis.data.demos.ct's real-size anatomy)",
            modalities=("CT",),
            labels=CT_LABELS_3,
            spacing=(3.2, 3.2, 3.0),
            shape=(128, 104, 31),
            shares={"liver": (0.04, 0.13), "spleen": (0.01, 0.07), "kidney": (0.004, 0.035)},
            generate=ct.ct_3mm_thin,
            hand_patch=hand_patch((128, 104, 31), (3.2, 3.2, 3.0)),
            spacing_tolerance=0.13,
        ),
        Kind(
            name="ct_thin_slice",
            description="thin-slice CT, int16 HU, LPS, 0.8x0.8x1 mm, a 102x102x96 mm field of view around the left "
            "kidney and the spleen",
            modalities=("CT",),
            labels=("background", "spleen", "kidney"),
            spacing=(0.8, 0.8, 1.0),
            shape=(128, 128, 96),
            shares={"spleen": (0.02, 0.30), "kidney": (0.05, 0.25)},
            generate=ct.ct_thin_slice,
            hand_patch=hand_patch((128, 128, 96), (0.8, 0.8, 1.0)),
            shape_tolerance=0.0,
        ),
        Kind(
            name="mr_thick",
            description="thick-slice T2w MR, 0.5x0.5x5 mm (partial volume along z), 64x64x120 mm of the brain",
            modalities=("T2w",),
            labels=brain.LABELS,
            spacing=(0.5, 0.5, 5.0),
            shape=(128, 128, 24),
            shares={"CSF": (0.04, 0.12), "grey matter": (0.35, 0.55), "white matter": (0.28, 0.45)},
            generate=brain.mr_thick,
            hand_patch=hand_patch((128, 128, 24), (0.5, 0.5, 5.0)),
            shape_tolerance=0.0,
        ),
        Kind(
            name="brats_like",
            description="BraTS-like glioma, FLAIR/T1w/T1gd/T2w, 2.5 mm, LPS (tfmis.data.demos.brats); regions scored "
            "too",
            modalities=brats.MODALITIES,
            labels=brats.LABELS,
            spacing=(2.5, 2.5, 2.5),
            shape=(96, 96, 62),
            shares={"edema": (0.002, 0.08), "non-enhancing tumor": (0.0001, 0.03), "enhancing tumour": (0.0002, 0.01)},
            generate=brats.brats_like,
            hand_patch=hand_patch((96, 96, 62), (2.5, 2.5, 2.5)),
            regions=brats.REGIONS,
            shape_tolerance=0.0,
        ),
        Kind(
            name="ct_full_size",
            description="real-size abdominal CT, 512x512x60-72, ~0.8 mm pixels, 5 mm slices, int16 HU "
            "(tfmis.data.demos.ct --size full)",
            modalities=("CT",),
            labels=("background", "liver", "spleen", "kidney", "pancreas", "lesion"),
            spacing=(0.8, 0.8, 5.0),
            shape=(512, 512, 66),
            shares={
                "liver": (0.01, 0.06),
                "spleen": (0.0005, 0.015),
                "kidney": (0.002, 0.015),
                "pancreas": (0.0001, 0.003),
                "lesion": (0.0, 0.005),
            },
            generate=ct.ct_full_size,
            num_train=6,
            num_test=2,
            hand_patch=hand_patch((512, 512, 66), (0.8, 0.8, 5.0)),
            spacing_tolerance=0.13,
            shape_tolerance=0.1,
        ),
        Kind(
            name="tiny_structure",
            description="small CT slab (tfmis.data.demos.ct), a spleen and a lesion inside it of under 0.5 % of the "
            "voxels in every case",
            modalities=("CT",),
            labels=("background", "spleen", "lesion"),
            spacing=(0.8, 0.8, 2.5),
            shape=(96, 96, 40),
            shares={"spleen": (0.01, 0.08), "lesion": (0.0002, 0.005)},
            generate=ct.tiny_structure,
            hand_patch=hand_patch((96, 96, 40), (0.8, 0.8, 2.5)),
            spacing_tolerance=0.21,
            shape_tolerance=0.11,
        ),
        Kind(
            name="real_anatomy",
            description="T1-like scans synthesised from 12 real manual brain label maps (SynthSeg's), 1.5 mm, "
            "12 structures",
            modalities=("T1w",),
            labels=real_anatomy.LABELS,
            spacing=(1.5, 1.5, 1.5),
            shape=(102, 126, 104),
            shares={
                "cerebral white matter": (0.06, 0.14),
                "cerebral cortex": (0.06, 0.15),
                "lateral ventricle": (0.001, 0.03),
                "cerebellum white matter": (0.003, 0.012),
                "cerebellum cortex": (0.012, 0.04),
                "thalamus": (0.0015, 0.006),
                "caudate": (0.0006, 0.004),
                "putamen": (0.001, 0.005),
                "pallidum": (0.0002, 0.001),
                "hippocampus": (0.0005, 0.004),
                "amygdala": (0.0002, 0.001),
                "brain-stem": (0.002, 0.009),
            },
            generate=real_anatomy.real_anatomy,
            num_train=real_anatomy.NUM_TRAIN,
            num_test=real_anatomy.NUM_TEST,
            hand_patch=hand_patch((102, 126, 104), (1.5, 1.5, 1.5)),
            shape_tolerance=0.12,
        ),
    ]
}

__all__ = ["KINDS", "TEST_FIRST", "Kind", "class_shares", "dataset_complete", "hand_patch", "make_dataset"]
