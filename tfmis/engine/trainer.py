"""The one training loop: a `tf.function` step with `GradientTape`, run by a distribution backend.

Per optimizer step, each replica splits its batch into `accumulation_steps` micro-batches, sums
their gradients (scaled loss under mixed_float16), asks the backend to reduce them and applies them
once (clipped as `optimizer.clipnorm` says), or skips the step on every replica if the reduced
gradient holds NaN/Inf (counted as `skipped_steps` per epoch). Between epochs: sliding-window
validation on whole volumes, atomic checkpoints, the best model by mean Dice,
history/TensorBoard/plots. Time spent waiting for input is measured apart from
compute time, because "is the accelerator starving?" is the first question about a slow run.

The steps run `training.steps_per_loop` at a time in one `tf.function` with an inner loop over the
distributed iterator (as tensorflow/models' orbit does): the host reads the losses once per loop, not
once per step, so that on an accelerator it can queue the next steps while the device works.

Example:
```python
trainer = Trainer(load_config("configs/demo.yaml"))
summary = trainer.fit(resume=False)
```
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from tfmis.config import save_config
from tfmis.data.pipeline import step_augmentation, train_steps_per_epoch
from tfmis.data.records import RUN_DATA_FILE, training_data_info
from tfmis.engine.budget import TimeBudget, describe
from tfmis.engine.callbacks import CallbackList, default_callbacks
from tfmis.engine.distribution import Backend, make_backend
from tfmis.engine.history import History
from tfmis.errors import ConfigError, RunStateError, TrainingFailed
from tfmis.hardware import accelerator_device, model_parallel_devices
from tfmis.inference.placement import VolumePlacement
from tfmis.inference.sliding_window import sliding_window_inference
from tfmis.networks.weights import has_weights_by_path, weights_by_path
from tfmis.task import SegmentationTask
from tfmis.utils.io import atomic_path, atomic_write_json
from tfmis.utils.lock import FolderLocked, folder_lock
from tfmis.utils.run_files import BEST_WEIGHTS, FINAL_WEIGHTS

# an epoch's outputs before its checkpoint commits them (see Trainer._commit_epoch)
STAGED_EPOCH = "epoch.staged.json"
STAGED_BEST = "best.staged.weights.h5"
# A step whose gradient holds NaN/Inf is skipped. In float32/bfloat16 that is an outlier batch; this many in a
# row means the loss or the model is broken (under mixed_float16 the loss scaler would have lowered its scale
# 2^20-fold by then, far past any float16 overflow), and so does an epoch in which every step was skipped.
MAX_CONSECUTIVE_SKIPPED_STEPS = 20


class TrainingDiverged(TrainingFailed):
    """The loss, the gradients or the weights became NaN or infinite for good."""


class RunExists(RunStateError):
    """The output folder already holds checkpoints and --resume was not given."""


class Trainer:
    """Trains the parts a `SegmentationTask` builds, with one distribution backend.

    Args:
        config: a `tfmis.config.Config`.
        backend: a distribution backend (default: from `runtime`; build it before anything touches devices).
        train_dataset_fn: `fn(config, input_context, seed_offset)` building the training stream of one input
            pipeline, as `tfmis.data.pipeline.build_train_dataset` (the default) does; e.g. another input
            pipeline to compare with (`tfmis.benchmark`). Ignored when `task` is given.
        callbacks: `tfmis.engine.callbacks.Callback`s called after the default ones (progress, epoch log,
            TensorBoard, curves) at each event of `fit`.
        task: the `tfmis.task.SegmentationTask` that builds model, loss, optimizer, inputs and metrics
            (default: one for `config`).

    The public steps: `train_step(batch)` (one optimizer step on a global batch), `train_loop(iterator)` (one
    call of the compiled loop of `steps_per_loop` steps that `fit` runs), `predict_windows(windows)` (the model's
    logits for a batch of sliding windows), `evaluate(dataset)` (sliding-window validation on whole volumes) and
    `fit(resume)` (the loop).
    """

    def __init__(self, config, backend: Backend | None = None, train_dataset_fn=None, callbacks=(), task=None):
        self.config = config
        self.callbacks = list(callbacks)
        tc = config.training
        self.backend = backend or make_backend(config.runtime, output_dir=config.output.dir)  # before any device use
        self.task = task or SegmentationTask(config, train_dataset_fn=train_dataset_fn)
        self.out = Path(config.output.dir)
        self.data_info = training_data_info(self.task.data_info, config.data.dataset_dir)
        self.class_names, self.in_channels = self.task.class_names, self.task.in_channels
        self.spacing_by_case = {cid: c["geometry"]["spacing"] for cid, c in self.task.data_info["cases"].items()}
        keras.utils.set_random_seed(tc.seed)
        self.precision = self.task.set_precision_policy()  # auto: this machine's best
        self.steps_per_epoch = train_steps_per_epoch(config, self.backend.num_replicas)
        self.task.check_sizes()
        self.task.build_metrics()  # validation.regions' labels against the dataset's classes, before training
        self.global_batch = config.pipeline.num_images_per_batch * self.backend.num_replicas * tc.accumulation_steps
        self.learning_rate = self.task.learning_rates(self.global_batch)[0]
        mp = config.runtime.model_parallel
        if mp.enabled and tc.jit_compile:
            raise ConfigError(
                "training.jit_compile: true does not work with runtime.model_parallel (XLA compiles for one device); "
                "set training.jit_compile=false"
            )
        if mp.enabled and config.pipeline.num_images_per_batch % (
            mp.data * (mp.micro_batches if mp.mode == "pipeline" else 1)
        ):
            raise ConfigError(
                f"pipeline.num_images_per_batch={config.pipeline.num_images_per_batch} must be a multiple of "
                f"runtime.model_parallel.data ({mp.data}) x micro_batches ({mp.micro_batches}, pipeline mode): the "
                "step's images are split over the data groups and then into micro-batches"
            )
        if tc.jit_compile and self.backend.name == "horovod":
            raise ConfigError(
                "training.jit_compile: true does not work with runtime.distribution: horovod (Horovod's "
                "all-reduce inside the step has no XLA kernel); set training.jit_compile=false"
            )
        with self.backend.scope():
            self.model, self.training_model = self.task.build_training_model()
            # one model over several devices: the same variables, placed computation (None when off)
            self.parallel = self.parallel_inference = None
            if mp.enabled:
                devices = model_parallel_devices(mp.devices * mp.data)
                self.parallel = self.task.build_model_parallel(self.training_model, devices)
                self.parallel_inference = self.task.build_model_parallel(
                    self.model, devices[: mp.devices], training=False
                )
            # the schedule's length in a variable: a time budget sets it once it has measured the epochs
            self.schedule_length = self.task.build_schedule_length(self.steps_per_epoch)
            self.optimizer = self.task.build_optimizer(self.global_batch, self.steps_per_epoch, self.schedule_length)
            self.optimizer.build(self.training_model.trainable_variables)
            self.backend.prepare_optimizer(self.optimizer)  # the step reduces gradients before apply() clips them
            self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
            self.best_dice = tf.Variable(-1.0, dtype=tf.float64, trainable=False, name="best_dice")
            self.best_epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="best_epoch")
            self.elapsed = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="elapsed_seconds")
            # the epoch count training.max_minutes decided (0: none yet, or no budget): a resume keeps it
            self.budget_epochs = tf.Variable(0, dtype=tf.int64, trainable=False, name="budget_epochs")
        self.time_budget: TimeBudget | None = None  # fit()'s, with training.max_minutes
        self.loss_fn = self.task.build_loss()
        self._state = dict(
            model=self.training_model,
            optimizer=self.optimizer,
            epoch=self.epoch,
            best_dice=self.best_dice,
            best_epoch=self.best_epoch,
            elapsed=self.elapsed,
        )
        # saved since the time budget sets the schedule's length: a checkpoint of an older tfmis has neither
        self._schedule_state = dict(schedule_steps=self.schedule_length.variable, budget_epochs=self.budget_epochs)
        # the weights also under their names: another build of the model (prediction's) reads them by name
        self.checkpoint = tf.train.Checkpoint(
            **self._state, **self._schedule_state, weights_by_path=weights_by_path(self.training_model)
        )
        # MultiWorkerMirroredStrategy: every worker saves, non-chiefs into a temporary folder they then drop
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, str(self.backend.checkpoint_dir(self.out)), max_to_keep=tc.keep_checkpoints
        )
        self._compile()
        # one policy for the whole run: the volume sizes it learns not to fit stay learned across epochs
        self.placement = VolumePlacement.for_validation(config.validation)

    def _compile(self) -> None:
        """The compiled functions: the replica step (XLA with `training.jit_compile`), one global step, the loop
        of `training.steps_per_loop` steps, and the windows' forward pass."""
        self._step_augment = None
        if self.config.pipeline.augment.placement == "step":
            # the dataset yields un-augmented crops and their seeds; the replica step augments them on its device
            self._step_augment = step_augmentation(self.config.pipeline)
        step = (
            tf.function(self._replica_step, jit_compile=True)
            if self.config.training.jit_compile
            else self._replica_step
        )
        self._step = step
        self._global_step = tf.function(lambda batch: self.backend.reduce_mean(self.backend.run(step, batch)))

        def train_loop(iterator, num_steps: int):  # a function of its own per trainer, traced once per loop length
            return self._steps_loop(iterator, num_steps)

        # no AutoGraph: the step is plain TensorFlow (explicit tf.cond / tf.while_loop), and converting it was a
        # large share of the first epoch's tracing (docs/benchmarks.md, "First epoch, precision and other costs")
        self._train_loop = tf.function(train_loop, autograph=False)
        forward = self.parallel_inference or self.model
        self._forward = tf.function(lambda x: forward(x, training=False), reduce_retracing=True, autograph=False)

    def train_step(self, batch):
        """One optimizer step on a global batch `(images, labels)` (or `(images, labels, seeds)` with
        `pipeline.augment.placement: step`); returns (mean loss, 1.0 if the step was skipped for a
        non-finite gradient, else 0.0), as tensors."""
        return self._global_step(batch)

    @property
    def steps_per_loop(self) -> int:
        """The optimizer steps of one `train_loop` call in `fit`: `training.steps_per_loop`, at most an epoch's
        steps (an epoch's last loop is shorter when its steps do not divide evenly)."""
        return max(1, min(self.config.training.steps_per_loop, self.steps_per_epoch))

    def train_loop(self, iterator, num_steps: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`num_steps` (default `steps_per_loop`) optimizer steps in one call of the compiled loop `fit` runs, each
        on the next batch of `iterator`; returns once they have run.

        Args:
            iterator: over `self.backend.distribute_dataset(dataset_fn)` of per-replica batches `(images,
                labels)` (or `(images, labels, seeds)` with `pipeline.augment.placement: step`), as `fit`'s. The
                loop is traced once per loop length and batch shapes and dtypes: batches with the shapes and
                dtypes of the training stream's run the graph `fit` runs.
            num_steps: the loop's length.

        Returns:
            (losses, skipped, waits), numpy arrays with one entry per step: the mean loss (float32), 1.0 if the
            step was skipped for a non-finite gradient (float32), the seconds it waited for its batch (float64).
        """
        results = self._train_loop(iterator, self.steps_per_loop if num_steps is None else num_steps)
        return tuple(v.numpy() for v in results)  # one host round-trip per loop

    def predict_windows(self, windows):
        """The model's logits for a batch of windows (B, x, y, z, C): the predictor `sliding_window_inference`
        calls during validation."""
        return self._forward(windows)

    # ------------------------------------------------------------------ the step

    def _replica_step(self, images, labels, seeds=None):
        """One optimizer step on this replica's batch; returns (mean loss, 1.0 if the step was skipped).

        With `pipeline.augment.placement: step` the batch holds un-augmented crops and their per-crop
        seeds (B, 2), and the random augmentation runs first, here, on the replica's device (under the
        `augment` name scope), as the pipeline would have run it on the CPU.

        The gradient summed over micro-batches and replicas is what `optimizer.apply` clips
        (`optimizer.clipnorm`) and what decides, identically on every replica, whether the step is
        taken: a non-finite gradient in any precision skips it, leaving weights, optimizer state and
        the BatchNorm moving statistics of its forward passes as they were (under mixed_float16 the
        loss scaler skips it and lowers its scale). BatchNorm moving statistics take one update per
        micro-batch forward pass (as in PyTorch gradient accumulation), from that micro-batch's
        statistics over all replicas (synchronised BatchNorm, see `make_normalization`).
        """
        # a stream that does not state its channel count (one pulled inside the loop is traced from its element
        # spec) would trace the convolutions with an unknown input depth, which run several times slower on a CPU
        # (docs/benchmarks.md, "First epoch, precision and other costs")
        images = tf.ensure_shape(images, [None] * (len(images.shape) - 1) + [self.in_channels])
        if self._step_augment is not None:
            if seeds is None:
                raise ValueError(
                    "pipeline.augment.placement is step but the training batches hold no crop seeds: "
                    "the training dataset must yield (images, labels, seeds), as "
                    "tfmis.data.pipeline.build_train_dataset does with that placement"
                )
            with tf.name_scope("augment"):
                images, labels = self._step_augment(images, labels, seeds)
        n = self.config.training.accumulation_steps
        variables = self.training_model.trainable_variables
        loss_scaler = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        # float state the forward passes update (BatchNorm moving statistics), restored if the step is skipped
        state = [v for v in self.training_model.non_trainable_variables if "float" in str(v.dtype)]
        saved = [tf.identity(v.value) for v in state]
        scaled_loss_factor = self.backend.loss_scale() / n
        total_loss = tf.constant(0.0)
        grads = None
        for x, y in zip(tf.split(images, n), tf.split(labels, n)):
            # the name scopes prefix the ops' names, so a profiler trace shows the phases of the step
            with tf.GradientTape() as tape, tf.name_scope("forward"):
                if self.parallel is not None:  # the model over its devices; the loss on the whole patch
                    loss = self.parallel.loss(self.loss_fn, y, x, training=True)
                else:
                    loss = self.loss_fn(y, self.training_model(x, training=True))
                scaled = loss * scaled_loss_factor
                if loss_scaler:
                    scaled = self.optimizer.scale_loss(scaled)
            with tf.name_scope("backward"):
                if self.parallel is not None:  # each backward op on its forward op's device, not all on the first
                    g = self.parallel.gradients(scaled, variables)
                else:
                    g = tape.gradient(scaled, variables)
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
            total_loss += tf.cast(loss, tf.float32)
        with tf.name_scope("gradient_reduce"):
            grads = self.backend.reduce_gradients(grads)  # the global gradient, the same on every replica
        with tf.name_scope("optimizer_step"):
            finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads if g is not None])
            if loss_scaler:  # skips a non-finite step itself, lowering the scale (its check sees the same grads)
                self.optimizer.apply(grads, variables)
            else:
                self.backend.run_if(finite, lambda: self.optimizer.apply(grads, variables))
        for variable, value in zip(state, saved):
            variable.assign(tf.where(finite, variable, value))
        return total_loss / n, 1.0 - tf.cast(finite, tf.float32)

    def _steps_loop(self, iterator, num_steps: int):
        """`num_steps` optimizer steps in one call, whose results the host reads once per loop instead of once
        per step, so that it can queue the steps while the device works.

        As tensorflow/models' orbit does, each step of a `tf.while_loop` takes its batch from the distributed
        `iterator` inside the function (`next`, under the `data_wait` name scope) and runs the replica step
        through the backend. The time each step waits for its batch is measured in the graph: `tf.timestamp()`
        at the start of the iteration (after the previous step's ops: the loop's next iteration starts once
        they have run) and once the batch is there. The loop has no data-dependent exit (it would make the host
        wait for every step's loss): a non-finite loss is found by the host when the loop returns.

        Returns:
            (losses, skipped, waits): one entry per step: float32 mean loss, float32 1.0 if the step was
            skipped (non-finite gradient), float64 seconds waited for the step's batch.
        """

        def one_step():
            start = tf.timestamp()
            with tf.name_scope("data_wait"):
                batch = next(iterator)
            with tf.control_dependencies(tf.nest.flatten(batch, expand_composites=True)):
                ready = tf.timestamp()
            with tf.name_scope("train_step"):
                result = self.backend.reduce_mean(self.backend.run(self._step, batch))
            # (loss, skipped) as a pair, or as one tensor (MultiWorkerMirroredStrategy's reduce in a function)
            return tf.cast(result[0], tf.float32), tf.cast(result[1], tf.float32), ready - start

        if num_steps == 1:  # no loop: the graph of training.steps_per_loop: 1 is the step's
            return tuple(v[None] for v in one_step())
        arrays = [tf.TensorArray(dtype, size=num_steps) for dtype in (tf.float32, tf.float32, tf.float64)]

        def body(i, *arrays):
            return (i + 1, *(array.write(i, value) for array, value in zip(arrays, one_step())))

        _, *arrays = tf.while_loop(lambda i, *_: i < num_steps, body, (tf.constant(0), *arrays))
        return tuple(array.stack() for array in arrays)

    # ------------------------------------------------------------------ validation

    def evaluate(self, dataset) -> dict:
        """Sliding-window inference on each whole validation volume; per-class Dice (and HD95, NSD), and the same
        of the regions in `validation.regions` (`SegmentationMetrics.result()`). Scored on the preprocessed grid
        with the preprocessed spacing: HD95 and NSD here are "on the preprocessed grid", `tfmis-predict`'s on the
        scan's original grid (the same when preprocessing does not resample; docs/training.md).

        The result also holds `fallbacks`: how many cases were not aggregated on the first-choice
        placement of `validation.validation_data_device` (see `tfmis.inference.placement`).
        """
        metrics = self.task.build_metrics()
        fallbacks = 0
        positions = []
        rank, size = self.backend.rank, self.backend.size
        if size > 1:  # several workers: each scores every size-th case
            dataset = dataset.shard(size, rank)
        for i, (image, label, meta) in enumerate(dataset):
            case_id = meta["case_id"].numpy().decode()
            prediction, placement = self._segment_volume(image, case_id)
            fallbacks += placement.is_fallback
            metrics.update(prediction, label[0].numpy(), spacing=self.spacing_by_case.get(case_id), case_id=case_id)
            positions.append(rank + i * size)
        if size > 1:  # one table of all cases on every worker, so that all take the same decisions
            total = int(self.backend.all_reduce_sum([len(positions)])[0])
            table = np.zeros((total, metrics.table_width))
            table[positions] = metrics.case_table()
            summed = self.backend.all_reduce_sum(np.append(table.reshape(-1), fallbacks))
            metrics.reset()
            metrics.add_case_table(summed[:-1].reshape(table.shape))
            fallbacks = int(summed[-1])
        return {**metrics.result(), "fallbacks": fallbacks}

    def _segment_volume(self, image, case_id: str):
        """(label map (X, Y, Z), Placement) of one whole volume (1, X, Y, Z, C), placed by `self.placement`;
        an out-of-memory fallback is logged once, when it happens."""
        v = self.config.validation
        roi = tuple(v.roi_size or self.config.pipeline.patch_size)

        def segment(device: str, sw_batch_size: int):
            logits = sliding_window_inference(
                image,
                roi,
                sw_batch_size,
                self.predict_windows,
                overlap=v.overlap,
                mode=v.mode,
                sw_device=accelerator_device(),
                device=device,
            )
            with tf.device(device):  # the label map where the logits are; numpy() finishes the attempt
                return self.task.label_map(logits)[0].numpy()

        logged = len(self.placement.events)
        prediction, placement = self.placement.run(segment, int(np.prod(image.shape[1:4])), case_id)
        for event in self.placement.events[logged:]:
            print(f"validation: {event}", file=sys.stderr)
        return prediction, placement

    # ------------------------------------------------------------------ the loop

    def restore(self, resume: bool = True) -> int:
        """Restores the last committed epoch and returns how many epochs are done (0 for a new run).

        Model, optimizer (iterations, moments, loss scale), epoch, best Dice and elapsed time come
        from the latest checkpoint; an epoch whose checkpoint was written but whose history record or
        best weights were not (a kill in between) is completed, and the staged outputs of an epoch
        whose checkpoint was never written are dropped (see `_commit_epoch`).

        Raises:
            RunExists: the run folder holds checkpoints and `resume` is False.
        """
        # every worker restores the chief's checkpoints (output.dir on a file system all workers share)
        latest = tf.train.latest_checkpoint(str(self.out / "checkpoints"))
        if self.backend.size > 1:  # all workers must take the same branch below, or one waits forever
            mine = _checkpoint_number(latest)
            chief = int(self.backend.broadcast([mine])[0])
            if mine != chief:
                raise RunStateError(
                    f"worker {self.backend.rank} sees checkpoint {mine} in {self.out / 'checkpoints'} but the chief "
                    f"sees {chief} (-1 = none): output.dir must be on a file system every worker shares"
                )
        if latest and not resume:
            raise RunExists(
                f"{self.out} already holds a training run (last checkpoint {Path(latest).name}); "
                "rerun with --resume to continue it, or set another output.dir "
                "(e.g. --set output.dir=runs/new)"
            )
        if resume and latest:
            # a checkpoint of an older tfmis has no named weights, nor the schedule's length: restored without them
            saved = {name.split("/", 1)[0] for name, _ in tf.train.list_variables(latest)}
            schedule_state = {k: v for k, v in self._schedule_state.items() if k in saved}
            checkpoint = (
                tf.train.Checkpoint(**self._state, **schedule_state, weights_by_path=self.checkpoint.weights_by_path)
                if has_weights_by_path(latest)
                else tf.train.Checkpoint(**self._state, **schedule_state)
            )
            checkpoint.restore(latest).assert_existing_objects_matched()
            if self.backend.is_chief:
                print(
                    f"Resuming from {latest}: epoch {int(self.epoch.numpy())} done, best mean Dice "
                    f"{float(self.best_dice.numpy()):.4f} at epoch {int(self.best_epoch.numpy())}",
                    file=sys.stderr,
                )
        elif resume and self.backend.is_chief:
            print(f"--resume: no checkpoint in {self.out / 'checkpoints'}, starting from scratch", file=sys.stderr)
        self._restore_schedule_length()
        self.backend.sync_initial_state(self.training_model, self.optimizer)
        done = int(self.epoch.numpy())
        if self.backend.is_chief:
            self.out.mkdir(parents=True, exist_ok=True)
            history = History(self.out, self.config.training.dice_thresholds)
            staged = self.out / STAGED_EPOCH
            if staged.is_file():
                record = json.loads(staged.read_text())
                if record["epoch"] == done:  # committed, not yet published
                    self._publish_epoch(record, history)
            self._discard_staged()
            history.truncate(done)
            save_config(self.config, self.out / "config.yaml")
            # the run folder alone is enough to predict: preprocessing, channels, classes, splits
            atomic_write_json(self.out / RUN_DATA_FILE, self.data_info)
        return done

    def _restore_schedule_length(self) -> None:
        """The schedule's length after `restore`: the epochs a time budget decided before the resume (at most
        `training.epochs`), so that the run continues the same schedule; without a decision, or without a
        budget now, `training.epochs` of this config (a resume may lengthen or shorten a run)."""
        tc = self.config.training
        decided = int(self.budget_epochs.numpy())
        if tc.max_minutes is None or decided <= 0:
            self.budget_epochs.assign(0)
            self.schedule_length.assign(tc.epochs * self.steps_per_epoch)
        else:
            self._set_schedule_epochs(min(decided, tc.epochs))

    def _set_schedule_epochs(self, epochs: int) -> None:
        """The learning-rate schedule ends after `epochs` epochs (the next steps use it); saved with the next
        checkpoint as the time budget's decision."""
        self.budget_epochs.assign(epochs)
        self.schedule_length.assign(epochs * self.steps_per_epoch)

    @property
    def schedule_epochs(self) -> int:
        """The epoch at which the learning-rate schedule ends (warm-up included)."""
        return self.schedule_length.total_steps // self.steps_per_epoch

    # ------------------------------------------------------------------ one commit point per epoch

    def _commit_epoch(self, record: dict, improved: bool, history: History) -> None:
        """Writes an epoch's outputs so that a kill at any moment leaves them consistent.

        1. stage: the best weights (if improved) and the history record, under temporary names;
        2. commit: the checkpoint (TensorFlow writes its `checkpoint` index file atomically, last);
        3. publish: append the record, rename the staged best weights, drop the staged files.
        `restore` completes step 3 for a committed epoch and drops what step 1 left otherwise.
        """
        if not self.backend.is_chief:
            if self.backend.saves_checkpoints:  # MultiWorkerMirroredStrategy: the save may synchronise workers
                self.manager.save(checkpoint_number=record["epoch"])
                self.backend.after_save(self.out)
            return
        self._discard_staged()
        if improved:  # fit() checked the weights are finite right after the epoch's steps
            staged = self.out / STAGED_BEST
            _check_free_space(staged, _weights_file_bytes(self.model))
            with atomic_path(staged, suffix=".weights.h5") as tmp:  # Keras picks the format from the suffix
                self.model.save_weights(str(tmp))
        atomic_write_json(self.out / STAGED_EPOCH, record)
        self.manager.save(checkpoint_number=record["epoch"])
        self._publish_epoch(record, history)

    def _publish_epoch(self, record: dict, history: History) -> None:
        """Step 3 of `_commit_epoch`; safe to repeat after a kill half-way through it."""
        history.truncate(record["epoch"] - 1)
        history.append(record)
        if (self.out / STAGED_BEST).is_file():
            os.replace(self.out / STAGED_BEST, self.out / BEST_WEIGHTS)
        (self.out / STAGED_EPOCH).unlink(missing_ok=True)

    def _discard_staged(self) -> None:
        for name in (STAGED_EPOCH, STAGED_BEST):
            (self.out / name).unlink(missing_ok=True)

    def fit(self, resume: bool = False) -> dict:
        """Trains for `training.epochs` (or until `target_dice` or `max_minutes`); returns the run summary,
        whose `stop_reason` says which: `epochs`, `target_dice` or `max_minutes`.

        With `training.max_minutes` the schedule's length is fitted to the budget from the epoch time measured
        here (`tfmis.engine.budget`; `training.epochs` is then an upper bound): the run ends after the epochs
        that fit (`stop_reason` `epochs`, the learning-rate schedule complete), or, if the clock runs out first
        anyway, after the epoch that crosses the budget (`max_minutes`). `summary["time_budget"]` records the
        decision.

        The loop runs the steps, validates, commits each epoch and applies the stopping rules; the
        progress display, logs, TensorBoard, plots and monitors are callbacks (`tfmis.engine.callbacks`).

        The chief holds the run folder's lock (`run_folder_lock`) throughout.

        Raises:
            FolderLocked: another live process holds the run folder (on every worker of a multi-worker run).
        """
        with run_folder_lock(self.backend, self.out):  # taking it removes the temporaries of dead writers
            return self._fit(resume)

    def _fit(self, resume: bool) -> dict:
        cfg, tc = self.config, self.config.training
        done = self.restore(resume)
        self.history = History(self.out, tc.dice_thresholds)
        callbacks = CallbackList(default_callbacks(self) + self.callbacks)
        seed_offset = done  # a resumed run draws new crops, not epoch 1's again
        iterator = iter(self.backend.distribute_dataset(lambda ctx: self.task.build_train_dataset(ctx, seed_offset)))
        val_dataset = self.task.build_val_dataset()
        run_start = time.perf_counter() - float(self.elapsed.numpy())
        self._skip_streak = []  # (epoch, step) of the consecutive skipped steps up to now
        stop_reason = "epochs"
        budget = self.time_budget = (
            TimeBudget(tc.max_minutes, tc.epochs, cfg.validation.val_interval, int(self.budget_epochs.numpy()) or None)
            if tc.max_minutes is not None
            else None
        )
        if budget is not None and budget.resumed and self.backend.is_chief:
            print(budget.reason, file=sys.stderr)
        callbacks.on_train_begin(self, done + 1)
        epoch = done
        cycle_start = time.perf_counter()  # the budget's epoch time: from one epoch's validation end to the next's
        while epoch < self._last_epoch():
            epoch += 1
            epoch_start = time.perf_counter()
            callbacks.on_epoch_begin(self, epoch)
            record = self._train_epoch(epoch, iterator, callbacks)
            out_of_time = tc.max_minutes is not None and time.perf_counter() - run_start >= 60 * tc.max_minutes
            if self.backend.size > 1:  # rank 0's clock decides for all
                out_of_time = bool(self.backend.broadcast([out_of_time])[0])
            # the same on every worker: the budget's validation at its decision depends on epoch counts only
            validated = (
                epoch % cfg.validation.val_interval == 0
                or epoch == self._last_epoch()
                or out_of_time
                or (budget is not None and budget.wants_validation(epoch))
            )
            improved = False
            if validated:
                result = self._validate_epoch(record, val_dataset)
                callbacks.on_validation_end(self, epoch, result)
                improved = math.isfinite(result["mean_dice"]) and result["mean_dice"] > float(self.best_dice.numpy())
                if self.backend.size > 1:  # rank 0's decision, whatever rounding another worker's sum saw
                    improved = bool(self.backend.broadcast([improved])[0])
                if improved:
                    self.best_dice.assign(result["mean_dice"])
                    self.best_epoch.assign(epoch)
            if budget is not None:
                now = time.perf_counter()
                val_seconds = record.get("val_seconds") if validated else None
                budget.add_epoch(epoch, now - cycle_start - (val_seconds or 0.0), val_seconds)
                cycle_start = now
                self._update_budget(budget, epoch, now - run_start, out_of_time, record)
            record["epoch_seconds"] = time.perf_counter() - epoch_start
            record["elapsed_seconds"] = time.perf_counter() - run_start
            self.epoch.assign(epoch)
            self.elapsed.assign(record["elapsed_seconds"])
            self._commit_epoch(record, improved, self.history)
            callbacks.on_epoch_end(self, epoch, record)
            reached = validated and tc.target_dice is not None and record["val_mean_dice"] >= tc.target_dice
            if self.backend.size > 1:
                reached = bool(self.backend.broadcast([reached])[0])
            if reached or (out_of_time and epoch < self._last_epoch()):
                stop_reason = "target_dice" if reached else "max_minutes"
                if self.backend.is_chief:
                    cut = (
                        f"; the learning-rate schedule was cut before its end (epoch {self._last_epoch()})"
                        if epoch < self.schedule_epochs
                        else ""
                    )
                    print(
                        f"target Dice {tc.target_dice} reached at epoch {epoch}: stopping"
                        if reached
                        else f"time budget training.max_minutes={tc.max_minutes:g} used up after epoch {epoch} "
                        f"({record['elapsed_seconds'] / 60:.1f} min): stopping{cut}",
                        file=sys.stderr,
                    )
                break
        self._save_final_weights()
        summary = self._summary(self.history, stop_reason)
        callbacks.on_train_end(self, summary)
        return summary

    def _last_epoch(self) -> int:
        """The loop's last epoch: the time budget's decision, else `training.epochs`."""
        budget = self.time_budget
        return budget.epochs if budget is not None and budget.epochs is not None else self.config.training.epochs

    def _update_budget(self, budget: TimeBudget, epoch: int, elapsed: float, out_of_time: bool, record: dict):
        """After epoch `epoch`'s validation: the budget decides or shortens the schedule (the chief's measurement
        decides for every worker), the schedule's length follows, and the epoch's record notes it."""
        changed = budget.update(epoch, elapsed) if not out_of_time else None
        if self.backend.size > 1:  # rank 0's measurement decides for all
            epochs = int(self.backend.broadcast([budget.epochs or 0])[0])
            changed = epochs if epochs and epochs != int(self.budget_epochs.numpy()) else None
            budget.epochs = epochs or None
        if changed is not None:
            self._set_schedule_epochs(changed)
            if self.backend.is_chief:
                print(budget.reason, file=sys.stderr)
            record["time_budget"] = budget.reason
        record["schedule_epochs"] = self.schedule_epochs

    def _save_final_weights(self) -> None:
        """`final.weights.h5`: the inference model as training ended (the last committed epoch's weights, also on a
        resume that had nothing left to train), written before `summary.json` marks the run finished."""
        if not self.backend.is_chief:
            return
        path = self.out / FINAL_WEIGHTS
        _check_free_space(path, _weights_file_bytes(self.model))
        with atomic_path(path, suffix=".weights.h5") as tmp:
            self.model.save_weights(str(tmp))

    def _train_epoch(self, epoch: int, iterator, callbacks) -> dict:
        """The epoch's optimizer steps; returns its record so far (loss, throughput, input wait, skips).

        The steps run `steps_per_loop` at a time (`train_loop`; the epoch's last loop is shorter
        when the steps do not divide evenly) and the host reads a loop's losses once it returns: the
        callbacks then get `on_step_begin` for every step of a loop before it runs and `on_step_end` for
        every step after it returns, in step order. `data_wait_seconds` sums the time the steps waited for
        their batches (measured inside the loop), `compute_seconds` is the rest of the loops' wall time.
        """
        wait = compute = 0.0
        losses = []
        skipped = 0
        per_loop = self.steps_per_loop
        for first in range(0, self.steps_per_epoch, per_loop):
            n = min(per_loop, self.steps_per_epoch - first)
            for step in range(first, first + n):
                callbacks.on_step_begin(self, epoch, step)
            global_step = (epoch - 1) * self.steps_per_epoch + first + 1
            t0 = time.perf_counter()
            with tf.profiler.experimental.Trace("train_step", step_num=global_step, steps=n, _r=1):
                loop_losses, loop_skipped, loop_waits = self.train_loop(iterator, n)
            loop_seconds = time.perf_counter() - t0
            loop_wait = min(float(np.sum(loop_waits)), loop_seconds)
            wait, compute = wait + loop_wait, compute + (loop_seconds - loop_wait)
            for j, (loss, was_skipped) in enumerate(zip(loop_losses.tolist(), loop_skipped.tolist())):
                step = first + j
                if not math.isfinite(loss):
                    raise TrainingDiverged(
                        f"the training loss became {loss} at epoch {epoch}, step {step + 1}. Training stopped; the "
                        f"last good checkpoint (epoch {int(self.epoch.numpy())}) is kept in "
                        f"{self.out / 'checkpoints'}. Lower optimizer.learning_rate, try training.precision=float32, "
                        "or check the data, then rerun with --resume."
                    )
                losses.append(loss)
                skipped += int(was_skipped > 0)
                self._skip_streak = self._skip_streak + [(epoch, step + 1)] if was_skipped > 0 else []
                if len(self._skip_streak) >= MAX_CONSECUTIVE_SKIPPED_STEPS:
                    (e0, s0), (e1, s1) = self._skip_streak[0], self._skip_streak[-1]
                    where = (
                        f"epoch {e1}, steps {s0}-{s1}" if e0 == e1 else f"epoch {e0} step {s0} to epoch {e1} step {s1}"
                    )
                    raise self._skipped_error(f"{len(self._skip_streak)} consecutive steps were skipped ({where})")
                callbacks.on_step_end(
                    self,
                    epoch,
                    step,
                    {
                        "loss": loss,
                        "mean_loss": float(np.mean(losses)),
                        "skipped": bool(was_skipped > 0),
                        "wait_seconds": wait,
                        "compute_seconds": compute,
                        "loop_steps": n,
                    },
                )
        loss_scaler = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        if skipped == self.steps_per_epoch and not loss_scaler:
            raise self._skipped_error(f"all {skipped} steps of epoch {epoch} were skipped")
        self.backend.sync_statistics(self.training_model)  # Horovod: one set of BatchNorm statistics for all processes
        self._check_finite_state(epoch)  # before validation and any save
        train_seconds = wait + compute
        record = {
            "epoch": epoch,
            "train_loss": float(np.mean(losses)),
            "learning_rate": float(keras.ops.convert_to_numpy(self.optimizer.learning_rate)),
            "images_per_second": self.steps_per_epoch * self.global_batch / max(train_seconds, 1e-9),
            "data_wait_seconds": wait,
            "compute_seconds": compute,
            "data_wait_fraction": wait / max(train_seconds, 1e-9),
            "skipped_steps": skipped,
        }
        if loss_scaler:
            record["loss_scale"] = float(keras.ops.convert_to_numpy(self.optimizer.dynamic_scale))
        return record

    def _validate_epoch(self, record: dict, val_dataset) -> dict:
        """Validates and adds the results to the epoch's `record`; returns the full result."""
        val_start = time.perf_counter()
        with tf.profiler.experimental.Trace("validation", epoch=record["epoch"]):
            result = self.evaluate(val_dataset)
        record["val_mean_dice"] = result["mean_dice"]
        record["val_dice"] = dict(zip(self.class_names[1:], result["dice_per_class"]))
        if "mean_hd95" in result:  # inf when a class was missed in some case; the misses are counted
            record["val_mean_hd95"] = result["mean_hd95"]
            record["val_hd95_misses"] = int(sum(result["hd95_inf_count_per_class"]))
        if "mean_nsd" in result:  # NSD on the preprocessed grid (predict's nsd_<class>: on the original grid)
            record["val_mean_nsd"] = result["mean_nsd"]
            record["val_nsd"] = dict(zip(self.class_names[1:], result["nsd_per_class"]))
        for region in self.config.validation.regions:  # flat keys: val_dice_whole_tumour, ...
            for metric in ("dice", "hd95", "nsd"):
                if f"{metric}_{region}" in result:
                    record[f"val_{metric}_{region}"] = result[f"{metric}_{region}"]
        if "mean_region_dice" in result:
            record["val_mean_region_dice"] = result["mean_region_dice"]
        if result["fallbacks"]:
            record["val_fallbacks"] = result["fallbacks"]
        record["val_seconds"] = time.perf_counter() - val_start
        return result

    def preview(self, path: str | Path) -> Path:
        """Draws the first validation case: ground truth filled, the best model's prediction outlined."""
        from tfmis.utils.io import atomic_writer
        from tfmis.viz.slices import plot_orthogonal_planes

        if (self.out / BEST_WEIGHTS).is_file():
            self.model.load_weights(str(self.out / BEST_WEIGHTS))
        image, label, meta = next(iter(self.task.build_val_dataset(cached=False)))  # one case: no cache to fill
        case_id = meta["case_id"].numpy().decode()
        prediction, _ = self._segment_volume(image, case_id)
        fig = plot_orthogonal_planes(
            image[0].numpy(),
            label[0].numpy(),
            spacing=self.spacing_by_case.get(case_id),
            channel_names=self.task.data_info["source"]["modalities"],
            class_names=self.class_names,
            title=f"{case_id}: label (fill) vs prediction of the best model (outline)",
            prediction=prediction,
        )
        with atomic_writer(path, "wb") as f:
            fig.savefig(f, format="png")
        return Path(path)

    def _skipped_error(self, what: str) -> TrainingDiverged:
        return TrainingDiverged(
            f"{what}: their gradients held NaN or Inf values although the loss was finite, so the weights were "
            f"left unchanged. Training stopped; the last good checkpoint (epoch {int(self.epoch.numpy())}) is kept "
            f"in {self.out / 'checkpoints'}. Look for a sqrt, norm, log or division at zero in the loss and for "
            "NaN/Inf voxels in the data, then rerun with --resume."
        )

    def _check_finite_state(self, epoch: int) -> None:
        """Raises TrainingDiverged if a model or optimizer variable holds NaN/Inf: such a state is never saved."""
        variables = list(self.training_model.variables) + list(self.optimizer.variables)
        bad = [
            v.path for v in variables if "float" in str(v.dtype) and not bool(tf.reduce_all(tf.math.is_finite(v.value)))
        ]
        if bad:
            raise TrainingDiverged(
                f"non-finite values in {len(bad)} model/optimizer variables ({', '.join(bad[:3])}"
                f"{', ...' if len(bad) > 3 else ''}) after epoch {epoch}, with finite losses and gradients. They "
                f"were not saved; the last good checkpoint (epoch {int(self.epoch.numpy())}) is kept in "
                f"{self.out / 'checkpoints'}. Lower optimizer.learning_rate (or set optimizer.clipnorm), then rerun "
                "with --resume."
            )

    def _summary(self, history: History, stop_reason: str = "epochs") -> dict:
        records = history.records
        train_time = sum(r["data_wait_seconds"] + r["compute_seconds"] for r in records)
        best = history.best
        summary = {
            "epochs": len(records),
            "elapsed_seconds": records[-1]["elapsed_seconds"] if records else 0.0,
            "best_epoch": best["epoch"] if best else None,
            "best_mean_dice": best["val_mean_dice"] if best else None,
            "best_dice_per_class": best["val_dice"] if best else None,
        }
        regions = self.config.validation.regions
        if regions:  # the best epoch's (by mean class Dice) region Dice; absent without regions
            summary["best_dice_per_region"] = {r: best.get(f"val_dice_{r}") for r in regions} if best else None
        summary |= {
            "final_mean_dice": next((r["val_mean_dice"] for r in reversed(records) if "val_mean_dice" in r), None),
            "images_per_second": float(np.mean([r["images_per_second"] for r in records])) if records else None,
            "data_wait_fraction": sum(r["data_wait_seconds"] for r in records) / max(train_time, 1e-9),
            "thresholds_reached": history.thresholds_reached(),
            "best_weights": str(self.out / BEST_WEIGHTS),
            "final_weights": str(self.out / FINAL_WEIGHTS),
            "num_replicas": self.backend.num_replicas,
            "stop_reason": stop_reason,
        }
        if self.time_budget is not None:  # planned vs used minutes, the decided epochs and why
            summary["time_budget"] = describe(self.time_budget, summary["elapsed_seconds"])
        if self.backend.is_chief:
            atomic_write_json(self.out / "summary.json", summary)
        return summary


