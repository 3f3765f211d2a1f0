#!/usr/bin/env python3
"""The peak factors `tfmis.data.case_pool` sizes its workers with: a case worker's peak resident memory over its
baseline, per MB of the case's float32 size (X·Y·Z·C·4 bytes), for the planner's first pass
(`tfmis.planning.fingerprint.case_summary`), the conversion's CT window pass (`case_foreground_sample`) and the
conversion (`tfmis.data.conversion_cases.process_case`).

Each case and pass runs in a fresh interpreter (the worker's imports only, as a spawned worker has them): its VmRSS
before the case is the baseline, its VmHWM (reset through /proc/self/clear_refs just before) the peak. The conversion
resamples to 0.8 x 0.8 x 2.5 mm, float16, a fixed CT window (the CT demo's median grid). A conversion's result (the
converted image and label) goes to the parent, which holds it and its encoded record until its shard takes it:
`parent_factor` is twice its size over the case's float32 size.

Example (CT-size cases from the CT demo generator, under /tmp):
    python -m tfmis.data.demos.ct --size full --output /tmp/ct12 --cases 12 --test-cases 0 --slices 200,300
    python benchmarks/case_memory.py /tmp/ct12 --cases ct_002 ct_008     # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ONE_CASE = r"""
import json, sys, time
from tfmis.data.conversion_cases import case_foreground_sample, process_case
from tfmis.data.case_pool import case_float32_mb
from tfmis.data.sources.layouts import open_dataset
from tfmis.data.preprocess import PreprocessConfig
from tfmis.hardware import peak_rss_mb, process_status_mb, reset_peak_rss
from tfmis.planning.fingerprint import case_summary

root, case_id, what = sys.argv[1:4]
dataset = open_dataset(root)
case = next(c for c in dataset.training if c.case_id == case_id)
float32_mb, shape = case_float32_mb(case, dataset)
baseline = process_status_mb("self", "VmRSS")
reset_peak_rss()
start = time.time()
if what == "fingerprint":
    result = case_summary((case, root))
elif what == "ct-window":
    result = {"status": "ok" if case_foreground_sample((case, root)) is not None else "skipped"}
else:
    prep = PreprocessConfig(spacing=(0.8, 0.8, 2.5), normalization=("ct",), ct_window=(-160.0, 240.0))
    result = process_case((case, root, prep))
peak = peak_rss_mb()
held = sum(result[k].nbytes for k in ("image", "label") if result.get(k) is not None) / 2**20  # what the parent gets
print(json.dumps({"case": case_id, "pass": what, "shape": shape, "float32_mb": round(float32_mb),
                  "baseline_mb": round(baseline), "peak_mb": round(peak),
                  "factor": round((peak - baseline) / float32_mb, 2), "seconds": round(time.time() - start, 1),
                  "status": result["status"], "result_mb": round(held),
                  "parent_factor": round(2 * held / float32_mb, 2)}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source_dir", help="an MSD-layout dataset (e.g. the CT demo generator's, --size full)")
    p.add_argument("--cases", nargs="+", required=True, help="case ids to measure")
    args = p.parse_args()
    rows = []
    for case_id in args.cases:
        for what in ("fingerprint", "ct-window", "convert"):
            proc = subprocess.run(
                [sys.executable, "-c", ONE_CASE, args.source_dir, case_id, what],
                capture_output=True,
                text=True,
                check=True,
                env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
            )
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| case | shape | float32 MB | pass | baseline MB | peak MB | factor | s | parent factor |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        shape = " × ".join(str(n) for n in r["shape"][:3])
        print(
            f"| {r['case']} | {shape} | {r['float32_mb']} | {r['pass']} | {r['baseline_mb']} | {r['peak_mb']} | "
            f"{r['factor']} | {r['seconds']} | {r['parent_factor'] if r['pass'] == 'convert' else ''} |"
        )


if __name__ == "__main__":
    main()
