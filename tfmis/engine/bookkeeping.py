"""The trainer's epoch bookkeeping: the run's state restored (`RunBookkeeping.restore`), each epoch committed once
(stage, checkpoint, publish: `RunBookkeeping.commit_epoch`), the schedule's length a time budget decides, the final
weights, `summary.json` and the closing lines (`summary_table`), and the chief's lock on the run folder
(`run_folder_lock`).

`RunBookkeeping` gets what it writes from its constructor (the `Trainer` builds the model and optimizer) and owns the
run's state variables (epoch, best Dice, elapsed time, the budget's epochs) and the checkpoint that saves them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

from tfmis.config import save_config
from tfmis.data.records import RUN_DATA_FILE
from tfmis.engine.backend import Backend
from tfmis.engine.history import History
from tfmis.engine.time_budget import TimeBudget, describe
from tfmis.errors import RunStateError, TrainingFailed
from tfmis.hardware import detect_hardware
from tfmis.networks.weights import has_weights_by_path, weights_by_path
from tfmis.utils.io import atomic_path, atomic_write_json
from tfmis.utils.lock import FolderLocked, folder_lock
from tfmis.utils.run_files import BEST_WEIGHTS, FINAL_WEIGHTS

# an epoch's outputs before its checkpoint commits them (see RunBookkeeping.commit_epoch)
STAGED_EPOCH = "epoch.staged.json"
STAGED_BEST = "best.staged.weights.h5"


class TrainingDiverged(TrainingFailed):
    """The loss, the gradients or the weights became NaN or infinite for good."""


class RunExists(RunStateError):
    """The output folder already holds checkpoints and --resume was not given."""


class RunBookkeeping:
    """What a training run writes and reads around its epochs, and the state a checkpoint saves.

    Build it in the backend's scope: it makes the state variables `epoch`, `best_dice`, `best_epoch`, `elapsed`
    (seconds) and `budget_epochs` (the epoch count `training.max_minutes` decided; 0: none), and the checkpoint
    (`checkpoint`, `manager`) of them with the training model, its optimizer and the schedule's length.

    Args:
        config: the run's `Config`.
        backend: the distribution backend (who is chief, where each worker saves).
        out: the run folder.
        model: the inference model (best and final weights files).
        training_model: the model the steps train (the checkpoint's).
        optimizer: its optimizer.
        schedule_length: the learning-rate schedule's length variable (`task.build_schedule_length`).
        steps_per_epoch: an epoch's optimizer steps.
        data_info: what the run folder needs to predict alone (written by `restore`).
    """

    def __init__(
        self,
        config,
        backend: Backend,
        out: Path,
        model,
        training_model,
        optimizer,
        schedule_length,
        steps_per_epoch: int,
        data_info: dict,
    ):
        self.config, self.backend, self.out = config, backend, Path(out)
        self.model, self.training_model, self.optimizer = model, training_model, optimizer
        self.schedule_length, self.steps_per_epoch, self.data_info = schedule_length, steps_per_epoch, data_info
        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        self.best_dice = tf.Variable(-1.0, dtype=tf.float64, trainable=False, name="best_dice")
        self.best_epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="best_epoch")
        self.elapsed = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="elapsed_seconds")
        # the epoch count training.max_minutes decided (0: none yet, or no budget): a resume keeps it
        self.budget_epochs = tf.Variable(0, dtype=tf.int64, trainable=False, name="budget_epochs")
        self._state = dict(
            model=training_model,
            optimizer=optimizer,
            epoch=self.epoch,
            best_dice=self.best_dice,
            best_epoch=self.best_epoch,
            elapsed=self.elapsed,
        )
        # saved since the time budget sets the schedule's length: a checkpoint of an older tfmis has neither
        self._schedule_state = dict(schedule_steps=schedule_length.variable, budget_epochs=self.budget_epochs)
        # the weights also under their names: another build of the model (prediction's) reads them by name
        self.checkpoint = tf.train.Checkpoint(
            **self._state, **self._schedule_state, weights_by_path=weights_by_path(training_model)
        )
        # MultiWorkerMirroredStrategy: every worker saves, non-chiefs into a temporary folder they then drop
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, str(backend.checkpoint_dir(self.out)), max_to_keep=config.training.keep_checkpoints
        )

    def restore(self, resume: bool = True) -> int:
        """Restores the last committed epoch and returns how many epochs are done (0 for a new run).

        Model, optimizer (iterations, moments, loss scale), epoch, best Dice and elapsed time come
        from the latest checkpoint; an epoch whose checkpoint was written but whose history record or
        best weights were not (a kill in between) is completed, and the staged outputs of an epoch
        whose checkpoint was never written are dropped (see `commit_epoch`).

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
            self.set_schedule_epochs(min(decided, tc.epochs))

    def set_schedule_epochs(self, epochs: int) -> None:
        """The learning-rate schedule ends after `epochs` epochs (the next steps use it); saved with the next
        checkpoint as the time budget's decision."""
        self.budget_epochs.assign(epochs)
        self.schedule_length.assign(epochs * self.steps_per_epoch)

    @property
    def schedule_epochs(self) -> int:
        """The epoch at which the learning-rate schedule ends (warm-up included)."""
        return self.schedule_length.total_steps // self.steps_per_epoch

    # ------------------------------------------------------------------ one commit point per epoch

    def commit_epoch(self, record: dict, improved: bool, history: History) -> None:
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
        """Step 3 of `commit_epoch`; safe to repeat after a kill half-way through it."""
        history.truncate(record["epoch"] - 1)
        history.append(record)
        if (self.out / STAGED_BEST).is_file():
            os.replace(self.out / STAGED_BEST, self.out / BEST_WEIGHTS)
        (self.out / STAGED_EPOCH).unlink(missing_ok=True)

    def _discard_staged(self) -> None:
        for name in (STAGED_EPOCH, STAGED_BEST):
            (self.out / name).unlink(missing_ok=True)

    def save_final_weights(self) -> None:
        """`final.weights.h5`: the inference model as training ended (the last committed epoch's weights, also on a
        resume that had nothing left to train), written before `summary.json` marks the run finished."""
        if not self.backend.is_chief:
            return
        path = self.out / FINAL_WEIGHTS
        _check_free_space(path, _weights_file_bytes(self.model))
        with atomic_path(path, suffix=".weights.h5") as tmp:
            self.model.save_weights(str(tmp))

    def summary(self, history: History, stop_reason: str = "epochs", time_budget: TimeBudget | None = None) -> dict:
        """The run summary (`summary.json`, written by the chief): epochs, best and final Dice, throughput, input wait,
        thresholds reached, weights files, the stop reason and, with `time_budget`, its planned and used minutes."""
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
            "machine": detect_hardware().short(),  # the processor or GPUs it trained on (an export's model card)
            "stop_reason": stop_reason,
        }
        if time_budget is not None:  # planned vs used minutes, the decided epochs and why
            summary["time_budget"] = describe(time_budget, summary["elapsed_seconds"])
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
