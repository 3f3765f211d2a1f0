"""`python -m tfmis.monitor [--interval 1] [--output DIR] [--gpus 0,1] -- COMMAND ...`

Runs COMMAND as a child and samples, every interval, GPU utilisation and memory per GPU (NVML), or,
without NVIDIA GPUs, the CPU utilisation and RSS of COMMAND's process tree, into DIR/monitor.csv;
then plots DIR/monitor.png, writes DIR/monitor.json (the summary), prints a summary table on stderr,
and exits with COMMAND's exit status. Ctrl-C (SIGINT) and SIGTERM are forwarded to COMMAND.
The implementation is tfmis.profiling.monitor.
"""

import sys

from tfmis.profiling.monitor import main

if __name__ == "__main__":
    sys.exit(main())
