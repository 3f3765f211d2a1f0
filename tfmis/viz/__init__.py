"""Pictures of cases: orthogonal mid-planes (PNG) and slice sweeps (animated GIF) with label overlays.

Example:
```python
from tfmis.data.records import read_record
from tfmis.viz import plot_orthogonal_planes, write_slice_sweep_gif

case = read_record("OUT", "train", 0)
meta = case["metadata"]
fig = plot_orthogonal_planes(case["image"], case["label"], spacing=meta["geometry"]["spacing"],
                             channel_names=meta["modalities"], class_names=meta["labels"], title=case["case_id"])
fig.savefig("case.png")
```
From a shell: `tfmis-visualize --dataset-dir OUT --sample 0` (see `--help`).
"""

from tfmis.viz.slices import (
    PLANES,
    class_color,
    intensity_window,
    plot_orthogonal_planes,
    render_rgb,
    write_slice_sweep_gif,
)

__all__ = ["PLANES", "class_color", "intensity_window", "plot_orthogonal_planes", "render_rgb", "write_slice_sweep_gif"]
