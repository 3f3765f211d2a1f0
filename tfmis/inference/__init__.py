"""Inference on whole volumes: sliding-window prediction with overlap blending (MONAI-like)."""

from tfmis.inference.sliding_window import (
    BLEND_MODES,
    PADDING_MODES,
    aggregate_windows,
    importance_map,
    number_of_windows,
    scan_intervals,
    sliding_window_inference,
    window_starts,
)

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
