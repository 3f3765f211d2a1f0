"""Learning-rate schedules: constant, polynomial (nnU-Net "poly") and cosine decay, with linear warm-up.

Every schedule is a `keras.optimizers.schedules.LearningRateSchedule` with `get_config`, registered for
Keras serialisation, so an optimizer using one can be saved and restored with the model. Steps are
optimizer steps (`optimizer.iterations`, 0-based).

A decay's length may be a `ScheduleLength`: the run's total steps in a non-trainable variable, read by the
compiled step, so that the trainer can set it after the schedule is built (a time budget fits the schedule to
the step time it measures; `tfmis.engine.time_budget`). `get_config` then records the length of that moment.

Example:
    >>> from tfmis.optimizers import build_schedule
    >>> schedule = build_schedule("poly", 1e-2, total_steps=1000, warmup_steps=50)
    >>> [round(float(schedule(step)), 6) for step in (0, 25, 50, 1000)]
    [0.0, 0.005, 0.01, 0.0]
"""

from __future__ import annotations

import math
import weakref

import keras
from keras import ops

LearningRateSchedule = keras.optimizers.schedules.LearningRateSchedule

SCHEDULE_NAMES = ("constant", "poly", "cosine")


def _as_float_step(step):
    return ops.cast(step, "float32")


class ScheduleLength:
    """The optimizer steps a schedule runs, warm-up included, in a non-trainable int64 `tf.Variable`.

    A decay given one (`build_schedule(total_steps=length)`) reads its length from the variable at every step,
    so assigning it changes where the schedule ends without rebuilding the optimizer or retracing the step. The
    decay after a warm-up of `warmup_steps` runs over `total_steps - warmup_steps` steps (at least 1). Create
    it where the optimizer's variables are created (the distribution strategy's scope) and save `variable` in
    the checkpoint, so that a resumed run continues the same schedule.

    Args:
        total_steps: the initial length.
        warmup_steps: the linear warm-up's steps (fixed).
        name: the variable's name.

    Example:
        >>> length = ScheduleLength(100, warmup_steps=10)
        >>> schedule = build_schedule("cosine", 1e-2, total_steps=length, warmup_steps=10)
        >>> length.assign(50)
        >>> round(float(schedule(50)), 6)
        0.0
    """

    def __init__(self, total_steps: int, warmup_steps: int = 0, name: str = "schedule_total_steps"):
        import tensorflow as tf

        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = int(warmup_steps)
        self.variable = tf.Variable(int(total_steps), dtype=tf.int64, trainable=False, name=name)

    @property
    def total_steps(self) -> int:
        """The current length (a host read of the variable)."""
        return int(self.variable.numpy())

    def assign(self, total_steps: int) -> None:
        """Sets the schedule's length; the steps after this use it."""
        self.variable.assign(int(total_steps))

    def decay_steps(self):
        """The decay's length as a float32 tensor read from the variable: total - warm-up, at least 1."""
        return ops.maximum(ops.cast(self.variable, "float32") - float(self.warmup_steps), 1.0)

    def __int__(self) -> int:
        return max(self.total_steps - self.warmup_steps, 1)


def _decay_progress(step, decay_steps):
    """step / decay_steps, clipped to [0, 1] (the schedule stays at its end value after `decay_steps`)."""
    steps = decay_steps.decay_steps() if isinstance(decay_steps, ScheduleLength) else float(decay_steps)
    return ops.clip(_as_float_step(step) / steps, 0.0, 1.0)


def _check_decay_steps(decay_steps):
    """An int > 0, or a `ScheduleLength` (read at every step)."""
    if isinstance(decay_steps, ScheduleLength):
        return decay_steps
    if decay_steps <= 0:
        raise ValueError(f"decay_steps must be > 0, got {decay_steps}")
    return int(decay_steps)


@keras.saving.register_keras_serializable(package="tfmis")
class ConstantLearningRate(LearningRateSchedule):
    """The same learning rate at every step (useful as the post-warm-up part of `LinearWarmup`).

    Args:
        learning_rate: the learning rate.

    Example:
        >>> round(float(ConstantLearningRate(3e-4)(123)), 6)
        0.0003
    """

    def __init__(self, learning_rate: float):
        self.learning_rate = float(learning_rate)

    def __call__(self, step):
        return ops.full((), self.learning_rate, "float32")

    def get_config(self):
        return {"learning_rate": self.learning_rate}


