"""How the one training loop is spread over devices: the only part that differs between backends.

The trainer asks a backend to: create variables in its scope, distribute the input, run the
per-replica step, scale the per-replica loss, reduce gradients, tell whether any replica saw a
non-finite gradient, reduce metrics, and synchronise the initial state. `StrategyBackend` covers a
single device and every tf.distribute strategy (MirroredStrategy here; MultiWorkerMirroredStrategy
plugs in the same way); a Horovod backend implements the same methods with `hvd.allreduce` /
`hvd.broadcast_variables`.

Example:
```python
backend = make_backend("auto")          # MirroredStrategy over all GPUs if more than one
with backend.scope():
    model = build_unet(...)
```
"""

from __future__ import annotations

import tensorflow as tf


class StrategyBackend:
    """A tf.distribute strategy (the default strategy = one device).

    Args:
        strategy: any `tf.distribute.Strategy`; None = the default (single-device) strategy.
    """

    name = "tf.distribute"

    def __init__(self, strategy: tf.distribute.Strategy | None = None):
        self.strategy = strategy or tf.distribute.get_strategy()

    @property
    def num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def is_chief(self) -> bool:
        resolver = getattr(self.strategy, "cluster_resolver", None)
        return resolver is None or resolver.task_type in (None, "chief") or (
            resolver.task_type == "worker" and resolver.task_id == 0)

    def scope(self):
        return self.strategy.scope()

    def distribute_dataset(self, dataset_fn):
        """`dataset_fn(input_context)` builds the per-replica-batched dataset of one input pipeline."""
        return self.strategy.distribute_datasets_from_function(dataset_fn)

    def run(self, fn, args):
        return self.strategy.run(fn, args=args)

    def loss_scale(self) -> float:
        # each replica's loss is its local mean; summing the replicas' gradients must give the mean
        return 1.0 / self.num_replicas

    def reduce_gradients(self, grads):
        # Keras 3's optimizer.apply() all-reduces (SUM) the gradients itself in a replica context
        return grads

    def any_replica(self, flag: tf.Tensor) -> tf.Tensor:
        ctx = tf.distribute.get_replica_context()
        if self.num_replicas == 1 or ctx is None:
            return flag
        return ctx.all_reduce(tf.distribute.ReduceOp.MAX, tf.cast(flag, tf.float32)) > 0

    def reduce_mean(self, per_replica) -> tf.Tensor:
        return self.strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica, axis=None)

    def sync_initial_state(self, model, optimizer) -> None:
        """Mirrored variables start identical by construction: nothing to do."""


def make_backend(distribution: str = "auto", devices=None) -> StrategyBackend:
    """A backend for `training.distribution`: `none`, `mirrored`, or `auto`.

    Args:
        distribution: `auto` uses MirroredStrategy when more than one GPU is visible (or `devices`
            lists several), else the default single-device strategy.
        devices: devices for MirroredStrategy (default: all local GPUs).
    """
    gpus = tf.config.list_logical_devices("GPU")
    several = len(devices) > 1 if devices else len(gpus) > 1
    if distribution == "none" or (distribution == "auto" and not several):
        return StrategyBackend()
    if distribution in ("mirrored", "auto"):
        return StrategyBackend(tf.distribute.MirroredStrategy(devices=devices))
    raise ValueError(f"training.distribution: unknown backend {distribution!r}; expected auto, none or mirrored")
