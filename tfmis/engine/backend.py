"""The distribution backends' interface and their registry: below every backend, so that none imports another.

- `Backend`: what the trainer asks of a backend (scope, input, step, reductions, barriers, leaving); its defaults
  are those of one process.
- `BACKENDS`, `register_backend`: the lookup table from a `runtime.distribution` name to the factory that builds
  its backend (`tfmis.engine.distribution` registers `none`, `mirrored`, `multiworker` and `horovod`, and builds
  one with `make_backend`).
- `HorovodUnavailable`: the error of `runtime.distribution: horovod` without a working Horovod.

`tfmis.engine.distribution` (the tf.distribute backends, `make_backend`) and `tfmis.engine.horovod` (the Horovod
backend) both import this module and it imports neither; only `distribution`'s `horovod` factory imports
`tfmis.engine.horovod`, when that backend is asked for.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import tensorflow as tf

from tfmis.errors import ConfigError


class Backend:
    """The interface of a distribution backend; the defaults are those of one process.

    Attributes:
        name: the registry name.
        rank: this process among the worker processes (0 = the chief).
        size: the number of worker processes.
        num_replicas: replicas in sync over all workers (each takes `num_images_per_batch` per step).
        is_chief: rank 0, which writes logs, history, plots, the summary and the best weights.
        saves_checkpoints: whether this process calls `CheckpointManager.save` (MultiWorkerMirroredStrategy
            needs every worker to, non-chiefs into a temporary folder; Horovod only the chief).
    """

    name = "base"
    rank = 0
    size = 1

    @property
    def num_replicas(self) -> int:
        return 1

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def saves_checkpoints(self) -> bool:
        return self.is_chief

    def checkpoint_dir(self, run_dir: str | Path) -> Path:
        """Where this process's CheckpointManager writes: the run's `checkpoints/` on the chief."""
        return Path(run_dir) / "checkpoints"

    def after_save(self, run_dir: str | Path) -> None:
        """Called after every checkpoint save (a non-chief worker drops its temporary copy)."""

    def scope(self):
        return contextlib.nullcontext()

    def distribute_dataset(self, dataset_fn):
        """`dataset_fn(input_context)` builds the per-replica-batched dataset of one input pipeline."""
        return dataset_fn(tf.distribute.InputContext(self.size, self.rank, self.num_replicas))

    def run(self, fn, args):
        return fn(*args)

    def loss_scale(self) -> float:
        # each replica's loss is its local mean; summing the replicas' gradients must give the mean
        return 1.0 / self.num_replicas

    def prepare_optimizer(self, optimizer) -> None:
        """Adapts the optimizer to gradients that `reduce_gradients` has already reduced."""

    def reduce_gradients(self, grads):
        return grads

    def run_if(self, condition: tf.Tensor, fn) -> None:
        tf.cond(condition, lambda: discard_result(fn()), lambda: None)

    def reduce_mean(self, per_replica):
        return per_replica

    def sync_initial_state(self, model, optimizer) -> None:
        """Makes every replica start from rank 0's weights and optimizer state."""

    def sync_statistics(self, model) -> None:
        """Makes the model's float non-trainable state (BatchNorm moving statistics) the same on every
        worker, before validation and saving; nothing to do where BatchNorm is synchronised."""

    def all_reduce_sum(self, values) -> np.ndarray:
        """Host values (a float64 array) summed over the worker processes; every worker gets the sum."""
        return np.asarray(values, np.float64)

    def broadcast(self, values) -> np.ndarray:
        """Rank 0's host values (a float64 array) on every worker: one decision that all follow."""
        values = np.asarray(values, np.float64)
        return self.all_reduce_sum(values if self.rank == 0 else np.zeros_like(values))

    def barrier(self, name: str = "barrier") -> None:
        """Returns when every worker has called it."""
        arrived = int(round(float(self.all_reduce_sum([1.0])[0])))
        if arrived != self.size:
            raise RuntimeError(f"barrier {name!r}: {arrived} of {self.size} workers arrived")

    def finish(self, exit_status: int | None = None, timeout_s: float = 60.0, barrier_s: float = 3600.0) -> None:
        """Called by every worker process once, after its last piece of work in a successful run (not after a
        failure: a lost worker would never arrive), so that the processes leave together: here a barrier (the
        chief's last writes are done); nothing for one process. `StrategyBackend` orders the exit itself and
        may end the process with `exit_status`; here the caller returns it as usual."""
        if self.size > 1:
            self.barrier("finish")

    def leave_after_failure(self, timeout_s: float = 120.0) -> None:
        """Called by a worker whose run failed, so that the others do not wait for it at `finish`. Nothing here:
        a collective barrier would hang on a peer stuck in another collective, and the launcher (mpirun, srun)
        ends the job when one process fails."""


def discard_result(_):
    return None


class HorovodUnavailable(ConfigError, RuntimeError):
    """`runtime.distribution: horovod` in an environment without a working Horovod (exit 2: choose another
    runtime.distribution, or run from Horovod's environment)."""


# ---------------------------------------------------------------- the registry

BACKENDS = {}


def register_backend(name: str):
    """Decorator: `factory(runtime, output_dir) -> Backend` becomes `runtime.distribution: <name>`."""

    def register(factory):
        BACKENDS[name] = factory
        return factory

    return register
