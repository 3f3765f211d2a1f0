"""How the one training loop is spread over devices: the only part that differs between backends.

The trainer asks a backend to: create variables in its scope, distribute the input, run the
per-replica step, scale the per-replica loss, reduce gradients (once per step, before clipping and
the non-finite check, so that both see the global gradient), apply an update only if a condition
holds on every replica, reduce metrics, and synchronise the initial state. `StrategyBackend` covers a
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

    def prepare_optimizer(self, optimizer) -> None:
        """Makes `optimizer.apply()` take the gradients as given: `reduce_gradients` has summed them.

        Keras 3's TensorFlow optimizer all-reduces (SUM) the gradients inside `apply()` when called in a
        replica context, after its `clipnorm`/`global_clipnorm` clipping, so that clipping would see each
        replica's partial gradient. The trainer instead reduces first (one all-reduce per step) and lets
        `apply()` clip and check the global gradient.
        """
        inner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's wrapped optimizer
        if not callable(getattr(inner, "_all_reduce_sum_gradients", None)):
            raise RuntimeError(
                f"{type(inner).__name__} has no _all_reduce_sum_gradients: this Keras version reduces gradients "
                "differently, and tfmis.engine.distribution.StrategyBackend.prepare_optimizer must be adapted")
        inner._all_reduce_sum_gradients = _already_reduced

    def reduce_gradients(self, grads):
        """The gradients summed over replicas, the same on every replica (None entries kept)."""
        ctx = tf.distribute.get_replica_context()
        if self.num_replicas == 1 or ctx is None:
            return grads
        present = [g for g in grads if g is not None]
        summed = iter(ctx.all_reduce(tf.distribute.ReduceOp.SUM, present))
        return [None if g is None else next(summed) for g in grads]

    def run_if(self, condition: tf.Tensor, fn) -> None:
        """Runs `fn()` on every replica if `condition` holds, else nothing; from inside the replica step.

        `condition` must be the same on every replica (e.g. computed from reduced gradients); replica 0's
        is used. `fn` may synchronise replicas (`optimizer.apply` does, through a merge call), which a
        `tf.cond` in a replica context does not allow: the branch is then taken in the cross-replica
        context, as Keras' LossScaleOptimizer does.
        """
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            tf.cond(condition, lambda: _none(fn()), lambda: None)
            return

        def cross_replica(strategy, condition):
            first = strategy.experimental_local_results(condition)[0]
            tf.cond(first, lambda: _none(strategy.extended.call_for_each_replica(fn)), lambda: None)

        tf.distribute.get_replica_context().merge_call(cross_replica, args=(condition,))

    def reduce_mean(self, per_replica) -> tf.Tensor:
        return self.strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica, axis=None)

    def sync_initial_state(self, model, optimizer) -> None:
        """Mirrored variables start identical by construction: nothing to do."""


def _already_reduced(grads_and_vars):
    return list(grads_and_vars)


def _none(_):
    return None


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
