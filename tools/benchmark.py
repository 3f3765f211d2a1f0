#!/usr/bin/env python3
"""Regular vs fast training benchmark (MONAI's fast-training notebook, in TensorFlow). Run with --help.

Example:
    python tools/benchmark.py --config configs/demo.yaml                  # docs/benchmarks.md gives its time
    python tools/benchmark.py --config configs/demo.yaml --pipeline-only  # the input pipelines alone
"""

import sys

from tfmis.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
