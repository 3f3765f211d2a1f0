"""Regular vs fast training: MONAI's fast-training notebook, in TensorFlow (`tfmis-benchmark`,
`python -m tfmis.benchmark`).

The same network is trained on the same data twice, each arm in its own subprocess (fresh TensorFlow
state) through the real `tfmis.engine.trainer.Trainer`, with the same wall-clock budget
(`training.max_minutes`) and the same images per epoch. Each arm fits its learning-rate schedule to the budget
from its own measured epoch time (docs/training.md, "Time budget"; the config's `training.epochs` bounds it):
the slower arm trains fewer epochs, but both end their schedules within the budget, so the comparison is of
what each pipeline reaches in the same time, not of the same epochs cut at different points:

- **regular** (`tfmis.data.regular`): every volume decoded from its NIfTI files and preprocessed again
  on every read (serial `tf.py_function`), no cache, no prefetch; float32, batch 1, Dice loss, Adam
  (`REGULAR_OVERRIDES`), the config's crops, augmentation, model and learning-rate schedule.
- **fast** (`tfmis.data.pipeline`): the config as it is: TFRecords, cache, parallel crops, prefetch,
  its own precision, loss, optimizer and batch size (e.g. a `python -m tfmis.tune fit` result).

Both validate the same way (sliding window on the converted validation volumes). The report compares
their `history.jsonl`: epoch time, images/s, data-wait share, and the wall time to each
`training.dice_thresholds` mean Dice, as ratios regular / fast; `--pipeline-only` times the two input
pipelines without a model.

Outputs in `--output` (default `runs/benchmark`): `regular/` and `fast/` (the two run folders, with
their `.log`), `curves_vs_epoch.png`, `curves_vs_time.png`, `epoch_time.png`, `time_to_dice.png`,
`benchmark.md`, `benchmark.json`.

Example:
```bash
tfmis-benchmark --config configs/demo.yaml                  # both arms, --max-minutes each (default 4)
tfmis-benchmark --config configs/demo.yaml --pipeline-only  # the input pipelines alone, no model
```
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tfmis.errors import TrainingFailed, UsageError
from tfmis.hardware import detect_hardware
from tfmis.profiling.comparison import ARMS, PNGS, arm_stats, compare, plot_all, read_history, render_markdown
from tfmis.utils.cli import add_set_argument, command, writing
from tfmis.utils.io import atomic_write_json, atomic_writer

DEFAULT_OUTPUT = "runs/benchmark"
DEFAULT_MAX_MINUTES = 4.0
# a typical first TensorFlow implementation (DistMIS-like; MONAI's notebook's regular arm): float32, batch 1,
# plain Dice loss, Adam; the NIfTI pipeline of tfmis.data.regular replaces the TFRecord one (nothing cached)
REGULAR_OVERRIDES = (
    "pipeline.num_images_per_batch=1",
    "pipeline.cache=none",
    "training.precision=float32",
    "training.accumulation_steps=1",
    "training.jit_compile=false",
    "loss.name=dice",
    "optimizer.name=adam",
    "optimizer.weight_decay=0.0",
    "optimizer.clipnorm=null",
)
ARM_FILE = "arm.json"


# ---------------------------------------------------------------- the two arms' configs


def arm_config(config_path, overrides, arm: str, output_dir, max_minutes: float | None = None, regular_overrides=()):
    """The training config of one arm.

    Args:
        config_path: the YAML config (both arms start from it).
        overrides: `key=value` strings applied to both arms.
        arm: `regular` or `fast`.
        output_dir: the arm's run folder (`output.dir`).
        max_minutes: wall-clock budget (`training.max_minutes`); None or 0 = the config's epochs only.
        regular_overrides: `key=value` strings applied to the regular arm after `REGULAR_OVERRIDES`.

    Returns:
        A `tfmis.config.Config`. The regular arm keeps the fast arm's images per epoch: an explicit
        `training.steps_per_epoch` is multiplied by the fast arm's batch (per replica x accumulation).

    Example:
    ```python
    config = arm_config("configs/demo.yaml", [], "regular", "runs/benchmark/regular", max_minutes=4)
    ```
    """
    from tfmis.config import load_config

    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    budget = [f"training.max_minutes={max_minutes}" if max_minutes else "training.max_minutes=null"]
    common = [*overrides, f"output.dir={output_dir}", *budget]
    if arm == "fast":
        return load_config(config_path, common)
    base = load_config(config_path, common)
    extra = list(REGULAR_OVERRIDES)
    if base.training.steps_per_epoch:
        fast_batch = base.pipeline.num_images_per_batch * base.training.accumulation_steps
        extra.append(f"training.steps_per_epoch={base.training.steps_per_epoch * fast_batch}")
    return load_config(config_path, [*common, *extra, *regular_overrides])


def train_dataset_fn(arm: str):
    """The `Trainer(train_dataset_fn=...)` of an arm."""
    if arm == "regular":
        from tfmis.data.regular import build_regular_train_dataset

        return build_regular_train_dataset
    from tfmis.data.pipeline import build_train_dataset

    return build_train_dataset


def run_arm(config, arm: str) -> dict:
    """Trains one arm in this process with the real `Trainer` and writes `arm.json` into its run folder.

    Args:
        config: from `arm_config`.
        arm: `regular` or `fast`.

    Returns:
        The arm record: the Trainer's summary, steps per epoch, global batch, parameter count,
        setup seconds (Trainer construction) and fit seconds.
    """
    process_start = time.perf_counter()
    from tfmis.engine.distribution import make_backend

    backend = make_backend(config.runtime, output_dir=config.output.dir)  # before anything touches devices
    from tfmis.engine.trainer import Trainer

    trainer = Trainer(config, backend=backend, train_dataset_fn=train_dataset_fn(arm))
    tc = config.training
    length = (
        f"a schedule fitted to {tc.max_minutes:g} min from the measured epoch time (at most {tc.epochs} epochs)"
        if tc.max_minutes
        else f"{tc.epochs} epochs, no time limit"
    )
    print(
        f"{arm} arm: {trainer.model.count_params():,} parameters, global batch {trainer.global_batch}, "
        f"{trainer.steps_per_epoch} steps/epoch, precision {tc.precision}, loss {config.loss.name}, optimizer "
        f"{config.optimizer.name}, cache {config.pipeline.cache}, {length}",
        file=sys.stderr,
        flush=True,
    )
    fit_start = time.perf_counter()
    summary = trainer.fit(resume=False)
    record = {
        "arm": arm,
        "summary": summary,
        "steps_per_epoch": trainer.steps_per_epoch,
        "global_batch": trainer.global_batch,
        "parameters": int(trainer.model.count_params()),
        "setup_seconds": fit_start - process_start,
        "fit_seconds": time.perf_counter() - fit_start,
        "settings": {
            "precision": tc.precision,
            "loss": config.loss.name,
            "optimizer": config.optimizer.name,
            "batch": config.pipeline.num_images_per_batch,
            "cache": config.pipeline.cache,
            "max_minutes": tc.max_minutes,
            "epochs": tc.epochs,
        },
    }
    atomic_write_json(Path(config.output.dir) / ARM_FILE, record)
    return record


# ---------------------------------------------------------------- input pipelines alone


def measure_pipeline(dataset_fn, config, epoch_batches: int, timed_batches: int) -> dict:
    """Times a training input pipeline without a model.

    The pipeline is built fresh (an empty cache), its first batch timed (`first_batch_seconds`: cold
    cache), then the rest of its first epoch (`first_epoch_seconds`, `epoch_batches` batches in all:
    the warm-up, which fills a cache), then `timed_batches` more batches: the steady state.

    Returns:
        dict with `batch_size`, `first_batch_seconds`, `first_epoch_seconds`, `epoch_batches`,
        `timed_batches`, `timed_images`, `timed_seconds`, `samples_per_second` (steady state).
    """
    start = time.perf_counter()
    iterator = iter(dataset_fn(config, None, 0))
    batch_size = int(next(iterator)[0].shape[0])
    first_batch = time.perf_counter() - start
    for _ in range(epoch_batches - 1):
        next(iterator)
    first_epoch = time.perf_counter() - start
    t0, images = time.perf_counter(), 0
    for _ in range(timed_batches):
        images += int(next(iterator)[0].shape[0])
    seconds = time.perf_counter() - t0
    return {
        "batch_size": batch_size,
        "first_batch_seconds": first_batch,
        "first_epoch_seconds": first_epoch,
        "epoch_batches": epoch_batches,
        "timed_batches": timed_batches,
        "timed_images": images,
        "timed_seconds": seconds,
        "samples_per_second": images / max(seconds, 1e-9),
    }


def pipeline_benchmark(configs: dict, batches: int | None = None, scratch_dir=None, progress: bool = True) -> dict:
    """Samples/s of the regular and the fast input pipelines (no model), one after the other.

    Args:
        configs: {"regular": Config, "fast": Config} from `arm_config`.
        batches: timed batches per pipeline after its first (warm-up) epoch; None = two epochs' worth.
        scratch_dir: where a `pipeline.cache: file` fast pipeline writes a fresh (cold) cache, removed after.

    Returns:
        {"regular": measurement, "fast": measurement, "samples_per_second_ratio": fast / regular}
        (measurements from `measure_pipeline`, plus `steps_per_epoch` and `cache`).
    """
    import dataclasses

    from tfmis.data.pipeline import train_steps_per_epoch

    out = {}
    for arm in ARMS:
        config = configs[arm]
        scratch = None
        if config.pipeline.cache == "file":  # a cold cache: not the one earlier runs left in cache_dir
            scratch = Path(scratch_dir or ".") / "pipeline_cache"
            shutil.rmtree(scratch, ignore_errors=True)
            config = dataclasses.replace(config, pipeline=dataclasses.replace(config.pipeline, cache_dir=str(scratch)))
        steps = train_steps_per_epoch(config)
        timed = batches or 2 * steps
        if progress:
            print(
                f"input pipeline {arm}: 1 warm-up epoch ({steps} batches), then {timed} timed batches",
                file=sys.stderr,
                flush=True,
            )
        try:
            out[arm] = {
                **measure_pipeline(train_dataset_fn(arm), config, steps, timed),
                "steps_per_epoch": steps,
                "cache": "none (NIfTI read every time)" if arm == "regular" else config.pipeline.cache,
            }
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        if progress:
            m = out[arm]
            print(
                f"  {m['samples_per_second']:.2f} samples/s (first batch {m['first_batch_seconds']:.2f} s, first "
                f"epoch {m['first_epoch_seconds']:.2f} s)",
                file=sys.stderr,
                flush=True,
            )
    out["samples_per_second_ratio"] = out["fast"]["samples_per_second"] / max(
        out["regular"]["samples_per_second"], 1e-12
    )
    return out


# ---------------------------------------------------------------- the whole benchmark


def _prepare_arm_dir(path: Path) -> None:
    """Removes an earlier benchmark's run folder of an arm; refuses to delete anything else."""
    if not path.exists():
        return
    known = {"config.yaml", "history.jsonl", ARM_FILE, "checkpoints", "training_data.json"}
    entries = {p.name for p in path.iterdir()}
    if entries and not entries & known:
        raise UsageError(f"{path} exists and is not a run folder of an earlier benchmark: choose another --output")
    shutil.rmtree(path)


