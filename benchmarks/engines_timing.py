"""The `speed` measurement of benchmarks/engines.py: one large scan, every engine in one process, alternating.

Per pass: the seconds of `predict_array` (label map only: what `tfmis-predict` computes before writing), and the
peak resident memory during it (the process' peak is reset before the pass through /proc/self/clear_refs) above the
resident memory before it, as a multiple of the scan's float32 size. With `--monai PYTHON`, MONAI's
`sliding_window_inference` around a `monai.networks.nets.DynUNet` shaped like the run's network (its filters,
strides, 3x3x3 kernels, a residual block per level, instance norm, PReLU, random weights) runs on tfmis's
preprocessed volume in that interpreter (benchmarks/monai_unet.py) with the run's window, sliding-window batch,
overlap and blending mode, in turn with the engines; it does no preprocessing nor restore, so tfmis's sliding window
on the same preprocessed volume (`window s`: the sliding window, blend and softmax, no preprocessing nor restore) is
timed too with `--window`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from engines import FLOAT32, engine_predictor, reference_predictor

WORKER = Path(__file__).resolve().with_name("monai_unet.py")


def _status_mb(key: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _measured(function) -> tuple[float, float, float]:
    """(seconds, peak RSS MiB, peak above the RSS before, MiB) of one call."""
    before = _status_mb("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    function()
    seconds = time.perf_counter() - start
    peak = _status_mb("VmHWM")
    return seconds, peak, peak - before


class MonaiWorker:
    """benchmarks/monai_unet.py in `python`, one JSON line per request."""

    def __init__(self, python: str, threads: int):
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        self.process = subprocess.Popen(
            [python, str(WORKER), "--threads", str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.header = self._answer()

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the MONAI worker stopped")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"MONAI worker: {answer['error']}")
        return answer

    def request(self, **payload) -> dict:
        self.process.stdin.write(json.dumps(payload) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
        self.process.stdin.flush()
        self.process.wait(timeout=60)


def dynunet_arguments(predictor) -> dict:
    """`DynUNet`'s arguments for the network of `predictor`'s run (tfmis.networks.unet: one level per stride)."""
    model = predictor.config.model
    strides = [s if isinstance(s, int) else list(s) for s in model.strides]
    return {
        "spatial_dims": 3,
        "in_channels": len(predictor.modalities),
        "out_channels": predictor.task.out_channels,
        "kernel_size": [model.kernel_size] * len(strides),
        "strides": strides,
        "upsample_kernel_size": strides[1:],
        "filters": list(model.filters),
        "norm_name": "instance",
        "act_name": "prelu",
        "res_block": model.num_res_units > 0,
    }


def _start_monai(args, reference, volume, folder: Path):
    from tfmis.hardware import usable_cpu_count

    np.save(folder / "volume.npy", volume)
    worker = MonaiWorker(args.monai, usable_cpu_count())
    loaded = worker.request(
        cmd="load",
        input=str(folder / "volume.npy"),
        network=dynunet_arguments(reference),
        roi_size=list(reference.roi_size),
        sw_batch_size=reference.sw_batch_size,
        overlap=reference.overlap,
        mode=reference.mode,
    )
    (folder / "volume.npy").unlink()
    print(f"MONAI worker: {worker.header}; DynUNet {dynunet_arguments(reference)}: {loaded['parameters']} parameters")
    return worker


def speed(args) -> int:
    """Seconds and peak memory of `--scan` per engine (and MONAI), alternating pass by pass."""
    from tfmis.data.preprocess import preprocess
    from tfmis.data.sources.image_io import load_image
    from tfmis.hardware import cpu_name, usable_cpu_count

    reference, _ = reference_predictor(args.reference)
    arms = {("tfmis-predict (run folder)", "float32"): reference}
    for engine, precision in FLOAT32 + ([("openvino", "bfloat16")] if args.bfloat16 else []):
        arms[(engine, precision)] = engine_predictor(args.model, engine, precision)
    channels = len(reference.modalities)
    image, affine = load_image(args.scan, channels, "scan", integers=True)[:2]
    scan_mb = int(np.prod(image.shape[:3])) * channels * 4 / 2**20
    start = time.perf_counter()
    volume, _, geometry = preprocess(image, None, affine, reference.preprocessing)
    preprocess_seconds = time.perf_counter() - start
    print(
        f"{args.scan}: {image.shape[:3]} ({scan_mb:.0f} MiB as float32), preprocessed {volume.shape[:3]} "
        f"{volume.dtype} in {preprocess_seconds:.1f} s; window {reference.roi_size}, batch {reference.sw_batch_size}, "
        f"overlap {reference.overlap}, {reference.mode}; {usable_cpu_count()} cores of {cpu_name()}; "
        f"load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        worker = _start_monai(args, reference, volume, Path(tmp)) if args.monai else None
        if args.warmup:
            small, small_affine = load_image(args.warmup, channels, "warmup", integers=True)[:2]
            for predictor in arms.values():
                predictor.predict_array(small, small_affine, probabilities=False)
        samples = {name: [] for name in arms}
        samples.update({("MONAI DynUNet", "float32"): []} if worker else {})
        for number in range(args.repeats):
            for name, predictor in arms.items():
                s, peak, above = _measured(lambda p=predictor: p.predict_array(image, affine, probabilities=False))
                w = float("nan")
                if args.window:  # the sliding window alone on the preprocessed volume, as MONAI's
                    w = _measured(lambda p=predictor: p._grid_prediction([volume.copy()], geometry, "scan", None))[0]
                samples[name].append({"seconds": s, "window_seconds": w, "peak_rss_mb": peak, "above_mb": above})
                print(json.dumps({"pass": number, "arm": name, **samples[name][-1]}), flush=True)
            if worker:
                answer = worker.request(cmd="time")
                samples[("MONAI DynUNet", "float32")].append(
                    {"seconds": None, "window_seconds": answer["seconds"], "peak_rss_mb": answer["peak_rss_mb"]}
                    | {"above_mb": answer["above_start_mb"]}
                )
                print(json.dumps({"pass": number, "arm": "MONAI", **answer}), flush=True)
        if worker:
            worker.close()
    _print_speed(samples, scan_mb)
    if args.json:
        rows = [{"engine": e, "precision": p, "samples": v, "scan_mb": scan_mb} for (e, p), v in samples.items()]
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def _print_speed(samples: dict, scan_mb: float) -> None:
    base = statistics.mean(r["seconds"] for r in samples[("tfmis-predict (run folder)", "float32")])
    print(f"\nload average now {os.getloadavg()[0]:.1f}")
    print(
        "| engine | precision | s / case (passes) | vs run folder | window s | peak RSS above start (x scan float32) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for (engine, precision), rows in samples.items():
        seconds = [r["seconds"] for r in rows if r["seconds"] is not None]
        windows = " / ".join(f"{r['window_seconds']:.1f}" for r in rows)
        above = max(r["above_mb"] for r in rows)
        whole = f"{statistics.mean(seconds):.1f} ({' / '.join(f'{s:.1f}' for s in seconds)})" if seconds else ""
        ratio = f"{base / statistics.mean(seconds):.2f}x" if seconds else ""
        print(
            f"| {engine} | {precision} | {whole} | {ratio} | {windows} | "
            f"{above:.0f} MiB ({above / scan_mb:.2f}x; peak {max(r['peak_rss_mb'] for r in rows):.0f} MiB) |"
        )
