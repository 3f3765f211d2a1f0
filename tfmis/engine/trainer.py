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

`Trainer` is this module's loop (the epochs, their validation, the time budget and the stopping rules) over two
parts it builds and owns, each given what it uses in its constructor: the steps (`self.steps`,
`tfmis.engine.steps.CompiledSteps`: the compiled step and loop of steps, the windows' forward pass, evaluation) and
the run's bookkeeping (`self.state`, `tfmis.engine.bookkeeping.RunBookkeeping`: the state variables and their
checkpoint, restore, the epoch's commit point, the schedule's length, the final weights and the summary).

Example:
```python
trainer = Trainer(load_config("configs/demo.yaml"))
summary = trainer.fit(resume=False)
```
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from tfmis.config import check_model_parallel
from tfmis.data.pipeline import train_steps_per_epoch
from tfmis.data.records import training_data_info
from tfmis.engine.backend import Backend
from tfmis.engine.bookkeeping import (
    RunBookkeeping,
    TrainingDiverged,
    run_folder_lock,
)
from tfmis.engine.callbacks import CallbackList, default_callbacks
from tfmis.engine.distribution import make_backend
from tfmis.engine.history import History
from tfmis.engine.steps import CompiledSteps
from tfmis.engine.time_budget import TimeBudget
from tfmis.errors import ConfigError
from tfmis.hardware import model_parallel_devices
from tfmis.inference.placement import VolumePlacement
from tfmis.task import SegmentationTask
from tfmis.utils.cli import start_unjoined
from tfmis.utils.run_files import weights_file

# A step whose gradient holds NaN/Inf is skipped. In float32/bfloat16 that is an outlier batch; this many in a
# row means the loss or the model is broken (under mixed_float16 the loss scaler would have lowered its scale
# 2^20-fold by then, far past any float16 overflow), and so does an epoch in which every step was skipped.
MAX_CONSECUTIVE_SKIPPED_STEPS = 20