def _spawn_arm(args, arm: str, output: Path) -> int:
    """Runs one arm in a fresh `python -m tfmis.benchmark --arm ...` process; its output goes to the
    terminal and to `<output>/<arm>.log`."""
    cmd = [
        sys.executable,
        "-m",
        "tfmis.benchmark",
        "--arm",
        arm,
        "--config",
        args.config,
        "--output",
        str(output),
        "--max-minutes",
        str(args.max_minutes),
    ]
    for override in args.overrides:
        cmd += ["--set", override]
    for override in args.regular_overrides:
        cmd += ["--regular-set", override]
    log = output / f"{arm}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        while chunk := proc.stdout.read1(1 << 14):
            f.write(chunk)
            f.flush()
            if not args.quiet:
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()
        return proc.wait()


def run_benchmark(args) -> dict:
    """Both arms (unless `--pipeline-only`), then the input pipelines alone (unless `--skip-pipeline`);
    writes benchmark.json, benchmark.md and the PNGs into `args.output` and returns the result."""
    import datetime

    from tfmis.config import load_config
    from tfmis.data.prepare import prepare_dataset

    config = load_config(args.config, args.overrides)  # config errors before anything runs
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    prepare_dataset(config.data, progress=not args.quiet)  # generates / converts once, for both arms
    result = {
        "config": args.config,
        "overrides": list(args.overrides),
        "regular_overrides": [*REGULAR_OVERRIDES, *args.regular_overrides],
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": None,
    }
    started = time.perf_counter()
    if not args.pipeline_only:
        arms, histories, stats = {}, {}, {}
        for i, arm in enumerate(ARMS, 1):
            folder = output / arm
            _prepare_arm_dir(folder)
            _say(args, f"[{i}/2] {arm} arm, up to {args.max_minutes:g} min (log: {output / f'{arm}.log'})")
            t0 = time.perf_counter()
            code = _spawn_arm(args, arm, output)
            if code != 0:
                raise TrainingFailed(
                    f"the {arm} arm failed (exit status {code}); its output is in {output / f'{arm}.log'}"
                )
            arms[arm] = {**json.loads((folder / ARM_FILE).read_text()), "process_seconds": time.perf_counter() - t0}
            histories[arm] = read_history(folder)
            stats[arm] = {
                **arm_stats(histories[arm], config.training.dice_thresholds),
                "loss": arms[arm]["settings"]["loss"],
            }
        result["training"] = {
            "max_minutes": args.max_minutes or None,
            "arms": arms,
            "stats": stats,
            "ratios": compare(stats),
        }
        plot_all(histories, stats, output)
    if args.pipeline_only or not args.skip_pipeline:
        _say(args, "input pipelines alone (no model)")
        configs = {
            arm: arm_config(args.config, args.overrides, arm, output / arm, None, args.regular_overrides)
            for arm in ARMS
        }
        result["pipeline"] = pipeline_benchmark(configs, args.pipeline_batches, output, progress=not args.quiet)
    result["device"] = detect_hardware().describe()
    result["seconds"] = time.perf_counter() - started
    atomic_write_json(output / "benchmark.json", result)
    with atomic_writer(output / "benchmark.md") as f:
        f.write(render_markdown(result))
    return result


