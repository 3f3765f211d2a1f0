#!/usr/bin/env python3
"""Convert an MSD-style dataset to preprocessed TFRecord shards. Run with --help for the options.

Example:
    python tools/tfrecord.py --source-dir Task09_Spleen --target-dir data/spleen \
        --split 0.7,0.15,0.15 --spacing 1.5,1.5,2.0 --ct-window -57,164 --shards 4 --workers 2
"""

import sys

from tfmis.convert import main

if __name__ == "__main__":
    sys.exit(main())
