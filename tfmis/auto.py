"""nnU-Net's protocol in one command: `tfmis-auto --source-dir DIR --output DIR`.

Plans the dataset's candidate configurations (full resolution always; low resolution and a cascade on it where the
low-resolution stage saves at least 2x the voxels), cross-validates them in K folds as parallel experiments (each
held-out fold predicted with the weights its training ended with), and chooses the configuration, or two averaged,
and the postprocessing by the out-of-fold Dice. The result is the folder `tfmis-predict --checkpoint OUTPUT/cv`
takes. `--max-minutes` splits a wall-clock budget evenly over the trainings after the conversion and says how.
Rerun the same command to continue. For one quick training of the recommended configuration use
`tfmis-train --source-dir DIR` instead.

Exit status: 0 done; 3 a fold failed (rerun to continue); 1 bad data or a failed run; 2 bad arguments
(docs/exit-codes.md).
"""

from __future__ import annotations

import time

# the command's start (its imports included), from which --max-minutes counts
STARTED = time.time()

import argparse  # noqa: E402
import sys  # noqa: E402

from tfmis.utils.cli import add_set_argument, command, writing  # noqa: E402

CHOICES = ("fullres", "lowres", "cascade")


def build_parser() -> argparse.ArgumentParser:
    from tfmis.cli_arguments import add_target_arguments

    p = argparse.ArgumentParser(
        prog="tfmis-auto",
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 done; 3 a fold failed (rerun to continue); 1 bad data or a failed run; 2 bad arguments.",
    )
    p.add_argument(
        "--source-dir",
        required=True,
        help="the dataset folder (dataset.json, imagesTr, labelsTr): MSD or nnU-Net v2 raw",
    )
    p.add_argument("--output", required=True, help="the protocol's folder: plan/, cv/ (what predict takes)")
    p.add_argument("--folds", type=int, default=5, help="K (default 5, as nnU-Net)")
    p.add_argument(
        "--configurations",
        default=None,
        metavar="fullres,lowres,cascade",
        help="the candidates to cross-validate (default: every one the plan offers; a cascade brings its coarse "
        "stage, the low-resolution configuration)",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="wall-clock budget of the whole command: after planning and converting, the rest is split evenly over "
        "the trainings (the configurations of a fold get the same share) and the out-of-fold predictions; each "
        "training fits its schedule to its share, the plan's epoch count does not cap it (default: each training's "
        "planned length)",
    )
    p.add_argument("--workers", type=int, default=1, help="folds trained at once on this machine (default 1)")
    add_set_argument(p, "--set training.epochs=40 (every configuration)")
    add_target_arguments(p, "tfmis-auto: ")
    return p


@command
def main(argv=None) -> int:
    started = STARTED if argv is None else time.time()  # the process's command, or a call from Python
    from tfmis.cli_arguments import target_hardware
    from tfmis.crossvalidation.protocol import Protocol
    from tfmis.errors import UsageError

    parser = build_parser()
    args = parser.parse_args(argv)
    configurations = None
    if args.configurations:
        configurations = [c.strip() for c in args.configurations.split(",") if c.strip()]
        unknown = [c for c in configurations if c not in CHOICES]
        if unknown or not configurations:
            raise UsageError(f"--configurations {args.configurations}: choose among {', '.join(CHOICES)}")
    if args.folds < 2:
        raise UsageError(f"--folds must be at least 2, got {args.folds}")
    if args.max_minutes is not None and args.max_minutes <= 0:
        raise UsageError(f"--max-minutes must be > 0, got {args.max_minutes:g}")
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    keys = [o.split("=", 1)[0].strip() for o in args.overrides]
    if "output.dir" in keys:
        raise UsageError("--set output.dir: tfmis-auto writes the plan and the folds into --output; leave it out")
    if "training.max_minutes" in keys:
        raise UsageError("--set training.max_minutes: give the protocol's budget as --max-minutes (it is split)")
    if "training.epochs" in keys and args.max_minutes is not None:
        raise UsageError(
            "--set training.epochs with --max-minutes: the budget fits each training's schedule to its share (the "
            "candidates compared get the same time) and an epoch count would cap it; give one of them"
        )
    writing(args.output)
    protocol = Protocol(
        args.source_dir,
        args.output,
        folds=args.folds,
        configurations=configurations,
        max_minutes=args.max_minutes,
        workers=args.workers,
        overrides=list(args.overrides),
        hardware=target_hardware(args),
        started=started,
    )
    return protocol.run()


if __name__ == "__main__":
    sys.exit(main())
