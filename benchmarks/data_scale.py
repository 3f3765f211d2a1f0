#!/usr/bin/env python3
"""The patch-read input at scale: many small cases, and CT-size cases in a small memory limit.

Two datasets, each converted with `tfmis-convert --patch-layout` and then trained one epoch from its arrays
(`pipeline.cache: patches`), every step a fresh process in its own memory cgroup:

- **many**: `--cases` (default 2,000) small CT cases (`--small-shape`, default 40 x 40 x 24), limit `--many-limit-mb`;
- **ct**: `--ct-cases` (default 12) CT-size cases (`--ct-shape`, default 512 x 512 x 300, int16 HU), limit
  `--ct-limit-mb` (default 1,536: 1.5 GB), `--ct-steps` steps of 64³ crops (default 24).

Per step, polled every 0.1 s: wall seconds, exit code (137/-9 = killed at the limit), the largest peak RSS of any
of its processes (VmHWM: anonymous and file-backed), the cgroup's peak usage (the kernel's own high-water mark:
memory.max_usage_in_bytes / memory.peak, page cache included), its peak anonymous memory (what a limit kills for),
the most files its processes held open at once, and for the epochs the input wait (the share of step time the
trainer waited for data, epochs after the first when there are several). Prints a table with the processor and
writes `data_scale.json` in `--output`.

Example (the figures in docs/benchmarks.md, "The patch-read input at scale"):
    python benchmarks/data_scale.py --output /tmp/data_scale
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MB = 2**20
sys.path.insert(0, str(REPO / "benchmarks"))
from larger_than_memory import DEMO_MODEL  # noqa: E402
from larger_than_memory import TRAINING as LARGER_THAN_MEMORY  # noqa: E402

# larger_than_memory.py's arms (the demo's small network, no validation) reading patches; the patch size is set after
TRAINING = [*DEMO_MODEL, *LARGER_THAN_MEMORY, "pipeline.cache=patches"]


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def _pids(folder: Path) -> list[int]:
    try:
        return [int(p) for p in (folder / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _status_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith(key + ":")), 0)
    except OSError:
        return 0


def _open_files(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _cgroup_peak(folder: Path) -> float:
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        try:
            return int((folder / name).read_text()) / MB
        except (OSError, ValueError):
            continue
    return float("nan")


def measured(limit_mb: float, command: list[str], timeout: float = 6 * 3600) -> dict:
    """`command` in a new memory cgroup of `limit_mb`, polled every 0.1 s (see the module docstring)."""
    sys.path.insert(0, str(REPO))
    from tests.test_case_memory import memory_cgroup, remove_cgroup

    folder, prefix = memory_cgroup(limit_mb)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    start = time.perf_counter()
    process = subprocess.Popen([*prefix, *command], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    output: dict = {}
    readers = [
        threading.Thread(target=lambda n=n, s=s: output.__setitem__(n, s.read()))
        for n, s in (("out", process.stdout), ("err", process.stderr))
    ]
    for reader in readers:
        reader.start()
    peak = {"rss_mb": 0.0, "anon_mb": 0.0, "open_files": 0}
    cgroup_peak = 0.0
    deadline = time.monotonic() + timeout
    try:
        while process.poll() is None and time.monotonic() < deadline:
            pids = _pids(folder)
            peak["rss_mb"] = max([peak["rss_mb"], *(_status_kb(p, "VmHWM") / 1024 for p in pids)])
            peak["open_files"] = max([peak["open_files"], *(_open_files(p) for p in pids)])
            try:
                stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
                peak["anon_mb"] = max(peak["anon_mb"], int(stat.get("total_rss", stat.get("anon", 0))) / MB)
            except (OSError, ValueError):
                pass
            cgroup_peak = _cgroup_peak(folder)
            time.sleep(0.1)
        if process.poll() is None:
            process.kill()
        process.wait()
        for reader in readers:
            reader.join()
        cgroup_peak = max(cgroup_peak, _cgroup_peak(folder))
    finally:
        remove_cgroup(folder)
    result = {
        "exit": process.returncode,
        "seconds": time.perf_counter() - start,
        "limit_mb": limit_mb,
        "cgroup_peak_mb": cgroup_peak,
        **peak,
    }
    out = output["out"].decode(errors="replace").strip().splitlines()
    if process.returncode != 0:
        result["stderr"] = output["err"].decode(errors="replace")[-1500:]
    elif out and out[-1].startswith("{"):
        result.update(json.loads(out[-1]))
    return result


def input_wait(records: list[dict]) -> float:
    warm = [r for r in records if r["epoch"] > 1] or records
    wait = sum(r["data_wait_seconds"] for r in warm)
    return wait / max(wait + sum(r["compute_seconds"] for r in warm), 1e-9)


def make_dataset(root: Path, count: int, shape: tuple[int, int, int]) -> Path:
    """`count` CT cases of `shape` (tests/test_case_memory.py's phantom: air, a body box, a labelled organ)."""
    sys.path.insert(0, str(REPO))
    from tests.test_case_memory import write_ct_dataset

    if (root / "dataset.json").is_file():
        return root
    return write_ct_dataset(root, {f"case_{i:05d}": shape for i in range(count)})


def one_kind(
    name: str, source: Path, out: Path, limit_mb: float, steps: int | None, patch: int, convert_args: list[str] = ()
) -> dict:
    """Conversion with --patch-layout (and `convert_args`), then one epoch (or `steps`) of patches, each measured in
    `limit_mb`."""
    target = out / f"{name}-records"
    convert = [sys.executable, "-m", "tfmis.convert", "--source-dir", str(source), "--target-dir", str(target)]
    convert += ["--split", "0.9,0.1", "--patch-layout", "--quiet", "--overwrite", *convert_args]
    print(f"{name}: converting ...", file=sys.stderr, flush=True)
    conversion = measured(limit_mb, convert)
    if conversion["exit"] != 0:
        return {"conversion": conversion}
    index = json.loads((target / "index.json").read_text())
    train = sum(1 for c in index["cases"].values() if c["split"] == "train")
    per_step = 2  # pipeline.num_images_per_batch
    steps = steps or math.ceil(train / per_step)
    spec = {
        "overrides": [
            f"data.dataset_dir={target}",
            *TRAINING,
            f"pipeline.patch_size=[{patch},{patch},{patch}]",
            f"training.steps_per_epoch={steps}",
            f"output.dir={out / (name + '-run')}",
        ],
        "epochs": 1,
    }
    print(f"{name}: one epoch of {steps} steps ...", file=sys.stderr, flush=True)
    epoch = measured(
        limit_mb, [sys.executable, str(REPO / "benchmarks" / "larger_than_memory.py"), "--arm", json.dumps(spec)]
    )
    if "records" in epoch:
        epoch["input_wait"] = input_wait(epoch["records"])
        epoch["steps"] = steps
    return {"conversion": conversion, "epoch": epoch, "train_cases": train}


def row(what: str, r: dict) -> str:
    wait = f"{r['input_wait']:.1%}" if "input_wait" in r else "-"
    return (
        f"| {what} | {r['seconds']:.0f} | {r['exit']} | {r['rss_mb']:,.0f} | {r['cgroup_peak_mb']:,.0f} of "
        f"{r['limit_mb']:,.0f} | {r['anon_mb']:,.0f} | {r['open_files']} | {wait} |"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--cases", type=int, default=2000)
    p.add_argument("--small-shape", type=int, nargs=3, default=(40, 40, 24))
    p.add_argument("--many-limit-mb", type=float, default=4096)
    p.add_argument("--ct-cases", type=int, default=12)
    p.add_argument("--ct-shape", type=int, nargs=3, default=(512, 512, 300))
    p.add_argument("--ct-limit-mb", type=float, default=1536)
    p.add_argument("--ct-steps", type=int, default=24)
    p.add_argument(
        "--ct-convert",
        default="",
        help="more tfmis-convert arguments for the CT cases, e.g. '--no-crop' keeps them at 512x512x300 (157 MB of "
        "float16 arrays a case, 1.9 GB for 12: more than the 1.5 GB limit) instead of their body's box",
    )
    p.add_argument("--kinds", default="many,ct")
    args = p.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    results = {"machine": cpu_name(), "cores": os.cpu_count()}
    kinds = args.kinds.split(",")
    if "many" in kinds:
        start = time.perf_counter()
        source = make_dataset(args.output / "many-source", args.cases, tuple(args.small_shape))
        results["many_generation_seconds"] = time.perf_counter() - start
        results["many"] = one_kind("many", source, args.output, args.many_limit_mb, None, 32)
    if "ct" in kinds:
        source = make_dataset(args.output / "ct-source", args.ct_cases, tuple(args.ct_shape))
        results["ct"] = one_kind(
            "ct", source, args.output, args.ct_limit_mb, args.ct_steps, 64, args.ct_convert.split()
        )
        results["ct"]["convert_args"] = args.ct_convert.split()
    (args.output / "data_scale.json").write_text(json.dumps(results, indent=1))
    print(f"\n{results['machine']}, {results['cores']} cores")
    print(
        "| step | seconds | exit | peak RSS MB (largest process) | cgroup peak MB (page cache included) of limit | "
        "peak anonymous MB | open files (most) | input wait |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind, label in (
        ("many", f"{args.cases:,} cases of {'x'.join(map(str, args.small_shape))}"),
        ("ct", f"{args.ct_cases} cases of {'x'.join(map(str, args.ct_shape))} {args.ct_convert}".rstrip()),
    ):
        if kind in results:
            print(row(f"{label}: conversion with --patch-layout", results[kind]["conversion"]))
            if "epoch" in results[kind]:
                e = results[kind]["epoch"]
                print(row(f"{label}: {e.get('steps', '?')} steps of patches", e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
