"""The README's main job on the built-in demo dataset: generate → convert → visualize.

Every step is resumable and skips work already done, so running it again is cheap.
(Training and prediction join this job as they land.)

Example:
```
python -m tfmis.quickstart                 # writes data/demo/{Task00_DemoBrain,tfrecords}
```
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tfmis.data.convert import ConversionConfig, convert, summary_text
from tfmis.data.demo import DATASET_NAME, make_demo_dataset


def prepare_demo_data(data_dir: str | Path, workers: int | None = None, progress: bool = True) -> Path:
    """Makes sure the demo dataset exists and is converted; returns the TFRecord folder."""
    data_dir = Path(data_dir)
    source = make_demo_dataset(data_dir / DATASET_NAME)
    target = data_dir / "tfrecords"
    config = ConversionConfig(source_dir=str(source), target_dir=str(target), split=(0.7, 0.15, 0.15), shards=2,
                              seed=0, progress=progress, **({"workers": workers} if workers else {}))
    index = convert(config)
    print(summary_text(index))
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfmis.quickstart", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default="data/demo", help="where the demo data goes (default data/demo)")
    parser.add_argument("--workers", type=int, default=None, help="conversion worker processes")
    args = parser.parse_args(argv)
    from tfmis.viz.cli import main as visualize

    start = time.time()
    print(f"[1/2] Demo dataset → TFRecords in {args.data_dir}")
    target = prepare_demo_data(args.data_dir, args.workers)
    print("[2/2] Visualizing the first training case")
    for extra in ([], ["--no-screen"]):
        if visualize(["--dataset-dir", str(target), "--split", "train", "--sample", "0", *extra]) != 0:
            return 1
    print(f"Done in {time.time() - start:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
