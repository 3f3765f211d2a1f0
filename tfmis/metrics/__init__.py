"""Full-volume segmentation metrics: per-class and per-region Dice, HD95, NSD and a validation accumulator, in
bounded memory (label maps as stored, slab-wise counts, one structure's masks at a time inside its box, one pair of
surface distances for HD95 and NSD). nnU-Net's Dice and its means, which cross-validation's choices use, are
`tfmis.metrics.nnunet_scores`.

Example:
```python
from tfmis.metrics import SegmentationMetrics
metrics = SegmentationMetrics(num_classes=3, hd95=True, nsd=True, nsd_tolerance_mm=2.0, regions={"both": [1, 2]})
```
"""

from tfmis.metrics.segmentation import (
    SegmentationMetrics,
    check_regions,
    dice_per_class,
    hausdorff_distance_95,
    mean_dice,
    normalized_surface_dice,
    region_dice,
)
from tfmis.metrics.surface import (
    surface,
    surface_dice,
    surface_distance_percentile,
    surface_distances,
    surface_scores,
)

__all__ = [
    "SegmentationMetrics",
    "check_regions",
    "dice_per_class",
    "mean_dice",
    "hausdorff_distance_95",
    "normalized_surface_dice",
    "region_dice",
    "surface",
    "surface_dice",
    "surface_distance_percentile",
    "surface_distances",
    "surface_scores",
]
