"""`python -m tfmis.launch --nproc N [--grace-seconds S] [--gpus-per-worker G] -- COMMAND ...` (`tfmis-launch`).

Starts N local worker processes of one MultiWorkerMirroredStrategy cluster, each with its TF_CONFIG on a free
port addressed through loopback (TensorFlow's gRPC server still listens on it on all interfaces, unauthenticated;
the first line printed names the ports), its share of the CPU threads and, with GPUs, its own GPU
(`tfmis.engine.local_workers`). Worker 0 (the chief) prints the log; the others' output gets a `[worker k]` prefix. When
a worker fails, the others get `--grace-seconds` to notice and end by themselves, then they are stopped. For
several machines, use SLURM (`srun`), `mpirun` or a TF_CONFIG per machine instead (docs/scale-out.md).

Exit status: 0 every worker succeeded, else the first failure's status; 2 bad arguments (`--nproc` below 1, a
program after `--` that is not found or not executable).
"""

from __future__ import annotations

import argparse
import sys

from tfmis.errors import UsageError
from tfmis.utils.cli import check_command, command, parse_with_command

USAGE = (
    "usage: tfmis-launch --nproc N [--grace-seconds S] [--gpus-per-worker G] -- COMMAND ...\n"
    "e.g. tfmis-launch --nproc 2 -- tfmis-train --config configs/demo.yaml"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tfmis-launch",
        usage=USAGE.split("\n")[0][len("usage: ") :],
        description="Start N local worker processes of one "
        "MultiWorkerMirroredStrategy cluster (TF_CONFIG with loopback addresses; TensorFlow's gRPC "
        "servers listen on their ports on all interfaces, unauthenticated).",
        epilog="Exit status: 0 every worker succeeded, else the first failure's status; 2 bad arguments (--nproc "
        "below 1, a program after -- that is not found or not executable).",
    )
    p.add_argument("--nproc", type=int, required=True, help="number of worker processes on this machine")
    p.add_argument(
        "--grace-seconds",
        type=float,
        default=60.0,
        help="after a worker fails, how long the others may take to stop by themselves",
    )
    p.add_argument(
        "--gpus-per-worker",
        type=int,
        default=None,
        help="GPUs each worker sees (default: the visible GPUs shared out evenly; 0 = leave as is)",
    )
    return p


@command
def main(argv=None) -> int:
    args, command = parse_with_command(build_parser(), argv, USAGE)
    if args.nproc < 1:
        problem = f"--nproc must be >= 1 (worker processes on this machine), got {args.nproc}"
    elif args.gpus_per_worker is not None and args.gpus_per_worker < 0:
        problem = f"--gpus-per-worker must be >= 0 (0 = leave the GPUs as they are), got {args.gpus_per_worker}"
    elif args.grace_seconds < 0:
        problem = f"--grace-seconds must be >= 0, got {args.grace_seconds}"
    else:
        problem = check_command(command)
    if problem:
        raise UsageError(problem)
    from tfmis.engine.local_workers import launch

    try:
        return launch(command, args.nproc, args.grace_seconds, args.gpus_per_worker)
    except OSError as e:  # the program went away or is not executable
        raise UsageError(f"cannot start {command[0]}: {e.strerror or e}; check the command after --") from e


if __name__ == "__main__":
    sys.exit(main())
