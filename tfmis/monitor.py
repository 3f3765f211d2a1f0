"""`python -m tfmis.monitor [--interval 1] [--output DIR] [--gpus 0,1] -- COMMAND ...` (`tfmis-monitor`).

Runs COMMAND as a child and samples, every interval, GPU utilisation and memory per GPU (NVML), or,
without NVIDIA GPUs, the CPU utilisation and RSS of COMMAND's process tree, into DIR/monitor.csv;
then plots DIR/monitor.png, writes DIR/monitor.json (the summary), prints a summary table on stderr,
and exits with COMMAND's exit status. Ctrl-C (SIGINT) and SIGTERM are forwarded to COMMAND.
The sampler is `tfmis.profiling.ResourceMonitor`.

Exit status: COMMAND's (128 + N when signal N ended it; 127 when it cannot start); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys

from tfmis.errors import UsageError
from tfmis.utils.cli import check_command, command, parse_with_command

PREFIX = "tfmis.monitor:"
USAGE = (
    "usage: tfmis-monitor [--interval S] [--output DIR] [--gpus 0,1] -- COMMAND ...\n"
    "e.g. tfmis-monitor --interval 1 -- tfmis-train --config configs/demo.yaml"
)


def _gpu_list(text: str) -> list[int]:
    try:
        gpus = [int(g) for g in text.split(",") if g.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--gpus takes NVML indices separated by commas (e.g. 0,1), got {text!r}"
        ) from None
    if not gpus or min(gpus) < 0:
        raise argparse.ArgumentTypeError(f"--gpus takes non-negative GPU indices (e.g. 0,1), got {text!r}")
    return gpus


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"--interval takes a positive number of seconds, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tfmis-monitor",
        usage=USAGE.split("\n")[0][len("usage: ") :],
        description="Runs COMMAND, samples GPU utilisation/memory (or, without NVIDIA GPUs, "
        "the command's process-tree CPU and RSS) into DIR/monitor.csv, plots "
        "DIR/monitor.png, prints a summary, and exits with COMMAND's status.",
        epilog="Exit status: COMMAND's (128 + N when signal N ended it; 127 when it cannot start); 2 bad arguments.",
    )
    p.add_argument("--interval", type=_positive, default=1.0, help="seconds between samples (default 1)")
    p.add_argument(
        "--output", default=None, help="folder for monitor.csv/.png/.json (default: ./monitor-<YYYYmmdd-HHMMSS>)"
    )
    p.add_argument(
        "--gpus",
        type=_gpu_list,
        default=None,
        help="NVML indices of the GPUs to sample, e.g. 0,1 (default: CUDA_VISIBLE_DEVICES, else all)",
    )
    return p


@command
def main(argv=None) -> int:
    args, command = parse_with_command(build_parser(), argv, USAGE)
    problem = check_command(command)
    if problem:
        raise UsageError(problem)
    if args.gpus is not None:  # asked for GPUs: refuse before starting the command if they cannot be sampled
        from tfmis.hardware import NvmlGpus, NvmlUnavailable

        try:
            NvmlGpus(args.gpus).close()
        except NvmlUnavailable as e:
            raise UsageError(
                f"--gpus {','.join(map(str, args.gpus))}: no NVIDIA GPU can be sampled here ({e}); "
                "leave out --gpus to sample the command's CPU and memory"
            ) from None
        except ValueError as e:
            raise UsageError(f"--gpus {','.join(map(str, args.gpus))}: {e}") from None
    from tfmis.profiling.monitor import monitor_command

    output = args.output or f"monitor-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    return monitor_command(command, output, args.interval, args.gpus)


if __name__ == "__main__":
    sys.exit(main())
