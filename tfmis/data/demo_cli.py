"""`python -m tfmis.data.demo`: writes the demo dataset (`tfmis.data.demo.make_demo_dataset`) from the command
line; `tfmis.data.demo.main` runs it."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tfmis.data.demo import DATASET_NAME, make_demo_dataset
from tfmis.data.demo_brats import BRATS_DATASET_NAME


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
