#!/usr/bin/env python3
"""MONAI's recipe on tfmis's demo data: the reference arm of `benchmarks/time_to_dice.py`.

Runs in its own virtual environment (torch + MONAI are never tfmis dependencies), created with:

    python -m venv .venv-monai && .venv-monai/bin/pip install torch==2.13.0 && .venv-monai/bin/pip install monai nibabel

(`torch==2.13.0` is the CPU build; a plain `torch` would download gigabytes of CUDA wheels.) It imports only
torch, monai, numpy and nibabel.

It trains on the volumes `benchmarks/export_demo_npy.py` exported from tfmis's TFRecords (the same
preprocessed voxels and the same train/val split) with MONAI's recipe below, each setting a flag:

- model: `monai.networks.nets.UNet`, channels 8-16-32-64, strides 2,2,2, `--num-res-units` (default 2, MONAI's
  tutorials), instance norm, PReLU;
- crops: `ClassesToIndicesd` once per volume (cached), then `RandCropByLabelClassesd` with the demo's
  class ratios 1:1:1:2, `--crops-per-volume` patches of 48³ from each volume read, `--batch` crops per
  optimizer step (the demo: 4 per volume, 2 per step, so an epoch is 8 volumes x 4 / 2 = 16 steps);
- augmentation as tfmis's demo (`tfmis.transforms.augment`): a flip per axis (p 0.5 each), in-plane
  quarter turns (p 0.5, k in 1..3), intensity scale and shift by up to ±0.1 (MONAI draws the two with
  p 0.5 each, tfmis both together with p 0.5);
- `DiceCELoss` (softmax, background left out of the Dice), AdamW 3e-3 (weight decay 1e-5), linear warm-up
  over one epoch then cosine to 0 over `--epochs` (`WarmupCosineSchedule`, per step);
- validation every `--val-interval` epochs on the whole validation volumes: `sliding_window_inference`
  (roi 48³, sw batch 4, overlap 0.25, gaussian), argmax, `DiceMetric(include_background=False,
  ignore_empty=True)` per class, averaged over the cases, then over the classes (tfmis's mean Dice);
- `torch.set_num_threads(--threads)` (default 2: the same cores as tfmis).

Wall time: `elapsed_seconds` runs from just before the first training step (volumes already in memory,
model built, crop indices cached) and includes every step, augmentation and validation, as tfmis's
Trainer measures it (its clock starts before its first epoch, once the input pipeline is built; its
first epoch also pays for graph tracing and filling its cache). `--max-minutes` stops after the epoch
that crosses the budget, validating that epoch (as tfmis's `training.max_minutes`).

Outputs in `--output`: `history.jsonl` (one record per epoch, the keys of tfmis's history:
`epoch`, `train_loss`, `learning_rate`, `data_wait_seconds`, `compute_seconds`, `epoch_seconds`,
`elapsed_seconds`, and after a validation `val_mean_dice`, `val_dice`, `val_seconds`) and `summary.json`.

`--predict-split S --predict-output DIR` (used by `benchmarks/planner_zoo.py`): after training, the final weights
predict every volume of the export's split S (its `image` files; labels not needed) with the same sliding window as
validation and write `DIR/<case_id>_probabilities.npy`, the softmax (K, X, Y, Z) float16 on the exported grid, for
the caller to map back to each scan's grid and score.

Example:
    .venv-monai/bin/python benchmarks/monai_demo.py --data data/demo/npy --output runs/ttd/monai --max-minutes 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from monai.data import CacheDataset, DataLoader
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import DiceMetric
from monai.networks.nets import UNet
from monai.networks.utils import one_hot
from monai.optimizers import WarmupCosineSchedule
from monai.transforms import (
    ClassesToIndicesd,
    Compose,
    EnsureTyped,
    RandCropByLabelClassesd,
    RandFlipd,
    RandRotate90d,
    RandScaleIntensityd,
    RandShiftIntensityd,
    SpatialPadd,
)
from monai.utils import set_determinism


def write_json(path: Path, obj) -> None:
    """Atomic: a reader never sees a half-written file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def load_split(data_dir: Path, split: str) -> tuple[list[dict], dict]:
    """The exported volumes of `split` as MONAI dicts: image (C, X, Y, Z) float32, label (1, X, Y, Z) uint8."""
    manifest_path = data_dir / "manifest.json"
    if not manifest_path.is_file():
        raise SystemExit(
            f"{manifest_path}: not found; export the tfmis dataset first: "
            f"python benchmarks/export_demo_npy.py --output {data_dir}"
        )
    manifest = json.loads(manifest_path.read_text())
    if split not in manifest["splits"]:
        raise SystemExit(f"{manifest_path}: no split {split!r}; available: {sorted(manifest['splits'])}")
    cases = [
        {
            "image": np.load(data_dir / e["image"]),
            "label": np.load(data_dir / e["label"])[None],
            "case_id": e["case_id"],
        }
        for e in manifest["splits"][split]
    ]
    return cases, manifest


