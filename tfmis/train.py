"""Train a 3D segmentation model: `python -m tfmis.train --config configs/demo.yaml [--set key=value ...]`.

Converts the data first when the config names an MSD source folder, trains with the one custom
loop (single device or MirroredStrategy), validates with sliding-window inference, and writes the
run folder: config.yaml, checkpoints/, best.weights.h5, history.jsonl/.csv, training_curves.png,
validation_preview.png, summary.json, tensorboard/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tfmis.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="YAML config, e.g. configs/demo.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set training.epochs=3 --set pipeline.patch_size=[48,48,48]")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in output.dir")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from tfmis.config import ConfigError, load_config

    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from tfmis.data.prepare import prepare_dataset
    from tfmis.engine.trainer import RunExists, Trainer, TrainingDiverged, summary_table

    try:
        prepare_dataset(config.data, progress=config.output.progress)
        trainer = Trainer(config)
        print(f"Training {trainer.model.count_params():,} parameters on {trainer.backend.num_replicas} replica(s), "
              f"{trainer.steps_per_epoch} steps/epoch, precision {config.training.precision}; "
              f"results in {config.output.dir}", file=sys.stderr)
        summary = trainer.fit(resume=args.resume)
    except (RunExists, TrainingDiverged, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if trainer.backend.is_chief:
        trainer.preview(Path(config.output.dir) / "validation_preview.png")
    print(summary_table(summary))
    print(f"Results in {config.output.dir}: training_curves.png, validation_preview.png, history.csv, "
          "summary.json, best.weights.h5, tensorboard/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
