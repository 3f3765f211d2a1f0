"""How the one training loop is spread over devices and processes: the only part that differs between backends.

The trainer asks a backend to: create variables in its scope, distribute the input, run the
per-replica step, scale the per-replica loss, reduce gradients (once per step, before clipping and
the non-finite check, so that both see the global gradient), apply an update only if a condition
holds on every replica, reduce metrics, and synchronise the initial state. Between steps, worker
processes agree through `barrier`, `broadcast` (rank 0's decision) and `all_reduce_sum` (e.g. the
validation cases each worker scored), so that no worker waits in a collective the others skipped.
After its last piece of work, every process of a successful run calls `finish()`, which leaves the
cluster in order (the chief last) so that the run ends without errors.

Backends are chosen by name (`runtime.distribution`) from a registry (`tfmis.engine.backend`: the `Backend`
interface and the lookup table, below both this module and `tfmis.engine.horovod`), and are built *before*
anything touches TensorFlow's devices: MultiWorkerMirroredStrategy must configure the runtime
first, and Horovod must pin one GPU per process first.

- `none`: the default strategy (one device).
- `mirrored`: MirroredStrategy over the local GPUs (or `runtime.devices`).
- `multiworker`: MultiWorkerMirroredStrategy; the cluster comes from TF_CONFIG, from SLURM
  (`SlurmClusterResolver`) or from an MPI launch (`tfmis.engine.cluster`).
- `horovod`: `tfmis.engine.horovod.HorovodBackend` (its own install: tools/install_horovod.sh).

Example:
```python
backend = make_backend(config.runtime, output_dir=config.output.dir)   # first, before any device is used
with backend.scope():
    model = build_unet(...)
```
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

from tfmis.engine.backend import (
    BACKENDS,
    Backend,
    HorovodUnavailable,
    discard_result,
    register_backend,
)
from tfmis.engine.cluster import (
    Launch,
    detect_launch,
    is_loopback,
    mpi_tf_config,
    rendezvous_folder,
    wait_until_closed,
)
from tfmis.errors import ConfigError
from tfmis.hardware import model_parallel_devices, nvidia_smi_available, physical_gpus


class StrategyBackend(Backend):
    """A tf.distribute strategy (the default strategy = one device; Mirrored; MultiWorkerMirrored).

    Args:
        strategy: any `tf.distribute.Strategy`; None = the default (single-device) strategy.
        name: the registry name it was made under.
    """

    def __init__(self, strategy: tf.distribute.Strategy | None = None, name: str = "none"):
        self.strategy = strategy or tf.distribute.get_strategy()
        self.name = name
        resolver = getattr(self.strategy, "cluster_resolver", None)
        spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
        chiefs, workers = len(spec.get("chief", [])), len(spec.get("worker", []))
        self.size = max(1, chiefs + workers)
        if resolver is None or resolver.task_type in (None, "chief"):
            self.rank = int(getattr(resolver, "task_id", 0) or 0) if resolver is not None else 0
        else:
            self.rank = chiefs + int(resolver.task_id)
        self._sum_fn = None

    @property
    def num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def saves_checkpoints(self) -> bool:
        return True  # MultiWorkerMirroredStrategy: every worker takes part in a save (non-chiefs into a temp dir)

    def checkpoint_dir(self, run_dir: str | Path) -> Path:
        if self.is_chief:
            return Path(run_dir) / "checkpoints"
        return Path(run_dir) / ".workers" / f"worker{self.rank}" / "checkpoints"

    def after_save(self, run_dir: str | Path) -> None:
        if not self.is_chief:
            shutil.rmtree(Path(run_dir) / ".workers" / f"worker{self.rank}", ignore_errors=True)
            with contextlib.suppress(OSError):  # the last worker out removes the parent
                (Path(run_dir) / ".workers").rmdir()

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
                "differently, and tfmis.engine.distribution.StrategyBackend.prepare_optimizer must be adapted"
            )
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
            tf.cond(condition, lambda: discard_result(fn()), lambda: None)
            return

        def cross_replica(strategy, condition):
            first = strategy.experimental_local_results(condition)[0]
            tf.cond(first, lambda: discard_result(strategy.extended.call_for_each_replica(fn)), lambda: None)

        tf.distribute.get_replica_context().merge_call(cross_replica, args=(condition,))

    def reduce_mean(self, per_replica) -> tf.Tensor:
        return self.strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica, axis=None)

    def sync_initial_state(self, model, optimizer) -> None:
        """Mirrored variables start identical by construction (MultiWorkerMirroredStrategy broadcasts the
        chief's initial values when it creates them), and restore reads the same checkpoint everywhere."""

    def all_reduce_sum(self, values) -> np.ndarray:
        values = np.asarray(values, np.float64)
        if self.size == 1:
            return values
        if self._sum_fn is None:
            strategy = self.strategy
            local_replicas = strategy.num_replicas_in_sync // self.size

            @tf.function
            def summed(x):
                # every local replica contributes x; the sum over all replicas is local_replicas × Σ_workers x
                per_replica = strategy.run(lambda: tf.identity(x))
                return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None) / local_replicas

            self._sum_fn = summed
        flat = values.reshape(-1)
        return self._sum_fn(tf.constant(flat)).numpy().reshape(values.shape)

    def peer_addresses(self) -> list[str]:
        """The other workers' `host:port` (their TensorFlow gRPC servers), from the cluster spec."""
        resolver = getattr(self.strategy, "cluster_resolver", None)
        if resolver is None:
            return []
        spec = resolver.cluster_spec().as_dict()
        own = (resolver.task_type, int(resolver.task_id or 0))
        peers = []
        for job in ("chief", "worker"):
            tasks = spec.get(job, [])
            items = tasks.items() if isinstance(tasks, dict) else enumerate(tasks)
            peers += [address for index, address in items if (job, int(index)) != own]
        return peers

    def finish(self, exit_status: int | None = None, timeout_s: float = 60.0, barrier_s: float = 3600.0) -> None:
        """Leaves a MultiWorkerMirroredStrategy cluster in order: every worker first, the chief last.

        TensorFlow's coordination service runs in the chief (task 0) and every worker's agent sends it heartbeats
        until the process ends. A worker still running when the chief's process ends logs `Failed to send RPC to
        coordination service ... Connection refused` and `BaseCollectiveExecutor::StartAbort UNAVAILABLE`; a
        chief still running some seconds after a worker ended logs `StartAbort UNAVAILABLE: ... The following
        tasks are unhealthy (stopped sending heartbeats)`. TensorFlow has no call that disconnects an agent or
        stops the gRPC server (`GrpcServer::Stop` is unimplemented), so the order is made here:

        1. every worker waits at a coordination-service barrier (the chief arrives after its last writes, e.g.
           the prediction preview); unlike a collective, nobody needs data from a worker that has passed it;
        2. the other workers then end, and the chief waits until their gRPC servers no longer accept
           connections (their processes are gone; at most `timeout_s`);
        3. with `exit_status`, each process ends right there (`os._exit` after flushing stdout and stderr):
           TensorFlow's teardown of a process holding a server takes seconds, long enough for the chief's
           service to report a gone worker as unhealthy, and a worker's teardown cannot be ordered at all.
           Without it (a script that continues), the caller must end the process soon.

        Args:
            exit_status: end the process with this status once its part is done (`tfmis.train` passes 0).
            timeout_s: how long the chief waits for the other workers' processes to end.
            barrier_s: how long a worker waits at the barrier for the others (a lost worker fails it sooner).
        """
        if self.size == 1:
            return
        from tensorflow.python.eager import context  # no public API for the coordination service's barrier

        context.context().wait_at_barrier("tfmis_finish", int(barrier_s * 1000))
        if self.is_chief:
            still_open = wait_until_closed(self.peer_addresses(), timeout_s)
            if still_open:
                print(
                    f"warning: worker(s) at {', '.join(still_open)} were still running {timeout_s:.0f} s after "
                    "training ended; the chief ends anyway (they may log a lost coordination service)",
                    file=sys.stderr,
                )
        if exit_status is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exit_status)

    def leave_after_failure(self, timeout_s: float = 120.0) -> None:
        """Arrives at `finish`'s barrier (waiting at most `timeout_s`), so that the workers that finished leave
        instead of waiting for this failed one; a barrier that fails (a lost peer) is ignored."""
        if self.size == 1:
            return
        from tensorflow.python.eager import context

        with contextlib.suppress(tf.errors.OpError):
            context.context().wait_at_barrier("tfmis_finish", int(timeout_s * 1000))


