#!/usr/bin/env python3
"""Peak memory and seconds of `Predictor.predict_file` on a CT-size scan, before and after a change.

Builds a CT-like int16 phantom (default 512x512x600 voxels of 0.8x0.8x1.0 mm, LPS voxel order, as
DICOM converters write; a body with fat, bone and organ-like ellipsoids and noise, stored as
`.nii.gz`) and a run folder with an untrained small 3D U-Net (K classes, CT windowing, training
spacing `--spacing`), then predicts the scan once per setting, each in a fresh subprocess:

- `before`: the Predictor of an earlier commit (`--before-rev`, default the branch point from
  `main`), extracted with `git archive` into a temporary folder;
- `after`: this tree's Predictor (label map only);
- `after-f16`: the same with float16 sliding-window buffers (`buffer_dtype="float16"`);
- `after+probs`: this tree's Predictor with the probability maps written (`--probabilities`);
- `after+score` / `before+score`: with a label NIfTI of the phantom's organs (uint8, classes 1..K-1), scored as
  `predict --label-dir` does with the run's default `validation` settings (Dice per class);
- `after+surface` / `before+surface`: the same scored with `validation.hd95`, `validation.nsd` (tolerance
  `--nsd-tolerance` mm) and a region uniting all foreground classes, as a challenge config would. The `before+`
  settings (minutes and GiB more) run only when `--settings` names them.

Each worker builds the Predictor and predicts a small crop of the scan first (tracing, thread pools),
then reads its resident memory (the baseline: interpreter, TensorFlow, model), resets the kernel's
high-water mark (`/proc/self/clear_refs`), predicts the scan, and reads `VmHWM` (peak RSS). The table
gives the peak over the baseline and its ratio to the scan's float32 size (X·Y·Z·4 bytes), the raw
peak, the seconds of `predict_file` (reading, preprocessing, sliding window, restoring, writing), and
the fraction of voxels whose label differs from the `before` label map. A scored setting also gives the largest
difference of its scores (Dice, and HD95 / NSD / region Dice when on) from its `before` counterpart's.

Example:
    python benchmarks/predict_memory.py                       # 512x512x600, K=4, 1.5x1.5x2.0 mm
    python benchmarks/predict_memory.py --classes 6 --spacing 0.8,0.8,1.0 --settings before,after
    python benchmarks/predict_memory.py --shape 256,256,200 --json /tmp/predict_memory.json
    python benchmarks/predict_memory.py --settings after,after+score,after+surface,before+score,before+surface
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETTINGS = (
    "before",
    "after",
    "after-f16",
    "after+probs",
    "after+score",
    "after+surface",
    "before+score",
    "before+surface",
)
DEFAULT_SETTINGS = SETTINGS[:6]  # the before+ settings take minutes and GiB more: ask for them with --settings
# the phantom's organ-like ellipsoids: centre and radii in mm (from the volume's centre), HU, and label in the
# scored label map (1 + index mod (K - 1))
ORGANS = [
    ((-60, -20, 40), (70, 60, 90), 60),  # liver-like
    ((70, 10, 60), (30, 35, 50), 100),  # spleen-like
    ((40, 30, -80), (25, 25, 40), 30),  # kidney-like
    ((-40, 30, -80), (25, 25, 40), 30),
]


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def phantom(shape, spacing, seed: int = 0):
    """A CT-like int16 volume in LPS voxel order and its affine (cheap to build at full size)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    sx, sy, sz = shape
    x = (np.arange(sx, dtype=np.float32) - sx / 2) * spacing[0]
    y = (np.arange(sy, dtype=np.float32) - sy / 2) * spacing[1]
    r2 = (x[:, None] / (0.38 * sx * spacing[0])) ** 2 + (y[None, :] / (0.28 * sy * spacing[1])) ** 2
    plane = np.full((sx, sy), -1000, np.int16)
    plane[(x[:, None] ** 2 + y[None, :] ** 2) > (0.5 * sx * spacing[0]) ** 2] = -1024  # outside the scan circle
    plane[r2 <= 1.0] = -100  # fat
    plane[r2 <= 0.85] = 40  # soft tissue
    bone = (x[:, None] ** 2 + (y[None, :] - 0.15 * sy * spacing[1]) ** 2) <= 15.0**2
    plane[bone] = 700
    image = np.empty(shape, np.int16)
    image[...] = plane[:, :, None]
    z = (np.arange(sz, dtype=np.float32) - sz / 2) * spacing[2]
    for centre, radii, hu in ORGANS:
        image[organ_mask(x, y, z, centre, radii)] = hu
    for k in range(sz):  # noise slice by slice: no whole-volume float temporaries
        image[:, :, k] += rng.integers(-12, 13, (sx, sy), dtype=np.int16)
    return image, phantom_affine(shape, spacing)


