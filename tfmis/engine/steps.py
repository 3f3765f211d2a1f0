"""The trainer's steps: the compiled replica step (gradient accumulation, the gradient's reduction, the skip of a
non-finite step), the loop of `training.steps_per_loop` steps over the distributed iterator, the windows' forward
pass and sliding-window evaluation on whole volumes.

`CompiledSteps` gets every part it uses from its constructor (the `Trainer` builds them: model, optimizer, loss,
backend); the trainer's public `train_step`, `train_loop`, `predict_windows` and `evaluate` are its methods.
"""

from __future__ import annotations

import sys

import keras
import numpy as np
import tensorflow as tf

from tfmis.data.pipeline import step_augmentation
from tfmis.hardware import accelerator_device
from tfmis.inference.sliding_window import sliding_window_inference


class CompiledSteps:
    """The step, the loop of steps and validation of one training run, compiled once.

    Args:
        config: the run's `Config`.
        backend: the distribution backend the steps run through.
        task: the `SegmentationTask` (validation metrics, label maps).
        model: the inference model (validation's windows).
        training_model: the model the step trains (the same as `model` without deep supervision).
        optimizer: its optimizer, built on `training_model`'s variables.
        loss_fn: the loss of (labels, logits).
        in_channels: the images' channel count (the step states it to the convolutions).
        steps_per_epoch: an epoch's optimizer steps (a loop is at most one epoch).
        spacing_by_case: {case_id: voxel spacing} of the validation cases (surface metrics).
        placement: the `VolumePlacement` validation volumes are segmented with.
        parallel, parallel_inference: the training and inference model over several devices (None: off).
    """

    def __init__(
        self,
        config,
        backend,
        task,
        model,
        training_model,
        optimizer,
        loss_fn,
        in_channels: int,
        steps_per_epoch: int,
        spacing_by_case: dict,
        placement,
        parallel=None,
        parallel_inference=None,
    ):
        self.config, self.backend, self.task = config, backend, task
        self.model, self.training_model, self.optimizer, self.loss_fn = model, training_model, optimizer, loss_fn
        self.in_channels, self.steps_per_epoch = in_channels, steps_per_epoch
        self.spacing_by_case, self.placement = spacing_by_case, placement
        self.parallel, self.parallel_inference = parallel, parallel_inference
        self._compile()

    def _compile(self) -> None:
        """The compiled functions: the replica step (XLA with `training.jit_compile`), one global step, the loop
        of `training.steps_per_loop` steps (`loop_function`), and the windows' forward pass."""
        self.step_augment = None
        if self.config.pipeline.augment.placement == "step":
            # the dataset yields un-augmented crops and their seeds; the replica step augments them on its device
            self.step_augment = step_augmentation(self.config.pipeline)
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
        self.loop_function = tf.function(train_loop, autograph=False)
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
        results = self.loop_function(iterator, self.steps_per_loop if num_steps is None else num_steps)
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
        if self.step_augment is not None:
            if seeds is None:
                raise ValueError(
                    "pipeline.augment.placement is step but the training batches hold no crop seeds: "
                    "the training dataset must yield (images, labels, seeds), as "
                    "tfmis.data.pipeline.build_train_dataset does with that placement"
                )
            with tf.name_scope("augment"):
                images, labels = self.step_augment(images, labels, seeds)
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
            grads = g if grads is None else self._per_variable(lambda a, b: a + b, variables, grads, g)
            total_loss += tf.cast(loss, tf.float32)
        with tf.name_scope("gradient_reduce"):
            grads = self.backend.reduce_gradients(grads)  # the global gradient, the same on every replica
        with tf.name_scope("optimizer_step"):
            checks = self._per_variable(lambda g: tf.reduce_all(tf.math.is_finite(g)), variables, grads)
            finite = tf.reduce_all([c for c in checks if c is not None])
            if loss_scaler:  # skips a non-finite step itself, lowering the scale (its check sees the same grads)
                self.optimizer.apply(grads, variables)
            else:
                self.backend.run_if(finite, lambda: self.optimizer.apply(grads, variables))
        for variable, value in zip(state, saved):
            variable.assign(tf.where(finite, variable, value))
        return total_loss / n, 1.0 - tf.cast(finite, tf.float32)

    def _per_variable(self, fn, variables, *per_variable):
        """[fn(*values of variable i) for each variable], each on its variable's device when the model runs over
        several devices (a pipeline's stages own their variables: their gradient sums over accumulation steps
        and their finiteness checks stay there instead of copying every gradient to the first device); None
        where a value is None."""
        out = []
        for variable, values in zip(variables, zip(*per_variable)):
            if any(v is None for v in values):
                out.append(None)
                continue
            if self.parallel is None:
                out.append(fn(*values))
                continue
            with tf.device(variable.value.device):
                out.append(fn(*values))
        return out

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
            prediction, placement = self.segment_volume(image, case_id)
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

    def segment_volume(self, image, case_id: str):
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
