"""The Horovod backend (`runtime.distribution: horovod`): one process per device, gradients all-reduced by Horovod.

Each process runs the same training loop on its own device and its own shard of the input; Horovod
sums the processes' gradients once per step (`hvd.grouped_allreduce`, op Sum, over Gloo on CPUs or
NCCL on GPUs) and broadcasts rank 0's initial weights and optimizer state. Rank 0 (the chief) writes
the run folder: logs, history, plots, summary, checkpoints and the best weights.

Launch it with `horovodrun` (Gloo; one process per GPU, or per CPU slot on a CPU machine):

    horovodrun -np 2 -H localhost:2 --gloo python -m tfmis.train --config configs/demo.yaml \\
        --set runtime.distribution=horovod

Installation: Horovod 0.28.1 (its last release) builds against TensorFlow 2.16 but not 2.17+, so it
lives in its own environment made by `tools/install_horovod.sh` (TensorFlow 2.16.2, Keras 3, Horovod
with TensorFlow + Gloo, tfmis editable).

Limits, by design of Horovod with Keras 3:

- Only Horovod's low-level API is used: `hvd.grouped_allreduce` on the gradients (one op per
  dtype) and `hvd.broadcast_variables` on the variables' TensorFlow values. `hvd.DistributedGradientTape`,
  `hvd.DistributedOptimizer` and Horovod's Keras callbacks expect Keras 2 objects and fail with
  Keras 3 (e.g. `'Variable' object has no attribute 'ref'`).
- BatchNorm is per process (no synchronised BatchNorm): each process normalises with the mean and
  variance of its own batch and keeps its own moving statistics; the weights stay identical, the
  moving statistics do not during an epoch; after the epoch's steps they are averaged over the
  processes (`sync_statistics`), before validation and saving. With small per-process batches prefer
  `model.norm: instance` (no batch statistics), or `runtime.distribution: mirrored` / `multiworker`,
  whose BatchNorm sees the global batch.
- `training.jit_compile: true` fails: the replica step would hold Horovod's all-reduce, which has no
  XLA CPU kernel (`No registered 'HorovodGroupedAllreduce' OpKernel for XLA_CPU_JIT`). Horovod
  documents XLA ops for GPUs behind `HOROVOD_ENABLE_XLA_OPS=1` (not verified here).

Example:
```python
from tfmis.engine.horovod import HorovodBackend
backend = HorovodBackend()          # hvd.init() and one GPU per process: before anything touches devices
trainer = Trainer(config, backend=backend)
trainer.fit()
```
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import tensorflow as tf

from tfmis.engine.backend import Backend, HorovodUnavailable, discard_result
from tfmis.errors import UsageError
from tfmis.hardware import physical_gpus

INSTALL_HINT = (
    "runtime.distribution: horovod needs Horovod built with TensorFlow ops; Horovod 0.28.1 builds "
    "against TensorFlow 2.16 (not 2.17+), so make its environment with `tools/install_horovod.sh` "
    "(add --gpu for NCCL) and run tfmis from it, e.g. `.venv-horovod/bin/horovodrun -np 2 -H localhost:2 "
    "--gloo .venv-horovod/bin/python -m tfmis.train ...`; or choose another runtime.distribution "
    "(none, mirrored, multiworker)."
)


def import_horovod():
    """`horovod.tensorflow`, or an error that says how to install it.

    Raises:
        HorovodUnavailable (a RuntimeError and a ConfigError): Horovod is not importable, or was built without
            TensorFlow ops (or against another TensorFlow than the one running).
    """
    try:
        import horovod  # noqa: F401
    except ImportError as e:
        raise HorovodUnavailable(f"Horovod is not installed in {sys.executable} ({e}). {INSTALL_HINT}") from e
    try:
        import horovod.tensorflow as hvd
    except Exception as e:  # built without HOROVOD_WITH_TENSORFLOW, or an ABI mismatch with this TensorFlow
        version = getattr(sys.modules.get("horovod"), "__version__", "?")
        raise HorovodUnavailable(
            f"Horovod {version} is installed in {sys.executable} but horovod.tensorflow does not load with "
            f"TensorFlow {tf.__version__} ({type(e).__name__}: {e}): it was built without TensorFlow ops "
            f"(HOROVOD_WITH_TENSORFLOW=1) or against another TensorFlow. {INSTALL_HINT}"
        ) from e
    return hvd


class HorovodBackend(Backend):
    """Horovod processes as the replicas of the training loop (one replica per process).

    Construct it before anything touches TensorFlow's devices: it calls `hvd.init()` and, when GPUs
    exist, makes the process see only GPU `hvd.local_rank()` (with memory growth). On CPUs nothing is
    pinned. Rank 0 is the chief and the only process that writes the run folder.

    Args:
        runtime: the `runtime` config section (`tfmis.config.RuntimeConfig`); Horovod takes its processes
            from the launcher (`horovodrun -np N -H host:slots`), so nothing in it is needed. None is fine.

    Raises:
        RuntimeError: Horovod is missing or unusable (see `import_horovod`), devices were already
            initialised, or this node runs more processes than it has GPUs.

    Example:
    ```python
    backend = HorovodBackend()
    print(backend.rank, backend.size, backend.is_chief)
    ```
    """

    name = "horovod"

    def __init__(self, runtime=None):
        self.runtime = runtime
        self.hvd = hvd = import_horovod()
        hvd.init()
        self.rank, self.size = int(hvd.rank()), int(hvd.size())
        self.local_rank, self.local_size = int(hvd.local_rank()), int(hvd.local_size())
        gpus = physical_gpus()
        if gpus:
            if self.local_rank >= len(gpus):
                raise UsageError(
                    f"runtime.distribution: horovod: process {self.rank} has local rank {self.local_rank} but its node "
                    f"has {len(gpus)} GPUs: start at most one process per GPU (horovodrun -np/-H slots, "
                    "--ntasks-per-node = GPUs per node)"
                )
            gpu = gpus[self.local_rank]
            try:
                tf.config.set_visible_devices(gpu, "GPU")
                tf.config.experimental.set_memory_growth(gpu, True)
            except RuntimeError as e:
                raise UsageError(
                    f"runtime.distribution: horovod must pin one GPU per process before TensorFlow initialises its "
                    f"devices ({e}); build the backend first, before any model, tensor or device query"
                ) from e
        self.device = f"/gpu:{self.local_rank}" if gpus else "/cpu:0"

    # ---------------------------------------------------------------- who am I

    @property
    def num_replicas(self) -> int:
        return self.size

    @property
    def saves_checkpoints(self) -> bool:
        """Only rank 0 writes checkpoints (into `run_dir/checkpoints`, which every rank restores from)."""
        return self.is_chief

    # ---------------------------------------------------------------- the training step

    def scope(self):
        """Variables are ordinary per-process variables: a null context."""
        return contextlib.nullcontext()

    def distribute_dataset(self, dataset_fn):
        """This process's input pipeline: `dataset_fn` with input pipeline `rank` of `size`.

        Args:
            dataset_fn: `dataset_fn(tf.distribute.InputContext)` -> a dataset batched per replica.
        """
        context = tf.distribute.InputContext(
            num_input_pipelines=self.size, input_pipeline_id=self.rank, num_replicas_in_sync=self.size
        )
        return dataset_fn(context)

    def run(self, fn, args):
        return fn(*args)

    def loss_scale(self) -> float:
        """Each process's loss is its local mean; the processes' gradients are summed: 1/size gives the mean."""
        return 1.0 / self.size

    def prepare_optimizer(self, optimizer) -> None:
        """Nothing: outside a tf.distribute strategy Keras' `apply()` reduces nothing itself."""

    def reduce_gradients(self, grads):
        """The gradients summed over processes (Horovod all-reduce, op Sum), dtypes kept, None entries kept."""
        if self.size == 1:
            return list(grads)
        return self._all_reduce(grads, self.hvd.Sum, "gradients")

    def run_if(self, condition, fn) -> None:
        """Runs `fn()` iff `condition` (the same on every process, e.g. computed from reduced gradients)."""
        tf.cond(condition, lambda: discard_result(fn()), lambda: None)

    def reduce_mean(self, per_replica):
        """The mean over processes of a per-process scalar (or tuple of scalars)."""
        if self.size == 1:
            return per_replica
        flat = tf.nest.flatten(per_replica)
        return tf.nest.pack_sequence_as(per_replica, self._all_reduce(flat, self.hvd.Average, "mean"))

    def _all_reduce(self, tensors, op, purpose: str):
        """One `hvd.grouped_allreduce` per dtype over `tensors` (None entries kept), in their order.

        Not one `hvd.allreduce` per tensor: in a tf.function, Grappler's common-subexpression
        elimination merges all-reduce ops whose inputs are identical expressions on one process but
        not on another; the processes then submit different collectives and hang or return wrong
        values (Horovod 0.28.1, TensorFlow 2.16: two scalars equal on one process only are merged
        there, which returns a wrong mean, while the other process fails). A grouped all-reduce
        is one op per dtype, which nothing can merge. Its name is short and the same on every process
        (Horovod matches the processes' requests by name; the default would join every tensor's name).
        """
        tensors = [None if t is None else tf.convert_to_tensor(t) for t in tensors]
        by_dtype = {}
        for i, t in enumerate(tensors):
            if t is not None:
                by_dtype.setdefault(t.dtype, []).append(i)
        out = list(tensors)
        for dtype, positions in by_dtype.items():
            reduced = self.hvd.grouped_allreduce(
                [tensors[i] for i in positions], op=op, name=f"tfmis_{purpose}_{dtype.name}"
            )
            for i, r in zip(positions, reduced):
                out[i] = r
        return out

    def sync_initial_state(self, model, optimizer) -> None:
        """Every process takes rank 0's model and optimizer variables (weights, moments, iterations)."""
        if self.size == 1:
            return
        variables = [v.value for v in list(model.variables) + list(optimizer.variables)]
        self.hvd.broadcast_variables(variables, root_rank=0)

    def sync_statistics(self, model) -> None:
        """The mean over processes of the BatchNorm moving statistics (each process keeps its own during an
        epoch: Horovod has no synchronised BatchNorm), so that validation and the saved model use one set."""
        if self.size == 1:
            return
        state = [v for v in model.non_trainable_variables if "float" in str(v.dtype)]
        if state:
            for variable, mean in zip(
                state, self._all_reduce([v.value for v in state], self.hvd.Average, "statistics")
            ):
                variable.assign(mean)

    # ---------------------------------------------------------------- host-side collectives

    def broadcast(self, values) -> np.ndarray:
        """Rank 0's `values` (float64), on every process."""
        array = np.asarray(values, np.float64)
        if self.size == 1:
            return array
        return self.hvd.broadcast(tf.constant(array), root_rank=0).numpy()

    def all_reduce_sum(self, values) -> np.ndarray:
        """`values` (float64) summed over processes, on every process (`Backend.barrier` is built on it)."""
        array = np.asarray(values, np.float64)
        if self.size == 1:
            return array
        return self.hvd.allreduce(tf.constant(array), op=self.hvd.Sum).numpy()