@keras.saving.register_keras_serializable(package="tfmis")
class PolyDecay(LearningRateSchedule):
    """nnU-Net's polynomial decay: min + (base − min) · (1 − step / decay_steps) ** power.

    With `min_learning_rate=0` this is exactly nnU-Net's `lr · (1 − step / total) ** 0.9`. The rate
    reaches `min_learning_rate` at `decay_steps` and stays there.

    Args:
        base_learning_rate: rate at step 0.
        decay_steps: steps from `base_learning_rate` to `min_learning_rate` (> 0), or a `ScheduleLength` whose
            decay steps are read at every step.
        power: exponent (nnU-Net: 0.9).
        min_learning_rate: final rate.

    Example:
        >>> round(float(PolyDecay(1e-2, decay_steps=100)(50)), 6)  # 0.01 * 0.5 ** 0.9
        0.005359
    """

    def __init__(self, base_learning_rate: float, decay_steps, power: float = 0.9, min_learning_rate: float = 0.0):
        self.decay_steps = _check_decay_steps(decay_steps)
        self.base_learning_rate = float(base_learning_rate)
        self.power = float(power)
        self.min_learning_rate = float(min_learning_rate)

    def __call__(self, step):
        remaining = 1.0 - _decay_progress(step, self.decay_steps)
        span = self.base_learning_rate - self.min_learning_rate
        return self.min_learning_rate + span * ops.power(remaining, self.power)

    def get_config(self):
        return {
            "base_learning_rate": self.base_learning_rate,
            "decay_steps": int(self.decay_steps),  # a ScheduleLength: its current length
            "power": self.power,
            "min_learning_rate": self.min_learning_rate,
        }


@keras.saving.register_keras_serializable(package="tfmis")
class CosineDecay(LearningRateSchedule):
    """Half-cosine decay: min + (base − min) · (1 + cos(π · step / decay_steps)) / 2.

    Args:
        base_learning_rate: rate at step 0.
        decay_steps: steps from `base_learning_rate` to `min_learning_rate` (> 0); constant after. Or a
            `ScheduleLength` whose decay steps are read at every step.
        min_learning_rate: final rate.

    Example:
        >>> round(float(CosineDecay(1e-2, decay_steps=100, min_learning_rate=1e-4)(50)), 6)
        0.00505
    """

    def __init__(self, base_learning_rate: float, decay_steps, min_learning_rate: float = 0.0):
        self.decay_steps = _check_decay_steps(decay_steps)
        self.base_learning_rate = float(base_learning_rate)
        self.min_learning_rate = float(min_learning_rate)

    def __call__(self, step):
        cosine = 0.5 * (1.0 + ops.cos(math.pi * _decay_progress(step, self.decay_steps)))
        return self.min_learning_rate + (self.base_learning_rate - self.min_learning_rate) * cosine

    def get_config(self):
        return {
            "base_learning_rate": self.base_learning_rate,
            "decay_steps": int(self.decay_steps),  # a ScheduleLength: its current length
            "min_learning_rate": self.min_learning_rate,
        }


@keras.saving.register_keras_serializable(package="tfmis")
class LinearWarmup(LearningRateSchedule):
    """Linear warm-up from 0 to `schedule(0)` over `warmup_steps`, then `schedule(step − warmup_steps)`.

    The wrapped schedule starts counting when the warm-up ends, so a decay over `total − warmup` steps
    ends exactly at step `total`. As in Keras' own warm-up, the rate is `target · step / warmup_steps`,
    i.e. 0 at step 0 and the full `schedule(0)` from step `warmup_steps` on.

    Args:
        schedule: the `LearningRateSchedule` that follows the warm-up.
        warmup_steps: warm-up length (0 = no warm-up, `schedule` unchanged).

    Example:
        >>> warm = LinearWarmup(ConstantLearningRate(1e-3), warmup_steps=10)
        >>> [round(float(warm(s)), 6) for s in (0, 5, 10, 99)]
        [0.0, 0.0005, 0.001, 0.001]
    """

    def __init__(self, schedule: LearningRateSchedule, warmup_steps: int):
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if isinstance(schedule, dict):  # from get_config
            schedule = keras.optimizers.schedules.deserialize(schedule)
        self.schedule = schedule
        self.warmup_steps = int(warmup_steps)

    def __call__(self, step):
        step = _as_float_step(step)
        after = self.schedule(ops.maximum(step - float(self.warmup_steps), 0.0))
        if self.warmup_steps == 0:
            return after
        target = ops.cast(self.schedule(0.0), "float32")
        warming = target * step / float(self.warmup_steps)
        return ops.where(step < float(self.warmup_steps), warming, ops.cast(after, "float32"))

    def get_config(self):
        return {"schedule": keras.optimizers.schedules.serialize(self.schedule), "warmup_steps": self.warmup_steps}


