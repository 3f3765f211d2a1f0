#!/usr/bin/env python3
"""Whole-scan inference at CT size: the cascade against full-resolution sliding window, with scoring.

For each labelled case given (e.g. a 512x512x600 case of `python -m tfmis.data.demos.ct --size full`) and a
cascade's run folder (`python -m tfmis.train --source-dir DIR` on a dataset the plan cascades), runs in a fresh
process each mode:

- `uncropped`: the fine stage's model alone over the whole scan, no foreground crop (what a full-resolution model
  does with CT, whose intensities are non-zero everywhere, as nnU-Net runs it);
- `cropped`: the same over the scan's foreground crop (tfmis's one-stage prediction);
- `box`: the cascade of an earlier commit (`--before-rev`, default 85ecbfe: one box around the coarse foreground
  without its pieces under 1 %), extracted with `git archive`;
- `cascade`: this tree's cascade (a region per structure, `tfmis.inference.cascade`);
- `coarse`: the coarse stage alone (not in the default `--modes`).

Each worker loads the models, predicts a small crop first (tracing, thread pools), reads its resident memory (the
baseline), resets the high-water mark, then runs `Predictor.predict_file` with the label: reading the scan,
predicting, writing the label map and scoring it, as `python -m tfmis.predict --label-dir` does. Printed per mode:
seconds, peak RSS over the baseline and its ratio to the scan's float32 size, the fine stage's regions (number and
share of the scan), Dice per class. Then the speed-ups against `uncropped` and `cropped`.

Example:
    python benchmarks/cascade_inference.py --run runs/Task92_DemoCTFar \
        --case data/Task92_DemoCTFar/imagesTr/ct_005.nii.gz data/Task92_DemoCTFar/labelsTr/ct_005.nii.gz
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("uncropped", "cropped", "box", "cascade", "coarse")


def _kb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return float("nan")


def child(mode: str, run: str, image: str, label: str, report: str) -> None:
    """One measurement in this process; writes a JSON report."""
    import dataclasses
    import time

    import nibabel as nib
    import numpy as np

    from tfmis.config import load_config
    from tfmis.inference.cascade import make_predictor
    from tfmis.inference.inputs import InputCase
    from tfmis.inference.predictor import Predictor

    fine_dir = Path(run) / fine_stage(Path(run))
    if mode == "box":  # the earlier code does not know the keys added since: the run's configs without them
        fine_dir = older_run(Path(run), Path(report).parent / "box_run") / fine_stage(Path(run))
    config = load_config(fine_dir / "config.yaml")
    if mode in ("box", "cascade"):
        predictor = make_predictor(config, fine_dir, device="cpu")
    elif mode == "coarse":
        predictor = Predictor(load_config(Path(run) / "lowres" / "config.yaml"), Path(run) / "lowres", device="cpu")
    else:
        config.cascade.coarse_run = None
        predictor = Predictor(config, fine_dir, device="cpu")
        if mode == "uncropped":
            predictor.preprocessing = dataclasses.replace(predictor.preprocessing, crop_foreground=False)
    out = Path(report).parent / f"out_{mode}"
    warm = out / "warmup.nii.gz"
    warm.parent.mkdir(parents=True, exist_ok=True)
    img = nib.load(image)
    nib.save(nib.Nifti1Image(np.asarray(img.dataobj[:96, :96, :48]), img.affine), str(warm))
    predictor.predict_file(InputCase("warmup", str(warm)), out / "warm")
    del img
    baseline = _kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    start = time.perf_counter()
    result = predictor.predict_file(InputCase(Path(image).name.split(".")[0], image, label), out)
    seconds = time.perf_counter() - start
    shape = nib.load(image).shape[:3]
    Path(report).write_text(
        json.dumps(
            {
                "mode": mode,
                "status": result.status,
                "reason": result.reason,
                "seconds": seconds,
                "peak_mb": _kb("VmHWM") / 1024,
                "baseline_mb": baseline / 1024,
                "scan_float32_mb": float(np.prod(shape)) * 4 / 2**20,
                "shape": list(shape),
                "region": getattr(predictor, "last_region", "") or "whole scan",
                "regions": [[[s.start, s.stop] for s in b] for b in getattr(predictor, "last_boxes", None) or []],
                "dice": result.dice or {},
            }
        )
    )


def fine_stage(run: Path) -> str:
    """The fine stage's folder name in a cascade's folder: `cascade` (`fullres` in runs planned before the plan
    offered candidates)."""
    return "cascade" if (run / "cascade").is_dir() else "fullres"


def older_run(run: Path, target: Path) -> Path:
    """A copy of the cascade's run folder (files linked) whose config.yaml files lack `cascade.min_region_mm3`, for
    the earlier code of the `box` mode."""
    import yaml

    for stage in ("lowres", fine_stage(run)):
        (target / stage).mkdir(parents=True, exist_ok=True)
        for item in (run / stage).iterdir():
            if item.name != "config.yaml" and not (target / stage / item.name).exists():
                (target / stage / item.name).symlink_to(item.resolve())
        raw = yaml.safe_load((run / stage / "config.yaml").read_text())
        raw.get("cascade", {}).pop("min_region_mm3", None)
        if raw.get("cascade", {}).get("coarse_run"):
            raw["cascade"]["coarse_run"] = str(target / "lowres")
        (target / stage / "config.yaml").write_text(yaml.safe_dump(raw))
    return target


def extract_tree(rev: str, target: Path) -> None:
    archive = target / "tree.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", str(REPO), "archive", rev, "tfmis"], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    archive.unlink()


def _nanmean(values) -> float:
    finite = [v for v in values if v == v]
    return sum(finite) / len(finite) if finite else float("nan")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="the cascade's folder (with lowres/ and cascade/)")
    p.add_argument("--case", nargs=2, action="append", metavar=("IMAGE", "LABEL"), required=True)
    p.add_argument("--modes", default="uncropped,cropped,box,cascade", help=f"comma-separated, of {MODES}")
    p.add_argument("--before-rev", default="85ecbfe", help="commit of the `box` mode's code (the single-box cascade)")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child)
        return 0
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        sys.exit(f"--modes: {sorted(unknown)} not in {MODES}")
    print(f"CPU: {cpu_model()}, {len(os.sched_getaffinity(0))} usable cores", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cascade_inference_") as work:
        work = Path(work)
        before = work / "before"
        if "box" in modes:
            before.mkdir()
            extract_tree(args.before_rev, before)
        for image, label in args.case:
            for mode in modes:
                report = work / f"{mode}.json"
                env = dict(os.environ)
                if mode == "box":
                    env["PYTHONPATH"] = str(before) + os.pathsep + env.get("PYTHONPATH", "")
                command = [sys.executable, __file__, "--run", args.run, "--case", image, label, "--child"]
                done = subprocess.run(
                    [*command, mode, args.run, image, label, str(report)],
                    cwd=work,
                    env=env,
                    capture_output=True,
                    text=True,
                )
                if done.returncode != 0 or not report.is_file():
                    sys.exit(f"{mode} failed on {image}:\n{done.stderr[-3000:]}")
                r = json.loads(report.read_text())
                if r["status"] != "ok":
                    sys.exit(f"{mode} failed on {image}: {r['reason']}")
                r["case"] = Path(image).name
                rows.append(r)
                growth = r["peak_mb"] - r["baseline_mb"]
                print(
                    f"{r['case']:<18} {mode:<10} {r['seconds']:7.1f} s  peak +{growth:6.0f} MB over the loaded "
                    f"process = {growth / r['scan_float32_mb']:.2f}x the scan's float32 {r['scan_float32_mb']:.0f} MB  "
                    f"{r['region']}  mean Dice {_nanmean(r['dice'].values()):.3f}  "
                    + " ".join(f"{k} {v:.3f}" for k, v in r["dice"].items()),
                    flush=True,
                )
    for case in dict.fromkeys(r["case"] for r in rows):
        by_mode = {r["mode"]: r for r in rows if r["case"] == case}
        for reference in ("uncropped", "cropped"):
            for mode in ("box", "cascade"):
                if reference in by_mode and mode in by_mode:
                    ratio = by_mode[reference]["seconds"] / by_mode[mode]["seconds"]
                    print(f"{case}: {mode} {ratio:.1f}x faster than {reference}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
