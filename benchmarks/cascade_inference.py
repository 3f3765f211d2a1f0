#!/usr/bin/env python3
"""Whole-scan inference at CT size: the cascade against full-resolution sliding window over the whole scan.

For each labelled case given (e.g. the 512x512x600 case of `python -m tfmis.data.demo_ct --size full`) and a
cascade's run folder (`python -m tfmis.train --source-dir DIR` on a dataset the plan cascades), runs in a fresh
process each:

- `full`: the fine stage's model alone, sliding over the whole scan at full resolution (what one full-resolution
  stage would do);
- `cascade`: the coarse stage on the whole scan, the fine stage on the box around what it found
  (`tfmis.inference.cascade`);

and prints seconds, peak resident memory (VmHWM, and its growth over the process's resident memory once the models
are loaded, the scan's reading included), the ratio of that growth to the scan's float32 size, the fine stage's
region, and Dice per class against the label.

Example:
    python benchmarks/cascade_inference.py --run runs/Task91_DemoCTFull \
        --case data/Task91_DemoCTFull/imagesTr/ct_005.nii.gz data/Task91_DemoCTFull/labelsTr/ct_005.nii.gz
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(mode: str, run: str, image: str, label: str) -> None:
    """One measurement in this process; prints a JSON line."""
    import time

    import nibabel as nib
    import numpy as np

    from tfmis.config import load_config
    from tfmis.data.msd import load_image
    from tfmis.inference.cascade import make_predictor
    from tfmis.inference.predictor import Predictor
    from tfmis.metrics.segmentation import dice_per_class

    fine_dir = Path(run) / "fullres"
    config = load_config(fine_dir / "config.yaml")
    predictor = make_predictor(config, fine_dir, device="cpu") if mode == "cascade" else None
    if mode == "full":
        config.cascade.coarse_run = None
        predictor = Predictor(config, fine_dir, device="cpu")
    baseline = _rss_mb("VmRSS")  # models loaded; the scan itself counts in the growth
    img = nib.load(image)
    scan = load_image(image, len(predictor.modalities), Path(image).name, integers=True)[0]  # as predict reads it
    start = time.perf_counter()
    labels = predictor.predict_array(scan, img.affine, Path(image).name, probabilities=False)[0]  # as predict does
    seconds = time.perf_counter() - start
    peak = _rss_mb("VmHWM")  # of the prediction, before scoring it
    truth = np.rint(np.asarray(nib.load(label).dataobj)).astype(np.int64)
    dice = dice_per_class(labels, truth, len(predictor.class_names))
    print(
        json.dumps(
            {
                "mode": mode,
                "seconds": seconds,
                "peak_mb": peak,
                "baseline_mb": baseline,
                "scan_float32_mb": scan[..., 0].size * 4 / 2**20,
                "shape": list(scan.shape[:3]),
                "region": getattr(predictor, "last_region", "whole scan"),
                "dice": dict(zip(predictor.class_names[1:], [float(d) for d in dice])),
            }
        )
    )


def _nanmean(values) -> float:
    finite = [v for v in values if v == v]
    return sum(finite) / len(finite) if finite else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="the cascade's folder (with lowres/ and fullres/)")
    p.add_argument("--case", nargs=2, action="append", metavar=("IMAGE", "LABEL"), required=True)
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child)
        return 0
    rows = []
    for image, label in args.case:
        for mode in ("full", "cascade"):
            done = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--run",
                    args.run,
                    "--case",
                    image,
                    label,
                    "--child",
                    mode,
                    args.run,
                    image,
                    label,
                ],
                cwd=REPO,
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                sys.exit(f"{mode} failed on {image}:\n{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(
                f"{Path(image).name:<18} {mode:<8} {r['seconds']:7.1f} s  peak {r['peak_mb']:7.0f} MB "
                f"(+{r['peak_mb'] - r['baseline_mb']:.0f} over the loaded process = "
                f"{(r['peak_mb'] - r['baseline_mb']) / r['scan_float32_mb']:.2f}x the scan's float32 "
                f"{r['scan_float32_mb']:.0f} MB)  {r['region']}  mean Dice "
                f"{_nanmean(r['dice'].values()):.3f}  " + " ".join(f"{k} {v:.3f}" for k, v in r["dice"].items()),
                flush=True,
            )
    for image, _ in args.case:
        full, cascade = [r for r in rows if r["shape"] and r["mode"] in ("full", "cascade")][:2]
        print(f"{Path(image).name}: cascade {full['seconds'] / cascade['seconds']:.1f}x faster")
        rows = rows[2:]
    return 0


if __name__ == "__main__":
    sys.exit(main())
