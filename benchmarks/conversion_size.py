#!/usr/bin/env python3
"""Conversion of real-size CT: seconds and peak resident memory per case against its voxel count.

Generates `--cases` CT-size cases with `tfmis.data.demos.ct.generate_full_case` (512 x 512 x Z, Z spread evenly
from `--slices` MIN to MAX, 0.7-0.9 mm pixels, 1.5-5 mm slices, int16 HU), then converts the folder with
`tfmis.data.convert.convert` (what `python -m tfmis.convert` runs) once per `--workers` value, each run in its own
Python process. Each case's worker (`process_case`: read, validate, preprocess, fingerprint) is wrapped so that it
records, in the process that ran it:

- `seconds`: wall time of the case;
- `baseline_mb`: VmRSS just before the case (the interpreter, numpy/scipy/nibabel, with --workers 1 also TensorFlow
  and what the writer holds);
- `peak_mb`: VmHWM over the case (reset through /proc/self/clear_refs just before it);
- `ratio`: (peak - baseline) / the case's float32 size (X*Y*Z*C*4 bytes), to hold to 4 at most.

Prints a table, writes `conversion_size.csv`, `conversion_size.md` and `conversion_size.png` (time per case and
peak RSS vs voxels) into `--output`. The conversion uses a fixed `--ct-window` (so no first pass over the data) and
the dataset's median spacing, as `tfmis.convert` does by default.

Example:
    python benchmarks/conversion_size.py --cases 20 --output runs/conversion_size           # ~15 min on 2 cores
    python benchmarks/conversion_size.py --cases 20 --output runs/conversion_size --report-only    # table + plot again
    python benchmarks/conversion_size.py --cases 3 --slices 100,200 --workers 1 --output /tmp/cs   # a quick look
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's tfmis, whatever is installed
LOG_ENV = "TFMIS_CONVERSION_SIZE_LOG"


# ---------------------------------------------------------------- measured worker (runs in the converting process)


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current VmRSS
    except OSError:
        pass


def measured_process_case(task):
    """`tfmis.data.convert.process_case` with its time and peak RSS appended to the log named in LOG_ENV."""
    from tfmis.data.conversion_cases import process_case

    _reset_peak()
    baseline = _status_mb("VmRSS")
    start = time.perf_counter()
    result = process_case(task)  # the conversion's own, which `run_one` replaced in tfmis.data.convert
    record = {
        "case_id": result["case_id"],
        "pid": os.getpid(),
        "seconds": round(time.perf_counter() - start, 3),
        "baseline_mb": round(baseline, 1),
        "peak_mb": round(_status_mb("VmHWM"), 1),
        "status": result["status"],
        "out_shape": list(result["image"].shape) if result["status"] == "ok" else None,
    }
    with open(os.environ[LOG_ENV], "a") as f:
        f.write(json.dumps(record) + "\n")
    return result


def run_one(args) -> int:
    """One conversion in this process (started by `main` per --workers value)."""
    from tfmis.data import convert as conversion

    conversion.process_case = measured_process_case
    _reset_peak()
    start = time.perf_counter()
    index = conversion.convert(
        conversion.ConversionConfig(
            source_dir=str(args.data),
            target_dir=str(args.target),
            workers=args.run_one,
            ct_window=tuple(args.ct_window),
            split=(1.0,),
            shards=1,
            overwrite=True,
            progress=False,
        )
    )
    summary = {
        "workers": args.run_one,
        "wall_seconds": round(time.perf_counter() - start, 1),
        "parent_peak_mb": round(_status_mb("VmHWM"), 1),
        "records": index["stats"]["records"],
        "skipped": index["skipped"],
        "spacing": index["preprocessing"]["spacing"],
    }
    Path(os.environ[LOG_ENV]).with_suffix(".summary.json").write_text(json.dumps(summary))
    return 0


# ---------------------------------------------------------------- data


def make_dataset(root: Path, cases: int, slices: tuple[int, int], seed: int) -> list[dict]:
    """The CT-size cases (kept if already there); returns [{case_id, shape, spacing}]."""
    import nibabel as nib
    import numpy as np

    from tfmis.data.demos import ct as demo_ct

    for sub in ("imagesTr", "labelsTr"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    counts = np.linspace(slices[0], slices[1], cases).round().astype(int) if cases > 1 else [slices[0]]
    training, info = [], []
    for i, n in enumerate(counts):
        name = demo_ct.case_name(i)
        image_path, label_path = root / "imagesTr" / f"{name}.nii.gz", root / "labelsTr" / f"{name}.nii.gz"
        if not (image_path.is_file() and label_path.is_file()):
            start = time.perf_counter()
            image, label, affine = demo_ct.generate_full_case(i, seed, (int(n), int(n)))
            demo_ct.save_volume(label, affine, label_path)
            demo_ct.save_volume(image, affine, image_path)
            del image, label
            print(f"generated {name}: 512 x 512 x {n} in {time.perf_counter() - start:.1f} s", flush=True)
        header = nib.load(str(image_path)).header
        info.append({"case_id": name, "shape": list(header.get_data_shape()), "spacing": header.get_zooms()[:3]})
        training.append({"image": f"./imagesTr/{name}.nii.gz", "label": f"./labelsTr/{name}.nii.gz"})
    meta = {
        "name": root.name,
        "description": demo_ct.FULL_DESCRIPTION,
        "tensorImageSize": "3D",
        "reference": "synthetic",
        "licence": "CC0",
        "release": "1.0",
        "modality": demo_ct.MODALITIES,
        "labels": demo_ct.FULL_LABELS,
        "numTraining": len(training),
        "numTest": 0,
        "training": training,
        "test": [],
    }
    text = json.dumps(meta, indent=2)
    if not (root / "dataset.json").is_file() or (root / "dataset.json").read_text() != text:
        (root / "dataset.json").write_text(text)
    return info


# ---------------------------------------------------------------- report


def baseline_rss() -> dict:
    """VmRSS of a fresh interpreter after the worker's imports, and after importing TensorFlow too."""
    code = (
        "import sys, pathlib\n"
        "def rss():\n"
        "    for l in pathlib.Path('/proc/self/status').read_text().splitlines():\n"
        "        if l.startswith('VmRSS:'): return int(l.split()[1]) / 1024\n"
        "import numpy, scipy.ndimage, nibabel, tfmis.data.convert\n"
        "a = rss()\n"
        "import tensorflow\n"
        "print(a, rss())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    worker, with_tf = (float(v) for v in out.stdout.split())
    return {"worker_imports_mb": round(worker, 1), "with_tensorflow_mb": round(with_tf, 1)}


def write_report(out: Path, info: list[dict], runs: dict[int, dict], summaries: dict[int, dict], base: dict) -> str:
    rows = []
    for case in info:
        voxels = int(case["shape"][0] * case["shape"][1] * case["shape"][2])
        f32_mb = voxels * 4 / 2**20
        row = {
            "case_id": case["case_id"],
            "shape": "x".join(str(s) for s in case["shape"]),
            "spacing": ",".join(f"{s:.3g}" for s in case["spacing"]),
            "voxels_M": round(voxels / 1e6, 2),
            "float32_MB": round(f32_mb, 1),
        }
        for workers, records in runs.items():
            r = records.get(case["case_id"])
            if r is None:
                continue
            row[f"out_shape_w{workers}"] = "x".join(str(s) for s in r["out_shape"][:3]) if r["out_shape"] else ""
            row[f"seconds_w{workers}"] = r["seconds"]
            row[f"baseline_MB_w{workers}"] = r["baseline_mb"]
            row[f"peak_MB_w{workers}"] = r["peak_mb"]
            row[f"ratio_w{workers}"] = round((r["peak_mb"] - r["baseline_mb"]) / f32_mb, 2)
        rows.append(row)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(out / "conversion_size.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    lines.append("")
    for workers, s in summaries.items():
        ratios = [row[f"ratio_w{workers}"] for row in rows if f"ratio_w{workers}" in row]
        secs = [row[f"seconds_w{workers}"] for row in rows if f"seconds_w{workers}" in row]
        if ratios:
            peaks = [row[f"peak_MB_w{workers}"] for row in rows if f"peak_MB_w{workers}" in row]
            # with --workers 1 the cases run in the converting process and reset its VmHWM: its peak is theirs
            process_peak = max([s["parent_peak_mb"], *peaks]) if workers == 1 else s["parent_peak_mb"]
            lines.append(
                f"- workers {workers}: {s['records']} cases in {s['wall_seconds']} s wall "
                f"({sum(secs):.0f} s of case work), target spacing {s['spacing']}; peak RSS over baseline "
                f"{min(ratios):.2f}-{max(ratios):.2f} x the case's float32 size (median "
                f"{sorted(ratios)[len(ratios) // 2]:.2f}); converting (main) process peak {process_peak:.0f} MB"
            )
    lines.append(
        f"- baseline: a fresh interpreter with the worker's imports (numpy, scipy, nibabel, tfmis.data.convert) "
        f"{base['worker_imports_mb']:.0f} MB, with TensorFlow too {base['with_tensorflow_mb']:.0f} MB"
    )
    table = "\n".join(lines)
    (out / "conversion_size.md").write_text(table + "\n")
    _plot(out / "conversion_size.png", rows, sorted(runs))
    return table


def _plot(path: Path, rows: list[dict], workers: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m, ax_g) = plt.subplots(1, 3, figsize=(15, 4.4))
    for w, (marker, colour) in zip(workers, [("o", "tab:blue"), ("s", "tab:orange"), ("^", "tab:green")]):
        pts = [r for r in rows if f"seconds_w{w}" in r]
        vox = [r["voxels_M"] for r in pts]
        ax_t.plot(vox, [r[f"seconds_w{w}"] for r in pts], marker, color=colour, label=f"--workers {w}")
        ax_m.plot(vox, [r[f"peak_MB_w{w}"] for r in pts], marker, color=colour, label=f"peak, --workers {w}")
        ax_m.plot(vox, [r[f"baseline_MB_w{w}"] for r in pts], marker, color=colour, mfc="none", alpha=0.6)
        growth = [r[f"peak_MB_w{w}"] - r[f"baseline_MB_w{w}"] for r in pts]
        ax_g.plot(vox, growth, marker, color=colour, label=f"--workers {w}")
    vox = sorted(r["voxels_M"] for r in rows)
    if vox:
        for k, style in ((4, "k--"), (1, "k:")):
            ax_g.plot(vox, [k * v * 4e6 / 2**20 for v in vox], style, lw=1, label=f"{k} x the case's float32 size")
    ax_t.set(xlabel="voxels (millions)", ylabel="seconds per case (in its worker)", title="time per case")
    ax_m.set(
        xlabel="voxels (millions)",
        ylabel="MB",
        title="peak RSS of the worker (filled) and its RSS before the case (open)",
    )
    ax_g.set(xlabel="voxels (millions)", ylabel="MB", title="peak RSS minus RSS before the case")
    for ax in (ax_t, ax_m, ax_g):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_m.title.set_fontsize(9)
    fig.suptitle("tfmis conversion of 512 x 512 x Z CT (int16, 1 channel, to float16 at the median spacing)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ---------------------------------------------------------------- command line


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(v) for v in text.split(","))
    return lo, hi


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=20)
    p.add_argument("--slices", type=_pair, default=(100, 600), metavar="MIN,MAX")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--data", type=Path, default=REPO / "data" / "Task91_ConversionSize", help="generated cases")
    p.add_argument("--output", type=Path, default=REPO / "runs" / "conversion_size")
    p.add_argument("--ct-window", type=float, nargs=2, default=(-160.0, 240.0), metavar=("LOW", "HIGH"))
    p.add_argument("--report-only", action="store_true", help="redo the table and plot from --output's logs")
    p.add_argument("--run-one", type=int, default=None, help=argparse.SUPPRESS)  # internal: one conversion
    p.add_argument("--target", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run_one is not None:
        return run_one(args)

    args.output.mkdir(parents=True, exist_ok=True)
    info = make_dataset(args.data, args.cases, args.slices, args.seed)
    base_file = args.output / "baseline.json"
    if args.report_only and base_file.is_file():
        base = json.loads(base_file.read_text())
    else:
        base = baseline_rss()
        base_file.write_text(json.dumps(base))
    print(f"baseline RSS: {base}", flush=True)
    runs, summaries = {}, {}
    for workers in args.workers:
        log = args.output / f"cases_w{workers}.jsonl"
        if args.report_only:
            runs[workers] = {r["case_id"]: r for r in map(json.loads, log.read_text().splitlines())}
            summaries[workers] = json.loads(log.with_suffix(".summary.json").read_text())
            continue
        log.unlink(missing_ok=True)
        env = {**os.environ, LOG_ENV: str(log), "PYTHONPATH": str(REPO)}
        command = [sys.executable, __file__, "--run-one", str(workers), "--data", str(args.data)]
        command += ["--target", str(args.output / f"tfrecords_w{workers}"), "--ct-window", *map(str, args.ct_window)]
        print(f"converting with --workers {workers} ...", flush=True)
        subprocess.run(command, env=env, check=True, cwd=REPO)
        runs[workers] = {r["case_id"]: r for r in map(json.loads, log.read_text().splitlines())}
        summaries[workers] = json.loads(log.with_suffix(".summary.json").read_text())
        print(write_report(args.output, info, runs, summaries, base), flush=True)
    if args.report_only:
        print(write_report(args.output, info, runs, summaries, base), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