def _already_reduced(grads_and_vars):
    return list(grads_and_vars)


# ---------------------------------------------------------------- the backends registered (engine/backend.py)


def resolve_distribution(runtime, launch: Launch | None = None) -> str:
    """The backend name `runtime.distribution: auto` stands for in this process (devices are not initialised)."""
    if runtime.distribution != "auto":
        return runtime.distribution
    parallel = getattr(runtime, "model_parallel", None)
    if parallel is not None and parallel.enabled:
        return "none"  # one process runs the model over its devices
    launch = launch or detect_launch()
    if launch.kind == "horovod":
        return "horovod"
    if launch.size > 1:
        return "multiworker"
    gpus = physical_gpus()  # physical: does not initialise the runtime
    several = len(runtime.devices) > 1 if runtime.devices else len(gpus) > 1
    return "mirrored" if several else "none"


def make_backend(runtime="auto", devices=None, output_dir: str | Path | None = None) -> Backend:
    """The backend for `runtime.distribution`; call it before anything touches devices.

    Args:
        runtime: a `tfmis.config.RuntimeConfig`, or just the distribution name (`auto`, `none`,
            `mirrored`, `multiworker`, `horovod`).
        devices: with a name: the devices for `mirrored` (default: all local GPUs).
        output_dir: the run folder (default rendezvous folder of an MPI launch).
    """
    if isinstance(runtime, str):
        from tfmis.config import RuntimeConfig

        runtime = RuntimeConfig(distribution=runtime, devices=devices)
    name = resolve_distribution(runtime)
    parallel = getattr(runtime, "model_parallel", None)
    if parallel is not None and parallel.enabled:
        if name != "none":
            raise ConfigError(
                f"runtime.model_parallel.mode: {parallel.mode} runs one process over its devices and takes "
                f"runtime.distribution: none (got {name}); for data parallelism with it use "
                "runtime.model_parallel.data: groups of devices"
            )
        model_parallel_devices(parallel.devices * parallel.data)  # before anything touches the devices
    if name not in BACKENDS:
        raise ConfigError(
            f"runtime.distribution: unknown backend {name!r}; expected auto or one of {', '.join(sorted(BACKENDS))}"
        )
    return BACKENDS[name](runtime, output_dir)


