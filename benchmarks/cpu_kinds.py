#!/usr/bin/env python3
"""The README's main job on this CPU: tfmis's own CPU settings against every setting tried by hand.

Prints, first, the machine as the benchmark sees it (`lscpu`'s model name, the instruction sets that decide
TensorFlow's kernels, usable cores, TensorFlow's version, and tfmis's oneDNN choice with its reason). Then each
arm is a real `python -m tfmis.train --config configs/demo.yaml` run in its own process (validation off, the
first epoch discarded: it traces the step and fills the cache), with one setting changed by environment or
`--set`; the arms alternate over `--repeats` rounds so each sees the same share of a busy machine. Per arm: the
median images/s of the warm epochs, and its ratio to tfmis's choice (`auto`).

The arms: tfmis's choice; oneDNN forced off (TensorFlow's default on AVX2-only CPUs such as AMD EPYC Zen 2/3)
and forced on; oneDNN with its kernels capped at AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2`: how an AVX2-only CPU's oneDNN
runs, on a CPU with AVX-512); thread pools of 1 / 1 and oversubscribed (2x the usable cores); bfloat16
(`training.precision=mixed_bfloat16`); XLA (`training.jit_compile=true`). With `--profile`, a TensorFlow
profiler trace of one warm step per oneDNN arm names the kernels that ran the 3D convolutions' forward and
backward passes, with their share of the step's op time.

Channels-first is not an arm: TensorFlow's CPU Conv3D (Eigen) runs NDHWC only, and oneDNN reorders any layout
to its own blocked one inside the op; `--layout` measures one conv layer's forward+backward both ways instead.

Example:
    python benchmarks/cpu_kinds.py --repeats 2 --profile --layout --output docs/cpu_kinds
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from tfmis.hardware import cpu_isa, current_onednn, usable_cpu_count  # noqa: E402  (decides oneDNN: no TF yet)
from tfmis.utils.io import atomic_write_json, atomic_writer  # noqa: E402

# (name, environment changes, config overrides); None in the environment removes the variable
ARMS = {
    "tfmis (auto)": ({}, []),
    "oneDNN off": ({"TF_ENABLE_ONEDNN_OPTS": "0"}, []),
    "oneDNN on": ({"TF_ENABLE_ONEDNN_OPTS": "1"}, []),
    "oneDNN capped at AVX2": ({"TF_ENABLE_ONEDNN_OPTS": "1", "ONEDNN_MAX_CPU_ISA": "AVX2"}, []),
    "threads 1/1": ({"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}, []),
    "threads 2x cores": ({"TF_NUM_INTRAOP_THREADS": "2x", "TF_NUM_INTEROP_THREADS": "2x"}, []),
    "bfloat16": ({}, ["training.precision=mixed_bfloat16"]),
    "XLA": ({}, ["training.jit_compile=true"]),
}
CLEAN_ENV = ("TF_ENABLE_ONEDNN_OPTS", "TFMIS_ONEDNN_DECIDED", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


def machine() -> dict:
    """The CPU as lscpu names it, its instruction sets, usable cores, TensorFlow's version, tfmis's oneDNN choice."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next(
            (line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), ""
        )
    except (OSError, subprocess.TimeoutExpired):
        model = ""
    from importlib.metadata import PackageNotFoundError, version

    tf_version = ""
    for dist in ("tensorflow-cpu", "tensorflow"):
        try:
            tf_version = f"{dist} {version(dist)}"
            break
        except PackageNotFoundError:
            continue
    return {
        "cpu_model": model or platform.processor() or platform.machine(),
        "arch": platform.machine(),
        "isa": list(cpu_isa()),
        "usable_cores": usable_cpu_count(),
        "tensorflow": tf_version,
        "onednn_choice": current_onednn().describe(),
    }


