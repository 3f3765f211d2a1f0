#!/usr/bin/env python3
"""MONAI's side of benchmarks/sliding_window.py: a worker that runs `monai.inferers.sliding_window_inference`.

Run by benchmarks/sliding_window.py in a separate interpreter that has torch and MONAI (never a
dependency of tfmis); it imports only numpy, torch and MONAI. It reads one JSON request per line
on standard input and answers one JSON line on standard output:

    {"cmd": "load", "case": "c1", "input": "c1.npy", "roi_size": [64, 64, 64], "sw_batch_size": 4,
     "overlap": 0.5, "mode": "gaussian", "predictor": "tanh", "batches": [4, 4, 4, 4, 2]} -> {"ok": true}
    {"cmd": "time", "case": "c1"}            -> {"seconds": 0.031, "cpu_seconds": 0.05}   (one timed run)
    {"cmd": "time_predictor", "case": "c1"}  -> {"seconds": 0.012, "cpu_seconds": 0.02}   (the predictor
                                                alone on window batches of the given sizes)
    {"cmd": "save", "case": "c1", "output": "o.npy"}  -> {"ok": true}         (one run, output saved)
    {"cmd": "quit"}

`cpu_seconds` is the process' CPU time (all threads) over the run. Volumes are stored channels last,
(B, X, Y, Z, C), as tfmis takes them; the worker moves the channels first for MONAI and back for the
saved output. The first line it writes says which versions and how many torch threads it uses.

Example:
    .venv-monai/bin/python benchmarks/monai_sliding_window.py --threads 2
"""

import argparse
import json
import sys
import time

import numpy as np
import torch
from monai import __version__ as monai_version
from monai.inferers import sliding_window_inference

PREDICTORS = {
    "tanh": torch.tanh,
    "poly": lambda x: x * x - x / 2,
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, required=True, help="torch.set_num_threads: the cores TensorFlow uses")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = {}

    def answer(payload):
        print(json.dumps(payload), flush=True)

    def run(case):
        with torch.inference_mode():
            return sliding_window_inference(
                case["volume"],
                case["roi_size"],
                case["sw_batch_size"],
                PREDICTORS[case["predictor"]],
                overlap=case["overlap"],
                mode=case["mode"],
            )

    answer({"ready": True, "torch": torch.__version__, "monai": monai_version, "threads": torch.get_num_threads()})
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["cmd"] == "quit":
                break
            if request["cmd"] == "load":
                volume = np.load(request["input"])
                generator = torch.Generator().manual_seed(0)
                channels, roi = volume.shape[-1], request["roi_size"]
                cases[request["case"]] = {
                    **request,
                    "volume": torch.from_numpy(np.ascontiguousarray(np.moveaxis(volume, -1, 1))),
                    "window_batches": [
                        torch.randn((n, channels, *roi), generator=generator) for n in request.get("batches", [])
                    ],
                }
                answer({"ok": True})
            elif request["cmd"] == "time":
                case = cases[request["case"]]
                start, cpu = time.perf_counter(), time.process_time()
                run(case)
                answer({"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu})
            elif request["cmd"] == "time_predictor":
                case = cases[request["case"]]
                predictor = PREDICTORS[case["predictor"]]
                start, cpu = time.perf_counter(), time.process_time()
                with torch.inference_mode():
                    for batch in case["window_batches"]:
                        predictor(batch)
                answer({"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu})
            elif request["cmd"] == "save":
                output = run(cases[request["case"]])
                np.save(request["output"], np.moveaxis(output.numpy(), 1, -1))
                answer({"ok": True})
            else:
                answer({"error": f"unknown cmd {request['cmd']!r}"})
        except Exception as e:  # noqa: BLE001 - reported to the caller, which stops
            answer({"error": f"{type(e).__name__}: {e}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
