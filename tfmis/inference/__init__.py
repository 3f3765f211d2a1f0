"""Inference on whole volumes: sliding-window prediction with overlap blending (MONAI-like).

- `windows.py`: the window grid and the importance map (MONAI's formulas);
- `blending.py`: Σ(weight · prediction) / Σ(weight) in host memory or on a device (`host_blend.py`: the numpy
  blend; `buffers.py`: its aligned buffers, the kept Σ(weight), its threads);
- `sliding_window.py`: `sliding_window_inference`, MONAI's signature;
- `placement.py`: where a volume and its buffers live, with the out-of-memory fallback;
- `predictor.py`: whole scans in, NIfTI out, in the original geometry (the case loop and the model);
- `inputs.py`: the cases to predict, the training run a checkpoint belongs to, its weights;
- `outputs.py`: each case's result, predictions.csv and the results table;
- label-map files are `tfmis.data.sources.label_maps`, the postprocessing `tfmis.postprocessing`;
- `dicom_seg.py`: label maps written as DICOM SEG for a DICOM series input (`tfmis.data.sources.dicom_series` reads it).
"""

from tfmis.inference.blending import aggregate_windows
from tfmis.inference.sliding_window import PADDING_MODES, sliding_window_inference
from tfmis.inference.windows import BLEND_MODES, importance_map, number_of_windows, scan_intervals, window_starts

__all__ = [
    "BLEND_MODES",
    "PADDING_MODES",
    "aggregate_windows",
    "importance_map",
    "number_of_windows",
    "scan_intervals",
    "sliding_window_inference",
    "window_starts",
]
