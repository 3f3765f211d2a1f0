#!/usr/bin/env python3
"""Peak memory and input wait of `pipeline.cache: memory` vs `partial` on a generated dataset larger than the cache.

Generates `--cases` synthetic MSD cases of `--size`^3 x 2 channels (noise with a labelled blob), converts them with
`tfmis.data.convert` (80 % train), then trains the same small U-Net with the real `Trainer` once per arm, each arm in
its own Python process so that its peak resident memory is its own:

- `memory`: every training volume decoded and held (`dataset.cache()`);
- `partial`: `--cache-num` volumes held, `replace_rate` of them replaced per pass over the cache from the TFRecords
  (`tfmis.data.smart_cache`).

For each arm it prints the peak resident set (VmHWM) of the process, its growth over the resident set just before
`fit()` (the model and TensorFlow are already loaded then), and the input-wait share of the epochs after the first
(`data_wait_seconds / (data_wait_seconds + compute_seconds)` from history.jsonl; the first epoch fills the cache).
Next to them: the decoded size of the training split and the partial cache's bound (`partial_cache_bound` volumes).

glibc's malloc keeps freed large blocks for reuse in its per-thread arenas; with `--mmap-threshold 65536` every arm
runs with MALLOC_MMAP_THRESHOLD_=65536 (freed blocks above 64 KiB go back to the system at once), so that the
resident set counts what the pipeline holds. Run both ways to see the allocator's share.

Example:
    python benchmarks/partial_cache.py                                   # 40 cases of 128^3, cache_num 8
    python benchmarks/partial_cache.py --cases 60 --cache-num 10 --mmap-threshold 65536 --epochs 4
    python benchmarks/partial_cache.py --workdir /tmp/pc --keep --set training.steps_per_epoch=64
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TRAINING = [  # a small U-Net and a MONAI-like sampling: 4 crops of one volume per step
    "model.filters=[8,16,32]",
    "model.strides=[1,2,2]",
    "model.num_res_units=0",
    "model.norm=instance",
    "pipeline.patch_size=[32,32,32]",
    "pipeline.num_images_per_batch=4",
    "pipeline.num_crops_per_image=4",
    "pipeline.deterministic=false",
    "training.precision=float32",
    "validation.val_interval=1000",
    "validation.max_cases=1",
    "validation.overlap=0",
    "validation.roi_size=[64,64,64]",
    "output.progress=false",
    "output.tensorboard=false",
]


def generate(root: Path, cases: int, size: int, compression: str, image_dtype: str) -> Path:
    """`cases` MSD-style cases of size^3 x 2 channels, converted into `root/tfrecords`; returns that folder."""
    import nibabel as nib
    import numpy as np

    from tfmis.data.conversion_options import ConversionConfig
    from tfmis.data.convert import convert
    from tfmis.utils.progress import progress_bar

    source = root / "Task96_PartialCache"
    bar = progress_bar(cases, "Generating cases", "case", interval_seconds=10)
    rng = np.random.default_rng(0)
    affine = np.diag([1.5, 1.5, 2.0, 1.0])
    entries = []
    for i in range(cases):
        image = rng.normal(100.0, 10.0, (size, size, size, 2)).astype(np.float32)
        label = np.zeros((size, size, size), np.uint8)
        a, b = size // 3, size // 3 + size // 4
        label[a:b, a:b, a:b] = 1
        label[a + 2 : a + 6, a + 2 : a + 6, a + 2 : a + 6] = 2
        image[..., 0] += 30.0 * label
        for folder, data, dtype in (("imagesTr", image, np.int16), ("labelsTr", label, np.uint8)):
            (source / folder).mkdir(parents=True, exist_ok=True)
            nib.save(nib.Nifti1Image(data.astype(dtype), affine), str(source / folder / f"case_{i:03d}.nii.gz"))
        entries.append({"image": f"./imagesTr/case_{i:03d}.nii.gz", "label": f"./labelsTr/case_{i:03d}.nii.gz"})
        bar.update()
    bar.close()
    (source / "dataset.json").write_text(
        json.dumps(
            {
                "name": "PartialCacheBenchmark",
                "modality": {"0": "MR0", "1": "MR1"},
                "labels": {"0": "background", "1": "organ", "2": "core"},
                "numTraining": cases,
                "numTest": 0,
                "training": entries,
                "test": [],
            }
        )
    )
    target = root / "tfrecords"
    print("converting (tfmis.data.convert) ...", file=sys.stderr, flush=True)
    convert(
        ConversionConfig(
            str(source),
            str(target),
            split=(0.8, 0.2),
            shards=8,
            workers=1,
            progress=True,
            compression=compression,
            image_dtype=image_dtype,
        )
    )
    shutil.rmtree(source)
    return target


def status(key: str) -> int:
    """Bytes of `key` (VmRSS, VmHWM) in /proc/self/status."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def run_arm(spec: dict) -> dict:
    """One training run in this process (called through `--arm`): its memory and its history."""
    from tfmis.config import load_config
    from tfmis.engine.trainer import Trainer

    config = load_config(None, spec["overrides"])
    trainer = Trainer(config)
    before = status("VmRSS")
    start = time.perf_counter()
    trainer.fit()
    seconds = time.perf_counter() - start
    records = [json.loads(line) for line in (Path(config.output.dir) / "history.jsonl").read_text().splitlines()]
    return {"peak": status("VmHWM"), "before_fit": before, "seconds": seconds, "records": records}