def arm_env(name: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    cores = usable_cpu_count()
    for key, value in ARMS[name][0].items():
        env[key] = str(2 * cores) if value == "2x" else value
    return env


def run_arm(name: str, epochs: int, steps: int, out: Path, profile_step: int | None) -> dict:
    """One training run of the demo config with this arm's setting; images/s of the epochs after the first."""
    overrides = [
        f"training.epochs={epochs}",
        f"training.steps_per_epoch={steps}",
        "optimizer.warmup_epochs=0",
        f"validation.val_interval={epochs + 1}",
        f"output.dir={out}",
        "output.progress=false",
        f"output.tensorboard={'true' if profile_step else 'false'}",
        *ARMS[name][1],
    ]
    if profile_step:
        overrides += [f"profile.start_step={profile_step}", "profile.num_steps=1"]
    command = [sys.executable, "-m", "tfmis.train", "--config", "configs/demo.yaml"]
    command += [a for o in overrides for a in ("--set", o)]
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    start = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=arm_env(name)).returncode
    text = log.read_text()
    result = {"arm": name, "exit": code, "seconds": time.perf_counter() - start}
    result["error_lines"] = [line for line in text.splitlines() if line.startswith("E0000") or " E0000 " in line]
    history = out / "history.csv"
    if code != 0 or not history.is_file():
        result["failure"] = text.strip().splitlines()[-1] if text.strip() else f"exit {code}"
        return result
    with open(history) as f:
        rows = list(csv.DictReader(f))
    warm = [float(r["images_per_second"]) for r in rows[1:]]
    result["images_per_second"] = statistics.median(warm) if warm else None
    result["hardware_line"] = next((line for line in text.splitlines() if line.startswith("Hardware:")), "")
    if profile_step:
        result["kernels"] = conv_kernels(out)
    return result


def conv_kernels(run_dir: Path, top: int = 8) -> list[dict]:
    """The Conv3D kernels of the profiled step: TensorFlow's op names (`_MklNativeConv3DBackpropFilterV2` is
    oneDNN's, `Conv3DBackpropFilterV2` Eigen's), their time in the step (ms, summed over the threads that ran
    them) and that time over the step's wall time, from the trace's XPlane."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    files = sorted((run_dir / "tensorboard").rglob("*.xplane.pb"))
    if not files:
        return []
    space = xplane_pb2.XSpace()
    space.ParseFromString(files[-1].read_bytes())
    ops: dict[str, float] = {}
    step_ms = 0.0
    for plane in space.planes:
        names = {k: m.name for k, m in plane.event_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                name = names.get(event.metadata_id, "")
                ms = event.duration_ps / 1e9
                if name.startswith("train_step"):  # the loop's trace range around one optimizer step
                    step_ms = max(step_ms, ms)
                elif line.name == "TensorFlow Ops" and "Conv3D" in name:
                    op = name.rsplit(":", 1)[-1]
                    ops[op] = ops.get(op, 0.0) + ms
    ranked = sorted(ops.items(), key=lambda kv: -kv[1])[:top]
    return [
        {"op": op, "ms": round(ms, 2), "share_of_step": round(ms / step_ms, 3) if step_ms else None}
        for op, ms in ranked
    ]


def layout_benchmark(repeats: int = 5) -> dict:
    """One 3D conv layer (2 x 16 x 48^3 -> 32 channels, 3^3) forward + backward, channels-last and channels-first,
    in a subprocess per oneDNN setting; ms per step, or the error TensorFlow raises for the layout."""
    code = f"""