@register_backend("none")
def _single_device(runtime, output_dir):
    return StrategyBackend(name="none")


@register_backend("mirrored")
def _mirrored(runtime, output_dir):
    return StrategyBackend(tf.distribute.MirroredStrategy(devices=runtime.devices), name="mirrored")


@register_backend("multiworker")
def _multiworker(runtime, output_dir):
    """MultiWorkerMirroredStrategy over the cluster the launch describes (TF_CONFIG, SLURM or MPI)."""
    launch = detect_launch()
    if launch.kind == "slurm":
        resolver = _slurm_resolver(runtime.port)
    else:
        if launch.kind == "mpi":
            rendezvous = Path(runtime.rendezvous_dir or Path(output_dir or ".") / ".rendezvous")
            os.environ["TF_CONFIG"] = json.dumps(
                mpi_tf_config(launch, rendezvous, runtime.port, runtime.rendezvous_timeout_seconds)
            )
            _pin_local_gpu(launch.local_rank)
        elif launch.kind != "tf_config":
            raise ConfigError(
                "runtime.distribution: multiworker needs a cluster: set TF_CONFIG, or start the workers with "
                "python -m tfmis.launch --nproc N -- python -m tfmis.train ..., srun (SLURM) or mpirun"
            )
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    implementation = {
        "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
        "ring": tf.distribute.experimental.CommunicationImplementation.RING,
        "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
    }[runtime.communication]
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=resolver,
        communication_options=tf.distribute.experimental.CommunicationOptions(implementation=implementation),
    )
    backend = StrategyBackend(strategy, name="multiworker")
    if backend.is_chief:
        warn_exposure(resolver.cluster_spec().as_dict())
    if launch.kind == "mpi":
        backend.barrier("rendezvous")  # every rank has read the addresses: the chief may remove them
        if backend.is_chief:
            shutil.rmtree(rendezvous_folder(launch, rendezvous), ignore_errors=True)
            with contextlib.suppress(OSError):
                rendezvous.rmdir()
    return backend


@register_backend("horovod")
def _horovod(runtime, output_dir):
    try:
        from tfmis.engine.horovod import HorovodBackend
    except ImportError as e:
        raise HorovodUnavailable(
            f"runtime.distribution: horovod needs Horovod, which this environment lacks ({e}). "
            "Horovod 0.28.1 builds only against TensorFlow <= 2.16: make its environment with "
            "tools/install_horovod.sh, then run there"
        ) from e
    return HorovodBackend(runtime)


EXPOSURE = (
    "every worker runs TensorFlow's gRPC server, which listens on ALL network interfaces of its machine "
    "(TensorFlow binds 0.0.0.0 whatever host the cluster names; it has no option for one address) and "
    "accepts any client without authentication"
)


def warn_exposure(spec: dict) -> None:
    """Once, on the chief: a cluster whose addresses are not all loopback spans a network, so say what listens.
    (All-loopback clusters are single-host: `tfmis.launch` says what it exposes when it starts them.)"""
    addresses = [a for job in spec.values() for a in (job.values() if isinstance(job, dict) else job)]
    if all(is_loopback(a) for a in addresses):
        return
    print(
        f"warning: multiworker: {EXPOSURE}: {', '.join(addresses)}. Run the workers on a private cluster "
        "network or behind a firewall that admits only the other workers (docs/scale-out.md#network-exposure)",
        file=sys.stderr,
    )


def _slurm_resolver(port_base: int):
    """SlurmClusterResolver; on nodes without GPUs it is told one pseudo-GPU per task, because it places
    tasks by GPU slots and would otherwise find no room for any task (its GPU count comes from nvidia-smi)."""
    from tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver import expand_tasks_per_node

    if nvidia_smi_available():
        return tf.distribute.cluster_resolver.SlurmClusterResolver(port_base=port_base)
    tasks_per_node = max(
        expand_tasks_per_node(os.environ.get("SLURM_STEP_TASKS_PER_NODE", os.environ.get("SLURM_TASKS_PER_NODE", "1")))
    )
    return tf.distribute.cluster_resolver.SlurmClusterResolver(
        port_base=port_base, gpus_per_node=tasks_per_node, gpus_per_task=1
    )


def _pin_local_gpu(local_rank: int) -> None:
    """One GPU per process when several ranks share a node (before the runtime initialises)."""
    gpus = physical_gpus()
    if len(gpus) > 1:
        tf.config.set_visible_devices(gpus[local_rank % len(gpus)], "GPU")