def build_schedule(
    name: str,
    base_learning_rate: float,
    total_steps: int | ScheduleLength | None = None,
    warmup_steps: int = 0,
    power: float = 0.9,
    min_learning_rate: float = 0.0,
) -> LearningRateSchedule:
    """A learning-rate schedule by name, with optional linear warm-up from 0.

    The decay ("poly", "cosine") runs over the `total_steps − warmup_steps` steps after the warm-up, so
    the rate is `base_learning_rate` at step `warmup_steps` and `min_learning_rate` at `total_steps`
    (and after). "constant" ignores `total_steps`, `power` and `min_learning_rate`.

    Args:
        name: "constant", "poly" (nnU-Net) or "cosine" (case-insensitive).
        base_learning_rate: peak rate (after warm-up).
        total_steps: optimizer steps of the whole run, warm-up included (required for decays); or a
            `ScheduleLength` (its `warmup_steps` must be `warmup_steps`) to set the length later.
        warmup_steps: linear warm-up length (0: none).
        power: exponent of "poly".
        min_learning_rate: final rate of "poly"/"cosine".

    Returns:
        A `keras.optimizers.schedules.LearningRateSchedule`.

    Raises:
        ValueError: unknown name, or `total_steps` missing / not larger than `warmup_steps` for a decay.

    Example:
        >>> schedule = build_schedule("cosine", 1e-3, total_steps=10_000, warmup_steps=500)
        >>> optimizer = keras.optimizers.Adam(learning_rate=schedule)
    """
    key = name.lower()
    if key not in SCHEDULE_NAMES:
        raise ValueError(f"Unknown learning-rate schedule {name!r}; valid names: {', '.join(SCHEDULE_NAMES)}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if key == "constant":
        schedule = ConstantLearningRate(base_learning_rate)
    else:
        length = total_steps if isinstance(total_steps, ScheduleLength) else None
        if length is not None:
            if length.warmup_steps != warmup_steps:
                raise ValueError(
                    f"the ScheduleLength's warmup_steps ({length.warmup_steps}) must be warmup_steps ({warmup_steps})"
                )
            total_steps = length.total_steps
        if total_steps is None or total_steps <= warmup_steps:
            raise ValueError(
                f"{key!r} needs total_steps > warmup_steps, got total_steps={total_steps}, warmup_steps={warmup_steps}"
            )
        decay_steps = length if length is not None else total_steps - warmup_steps
        if key == "poly":
            schedule = PolyDecay(base_learning_rate, decay_steps, power, min_learning_rate)
        else:
            schedule = CosineDecay(base_learning_rate, decay_steps, min_learning_rate)
    return LinearWarmup(schedule, warmup_steps) if warmup_steps else schedule


def batch_scaled_learning_rate(learning_rate: float, scaling: str, global_batch: int, reference_batch: int) -> float:
    """The learning rate for `global_batch` when `learning_rate` was tuned for `reference_batch`.

    `linear`: × global / reference (Goyal et al. 2017, "Accurate, Large Minibatch SGD"); `sqrt`:
    × √(global / reference) (Krizhevsky 2014; Hoffer et al. 2017), often better for Adam-style
    optimizers; `none`: unchanged.

    Example:
        >>> batch_scaled_learning_rate(1e-3, "linear", 16, 4), batch_scaled_learning_rate(1e-3, "sqrt", 16, 4)
        (0.004, 0.002)
    """
    ratio = global_batch / reference_batch
    factors = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}
    if scaling not in factors:
        raise ValueError(f"optimizer.lr_scaling must be none, linear or sqrt, got {scaling!r}")
    return learning_rate * factors[scaling]


@keras.saving.register_keras_serializable(package="tfmis")
class OncePerStep(LearningRateSchedule):
    """`schedule`, computed once per traced step instead of once per variable.

    Keras' TensorFlow optimizer reads `learning_rate` once per variable when it applies weight decay, and with a
    schedule each read evaluates the schedule again, a large share of the step graph's ops and of its tracing
    (docs/benchmarks.md, "First epoch, precision and other costs"). This wrapper keeps the first value computed in
    a graph for the same step variable (`optimizer.iterations`, passed as the variable itself) and returns it for
    the other reads in that graph; eagerly, or for any other step argument, it evaluates `schedule`. It assumes
    one optimizer step per traced graph, as the `Trainer`'s step takes (a loop over steps traces its body as a
    graph of its own).

    Args:
        schedule: the `LearningRateSchedule` to evaluate.

    Example:
        >>> import tensorflow as tf
        >>> step = tf.Variable(5, dtype=tf.int64)
        >>> once = OncePerStep(CosineDecay(1e-2, decay_steps=10))
        >>> graph = tf.function(lambda: [once(step) for _ in range(3)]).get_concrete_function().graph
        >>> sum(op.type == "Cos" for op in graph.get_operations())
        1
    """

    def __init__(self, schedule: LearningRateSchedule):
        if isinstance(schedule, dict):  # from get_config
            schedule = keras.optimizers.schedules.deserialize(schedule)
        self.schedule = schedule
        self._values = weakref.WeakKeyDictionary()  # graph -> (step variable, its rate tensor in that graph)

    def __call__(self, step):
        import tensorflow as tf

        if tf.executing_eagerly() or not isinstance(step, (tf.Variable, keras.Variable)):
            return self.schedule(step)
        graph = tf.compat.v1.get_default_graph()
        cached = self._values.get(graph)
        if cached is None or cached[0] is not step:
            cached = (step, self.schedule(step))
            self._values[graph] = cached
        return cached[1]

    def get_config(self):
        return {"schedule": keras.optimizers.schedules.serialize(self.schedule)}
