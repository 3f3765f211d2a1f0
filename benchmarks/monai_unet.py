#!/usr/bin/env python3
"""MONAI's side of benchmarks/engines.py: `sliding_window_inference` around a MONAI network, in a torch interpreter.

Run by benchmarks/engines.py (`--monai PYTHON`) in an interpreter that has torch and MONAI (never a dependency of
tfmis); it imports only numpy, torch and MONAI. One JSON request per line on standard input, one JSON line back:

    {"cmd": "load", "input": "volume.npy", "network": {...}, "roi_size": [56, 56, 32], "sw_batch_size": 4,
     "overlap": 0.25, "mode": "gaussian"}            -> {"ok": true, "parameters": 123456}
    {"cmd": "time"}                                  -> {"seconds": 61.2, "cpu_seconds": 118.0, "peak_rss_mb": 2100,
                                                         "above_start_mb": 900}
    {"cmd": "quit"}

`network` is `monai.networks.nets.DynUNet`'s arguments (random weights, eval mode): the volume is the preprocessed
scan, channels last (X, Y, Z, C) as tfmis holds it, moved channels first here. `peak_rss_mb` is the worker's peak
resident memory during the run (its peak reset before: /proc/self/clear_refs), `above_start_mb` that minus the
resident memory before the run. torch threads: `--threads`.
"""

import argparse
import json
import sys
import time

import numpy as np
import torch
from monai import __version__ as monai_version
from monai.inferers import sliding_window_inference
from monai.networks.nets import DynUNet


def _status(key: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, required=True, help="torch.set_num_threads: the cores tfmis uses")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    state = {}

    def answer(payload):
        print(json.dumps(payload), flush=True)

    answer({"ready": True, "torch": torch.__version__, "monai": monai_version, "threads": torch.get_num_threads()})
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["cmd"] == "quit":
                break
            if request["cmd"] == "load":
                volume = np.load(request["input"]).astype(np.float32)
                state.update(request)
                state["volume"] = torch.from_numpy(np.ascontiguousarray(np.moveaxis(volume, -1, 0)[None]))
                torch.manual_seed(0)
                state["net"] = DynUNet(**request["network"]).eval()
                with torch.inference_mode():  # warm-up: one window batch
                    state["net"](torch.zeros((request["sw_batch_size"], volume.shape[-1], *request["roi_size"])))
                del volume
                answer({"ok": True, "parameters": sum(p.numel() for p in state["net"].parameters())})
            elif request["cmd"] == "time":
                start_rss = _status("VmRSS")
                _reset_peak()
                start, cpu = time.perf_counter(), time.process_time()
                with torch.inference_mode():
                    out = sliding_window_inference(
                        state["volume"],
                        state["roi_size"],
                        state["sw_batch_size"],
                        state["net"],
                        overlap=state["overlap"],
                        mode=state["mode"],
                    )
                    labels = out.argmax(1)
                seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
                del out, labels
                peak = _status("VmHWM")
                answer(
                    {"seconds": seconds, "cpu_seconds": cpu, "peak_rss_mb": peak, "above_start_mb": peak - start_rss}
                )
            else:
                answer({"error": f"unknown cmd {request['cmd']!r}"})
        except Exception as e:  # noqa: BLE001 - reported to the caller, which stops
            answer({"error": f"{type(e).__name__}: {e}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
