#!/usr/bin/env python3
"""Draw one case: a record of a converted dataset or a NIfTI file. Run with --help for the options.

Example:
    python tools/visualize.py --dataset-dir data/demo_tfr --sample 0                 # PNG of the mid-planes
    python tools/visualize.py --dataset-dir data/demo_tfr --sample 0 --no-screen     # GIF sweeping the slices
    python tools/visualize.py --image ct.nii.gz --label seg.nii.gz --class-names background,liver,tumour
"""

import sys

from tfmis.visualize import main

if __name__ == "__main__":
    sys.exit(main())