import json, time
import tfmis  # decides oneDNN (or keeps the environment's)
import tensorflow as tf
out = {{}}
for fmt in ("channels_last", "channels_first"):
    shape = (2, 48, 48, 48, 16) if fmt == "channels_last" else (2, 16, 48, 48, 48)
    try:
        layer = tf.keras.layers.Conv3D(32, 3, padding="same", data_format=fmt)
        x = tf.random.normal(shape)
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = tf.reduce_sum(layer(x))
            return tape.gradient(y, [x, *layer.trainable_variables])
        step(x)
        times = []
        for _ in range({repeats}):
            t = time.perf_counter(); [g.numpy() for g in step(x)]; times.append(time.perf_counter() - t)
        out[fmt] = round(1000 * sorted(times)[len(times) // 2], 1)
    except Exception as e:
        out[fmt] = type(e).__name__ + ": " + str(e).splitlines()[0][:120]
print(json.dumps(out))
"""
    result = {}
    for name in ("tfmis (auto)", "oneDNN off"):
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=arm_env(name), timeout=600
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        result[name] = json.loads(lines[-1]) if lines else {"error": proc.stderr.strip().splitlines()[-1:]}
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), metavar="ARM")
    p.add_argument("--epochs", type=int, default=3, help="per run; the first is discarded")
    p.add_argument("--steps", type=int, default=16, help="optimizer steps per epoch (the demo's is 16)")
    p.add_argument("--slow-steps", type=int, default=4, help="steps per epoch of the arms that run on Eigen")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="name the conv kernels of one warm step per oneDNN arm")
    p.add_argument("--layout", action="store_true", help="channels-last vs channels-first for one conv layer")
    p.add_argument("--output", default=None, help="write <output>.json and <output>.md")
    args = p.parse_args(argv)

    info = machine()
    print(f"CPU: {info['cpu_model']} ({info['arch']}; {', '.join(info['isa']) or 'no listed ISA flags'})")
    print(f"usable cores: {info['usable_cores']}; {info['tensorflow']}; tfmis: {info['onednn_choice']}")
    work = Path(tempfile.mkdtemp(prefix="cpu_kinds-"))
    # the demo's TFRecords first (the runs then share them): one short run converts
    results: dict[str, list[dict]] = {name: [] for name in args.arms}
    try:
        for r in range(args.repeats):
            for name in args.arms:
                slow = ARMS[name][0].get("TF_ENABLE_ONEDNN_OPTS") == "0" or "jit_compile" in " ".join(ARMS[name][1])
                profile = args.profile and r == 0 and name in ("tfmis (auto)", "oneDNN off", "oneDNN capped at AVX2")
                steps = args.slow_steps if slow else args.steps
                res = run_arm(
                    name, args.epochs, steps, work / f"{r}-{name.replace(' ', '_')}", steps + 1 if profile else None
                )
                results[name].append(res)
                ips = res.get("images_per_second")
                print(
                    f"  round {r + 1} {name:<24} "
                    + (f"{ips:6.2f} images/s" if ips else f"failed: {res.get('failure')}")
                    + (f"  ({len(res['error_lines'])} error line(s))" if res["error_lines"] else ""),
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    auto = statistics.median(
        [x["images_per_second"] for x in results.get("tfmis (auto)", []) if x.get("images_per_second")] or [0]
    )
    rows = []
    for name, runs in results.items():
        values = [x["images_per_second"] for x in runs if x.get("images_per_second")]
        median = statistics.median(values) if values else None
        rows.append(
            {
                "arm": name,
                "images_per_second": median,
                "runs": values,
                "ratio_to_auto": (median / auto) if median and auto else None,
                "error_lines": sorted({e.split("] ", 1)[-1] for x in runs for e in x["error_lines"]}),
                "kernels": next((x["kernels"] for x in runs if x.get("kernels")), None),
            }
        )
    layout = layout_benchmark() if args.layout else None
    lines = [
        f"CPU: {info['cpu_model']} ({info['arch']}; {', '.join(info['isa'])}); usable cores {info['usable_cores']}; "
        f"{info['tensorflow']}",
        f"tfmis: {info['onednn_choice']}",
        "",
        "| setting | images/s (warm epochs, median) | vs tfmis's choice | error lines |",
        "| --- | --- | --- | --- |",
    ]
    for row in rows:
        ips = f"{row['images_per_second']:.2f}" if row["images_per_second"] else "failed"
        ratio = f"{row['ratio_to_auto']:.2f}x" if row["ratio_to_auto"] else ""
        lines.append(f"| {row['arm']} | {ips} | {ratio} | {len(row['error_lines'])} |")
    for row in rows:
        if row["kernels"]:
            lines += ["", f"Conv3D kernels of one warm step, {row['arm']}:", "", "| op | ms | of the step's time |"]
            lines += ["| --- | --- | --- |"] + [
                f"| {k['op']} | {k['ms']} | {k['share_of_step']:.0%} |"
                if k["share_of_step"] is not None
                else f"| {k['op']} | {k['ms']} | |"
                for k in row["kernels"]
            ]
    if layout:
        lines += ["", "One Conv3D layer forward + backward (ms):", "", "| | channels-last | channels-first |"]
        lines += ["| --- | --- | --- |"] + [
            f"| {name} | {v.get('channels_last')} | {v.get('channels_first')} |" for name, v in layout.items()
        ]
    text = "\n".join(lines)
    print("\n" + text)
    if args.output:
        atomic_write_json(Path(args.output).with_suffix(".json"), {"machine": info, "arms": rows, "layout": layout})
        with atomic_writer(Path(args.output).with_suffix(".md")) as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
