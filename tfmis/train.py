"""Train a 3D segmentation model: `python -m tfmis.train --config configs/demo.yaml [--set key=value ...]`.

Converts the data first when the config names an MSD source folder, trains with the one custom
loop (one device, MirroredStrategy, MultiWorkerMirroredStrategy or Horovod; `runtime:`), validates with sliding-window inference, and writes the
run folder: config.yaml, checkpoints/, best.weights.h5, history.jsonl/.csv, training_curves.png,
validation_preview.png, summary.json, tensorboard/.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tfmis.tune.cli import add_search_arguments, run_search


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tfmis.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="YAML config, e.g. configs/demo.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set training.epochs=3 --set pipeline.patch_size=[48,48,48]")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in output.dir")
    g = p.add_argument_group("GPU customization", "choose pipeline.num_images_per_batch, validation.num_sw_batch_size "
                             "and validation.validation_data_device from measured memory and speed first (the search "
                             "of python -m tfmis.tune fit, or its cache), then train with them")
    g.add_argument("--gpu-customization", action="store_true", help="run the GPU-fit search before training")
    add_search_arguments(g, prefix="gpu-customization-")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.gpu_customization:  # this process must not hold GPU memory while the search's trials measure it
        os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    from tfmis.config import ConfigError, load_config

    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from tfmis.engine.distribution import make_backend

    try:  # first: MultiWorkerMirroredStrategy and Horovod must set up the devices themselves
        backend = make_backend(config.runtime, output_dir=config.output.dir)
    except (ValueError, RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    import tensorflow as tf

    from tfmis.data.prepare import prepare_dataset
    from tfmis.engine.trainer import RunExists, Trainer, TrainingDiverged, summary_table
    from tfmis.inference.placement import VolumeOutOfMemory
    from tfmis.tune.search import NoConfigurationFits

    expected = (RunExists, TrainingDiverged, NoConfigurationFits, VolumeOutOfMemory, FileNotFoundError, KeyError,
                ValueError)
    try:
        if not _prepare_on_chief(backend, lambda: prepare_dataset(config.data, progress=config.output.progress)):
            return 1
        if args.gpu_customization:
            if backend.size > 1:
                raise ValueError("--gpu-customization runs one search per machine: run python -m tfmis.tune fit "
                                 "first, then launch the workers with its fit.yaml")
            config = _gpu_customization(config, args)
        trainer = Trainer(config, backend=backend)
        if backend.is_chief:
            lr = "" if config.optimizer.lr_scaling == "none" else (
                f", learning rate {trainer.learning_rate:.3g} ({config.optimizer.lr_scaling} scaling)")
            print(f"Training {trainer.model.count_params():,} parameters on {backend.num_replicas} replica(s) "
                  f"({backend.name}, {backend.size} worker process(es)), global batch {trainer.global_batch}, "
                  f"{trainer.steps_per_epoch} steps/epoch, precision {config.training.precision}{lr}; "
                  f"results in {config.output.dir}", file=sys.stderr)
        summary = trainer.fit(resume=args.resume)
    except expected as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (tf.errors.UnavailableError, tf.errors.CancelledError, tf.errors.DeadlineExceededError,
            tf.errors.AbortedError, tf.errors.InternalError) as e:
        if backend.size == 1:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: worker {backend.rank} lost contact with the other workers ({type(e).__name__}: {first[:300]}). "
              f"A worker died or the network failed; training stopped. The last committed epoch is in "
              f"{Path(config.output.dir) / 'checkpoints'}: restart all workers with --resume.", file=sys.stderr)
        return 1
    if not backend.is_chief:
        return 0
    trainer.preview(Path(config.output.dir) / "validation_preview.png")
    print(summary_table(summary))
    print(f"Results in {config.output.dir}: training_curves.png, validation_preview.png, history.csv, "
          "summary.json, best.weights.h5, tensorboard/")
    return 0


def _prepare_on_chief(backend, prepare) -> bool:
    """The chief converts the data while the other workers wait; False (after an error line) if it failed."""
    ok = 1.0
    if backend.is_chief:
        try:
            prepare()
        except (FileNotFoundError, KeyError, ValueError) as e:
            if backend.size == 1:
                raise
            print(f"error: {e}", file=sys.stderr)
            ok = 0.0
    if backend.size > 1 and not backend.broadcast([ok])[0]:  # the barrier: every worker waits for the chief
        if not backend.is_chief:
            print(f"error: worker {backend.rank}: the chief could not prepare the data (see its log)", file=sys.stderr)
        return False
    return True


def _gpu_customization(config, args):
    """The config with the GPU-fit search's choice (BundleGen's gpu_customization=True)."""
    output = Path(config.output.dir) / "gpu_fit"
    fitted, report = run_search(config, args, "gpu-customization-", output)
    chosen = ", ".join(f"{key} {value}" for key, value in report["fitted"].items())
    print(f"GPU customization: {chosen} (details in {output})", file=sys.stderr)
    return fitted


if __name__ == "__main__":
    sys.exit(main())
