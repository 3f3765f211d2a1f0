#!/usr/bin/env python3
"""Training a dataset larger than the memory limit: `pipeline.cache: patches` against `memory` and `partial`.

On a converted CT-size dataset (e.g. the CT demo generator's 512 x 512 x 300 cases), it measures:

1. **Layout**: the patch-read arrays written from the records (`tfmis.data.patch_layout.write_patch_layout`): seconds
   and bytes per case, beside the records' bytes per case and the conversion time given with `--convert-seconds`.
2. **Training arms**, each a fresh Python process in its own memory cgroup (`--limit-mb`, default a third of the
   decoded training volumes), `--epochs` x `--steps-per-epoch` optimizer steps with the real `Trainer` steps and no
   validation (validation windows are another memory question, see docs/predicting.md):
   - `patches`: crops read from the memory-mapped arrays, with the demo model and with a model 4x heavier per step
     (twice the filters at every level);
   - `partial`: `--cache-num` volumes held (MONAI's SmartCache), in the same limit, its byte check lifted (at start
     it refuses a bound above the budget; the arm shows what the run would meet without that check);
   - `memory`: every volume of a subset (the validation split's cases as the training split), without a limit unless
     `--subset-limit-mb` (two CT-size volumes and a training process do not fit in a third of the decoded set).
   Per arm: exit code (137/-9 = killed at the limit), the cgroup's peak anonymous memory (polled every 0.1 s),
   input wait as a share of step time over the epochs after the first, images/s.
3. **The pipeline alone** (`--pipeline-batches` batches after a warm-up, no model): samples/s of `cache: patches`,
   against the samples/s a GPU step of the patch would consume at `--gpu-step-ms`.

Example (the figures in docs/benchmarks.md, "Larger than memory"):
    python -m tfmis.data.demos.ct ...  # or: make_ct_dataset(root, num_cases=24, size="full", slices=(300, 300))
    tfmis-convert --source-dir Task93_CT24 --target-dir ltm/records --split 0.9,0.1 --shards 4
    python benchmarks/larger_than_memory.py --dataset ltm/records --epochs 3 --steps-per-epoch 24
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MB = 2**20

DEMO_MODEL = ["model.filters=[8,16,32,64]", "model.strides=[1,2,2,2]"]
HEAVY_MODEL = ["model.filters=[16,32,64,128]", "model.strides=[1,2,2,2]"]  # 2x filters: ~4x the FLOPs per step
TRAINING = [
    "model.num_res_units=0",
    "model.norm=instance",
    "pipeline.patch_size=[64,64,64]",
    "pipeline.num_images_per_batch=2",
    "pipeline.num_crops_per_image=2",
    "pipeline.deterministic=false",
    "training.precision=float32",
    "output.progress=false",
    "output.tensorboard=false",
]


def run_arm(spec: dict) -> dict:
    """One arm in this process (`--arm`): the trainer's epochs without validation; its records and memory."""
    from tfmis.config import load_config
    from tfmis.data.memory_budget import input_memory
    from tfmis.data.records import load_index
    from tfmis.engine.callbacks import CallbackList
    from tfmis.engine.trainer import Trainer

    config = load_config(None, spec["overrides"])
    held = input_memory(config, load_index(config.data.dataset_dir))
    print(held["line"], file=sys.stderr, flush=True)
    trainer = Trainer(config)
    trainer.restore(False)
    if spec.get("pipeline_batches"):  # the pipeline alone: batches/s, no model step
        dataset = iter(trainer.task.build_train_dataset(None, 0))
        for _ in range(spec["pipeline_warmup"]):
            next(dataset)
        start = time.perf_counter()
        for _ in range(spec["pipeline_batches"]):
            next(dataset)
        seconds = time.perf_counter() - start
        batch = config.pipeline.num_images_per_batch
        return {"samples_per_second": spec["pipeline_batches"] * batch / seconds, "held_mb": held["held_mb"]}
    iterator = iter(trainer.backend.distribute_dataset(lambda ctx: trainer.task.build_train_dataset(ctx, 0)))
    records = [trainer._train_epoch(epoch, iterator, CallbackList([])) for epoch in range(1, spec["epochs"] + 1)]
    return {"records": records, "held_mb": held["held_mb"], "hwm_mb": _status("VmHWM") / MB}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def measured(limit_mb: float | None, spec: dict) -> dict:
    """`run_arm(spec)` in a new process inside a memory cgroup of `limit_mb` (None: no limit), with the cgroup's peak
    anonymous memory polled every 0.1 s (`tests.test_case_memory.run_measured`, the slow test's measure)."""
    sys.path.insert(0, str(REPO))
    from tests.test_case_memory import run_measured

    start = time.perf_counter()
    command = [sys.executable, __file__, "--arm", json.dumps(spec)]
    code, out, err, peak = run_measured(limit_mb or 1e6, command, REPO, timeout=24 * 3600)
    result = {"exit": code, "anon_peak_mb": peak, "seconds": time.perf_counter() - start}
    lines = out.strip().splitlines()
    if code == 0 and lines:
        result.update(json.loads(lines[-1]))
    else:
        result["stderr"] = err[-1500:]
    return result


def _limit(mb: float | None) -> str:
    return "none" if mb is None else f"{mb:,.0f}"