def phantom_affine(shape, spacing):
    """The phantom's affine: LPS voxel order, the volume's centre at the origin."""
    import numpy as np

    affine = np.diag([-spacing[0], -spacing[1], spacing[2], 1.0])
    affine[:3, 3] = [shape[0] * spacing[0] / 2, shape[1] * spacing[1] / 2, -shape[2] * spacing[2] / 2]
    return affine


def organ_mask(x, y, z, centre, radii):
    """The voxels of one ellipsoid, from the axes' coordinates in mm."""
    d = (
        ((x - centre[0]) / radii[0])[:, None, None] ** 2
        + ((y - centre[1]) / radii[1])[None, :, None] ** 2
        + ((z - centre[2]) / radii[2])[None, None, :] ** 2
    )
    return d <= 1


def phantom_label(shape, spacing, classes: int):
    """The phantom's label map: uint8, each organ ellipsoid labelled 1 + its index mod (classes - 1)."""
    import numpy as np

    x, y, z = ((np.arange(n, dtype=np.float32) - n / 2) * s for n, s in zip(shape, spacing))
    label = np.zeros(shape, np.uint8)
    for i, (centre, radii, _) in enumerate(ORGANS):
        label[organ_mask(x, y, z, centre, radii)] = 1 + i % (classes - 1)
    return label


def write_scan(path: Path, image, affine) -> None:
    """NIfTI written uncompressed, then gzipped fast (nibabel's own gzip level is slow at this size); in the
    array's dtype (the scan's int16, a label's uint8)."""
    import gzip
    import shutil

    import nibabel as nib

    img = nib.Nifti1Image(image, affine)
    img.set_data_dtype(image.dtype)
    raw = path.with_name(path.name.removesuffix(".gz"))
    nib.save(img, str(raw))
    with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=1) as dst:
        shutil.copyfileobj(src, dst, 2**24)
    raw.unlink()


def make_run(run: Path, classes: int, spacing, roi: int, filters: str) -> None:
    """A run folder (config.yaml, training_data.json, best.weights.h5) with an untrained U-Net."""
    sys.path.insert(0, str(REPO))
    import yaml

    from tfmis.config import load_config, to_dict
    from tfmis.data.preprocess import PreprocessConfig
    from tfmis.data.records import RUN_DATA_FILE, SCHEMA_VERSION
    from tfmis.task import SegmentationTask

    run.mkdir(parents=True, exist_ok=True)
    preprocessing = PreprocessConfig(spacing=tuple(spacing), normalization=("ct",), ct_window=(-175.0, 250.0))
    info = {
        "schema_version": SCHEMA_VERSION,
        "dataset_dir": str(run / "no-tfrecords"),
        "source": {"modalities": {"0": "CT"}, "labels": {str(k): f"class{k}" for k in range(classes)}},
        "preprocessing": preprocessing.to_dict(),
        "splits": {},
    }
    (run / RUN_DATA_FILE).write_text(json.dumps(info))
    config = load_config(
        None,
        [
            f"data.dataset_dir={run / 'no-tfrecords'}",
            f"output.dir={run}",
            f"model.filters=[{filters}]",
            "model.strides=[1,2,2]",
            "model.num_res_units=0",
            "model.norm=instance",
            f"pipeline.patch_size=[{roi},{roi},{roi}]",
            "training.precision=float32",
            "validation.num_sw_batch_size=2",
            "validation.overlap=0.25",
            "validation.mode=gaussian",
        ],
    )
    # only the keys that differ from the defaults: the `before` tree reads the file too, and may predate newer keys
    (run / "config.yaml").write_text(
        yaml.safe_dump(changed(to_dict(config), to_dict(load_config(None))), sort_keys=False)
    )
    task = SegmentationTask(config, data_info=info)
    model = task.build_inference_model()
    model.save_weights(str(run / "best.weights.h5"))


def changed(values: dict, defaults: dict) -> dict:
    """The entries of a nested dict that differ from `defaults`."""
    out = {}
    for key, value in values.items():
        default = defaults.get(key)
        if isinstance(value, dict) and isinstance(default, dict):
            if sub := changed(value, default):
                out[key] = sub
        elif value != default:
            out[key] = value
    return out