def train_transforms(args, num_classes: int):
    """(cached deterministic part, random part): volumes smaller than the patch zero-padded to it (as tfmis's
    crops pad) and crop indices, once per volume; crops + augmentation per read."""
    keys = ["image", "label"]
    cached = Compose(
        [SpatialPadd(keys=keys, spatial_size=args.patch), ClassesToIndicesd(keys="label", num_classes=num_classes)]
    )
    random = Compose(
        [
            RandCropByLabelClassesd(
                keys=keys,
                label_key="label",
                spatial_size=args.patch,
                ratios=args.class_ratios,
                num_classes=num_classes,
                num_samples=args.crops_per_volume,
                indices_key="label_cls_indices",
            ),
            RandFlipd(keys=keys, spatial_axis=0, prob=0.5),
            RandFlipd(keys=keys, spatial_axis=1, prob=0.5),
            RandFlipd(keys=keys, spatial_axis=2, prob=0.5),
            RandRotate90d(keys=keys, prob=0.5, max_k=3, spatial_axes=(0, 1)),
            RandScaleIntensityd(keys="image", factors=0.1, prob=0.5),
            RandShiftIntensityd(keys="image", offsets=0.1, prob=0.5),
            EnsureTyped(keys=keys, track_meta=False),
        ]
    )
    return cached, random


def validate(model, val_cases, args, num_classes: int) -> dict:
    """Sliding-window inference on each whole validation volume; per-class Dice averaged over the cases."""
    metric = DiceMetric(include_background=False, reduction="mean_batch", ignore_empty=True)
    model.eval()
    with torch.inference_mode():
        for case in val_cases:
            image = torch.from_numpy(case["image"])[None]
            logits = sliding_window_inference(
                image, args.patch, args.sw_batch_size, model, overlap=args.overlap, mode=args.mode
            )
            prediction = one_hot(torch.argmax(logits, dim=1, keepdim=True), num_classes)
            target = one_hot(torch.from_numpy(case["label"][None].astype(np.int64)), num_classes)
            metric(y_pred=prediction, y=target)
    per_class = metric.aggregate().cpu().numpy().astype(float)  # NaN for a class empty in every case
    model.train()
    return {"dice_per_class": per_class.tolist(), "mean_dice": float(np.nanmean(per_class))}


