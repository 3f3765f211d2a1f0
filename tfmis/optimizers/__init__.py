"""Optimizers (Novograd, and Keras' SGD/Adam/AdamW by name) and learning-rate schedules.

Example:
    >>> from tfmis.optimizers import build_optimizer, build_schedule
    >>> schedule = build_schedule("poly", 1e-2, total_steps=10_000, warmup_steps=200)
    >>> optimizer = build_optimizer("novograd", schedule, weight_decay=1e-3)
"""

from tfmis.optimizers.factory import OPTIMIZER_NAMES, build_optimizer
from tfmis.optimizers.novograd import Novograd
from tfmis.optimizers.schedules import (
    SCHEDULE_NAMES,
    ConstantLearningRate,
    CosineDecay,
    LinearWarmup,
    PolyDecay,
    ScheduleLength,
    batch_scaled_learning_rate,
    build_schedule,
)

__all__ = [
    "OPTIMIZER_NAMES",
    "SCHEDULE_NAMES",
    "ConstantLearningRate",
    "CosineDecay",
    "LinearWarmup",
    "Novograd",
    "PolyDecay",
    "ScheduleLength",
    "batch_scaled_learning_rate",
    "build_optimizer",
    "build_schedule",
]