def warm_wait(records: list[dict]) -> float:
    warm = [r for r in records if r["epoch"] > 1] or records
    wait = sum(r["data_wait_seconds"] for r in warm)
    return wait / max(wait + sum(r["compute_seconds"] for r in warm), 1e-9)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", help="a converted dataset (tfmis-convert --target-dir)")
    p.add_argument("--limit-mb", type=float, default=None, help="memory limit of the arms (default: decoded / 3)")
    p.add_argument(
        "--subset-limit-mb", type=float, default=None, help="memory limit of the memory-subset arm (default: none)"
    )
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps-per-epoch", type=int, default=24)
    p.add_argument("--cache-num", type=int, default=2, help="volumes the partial arm holds (default 2)")
    p.add_argument("--arms", default="patches,patches-4x,partial,memory-subset,pipeline")
    p.add_argument("--pipeline-batches", type=int, default=200)
    p.add_argument("--gpu-step-ms", type=float, default=60.0, help="assumed GPU step time of the patch (ms)")
    p.add_argument("--convert-seconds", type=float, default=None, help="the records' conversion wall time, to print")
    p.add_argument("--set", action="append", default=[], help="extra config override for every arm")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--arm", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.arm:
        print(json.dumps(run_arm(json.loads(args.arm))))
        return 0
    if not args.dataset:
        p.error("--dataset is required: a converted dataset folder")

    from tfmis.data.memory_budget import volume_mb
    from tfmis.data.patch_layout import layout_bytes, training_cases, write_patch_layout
    from tfmis.data.records import load_index, split_cases

    dataset = Path(args.dataset).resolve()
    index = load_index(dataset)
    train = split_cases(index, "train")
    decoded = sum(volume_mb(index, c) for c in train)
    record_bytes = sum((dataset / s["file"]).stat().st_size for s in index["splits"]["train"]["shards"])
    limit = args.limit_mb or decoded / 3
    cases = training_cases(dataset, "train")
    start = time.perf_counter()
    layout = write_patch_layout(dataset, cases, len(index["source"]["labels"]), 20000, 0, progress=True)
    layout["seconds_here"] = time.perf_counter() - start
    shapes = sorted({tuple(c["image_shape"]) for c in train})
    print(
        f"\n{len(train)} training cases, shapes {shapes[0]}..{shapes[-1]}, decoded {decoded:,.0f} MB "
        f"(float16 image + uint8 label); memory limit of the arms {limit:,.0f} MB"
    )
    print("| layout | bytes per case | seconds per case |\n| --- | ---: | ---: |")
    convert = f"{args.convert_seconds / len(index['cases']):.1f}" if args.convert_seconds else "not given"
    print(f"| TFRecords (GZIP) | {record_bytes / len(train) / MB:.1f} MB | {convert} (the whole conversion) |")
    per_case = layout["seconds"] / max(layout["written"], 1)
    print(
        f"| patch-read arrays (.npy) | {layout_bytes(dataset, cases) / len(cases) / MB:.1f} MB | "
        f"{per_case:.1f} (from the records; {layout['written']} written now) |"
    )

    base = [f"data.dataset_dir={dataset}", *TRAINING, f"training.steps_per_epoch={args.steps_per_epoch}", *args.set]
    arms = {
        "patches": (limit, [*DEMO_MODEL, "pipeline.cache=patches"]),
        "patches-4x": (limit, [*HEAVY_MODEL, "pipeline.cache=patches"]),
        # the partial cache as it ran before its byte check (which refuses this bound at start): budget lifted
        "partial": (
            limit,
            [*DEMO_MODEL, "pipeline.cache=partial", f"pipeline.cache_num={args.cache_num}"]
            + ["pipeline.memory_budget=1TB"],
        ),
        "memory-subset": (args.subset_limit_mb, [*DEMO_MODEL, "pipeline.cache=memory", "data.train_split=val"]),
    }
    results = {}
    for name in args.arms.split(","):
        if name == "pipeline":
            continue
        arm_limit, overrides = arms[name]
        spec = {
            "overrides": [*base, f"output.dir={dataset.parent / ('run-' + name)}", *overrides],
            "epochs": args.epochs,
        }
        print(f"arm {name} ...", file=sys.stderr, flush=True)
        results[name] = measured(arm_limit, spec)
    if "pipeline" in args.arms.split(","):
        spec = {
            "overrides": [*base, f"output.dir={dataset.parent / 'run-pipeline'}", *DEMO_MODEL]
            + ["pipeline.cache=patches"],
            "pipeline_batches": args.pipeline_batches,
            "pipeline_warmup": 10,
        }
        print("pipeline alone ...", file=sys.stderr, flush=True)
        results["pipeline"] = measured(limit, spec)

    print("\n| arm | limit MB | exit | peak anon MB | input wait (epochs > 1) | images/s | held (counted) MB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        if name == "pipeline":
            continue
        if r["exit"] != 0:
            print(f"| {name} | {_limit(arms[name][0])} | {r['exit']} | {r['anon_peak_mb']:,.0f} | - | - | - |")
            continue
        images = [x["images_per_second"] for x in r["records"][1:]] or [r["records"][0]["images_per_second"]]
        print(
            f"| {name} | {_limit(arms[name][0])} | 0 | {r['anon_peak_mb']:,.0f} | {warm_wait(r['records']):.1%} | "
            f"{sum(images) / len(images):.1f} | {r['held_mb']:,.0f} |"
        )
    if "pipeline" in results and results["pipeline"]["exit"] == 0:
        from tfmis.config import load_config

        patch = "x".join(str(s) for s in load_config(None, base).pipeline.patch_size)
        rate = results["pipeline"]["samples_per_second"]
        need = 2 / (args.gpu_step_ms / 1000)
        print(
            f"\npipeline alone (cache: patches, patch {patch}, batch 2): {rate:.1f} samples/s; a GPU step of "
            f"{args.gpu_step_ms:g} ms consumes {need:.1f} samples/s: {rate / need:.2f}x"
        )
    if args.json:
        from tfmis.utils.io import atomic_write_json

        atomic_write_json(args.json, {"decoded_mb": decoded, "limit_mb": limit, "layout": layout, "arms": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