def predict_split(model, data_dir: Path, split: str, output: Path, args) -> int:
    """Softmax of the final weights on each volume of an exported split: `<case_id>_probabilities.npy`, (K, X, Y, Z)
    float16; returns the number of volumes."""
    manifest = json.loads((data_dir / "manifest.json").read_text())
    if split not in manifest["splits"]:
        raise SystemExit(
            f"{data_dir / 'manifest.json'}: no split {split!r} to predict; available: {sorted(manifest['splits'])}"
        )
    output.mkdir(parents=True, exist_ok=True)
    model.eval()
    with torch.inference_mode():
        for entry in manifest["splits"][split]:
            image = torch.from_numpy(np.load(data_dir / entry["image"]))[None]
            logits = sliding_window_inference(
                image, args.patch, args.sw_batch_size, model, overlap=args.overlap, mode=args.mode
            )
            probabilities = torch.softmax(logits, dim=1)[0].numpy().astype(np.float16)
            np.save(output / f"{entry['case_id']}_probabilities.npy", probabilities)
    return len(manifest["splits"][split])


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    set_determinism(seed=args.seed)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    train_cases, manifest = load_split(Path(args.data), "train")
    val_cases, _ = load_split(Path(args.data), "val")
    classes = manifest["classes"]
    num_classes = len(classes)
    if len(args.class_ratios) != num_classes:
        raise SystemExit(f"--class-ratios has {len(args.class_ratios)} entries for {num_classes} classes {classes}")
    if args.crops_per_volume % args.batch:
        raise SystemExit(f"--crops-per-volume {args.crops_per_volume} must be a multiple of --batch {args.batch}")
    cached, random = train_transforms(args, num_classes)
    dataset = CacheDataset(
        train_cases, transform=Compose([cached, random]), cache_rate=1.0, num_workers=0, progress=False
    )
    loader = DataLoader(
        dataset, batch_size=1, shuffle=True, num_workers=args.num_workers, persistent_workers=args.num_workers > 0
    )
    steps_per_epoch = len(train_cases) * args.crops_per_volume // args.batch

    model = UNet(
        spatial_dims=3,
        in_channels=len(manifest["channels"]),
        out_channels=num_classes,
        channels=tuple(args.channels),
        strides=tuple(args.strides),
        num_res_units=args.num_res_units,
        norm="instance",
    )
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, include_background=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = WarmupCosineSchedule(
        optimizer, warmup_steps=int(args.warmup_epochs * steps_per_epoch), t_total=args.epochs * steps_per_epoch
    )
    settings = {k: v for k, v in vars(args).items()}
    settings.update(
        steps_per_epoch=steps_per_epoch,
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        parameters=sum(p.numel() for p in model.parameters()),
    )
    import monai

    settings["monai"] = monai.__version__
    write_json(out / "settings.json", settings)
    history_path = out / "history.jsonl"
    history_path.unlink(missing_ok=True)

    records, best, stop_reason = [], -1.0, "epochs"
    model.train()
    run_start = time.perf_counter()
    epoch, fitted = 0, False
    while epoch < args.epochs:
        epoch += 1
        epoch_start = time.perf_counter()
        wait = compute = 0.0
        losses = []
        t0 = time.perf_counter()
        for batch in loader:  # one volume read: crops_per_volume crops, batch crops per step
            images, labels = batch["image"], batch["label"]
            t1 = time.perf_counter()
            wait += t1 - t0
            for first in range(0, images.shape[0], args.batch):
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(images[first : first + args.batch]), labels[first : first + args.batch])
                loss.backward()
                optimizer.step()
                scheduler.step()
                losses.append(loss.item())
            t0 = time.perf_counter()
            compute += t0 - t1
        record = {
            "epoch": epoch,
            "train_loss": float(np.mean(losses)),
            "learning_rate": float(scheduler.get_last_lr()[0]),
            "data_wait_seconds": wait,
            "compute_seconds": compute,
            "images_per_second": len(losses) * args.batch / max(wait + compute, 1e-9),
        }
        if not math.isfinite(record["train_loss"]):
            raise SystemExit(f"training loss {record['train_loss']} at epoch {epoch}")
        out_of_time = args.max_minutes and time.perf_counter() - run_start >= 60 * args.max_minutes
        if epoch % args.val_interval == 0 or epoch == args.epochs or out_of_time:
            val_start = time.perf_counter()
            result = validate(model, val_cases, args, num_classes)
            record["val_mean_dice"] = result["mean_dice"]
            record["val_dice"] = dict(zip(classes[1:], result["dice_per_class"]))
            record["val_seconds"] = time.perf_counter() - val_start
            best = max(best, result["mean_dice"])
        record["epoch_seconds"] = time.perf_counter() - epoch_start
        record["elapsed_seconds"] = time.perf_counter() - run_start
        records.append(record)
        with open(history_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        dice = f" val Dice {record['val_mean_dice']:.4f}" if "val_mean_dice" in record else ""
        print(
            f"epoch {epoch}/{args.epochs} loss {record['train_loss']:.4f}{dice} "
            f"({record['epoch_seconds']:.1f} s, {record['elapsed_seconds']:.0f} s in all)",
            flush=True,
        )
        if out_of_time:
            stop_reason = "max_minutes"
            break
        if args.fit_budget and not fitted and epoch >= 4 and record["elapsed_seconds"] >= 6 * args.max_minutes:
            # the schedule fitted to the budget once a tenth of it has passed, as tfmis's time budget does: the epochs
            # after the first (tracing, warm-up) at their mean pace, validations included, to 97 % of the budget
            pace = (record["elapsed_seconds"] - records[0]["epoch_seconds"]) / (epoch - 1)
            fit = epoch + int((0.97 * 60 * args.max_minutes - record["elapsed_seconds"]) / pace)
            args.epochs = min(args.epochs, max(epoch + 1, fit))
            scheduler.t_total = args.epochs * steps_per_epoch  # WarmupCosineSchedule reads it at every step
            fitted = True
            settings.update(fitted_epochs=args.epochs, fitted_after_epoch=epoch, fitted_pace_seconds=pace)
            write_json(out / "settings.json", settings)
            print(f"fitted to the budget: {args.epochs} epochs ({pace:.2f} s each)", flush=True)
    summary = {
        "best_mean_dice": best,
        "epochs": len(records),
        "elapsed_seconds": records[-1]["elapsed_seconds"],
        "stop_reason": stop_reason,
        "steps_per_epoch": steps_per_epoch,
    }
    if args.predict_split:
        start = time.perf_counter()
        summary["predicted"] = predict_split(
            model, Path(args.data), args.predict_split, Path(args.predict_output), args
        )
        summary["predict_seconds"] = time.perf_counter() - start
    write_json(out / "summary.json", summary)
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default="data/demo/npy", help="folder written by benchmarks/export_demo_npy.py")
    parser.add_argument("--output", default="runs/time_to_dice/monai", help="run folder (history.jsonl, summary.json)")
    parser.add_argument("--epochs", type=int, default=60, help="epochs; the cosine schedule's length")
    parser.add_argument(
        "--fit-budget",
        action="store_true",
        help="with --max-minutes: once a tenth of the budget has passed, set the cosine schedule's length to the "
        "epochs that fit 97 %% of it at the pace measured so far (--epochs then only bounds it), as tfmis fits "
        "training.max_minutes",
    )
    parser.add_argument("--max-minutes", type=float, default=None, help="wall-clock budget (stop after that epoch)")
    parser.add_argument("--val-interval", type=int, default=4, help="epochs between validations")
    parser.add_argument("--patch", type=int, nargs=3, default=[48, 48, 48], help="training patch = sliding window")
    parser.add_argument("--crops-per-volume", type=int, default=4, help="crops per volume read (num_samples)")
    parser.add_argument("--batch", type=int, default=2, help="crops per optimizer step")
    parser.add_argument(
        "--class-ratios",
        type=float,
        nargs="+",
        default=[1, 1, 1, 2],
        help="crop centre ratios per class, background first (RandCropByLabelClassesd)",
    )
    parser.add_argument("--channels", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--strides", type=int, nargs="+", default=[2, 2, 2])
    parser.add_argument("--num-res-units", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=1e-5)
    parser.add_argument("--warmup-epochs", type=float, default=1.0)
    parser.add_argument("--sw-batch-size", type=int, default=4)
    parser.add_argument("--overlap", type=float, default=0.25)
    parser.add_argument("--mode", default="gaussian", choices=["constant", "gaussian"])
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes (0 = in the loop)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--predict-split", default=None, help="after training, predict this exported split (e.g. test)")
    parser.add_argument("--predict-output", default=None, help="where --predict-split writes <case>_probabilities.npy")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.predict_split and not args.predict_output:
        raise SystemExit("--predict-split needs --predict-output")
    if args.fit_budget and not args.max_minutes:
        raise SystemExit("--fit-budget needs --max-minutes (the budget the schedule is fitted to)")
    summary = run(args)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
