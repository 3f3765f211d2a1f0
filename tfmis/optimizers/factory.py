"""Optimizers by name: `build_optimizer("sgd" | "adam" | "adamw" | "novograd", learning_rate, ...)`."""

from __future__ import annotations

import keras

from tfmis.optimizers.fused_adam import FusedAdam, FusedAdamW
from tfmis.optimizers.novograd import Novograd

OPTIMIZER_NAMES = ("adam", "adamw", "sgd", "novograd")


def build_optimizer(
    name: str,
    learning_rate,
    weight_decay: float = 0.0,
    momentum: float = 0.99,
    nesterov: bool = True,
    beta_1: float = 0.9,
    beta_2: float = 0.999,
    epsilon: float = 1e-8,
    clipnorm: float | None = None,
    **extra,
) -> keras.optimizers.Optimizer:
    """A Keras optimizer by name.

    Weight decay semantics differ per optimizer, on purpose (each is the standard one):

    - "sgd", "adam", "adamw": Keras' decoupled weight decay (Adam and AdamW are Keras' with one fused kernel per
      variable, `tfmis.optimizers.fused_adam`), `w ← w − lr · weight_decay · w` each step
      (so "adam" with weight_decay > 0 is AdamW). Note that this is not PyTorch SGD's coupled L2
      (`g + wd · w` through the momentum): with momentum μ, nnU-Net's torch `weight_decay=3e-5`
      acts roughly like a decoupled 3e-5 / (1 − μ) = 3e-3 at μ = 0.99.
    - "novograd": the paper's term d · w added to the normalised gradient inside the momentum.

    Args:
        name: "adam", "adamw", "sgd" (momentum, Nesterov by default, nnU-Net style) or "novograd";
            case-insensitive.
        learning_rate: float or `keras.optimizers.schedules.LearningRateSchedule`.
        weight_decay: see above; 0 disables it.
        momentum, nesterov: "sgd" only.
        beta_1, beta_2, epsilon: "adam", "adamw", "novograd".
        clipnorm: per-variable gradient-norm clipping (None: off). The `Trainer` hands `apply()` the
            gradient of the whole global batch (summed over accumulation micro-batches and replicas), so
            the threshold means the same on one device as on several.
        **extra: further keyword arguments of the chosen optimizer (e.g. `global_clipnorm`,
            `amsgrad`, `grad_averaging` for Novograd, `gradient_accumulation_steps`).

    Returns:
        An unbuilt `keras.optimizers.Optimizer`.

    Raises:
        ValueError: unknown `name` (the message lists the valid names).

    Example:
        >>> from tfmis.optimizers import build_optimizer, build_schedule
        >>> schedule = build_schedule("poly", 1e-2, total_steps=250_000)
        >>> optimizer = build_optimizer("sgd", schedule, weight_decay=3e-5, momentum=0.99)
    """
    key = name.lower()
    common = dict(learning_rate=learning_rate, clipnorm=clipnorm, **extra)
    decoupled_decay = weight_decay if weight_decay else None  # Keras skips decay entirely for None
    if key == "sgd":
        return keras.optimizers.SGD(momentum=momentum, nesterov=nesterov, weight_decay=decoupled_decay, **common)
    if key == "adam":
        return FusedAdam(beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, weight_decay=decoupled_decay, **common)
    if key == "adamw":
        return FusedAdamW(beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, weight_decay=weight_decay, **common)
    if key == "novograd":
        return Novograd(beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, weight_decay=weight_decay, **common)
    raise ValueError(f"Unknown optimizer {name!r}; valid names: {', '.join(OPTIMIZER_NAMES)}")