def warm_wait(records: list[dict]) -> float:
    warm = [r for r in records if r["epoch"] > 1] or records
    wait = sum(r["data_wait_seconds"] for r in warm)
    return wait / max(wait + sum(r["compute_seconds"] for r in warm), 1e-9)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=40, help="generated cases (80 %% train; default 40)")
    p.add_argument("--size", type=int, default=128, help="edge of the generated volumes (default 128)")
    p.add_argument("--compression", default="GZIP", choices=("GZIP", "ZLIB", "NONE"))
    p.add_argument("--image-dtype", default="float32", choices=("float16", "float32"))
    p.add_argument("--cache-num", type=int, default=8, help="volumes the partial arm holds (default 8)")
    p.add_argument("--replace-rate", type=float, default=None, help="partial arm's replace_rate (default: config's)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps-per-epoch", type=int, default=32)
    p.add_argument("--arms", default="memory,partial", help="comma-separated: memory, partial, none")
    p.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        help="run the arms with MALLOC_MMAP_THRESHOLD_=N (e.g. 65536): freed blocks go back to the system",
    )
    p.add_argument("--set", action="append", default=[], help="extra config override for both arms (key=value)")
    p.add_argument("--workdir", default=None, help="keep the dataset here (reused when it exists)")
    p.add_argument("--keep", action="store_true", help="do not delete the work folder")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # internal: one arm, JSON spec
    args = p.parse_args(argv)
    if args.arm:
        print(json.dumps(run_arm(json.loads(args.arm))))
        return 0

    work = Path(args.workdir or tempfile.mkdtemp(prefix="tfmis-partial-cache-"))
    dataset = work / "tfrecords"
    if not (dataset / "index.json").is_file():
        dataset = generate(work, args.cases, args.size, args.compression, args.image_dtype)
    from tfmis.config import PipelineConfig
    from tfmis.data.records import load_index
    from tfmis.data.smart_cache import partial_cache_bound, partial_cache_size

    index = load_index(dataset)
    train = [c for c in index["cases"].values() if c["split"] == "train"]
    itemsize = 2 if index["preprocessing"]["image_dtype"] == "float16" else 4
    volume = max(_prod(c["image_shape"]) * itemsize + _prod(c["image_shape"][:3]) for c in train)
    partial = PipelineConfig(
        cache="partial",
        cache_num=args.cache_num,
        **({"replace_rate": args.replace_rate} if args.replace_rate is not None else {}),
    )
    cache_num, replace_num = partial_cache_size(partial, len(train))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    results = {}
    for arm in args.arms.split(","):
        overrides = [
            f"data.dataset_dir={dataset}",
            f"output.dir={work / ('run-' + arm)}",
            *TRAINING,
            f"training.epochs={args.epochs}",
            f"training.steps_per_epoch={args.steps_per_epoch}",
            f"pipeline.cache={arm}",
            *args.set,
        ]
        if arm == "partial":
            overrides.append(f"pipeline.cache_num={args.cache_num}")
            if args.replace_rate is not None:
                overrides.append(f"pipeline.replace_rate={args.replace_rate}")
        shutil.rmtree(work / f"run-{arm}", ignore_errors=True)
        print(
            f"arm {arm}: training {args.epochs} epochs x {args.steps_per_epoch} steps ...", file=sys.stderr, flush=True
        )
        done = subprocess.run(
            [sys.executable, __file__, "--arm", json.dumps({"overrides": overrides})],
            env=env,
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            return 1
        results[arm] = json.loads(done.stdout.strip().splitlines()[-1])

    mb = 2**20
    print(
        f"\n{len(train)} training volumes of {volume / mb:.1f} MB decoded ({len(train) * volume / mb:.0f} MB in all), "
        f"{index['preprocessing']['compression']} {index['preprocessing']['image_dtype']} TFRecords; partial: "
        f"cache_num {cache_num}, replace_num {replace_num} per cycle, "
        f"bound {partial_cache_bound(cache_num, replace_num)}"
        f" volumes = {partial_cache_bound(cache_num, replace_num) * volume / mb:.0f} MB; malloc "
        f"{'MALLOC_MMAP_THRESHOLD_=' + str(args.mmap_threshold) if args.mmap_threshold else 'default'}"
    )
    print(
        f"{'arm':<8} {'peak RSS MB':>11} {'growth MB':>9} {'input wait (epochs>1)':>22} {'per epoch':>20} "
        f"{'img/s':>6} {'fit s':>6}"
    )
    for arm, r in results.items():
        per_epoch = " ".join(f"{x['data_wait_fraction']:.1%}" for x in r["records"])
        images = sum(x["images_per_second"] for x in r["records"][1:]) / max(len(r["records"]) - 1, 1)
        print(
            f"{arm:<8} {r['peak'] / mb:11.0f} {(r['peak'] - r['before_fit']) / mb:9.0f} "
            f"{warm_wait(r['records']):22.1%} "
            f"{per_epoch:>20} {images:6.1f} {r['seconds']:6.0f}"
        )
    if args.json:
        from tfmis.utils.io import atomic_write_json

        atomic_write_json(
            args.json,
            {
                "volume_bytes": volume,
                "train_volumes": len(train),
                "cache_num": cache_num,
                "replace_num": replace_num,
                "mmap_threshold": args.mmap_threshold,
                "arms": results,
            },
        )
    if not args.keep and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


if __name__ == "__main__":
    sys.exit(main())
