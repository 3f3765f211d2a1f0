"""Train a 3D segmentation model: `python -m tfmis.train --config configs/demo.yaml [--set key=value ...]`.

Converts the data first when the config names an MSD source folder, trains with the one custom
loop (single device or MirroredStrategy), validates with sliding-window inference, and writes the
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
    from tfmis.data.prepare import prepare_dataset
    from tfmis.engine.trainer import RunExists, Trainer, TrainingDiverged, summary_table
    from tfmis.inference.placement import VolumeOutOfMemory
    from tfmis.tune.search import NoConfigurationFits

    try:
        prepare_dataset(config.data, progress=config.output.progress)
        if args.gpu_customization:
            config = _gpu_customization(config, args)
        trainer = Trainer(config)
        print(f"Training {trainer.model.count_params():,} parameters on {trainer.backend.num_replicas} replica(s), "
              f"{trainer.steps_per_epoch} steps/epoch, precision {config.training.precision}; "
              f"results in {config.output.dir}", file=sys.stderr)
        summary = trainer.fit(resume=args.resume)
    except (RunExists, TrainingDiverged, NoConfigurationFits, VolumeOutOfMemory, FileNotFoundError, KeyError,
            ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if trainer.backend.is_chief:
        trainer.preview(Path(config.output.dir) / "validation_preview.png")
    print(summary_table(summary))
    print(f"Results in {config.output.dir}: training_curves.png, validation_preview.png, history.csv, "
          "summary.json, best.weights.h5, tensorboard/")
    return 0


def _gpu_customization(config, args):
    """The config with the GPU-fit search's choice (BundleGen's gpu_customization=True)."""
    output = Path(config.output.dir) / "gpu_fit"
    fitted, report = run_search(config, args, "gpu-customization-", output)
    chosen = ", ".join(f"{key} {value}" for key, value in report["fitted"].items())
    print(f"GPU customization: {chosen} (details in {output})", file=sys.stderr)
    return fitted


if __name__ == "__main__":
    sys.exit(main())
