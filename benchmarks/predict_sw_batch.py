#!/usr/bin/env python3
"""Seconds per case of `tfmis.predict` for several sliding-window batch sizes, measured in one run.

Example (after the README's main job):
    python benchmarks/predict_sw_batch.py --config runs/demo/config.yaml --checkpoint runs/demo \
        --input data/demo/Task00_DemoBrain/dataset.json --sw-batch-sizes 1,4,8
"""

import argparse
import statistics
import sys
import tempfile
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--input", required=True, help="NIfTI file, folder, or dataset.json (its test list)")
    p.add_argument("--sw-batch-sizes", default="1,4,8")
    p.add_argument("--repeats", type=int, default=2, help="timed passes over the cases per batch size")
    p.add_argument("--device", choices=("cpu", "gpu"), default=None)
    p.add_argument("--tta", action="store_true")
    args = p.parse_args(argv)
    from tfmis.config import load_config
    from tfmis.inference.inputs import collect_inputs
    from tfmis.inference.predictor import Predictor

    config = load_config(args.config)
    sizes = [int(s) for s in args.sw_batch_sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for size in sizes:
            predictor = Predictor(config, args.checkpoint, sw_batch_size=size, device=args.device, tta=args.tta)
            cases = collect_inputs(args.input, "test", index=predictor.index)
            predictor.predict_file(cases[0], out)  # warm-up: tracing, first allocations
            times = []
            for _ in range(args.repeats):
                for case in cases:
                    start = time.perf_counter()
                    result = predictor.predict_file(case, out)
                    times.append(time.perf_counter() - start)
                    if result.status != "ok":
                        print(f"{case.case_id}: {result.reason}", file=sys.stderr)
                        return 1
            rows.append(
                (size, statistics.mean(times), statistics.stdev(times) if len(times) > 1 else 0.0, result.device)
            )
    base = rows[0][1]
    print(
        f"{len(cases)} case(s) x {args.repeats} repeats, roi {predictor.roi_size}, overlap {predictor.overlap}, "
        f"mode {predictor.mode}, tta {args.tta}"
    )
    print(f"{'sw batch':>8}  {'s/case':>7}  {'± sd':>6}  {'vs first':>8}  device")
    for size, mean, sd, device in rows:
        print(f"{size:>8}  {mean:7.3f}  {sd:6.3f}  {base / mean:7.2f}x  {device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
