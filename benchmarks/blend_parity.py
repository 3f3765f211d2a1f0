#!/usr/bin/env python3
"""Labels of the float16 sliding-window blend on a device (TensorFlow) against the host's (numpy), and both
against a float64 Σ(weight · prediction) / Σ(weight).

Both blends run on the CPU: the device one through the same path a GPU `device` gets
(`tfmis.inference.sliding_window.infer_windows(on_host=False)`). The predictor is cheap and not pointwise, so the
windows disagree where they overlap: every class score plus a tenth of its window mean. The inputs are smooth
random logits, K maps of `mean + smooth field of std` (`tfmis.data.demos.brain.smooth_random_field`), e.g. around
200 (about 100-300, where float16's step is 0.125-0.25) and around 0 (std 5, like a network's logits).
The reference is a plain numpy loop over the same window corners and importance map, in float64.

Per case and logit scale it prints the fraction of voxels whose argmax differs (device vs host, and each
vs the reference), the largest absolute difference of the blended values, and the seconds of each blend
(one run, informative only). With PYTHONPATH=<an older tree> it measures that tree's tfmis, for before/after numbers.

Example:
    python benchmarks/blend_parity.py                          # demo and CT sizes, logits ~200 and ~0
    python benchmarks/blend_parity.py --cases demo --logits 200:30 --json /tmp/parity.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

if importlib.util.find_spec("tfmis") is None:  # this checkout's, unless one is installed or on PYTHONPATH
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tensorflow as tf  # noqa: E402

from tfmis.data.demos.anatomy import smooth_random_field  # noqa: E402
from tfmis.inference.sliding_window import infer_windows  # noqa: E402
from tfmis.inference.windows import importance_array, scan_intervals, window_starts  # noqa: E402

# name: (spatial shape, classes, roi, overlap, mode, windows per predictor call)
CASES = {
    # a preprocessed demo case (configs/demo.yaml: about 60 x 75 x 62 voxels, roi 48, overlap 0.25, gaussian)
    "demo": ((60, 75, 62), 4, (48, 48, 48), 0.25, "gaussian", 4),
    # a CT at its training grid, 6 organs, 96^3 windows at overlap 0.5 (up to 8 windows per voxel)
    "ct": ((256, 256, 200), 6, (96, 96, 96), 0.5, "gaussian", 2),
}


def smooth_logits(shape, classes: int, mean: float, std: float, seed: int = 0) -> np.ndarray:
    """(1, X, Y, Z, K) float32: `mean` plus a smooth random field of `std` per class."""
    rng = np.random.default_rng(seed)
    logits = np.empty((1, *shape, classes), np.float32)
    for k in range(classes):
        logits[0, ..., k] = mean + smooth_random_field(rng, shape, nodes=6, std=std)
    return logits


def predictor(windows: tf.Tensor) -> tf.Tensor:
    return windows + 0.1 * tf.reduce_mean(windows, axis=(1, 2, 3), keepdims=True)


def reference(volume: np.ndarray, roi, starts: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Σ(w · p) / Σ(w) over the windows in float64, `predictor` in numpy."""
    total = np.zeros(volume.shape[1:], np.float64)
    count = np.zeros(volume.shape[1:4] + (1,), np.float64)
    w = weights.astype(np.float64)[..., None]
    for x, y, z in starts:
        region = (slice(x, x + roi[0]), slice(y, y + roi[1]), slice(z, z + roi[2]))
        window = volume[0][region].astype(np.float64)
        total[region] += w * (window + 0.1 * window.mean(axis=(0, 1, 2), keepdims=True))
        count[region] += w
    total /= count
    return total


def compare(a: np.ndarray, b: np.ndarray, b_labels: np.ndarray | None = None) -> tuple[float, float]:
    """(fraction of voxels whose argmax differs, max |a - b|), `b` float64 or float16."""
    labels = b.argmax(-1) if b_labels is None else b_labels
    differ = float(np.mean(a.argmax(-1) != labels))
    diff = 0.0
    for k in range(a.shape[-1]):  # a channel at a time: no float64 copy of the whole volume
        diff = max(diff, float(np.abs(a[..., k].astype(np.float64) - b[..., k]).max()))
    return differ, diff


def run_case(name: str, mean: float, std: float) -> dict:
    shape, classes, roi, overlap, mode, sw_batch_size = CASES[name]
    volume = smooth_logits(shape, classes, mean, std)
    starts = window_starts(shape, roi, scan_intervals(shape, roi, overlap))
    weights = importance_array(roi, mode, 0.125)
    row = dict(case=name, shape="x".join(map(str, shape)), classes=classes, roi=roi[0], overlap=overlap, mode=mode)
    row.update(logit_mean=mean, logit_std=std, windows=len(starts), logit_min=float(volume.min()))
    row["logit_max"] = float(volume.max())
    outputs = {}
    for arm, on_host in (("host", True), ("device", False)):
        start = time.perf_counter()
        out = infer_windows(
            volume,
            roi,
            sw_batch_size,
            predictor,
            overlap,
            mode,
            0.125,
            "constant",
            0.0,
            None,
            None,
            False,
            on_host=on_host,
            buffer_dtype="float16",
        )
        outputs[arm] = out.numpy()
        row[f"{arm}_s"] = round(time.perf_counter() - start, 2)
        del out
    row["device_vs_host_labels"], row["device_vs_host_max_abs"] = compare(outputs["device"], outputs["host"])
    expected = reference(volume, roi, starts, weights)
    del volume
    expected_labels = expected.argmax(-1)
    for arm in ("host", "device"):
        row[f"{arm}_vs_f64_labels"], row[f"{arm}_vs_f64_max_abs"] = compare(outputs[arm], expected, expected_labels)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="demo,ct", help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--logits", default="200:30,0:5", help="comma-separated MEAN:STD of the smooth logits")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    print(f"# {model}, {platform.python_version()}, TensorFlow {tf.__version__}, float16 buffers", flush=True)
    columns = (
        "case shape classes windows logit_min logit_max device_vs_host_labels device_vs_host_max_abs "
        "host_vs_f64_labels host_vs_f64_max_abs device_vs_f64_labels device_vs_f64_max_abs host_s device_s"
    ).split()
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns), flush=True)
    rows = []
    for name in args.cases.split(","):
        for scale in args.logits.split(","):
            mean, std = (float(v) for v in scale.split(":"))
            row = run_case(name.strip(), mean, std)
            rows.append(row)
            cells = [f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in columns]
            print("| " + " | ".join(cells) + " |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(cpu=model, rows=rows), indent=1))


if __name__ == "__main__":
    main()