def release_in_background(holder: list) -> None:
    """Empties `holder` (the only reference to a tf.data iterator) in another thread, so that the iterator's
    destructor does not hold up the caller.

    Why: deleting an autotuned iterator joins tf.data's autotuning thread, and on a busy machine that join took 27-32 s
    (a 2-core machine with one core kept busy, measured after 50 s of iteration; 0.01 s when idle or with
    `autotune.enabled` off): at the end of every training, the time the next stage of a plan, the next fold or trial
    then waited for. The wait releases the GIL, so the caller goes on. At the end of a command's process the thread is
    not waited for (`tfmis.utils.cli.start_unjoined`); elsewhere the interpreter waits for it at exit."""
    start_unjoined(holder.clear, "tfmis-release-iterator")


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
        check_model_parallel(config)  # XLA, the batch's split, the slabs: before anything is built
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
            if self.parallel is not None:  # a pipeline stage's weights and slots are updated on its device
                self.parallel.place_optimizer(self.optimizer)
            self.backend.prepare_optimizer(self.optimizer)  # the step reduces gradients before apply() clips them
            # the run's state variables and the checkpoint of them, the model and the optimizer
            self.state = RunBookkeeping(
                config,
                self.backend,
                self.out,
                self.model,
                self.training_model,
                self.optimizer,
                self.schedule_length,
                self.steps_per_epoch,
                self.data_info,
            )
        self.time_budget: TimeBudget | None = None  # fit()'s, with training.max_minutes
        # one policy for the whole run: the volume sizes it learns not to fit stay learned across epochs
        self.placement = VolumePlacement.for_validation(config.validation)
        self.steps = CompiledSteps(
            config,
            self.backend,
            self.task,
            self.model,
            self.training_model,
            self.optimizer,
            self.task.build_loss(),
            self.in_channels,
            self.steps_per_epoch,
            self.spacing_by_case,
            self.placement,
            parallel=self.parallel,
            parallel_inference=self.parallel_inference,
        )

    @property
    def loss_fn(self):
        """The loss of (labels, logits) the step trains with (`task.build_loss()`'s)."""
        return self.steps.loss_fn

    @loss_fn.setter
    def loss_fn(self, loss_fn) -> None:
        """Another loss for the step: set before the first step, which traces the step with it."""
        self.steps.loss_fn = loss_fn

    def train_step(self, batch):
        """One optimizer step on a global batch (`CompiledSteps.train_step`); (mean loss, skipped) as tensors."""
        return self.steps.train_step(batch)

    def train_loop(self, iterator, num_steps: int | None = None):
        """`num_steps` (default `steps_per_loop`) steps in one call of the compiled loop (`CompiledSteps.train_loop`);
        (losses, skipped, waits) per step."""
        return self.steps.train_loop(iterator, num_steps)

    @property
    def steps_per_loop(self) -> int:
        """The optimizer steps of one `train_loop` call (`CompiledSteps.steps_per_loop`)."""
        return self.steps.steps_per_loop

    def predict_windows(self, windows):
        """The model's logits for a batch of windows (`CompiledSteps.predict_windows`)."""
        return self.steps.predict_windows(windows)

    def evaluate(self, dataset) -> dict:
        """Sliding-window validation on whole volumes (`CompiledSteps.evaluate`): per-class Dice, HD95, NSD, regions."""
        return self.steps.evaluate(dataset)

    def restore(self, resume: bool = True) -> int:
        """Restores the last committed epoch (`RunBookkeeping.restore`); returns the epochs done (0: a new run).

        Raises:
            RunExists: the run folder holds checkpoints and `resume` is False.
        """
        return self.state.restore(resume)

    def fit(self, resume: bool = False) -> dict:
        """Trains for `training.epochs` (or until `target_dice` or `max_minutes`); returns the run summary,
        whose `stop_reason` says which: `epochs`, `target_dice` or `max_minutes`.

        With `training.max_minutes` the schedule's length is fitted to the budget from the epoch time measured
        here (`tfmis.engine.time_budget`; `training.epochs` is then an upper bound): the run ends after the epochs
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
        tc = self.config.training
        done = self.restore(resume)
        self.history = History(self.out, tc.dice_thresholds)
        callbacks = CallbackList(default_callbacks(self) + self.callbacks)
        seed_offset = done  # a resumed run draws new crops, not epoch 1's again
        stream = [iter(self.backend.distribute_dataset(lambda ctx: self.task.build_train_dataset(ctx, seed_offset)))]
        try:
            return self._run_epochs(done, stream[0], callbacks)
        finally:
            release_in_background(stream)

    def _run_epochs(self, done: int, iterator, callbacks) -> dict:
        """The epoch loop of `fit` over the training `iterator`, from epoch `done` + 1; returns the run summary."""
        cfg, tc = self.config, self.config.training
        val_dataset = self.task.build_val_dataset()
        run_start = time.perf_counter() - float(self.state.elapsed.numpy())
        self._skip_streak = []  # (epoch, step) of the consecutive skipped steps up to now
        stop_reason = "epochs"
        budget = self.time_budget = (
            TimeBudget(
                tc.max_minutes,
                tc.epochs,
                cfg.validation.val_interval,
                int(self.state.budget_epochs.numpy()) or None,
                cfg.validation.validations,
            )
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
                epoch % (budget.val_interval if budget is not None else cfg.validation.val_interval) == 0
                or epoch == self._last_epoch()
                or out_of_time
                or (budget is not None and budget.wants_validation(epoch))
            )
            improved = False
            if validated:
                result = self._validate_epoch(record, val_dataset)
                callbacks.on_validation_end(self, epoch, result)
                best = float(self.state.best_dice.numpy())
                improved = math.isfinite(result["mean_dice"]) and result["mean_dice"] > best
                if self.backend.size > 1:  # rank 0's decision, whatever rounding another worker's sum saw
                    improved = bool(self.backend.broadcast([improved])[0])
                if improved:
                    self.state.best_dice.assign(result["mean_dice"])
                    self.state.best_epoch.assign(epoch)
            if budget is not None:
                now = time.perf_counter()
                val_seconds = record.get("val_seconds") if validated else None
                budget.add_epoch(epoch, now - cycle_start - (val_seconds or 0.0), val_seconds)
                cycle_start = now
                self._update_budget(budget, epoch, now - run_start, out_of_time, record)
            record["epoch_seconds"] = time.perf_counter() - epoch_start
            record["elapsed_seconds"] = time.perf_counter() - run_start
            self.state.epoch.assign(epoch)
            self.state.elapsed.assign(record["elapsed_seconds"])
            self.state.commit_epoch(record, improved, self.history)
            callbacks.on_epoch_end(self, epoch, record)
            reached = validated and tc.target_dice is not None and record["val_mean_dice"] >= tc.target_dice
            if self.backend.size > 1:
                reached = bool(self.backend.broadcast([reached])[0])
            if reached or (out_of_time and epoch < self._last_epoch()):
                stop_reason = "target_dice" if reached else "max_minutes"
                if self.backend.is_chief:
                    cut = (
                        f"; the learning-rate schedule was cut before its end (epoch {self._last_epoch()})"
                        if epoch < self.state.schedule_epochs
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
        self.state.save_final_weights()
        summary = self.state.summary(self.history, stop_reason, self.time_budget)
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
        if self.backend.size > 1:  # rank 0's measurement decides for all, the validations' spacing too
            epochs, interval = (int(v) for v in self.backend.broadcast([budget.epochs or 0, budget.val_interval]))
            changed = epochs if epochs and epochs != int(self.state.budget_epochs.numpy()) else None
            budget.epochs, budget.val_interval = epochs or None, interval
        if changed is not None:
            self.state.set_schedule_epochs(changed)
            if self.backend.is_chief:
                print(budget.reason, file=sys.stderr)
            record["time_budget"] = budget.reason
        record["schedule_epochs"] = self.state.schedule_epochs

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
                        f"last good checkpoint (epoch {int(self.state.epoch.numpy())}) is kept in "
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

    def preview(self, path: str | Path, weights: str = "best") -> Path:
        """Draws the first validation case: ground truth filled, the `weights` ("best" or "final") model's
        prediction outlined."""
        from tfmis.utils.io import atomic_writer
        from tfmis.viz.slices import plot_orthogonal_planes

        if weights_file(self.out, weights).is_file():
            self.model.load_weights(str(weights_file(self.out, weights)))
        image, label, meta = next(iter(self.task.build_val_dataset(cached=False)))  # one case: no cache to fill
        case_id = meta["case_id"].numpy().decode()
        prediction, _ = self.steps.segment_volume(image, case_id)
        fig = plot_orthogonal_planes(
            image[0].numpy(),
            label[0].numpy(),
            spacing=self.spacing_by_case.get(case_id),
            channel_names=self.task.data_info["source"]["modalities"],
            class_names=self.class_names,
            title=f"{case_id}: label (fill) vs prediction of the {weights} model (outline)",
            prediction=prediction,
        )
        with atomic_writer(path, "wb") as f:
            fig.savefig(f, format="png")
        return Path(path)

    def _skipped_error(self, what: str) -> TrainingDiverged:
        kept = int(self.state.epoch.numpy())
        return TrainingDiverged(
            f"{what}: their gradients held NaN or Inf values although the loss was finite, so the weights were "
            f"left unchanged. Training stopped; the last good checkpoint (epoch {kept}) is kept "
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
                f"were not saved; the last good checkpoint (epoch {int(self.state.epoch.numpy())}) is kept in "
                f"{self.out / 'checkpoints'}. Lower optimizer.learning_rate (or set optimizer.clipnorm), then rerun "
                "with --resume."
            )
