"""Full-volume segmentation metrics: per-class Dice, HD95 and a validation accumulator.

Example:
```python
from tfmis.metrics import SegmentationMetrics
metrics = SegmentationMetrics(num_classes=3, hd95=True)
```
"""

from tfmis.metrics.segmentation import (
    SegmentationMetrics,
    dice_per_class,
    hausdorff_distance_95,
    mean_dice,
    surface_distance_percentile,
)

__all__ = ["SegmentationMetrics", "dice_per_class", "mean_dice", "hausdorff_distance_95", "surface_distance_percentile"]