def worker(args) -> int:
    """One setting in this process: baseline, reset high-water mark, predict, peak."""
    from tfmis.config import load_config
    from tfmis.inference.inputs import InputCase
    from tfmis.inference.predictor import Predictor

    surface = [
        "validation.hd95=true",
        "validation.nsd=true",
        f"validation.nsd_tolerance_mm={args.nsd_tolerance}",
        f"validation.regions={{organs: [{', '.join(map(str, range(1, args.classes)))}]}}",
    ]
    config = load_config(str(Path(args.run) / "config.yaml"), surface if args.surface else [])
    options = {"buffer_dtype": "float16"} if args.f16 else {}
    predictor = Predictor(config, args.run, device="cpu", **options)
    out = Path(args.output)
    warmup = InputCase("warmup", args.warmup, args.warmup_label if args.label else None)
    result = predictor.predict_file(warmup, out / "warmup", probabilities=args.probabilities)
    if result.status != "ok":
        raise RuntimeError(f"warm-up failed: {result.reason}")
    baseline_kb = status_kb("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    start = time.perf_counter()
    result = predictor.predict_file(InputCase("scan", args.image, args.label), out, probabilities=args.probabilities)
    seconds = time.perf_counter() - start
    report = {
        "scores": {**(result.dice or {}), **(result.scores or {})},
        "status": result.status,
        "reason": result.reason,
        "seconds": seconds,
        "baseline_mb": baseline_kb / 1024,
        "peak_mb": status_kb("VmHWM") / 1024,
        "hwm_reset": reset,
        "device": result.device,
        "code": str(Path(sys.modules["tfmis"].__file__).parent),
    }
    Path(args.report).write_text(json.dumps(report))
    return 0 if result.status == "ok" else 1


def extract_tree(rev: str, target: Path) -> Path:
    """`tfmis/` of commit `rev` under `target` (git archive), for the `before` worker's PYTHONPATH."""
    archive = target / "tree.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", str(REPO), "archive", rev, "tfmis"], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    archive.unlink()
    return target


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="512,512,600", help="scan size X,Y,Z (voxels)")
    p.add_argument("--scan-spacing", default="0.8,0.8,1.0", help="scan voxel size (mm)")
    p.add_argument("--spacing", default="1.5,1.5,2.0", help="the run's training spacing (mm)")
    p.add_argument("--classes", type=int, default=4, help="K, background included")
    p.add_argument("--roi", type=int, default=96, help="sliding window (and patch) size")
    p.add_argument("--filters", default="8,16,32")
    p.add_argument(
        "--settings",
        default=",".join(DEFAULT_SETTINGS),
        help=f"some of {','.join(SETTINGS)} (default {','.join(DEFAULT_SETTINGS)})",
    )
    p.add_argument("--before-rev", default=None, help="commit of `before` (default: git merge-base HEAD main)")
    p.add_argument("--workdir", default=None, help="keep the scan, run and outputs here (default: a temp folder)")
    p.add_argument("--json", default=None, help="also write the rows as JSON")
    p.add_argument("--nsd-tolerance", type=float, default=2.0, help="NSD tolerance (mm) of the +surface settings")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--image", help=argparse.SUPPRESS)
    p.add_argument("--warmup", help=argparse.SUPPRESS)
    p.add_argument("--output", help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    p.add_argument("--probabilities", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--f16", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--label", default=None, help=argparse.SUPPRESS)
    p.add_argument("--warmup-label", default=None, help=argparse.SUPPRESS)
    p.add_argument("--surface", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    import numpy as np

    shape = tuple(int(s) for s in args.shape.split(","))
    scan_spacing = tuple(float(s) for s in args.scan_spacing.split(","))
    spacing = tuple(float(s) for s in args.spacing.split(","))
    settings = args.settings.split(",")
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        p.error(f"--settings: unknown {sorted(unknown)}; choose from {SETTINGS}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="predict_memory_"))
    work.mkdir(parents=True, exist_ok=True)
    scan = work / f"ct_{'x'.join(map(str, shape))}.nii.gz"
    warmup = work / "warmup.nii.gz"
    label = work / f"label_{'x'.join(map(str, shape))}_k{args.classes}.nii.gz"
    warmup_label = work / f"warmup_label_k{args.classes}.nii.gz"
    crop = tuple(slice(int(a * n), int(a * n) + 80) for a, n in zip((160 / 512, 160 / 512, 1 / 3), shape))
    if not scan.is_file():
        image, affine = phantom(shape, scan_spacing)
        write_scan(warmup, np.ascontiguousarray(image[crop]), affine)
        write_scan(scan, image, affine)
        del image
    if not label.is_file() and any("score" in s or "surface" in s for s in settings):
        affine = phantom_affine(shape, scan_spacing)
        labels = phantom_label(shape, scan_spacing, args.classes)
        write_scan(warmup_label, np.ascontiguousarray(labels[crop]), affine)
        write_scan(label, labels, affine)
        del labels
    run = work / f"run_k{args.classes}_{'x'.join(map(str, spacing))}"
    if not (run / "best.weights.h5").is_file():
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; sys.argv = sys.argv[1:]; import runpy; "
                "m = runpy.run_path(sys.argv[0]); m['make_run'](*m['parse_run'](sys.argv[1:]))",
                __file__,
                str(run),
                str(args.classes),
                args.spacing,
                str(args.roi),
                args.filters,
            ],
            check=True,
            cwd=REPO,
        )
    rev = (
        args.before_rev
        or subprocess.run(
            ["git", "-C", str(REPO), "merge-base", "HEAD", "main"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    scan_mb = np.prod(shape) * 4 / 2**20
    rows = []
    with tempfile.TemporaryDirectory(prefix="predict_memory_before_") as before_tree:
        if any(s.startswith("before") for s in settings):
            extract_tree(rev, Path(before_tree))
        for setting in settings:
            out = work / f"out_{setting}"
            report = work / f"report_{setting}.json"
            tree = before_tree if setting.startswith("before") else str(REPO)
            scored = "score" in setting or "surface" in setting
            command = [
                sys.executable,
                __file__,
                "--worker",
                "--run",
                str(run),
                "--image",
                str(scan),
                "--warmup",
                str(warmup),
                "--output",
                str(out),
                "--report",
                str(report),
                *(["--probabilities"] if setting == "after+probs" else []),
                *(["--f16"] if setting == "after-f16" else []),
                *(["--label", str(label), "--warmup-label", str(warmup_label)] if scored else []),
                *(["--surface", "--nsd-tolerance", str(args.nsd_tolerance)] if "surface" in setting else []),
            ]
            env = {**os.environ, "PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", "")}
            done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True)
            if done.returncode != 0 or not report.is_file():
                print(f"{setting}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
                continue
            row = {"setting": setting, **json.loads(report.read_text())}
            row["over_baseline_mb"] = row["peak_mb"] - row["baseline_mb"]
            row["ratio"] = row["over_baseline_mb"] / scan_mb
            rows.append(row)
            print(f"{setting}: {row}", file=sys.stderr, flush=True)
    reference = work / "out_before" / "scan.nii.gz"
    if reference.is_file():
        import nibabel as nib

        ref = np.asanyarray(nib.load(str(reference)).dataobj)
        for row in rows:
            labels = np.asanyarray(nib.load(str(work / f"out_{row['setting']}" / "scan.nii.gz")).dataobj)
            row["labels_differ"] = float(np.mean(labels != ref))
    by_setting = {r["setting"]: r for r in rows}
    for row in rows:
        before = by_setting.get(row["setting"].replace("after", "before"))
        if row["setting"].startswith("after+") and before is not None and row["scores"]:
            row["scores_differ"] = max(score_difference(a, before["scores"].get(k)) for k, a in row["scores"].items())
    print(
        f"scan {'x'.join(map(str, shape))} int16 ({scan_spacing} mm; float32 {scan_mb:.0f} MiB), K={args.classes}, "
        f"training spacing {spacing} mm, roi {args.roi}, before = {rev[:10]}"
    )
    print(
        f"{'setting':<14} {'seconds':>8} {'baseline MiB':>12} {'peak MiB':>9} {'over base':>9} "
        f"{'x scan f32':>10} {'labels differ':>13} {'scores differ':>13}"
    )
    for r in rows:
        differ = f"{r['labels_differ']:.2e}" if "labels_differ" in r else "-"
        scores = f"{r['scores_differ']:.1e}" if "scores_differ" in r else "-"
        print(
            f"{r['setting']:<14} {r['seconds']:8.1f} {r['baseline_mb']:12.0f} {r['peak_mb']:9.0f} "
            f"{r['over_baseline_mb']:9.0f} {r['ratio']:10.2f} {differ:>13} {scores:>13}"
        )
    for r in rows:
        if r["scores"]:
            print(f"{r['setting']}: " + ", ".join(f"{k} {v:.4f}" for k, v in r["scores"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": shape, "classes": args.classes, "rows": rows}, indent=1))
    return 0


def score_difference(a, b) -> float:
    """|a - b|, 0 when both are NaN or the same infinity, inf when only one is a number."""
    import math

    if b is None:
        return math.inf
    if (math.isnan(a) and math.isnan(b)) or a == b:
        return 0.0
    return abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf


def parse_run(argv):
    run, classes, spacing, roi, filters = argv
    return Path(run), int(classes), [float(s) for s in spacing.split(",")], int(roi), filters


if __name__ == "__main__":
    sys.exit(main())
