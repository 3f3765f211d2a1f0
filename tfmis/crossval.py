"""K-fold cross-validation as parallel experiments: `tfmis-crossval --config CONFIG --folds 5 --output DIR`.

Trains every fold of every configuration (a config file, several `--config`, or a plan of stages: its coarse stage
and its cascade) as independent trainings, predicts each fold's held-out cases from the original scans, and chooses
the configuration (or two averaged) by the out-of-fold Dice and the postprocessing where it raises it, as nnU-Net
does (docs/crossval.md). The data are converted once, into K stratified folds shared by every configuration.

Where the folds run:
- `--workers N`: N processes on this machine, each pinned to its share of the cores and GPUs, each taking every
  N-th fold (default 1: one fold after another);
- under `mpirun -np N`, `srun`, or `tfmis-launch --nproc N`: each rank takes every N-th fold (a folder shared by
  the nodes); rank 0 converts first and chooses last.

Rerun the same command to continue: finished trainings are kept, an interrupted one continues from its last
committed epoch. Exit status: 0 done; 3 a fold failed (the others finished; rerun to retry it); 1 bad data;
2 bad arguments or config (docs/exit-codes.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tfmis.crossvalidation.driver import cross_validate, make_definition
from tfmis.crossvalidation.experiment import read_definition
from tfmis.crossvalidation.ranks import RANK_TIMEOUT_SECONDS
from tfmis.utils.cli import add_set_argument, command, writing


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tfmis-crossval",
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 done; 3 a fold failed (one line says which; rerun to continue); 1 bad data; 2 bad "
        "arguments or config.",
    )
    p.add_argument(
        "--config",
        action="append",
        required=True,
        metavar="[NAME=]PATH",
        help="a config, or a plan of stages (its stages are the configurations); repeat to compare configurations",
    )
    p.add_argument("--folds", type=int, default=5, help="K (default 5, as nnU-Net)")
    p.add_argument(
        "--run-folds", default=None, metavar="0,1,...", help="train only these folds (default all); choose on them"
    )
    p.add_argument("--splits-file", default=None, help="a splits_final.json (nnU-Net's format) to use as the folds")
    p.add_argument("--output", required=True, help="the cross-validation folder")
    p.add_argument("--workers", type=int, default=1, help="folds trained at once on this machine (default 1)")
    p.add_argument(
        "--val-best",
        action="store_true",
        help="predict each held-out fold with the weights of the epoch that scored best on that same fold "
        "(best.weights.h5): optimistic, as nnU-Net's --val_best; default: the weights training ended with "
        "(final.weights.h5), so the held-out fold chooses nothing",
    )
    p.add_argument(
        "--rank-timeout",
        type=float,
        default=RANK_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help="under a launcher: a rank not heard of for this long (killed, its node lost) ends the waits of the others "
        f"with one line naming it (default {RANK_TIMEOUT_SECONDS:g}); a rerun continues",
    )
    add_set_argument(p, "--set training.epochs=40 (every configuration)")
    return p


@command
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("worker", "oof"):
        return internal_main(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    definition = make_definition(
        args.config, args.folds, args.overrides, args.run_folds, args.splits_file, args.val_best
    )
    if definition.weights == "best":
        print(
            "warning: --val-best: each held-out fold is predicted with the weights of the epoch that scored best on "
            "that same fold, so the out-of-fold Dice (and the choice made from it) is optimistic; say so when you "
            "report it",
            file=sys.stderr,
        )
    cv_dir = Path(args.output)
    writing(cv_dir)
    return cross_validate(cv_dir, definition, args.workers, args.rank_timeout)


def internal_main(argv: list[str]) -> int:
    """`python -m tfmis.crossval worker CV --rank R --size N [--cpus LIST]` and `... oof CV --fold K`: the processes
    the command starts."""
    p = argparse.ArgumentParser(prog="python -m tfmis.crossval")
    sub = p.add_subparsers(dest="role", required=True)
    worker = sub.add_parser("worker")
    worker.add_argument("cv_dir")
    worker.add_argument("--rank", type=int, required=True)
    worker.add_argument("--size", type=int, required=True)
    worker.add_argument("--cpus", default="")
    oof = sub.add_parser("oof")
    oof.add_argument("cv_dir")
    oof.add_argument("--fold", type=int, required=True)
    oof.add_argument("--device", choices=("cpu", "gpu"), default=None)
    args = p.parse_args(argv)
    if args.role == "worker":
        from tfmis.crossvalidation.jobs import run_worker

        if args.cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, [int(c) for c in args.cpus.split(",")])  # the trainings inherit it
        return run_worker(Path(args.cv_dir), read_definition(args.cv_dir), args.rank, args.size)
    from tfmis.hardware import apply_onednn

    apply_onednn("auto")
    from tfmis.crossvalidation.oof import predict_fold

    return predict_fold(args.cv_dir, args.fold, args.device)


if __name__ == "__main__":
    sys.exit(main())