def _weights_file_bytes(model) -> int:
    """A generous estimate of `model.save_weights`' file size: the weights plus HDF5's per-dataset overhead."""
    return (
        sum(int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize for w in model.weights)
        + 4096 * len(model.weights)
        + 65536
    )


def _check_free_space(path: Path, needed: int) -> None:
    """An OSError(ENOSPC) naming `path` when its file system has less than `needed` bytes free. h5py cannot be
    trusted with a full disk (its write errors surface while it frees objects, and the process may crash), so
    the weights are written only when they fit."""
    free = shutil.disk_usage(path.parent).free
    if free < needed:
        raise OSError(errno.ENOSPC, f"No space left on device ({free} bytes free, about {needed} needed)", str(path))


@contextlib.contextmanager
def run_folder_lock(backend: Backend, folder: str | Path):
    """The chief holds `folder`'s lock (`tfmis.utils.lock.folder_lock`) while the block runs; the other workers
    of a multi-worker run do not touch it (only the chief writes the run folder) and learn from one broadcast
    whether the chief got it, so that all workers go on or all stop: none waits for a chief that has left.

    Yields:
        True on the chief when it holds the lock; False on the other workers (and without flock support).

    Raises:
        FolderLocked: on every worker, when another live process holds the lock (the chief's message names it).
    """
    with contextlib.ExitStack() as stack:
        error, locked = None, False
        if backend.is_chief:
            try:
                locked = stack.enter_context(folder_lock(folder, "tfmis-train"))
            except FolderLocked as e:
                error = e
        if backend.size > 1 and not backend.broadcast([error is None])[0] and error is None:
            error = FolderLocked(
                f"worker {backend.rank}: the chief could not lock the run folder {folder}: another run uses it "
                "(see the chief's log)"
            )
        if error is not None:
            raise error
        yield locked


