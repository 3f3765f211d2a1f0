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
from tfmis.data.demos.brain import make_demo_dataset
root = make_demo_dataset("data/Task00_DemoBrain")   # no-op if present
```
or from a shell: `python -m tfmis.data.demos.brain --output data/Task00_DemoBrain`.

BraTS size (`--size brats`, `generate_brats_case`): the same template, deformed and resampled at
1 mm onto the BraTS box (240 x 240 x 155, LPS, int16), with up to four channels (`--channels C`, the
first C of FLAIR, T1w, T1gd, T2w; contrasts synthesised from the tissue maps) and BraTS-like labels:
0 background, 1 edema, 2 non-enhancing tumor, 3 enhancing tumour (MSD Task01 names). One tumour per
case, its core radius log-uniform in 4-30 mm (many small ones), an enhancing rim 1.5-4 mm thick
around a non-enhancing core, irregular oedema reaching 1.4-2.6 radii along white matter (time and memory per
case: docs/converting.md, "Real-size variants"):

```bash
python -m tfmis.data.demos.brain --size brats --output data/Task01_DemoBraTS --cases 6 --test-cases 0
```

Z-scored (`--zscore`, brats only; `generate_brats_case(..., zscore=True)`): the same cases written as many public
MRI sets come, float32, each channel (x - mean) / std over its body (the non-zero voxels), so the background is a
per-case, per-channel constant such as -3.6 instead of 0 (the anatomy, labels and affines are those of the raw
cases):

```bash
python -m tfmis.data.demos.brain --size brats --zscore --output data/Task01_DemoBraTS_z --cases 6 --test-cases 0
```

Command line: `--output DIR` (required), `--cases N` (12), `--test-cases N` (3), `--seed S` (0),
`--overwrite`, `--size demo|brats` (demo), `--channels C` (brats: 2-4, default 4), `--spacing MM`
(brats: default 1.0; coarser only for tests, e.g. 2.0 gives 120 x 120 x 78), `--zscore` (brats: float32 z-scored).

Only numpy, scipy and nibabel are used; every case is a deterministic function of (seed, case number).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import nibabel as nib
import numpy as np

from tfmis.data.demos.anatomy import (
    TEMPLATE_ASSET,
    DemoCase,
    SubjectPose,
    Template,
    lesion_map,
    load_template,
    random_pose,
    random_rotation,
    reorient,
    smooth_random_field,
    subject_grid,
    synthesise_channels,
    template_voxel_coordinates,
    tissue_labels,
    warp_template,
)
from tfmis.data.demos.brats import (
    BRATS_BOX_MM,
    BRATS_DATASET_NAME,
    BRATS_DESCRIPTION,
    BRATS_LABELS,
    BRATS_MODALITIES,
    brats_grid,
    brats_pose,
    generate_brats_case,
    synthesise_brats_channels,
    tumour_maps,
    zscore_over_body,
)
from tfmis.utils.io import atomic_save_nifti, atomic_writer

# this module writes the dataset; the anatomy is drawn in `demo_anatomy`, the BraTS-size variant in `demo_brats`, the
# command line is `main` below (the moved names, this module's before, are importable from here too)
__all__ = [
    "BRATS_BOX_MM",
    "BRATS_DATASET_NAME",
    "BRATS_DESCRIPTION",
    "BRATS_LABELS",
    "BRATS_MODALITIES",
    "DATASET_NAME",
    "DESCRIPTION",
    "FIRST_TEST_NUMBER",
    "ISO",
    "LABELS",
    "LICENCE",
    "MODALITIES",
    "REFERENCE",
    "STORAGE_SCHEDULE",
    "TEMPLATE_ASSET",
    "DemoCase",
    "StorageStyle",
    "SubjectPose",
    "Template",
    "brats_grid",
    "brats_pose",
    "case_name",
    "dataset_json",
    "generate_brats_case",
    "generate_case",
    "lesion_map",
    "load_template",
    "main",
    "make_demo_dataset",
    "random_pose",
    "random_rotation",
    "reorient",
    "smooth_random_field",
    "storage_style",
    "subject_grid",
    "synthesise_brats_channels",
    "synthesise_channels",
    "template_voxel_coordinates",
    "tissue_labels",
    "tumour_maps",
    "warp_template",
    "zscore_over_body",
]

DATASET_NAME = "Task00_DemoBrain"
MODALITIES = {"0": "T1w", "1": "T2w"}
LABELS = {"0": "background", "1": "grey matter", "2": "white matter", "3": "lesion"}
FIRST_TEST_NUMBER = 100

DESCRIPTION = (
    "Synthetic demo dataset made by tfmis.data.demos.brain: the anatomy is the MNI ICBM152 2009a nonlinear "
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
# A case: drawn (`demo_anatomy`), then stored in its style
# --------------------------------------------------------------------------------------------


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
# The MSD folder
# --------------------------------------------------------------------------------------------


def nifti_image(data: np.ndarray, affine: np.ndarray) -> nib.Nifti1Image:
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
        atomic_save_nifti(nifti_image(case.image, case.affine), image_dir / f"{case_name(number)}.nii.gz")
        if not is_test:
            atomic_save_nifti(nifti_image(case.label, case.affine), root / "labelsTr" / f"{case_name(number)}.nii.gz")

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


def _folder_size_mb(root: Path) -> float:
    return sum(p.stat().st_size for p in root.rglob("*.nii.gz")) / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tfmis.data.demos.brain",
        description="Write a small two-channel (T1w, T2w) brain MRI segmentation dataset in the Medical "
        "Segmentation Decathlon layout (dataset.json, imagesTr/, labelsTr/, imagesTs/). "
        "Labels: 0 background, 1 grey matter, 2 white matter, 3 lesion. The anatomy is the MNI "
        "ICBM152 2009a template, randomly deformed per case. Does nothing if DIR/dataset.json "
        "already exists (use --overwrite to regenerate).",
        epilog="Example: python -m tfmis.data.demos.brain --output data/Task00_DemoBrain --cases 12 --test-cases 3",
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