def _say(args, message: str) -> None:
    if not args.quiet:
        print(message, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tfmis-benchmark",
        description="Regular vs fast training (MONAI's fast-training notebook, in TensorFlow): train the config's "
        "network twice with the same time budget, once with a regular input pipeline (NIfTI decoded and "
        "preprocessed on every read, no cache, float32, batch 1, Dice loss, Adam) and once with the fast "
        "one (TFRecords, cache, prefetch, the config's precision, loss, optimizer and batch), and compare "
        "epoch time, images/s, input wait and time to each Dice threshold.",
        epilog="Writes benchmark.md, benchmark.json, curves_vs_epoch.png, curves_vs_time.png, epoch_time.png, "
        "time_to_dice.png and the two run folders regular/ and fast/ into --output. Exit status 0 done, "
        "1 an arm or the data failed, 2 bad config or arguments.",
    )
    p.add_argument("--config", required=True, help="training YAML config, e.g. configs/demo.yaml")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=DEFAULT_MAX_MINUTES,
        help=f"wall-clock budget of each arm's training (training.max_minutes; default "
        f"{DEFAULT_MAX_MINUTES:g}); 0 = the config's epochs, however long",
    )
    p.add_argument("--output", default=DEFAULT_OUTPUT, help=f"output folder (default {DEFAULT_OUTPUT})")
    p.add_argument(
        "--pipeline-only",
        action="store_true",
        help="time the two input pipelines without a model (samples/s, cold first batch and epoch)",
    )
    p.add_argument("--skip-pipeline", action="store_true", help="after training, do not time the pipelines alone")
    p.add_argument(
        "--pipeline-batches",
        type=int,
        default=None,
        help="timed batches per pipeline after a warm-up epoch (default: two epochs' worth)",
    )
    add_set_argument(p, "--set training.epochs=20 (both arms)")
    p.add_argument(
        "--regular-set",
        dest="regular_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for the regular arm only, after its defaults (" + ", ".join(REGULAR_OVERRIDES) + ")",
    )
    p.add_argument("--quiet", action="store_true", help="no progress output (the arms' logs are still written)")
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # internal: train one arm in this process
    return p


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_minutes < 0 or (args.pipeline_batches is not None and args.pipeline_batches < 1):
        parser.error("--max-minutes must be >= 0 and --pipeline-batches >= 1")
    writing(args.output)
    if args.arm:  # one arm, in this (fresh) process; --output is the benchmark's folder
        config = arm_config(
            args.config,
            args.overrides,
            args.arm,
            Path(args.output) / args.arm,
            args.max_minutes,
            args.regular_overrides,
        )
        run_arm(config, args.arm)
        return 0
    result = run_benchmark(args)
    print(render_markdown(result))
    print(
        f"Results in {args.output}: benchmark.md, benchmark.json"
        + ("" if args.pipeline_only else ", " + ", ".join(PNGS) + ", regular/, fast/")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