def _checkpoint_number(path: str | None) -> int:
    """N of a `.../ckpt-N` checkpoint prefix; -1 for none."""
    return int(path.rsplit("-", 1)[1]) if path else -1


def summary_table(summary: dict) -> str:
    """A readable end-of-run report."""
    why = {
        "target_dice": "  (stopped: training.target_dice reached)",
        "max_minutes": "  (stopped: training.max_minutes used up)",
    }.get(summary.get("stop_reason"), "")
    budget = summary.get("time_budget")
    if budget and not why and budget["schedule_epochs"]:
        why = f"  (the schedule fitted to the {budget['max_minutes']:g}-min budget)"
    lines = [
        f"epochs trained        {summary['epochs']}{why}",
        f"elapsed               {summary['elapsed_seconds']:.0f} s"
        + (f" of {60 * budget['max_minutes']:.0f} s ({budget['used_share']:.0%})" if budget else ""),
        f"best mean Dice        {summary['best_mean_dice']:.4f} (epoch {summary['best_epoch']})"
        if summary["best_mean_dice"] is not None
        else "best mean Dice        -",
    ]
    for name, value in (summary["best_dice_per_class"] or {}).items():
        lines.append(f"  {name:<20}{value:.4f}")
    for name, value in (summary.get("best_dice_per_region") or {}).items():
        lines.append(f"  {name:<20}{value:.4f}  (region)" if value is not None else f"  {name:<20}-  (region)")
    lines.append(f"throughput            {summary['images_per_second']:.1f} images/s")
    lines.append(f"input wait            {summary['data_wait_fraction']:.1%} of step time")
    for threshold, reached in summary["thresholds_reached"].items():
        lines.append(f"Dice >= {threshold}         epoch {reached['epoch']}, {reached['elapsed_seconds']:.0f} s")
    return "\n".join(lines)
