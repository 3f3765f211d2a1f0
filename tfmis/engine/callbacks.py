"""Hooks of the training loop: what happens around the steps, outside the step itself.

`Trainer.fit` is a small loop: steps, validation, the epoch's commit point and the stopping rules.
Everything else listens to its events through `Callback` objects, as nnU-Net's `on_*` hooks and
MONAI's event handlers do: the progress display, the epoch log line, TensorBoard, the curves PNG,
and the monitors and profilers of `tfmis.profiling`. Events, in order:

    on_train_begin(trainer, start_epoch)
      on_epoch_begin(trainer, epoch)
        on_step_begin(trainer, epoch, step)      # step counts from 0
        on_step_end(trainer, epoch, step, logs)  # logs: loss, mean_loss, skipped, wait_seconds, compute_seconds,
                                                 # loop_steps
      on_validation_end(trainer, epoch, result)  # epochs that validate
      on_epoch_end(trainer, epoch, record)       # after the epoch is committed (checkpoint + history)
    on_train_end(trainer, summary)

With `training.steps_per_loop: K` the steps run K at a time in one compiled loop: `on_step_begin` comes for
each of the loop's steps before it runs, `on_step_end` for each after it returns (in step order, with that
step's loss; `wait_seconds`/`compute_seconds` are the epoch's totals at the end of its loop, `loop_steps`
its length). With K = 1 (the default) the two alternate, one step at a time.

The commit (checkpoint, history record, best weights) stays in the loop: it is the one point at
which an epoch becomes durable, and callbacks only ever see committed epochs.

Example:
```python
class PrintDice(Callback):
    def on_validation_end(self, trainer, epoch, result):
        print(epoch, result["mean_dice"])

Trainer(config, callbacks=[PrintDice()]).fit()
```
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from tfmis.engine.time_budget import budget_epoch_bound


class Callback:
    """Base class: override the events you need; each gets the trainer first."""

    def on_train_begin(self, trainer, start_epoch: int) -> None:
        pass

    def on_epoch_begin(self, trainer, epoch: int) -> None:
        pass

    def on_step_begin(self, trainer, epoch: int, step: int) -> None:
        pass

    def on_step_end(self, trainer, epoch: int, step: int, logs: dict) -> None:
        pass

    def on_validation_end(self, trainer, epoch: int, result: dict) -> None:
        pass

    def on_epoch_end(self, trainer, epoch: int, record: dict) -> None:
        pass

    def on_train_end(self, trainer, summary: dict) -> None:
        pass


class CallbackList(Callback):
    """Calls each event on every callback, in order."""

    def __init__(self, callbacks):
        self.callbacks = list(callbacks)

    def _call(self, event: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, event)(*args)

    def on_train_begin(self, *args):
        self._call("on_train_begin", *args)

    def on_epoch_begin(self, *args):
        self._call("on_epoch_begin", *args)

    def on_step_begin(self, *args):
        self._call("on_step_begin", *args)

    def on_step_end(self, *args):
        self._call("on_step_end", *args)

    def on_validation_end(self, *args):
        self._call("on_validation_end", *args)

    def on_epoch_end(self, *args):
        self._call("on_epoch_end", *args)

    def on_train_end(self, *args):
        self._call("on_train_end", *args)


class Progress(Callback):
    """Progress within an epoch: a tqdm bar on a terminal; otherwise (a SLURM log, `> train.log`) one plain
    line every `interval_seconds` (0 = every step), never carriage-return frames.

    Args:
        interval_seconds: seconds between plain lines when standard error is not a terminal.
        stream: where to write (default: standard error).
    """

    def __init__(self, interval_seconds: float = 60.0, stream=None):
        self.interval = float(interval_seconds)
        self.stream = stream or sys.stderr
        self.bar = None

    def on_epoch_begin(self, trainer, epoch):
        self.epoch_start = self.last_line = time.perf_counter()
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=trainer.steps_per_epoch,
                desc=f"epoch {epoch}/{epochs_shown(trainer)}",
                unit="step",
                file=self.stream,
                leave=False,
            )

    def on_step_end(self, trainer, epoch, step, logs):
        wait = logs["wait_seconds"] / max(logs["wait_seconds"] + logs["compute_seconds"], 1e-9)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{logs['mean_loss']:.4f}", wait=f"{wait:.0%}")
            return
        now = time.perf_counter()
        if now - self.last_line >= self.interval and step + 1 < trainer.steps_per_epoch:
            self.last_line = now
            print(
                f"epoch {epoch}/{epochs_shown(trainer)}  step {step + 1}/{trainer.steps_per_epoch}  "
                f"loss {logs['mean_loss']:.4f}  input wait {wait:.0%}  {now - self.epoch_start:.0f}s",
                file=self.stream,
                flush=True,
            )

    def on_validation_end(self, trainer, epoch, result):
        self._close()

    def on_epoch_end(self, trainer, epoch, record):
        self._close()

    def _close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def epochs_shown(trainer) -> str:
    """The epochs a progress line counts to: the learning-rate schedule's length once a time budget
    (`training.max_minutes`) has fitted it from the measured epochs; before that, `training.epochs`, or "?" when
    that is only the budget's bound (`budget_epoch_bound`: 10^4 epochs and more for a planned run)."""
    tc = trainer.config.training
    if tc.max_minutes is not None and int(trainer.state.budget_epochs.numpy()) > 0:
        return str(trainer.state.schedule_epochs)
    if tc.max_minutes is not None and tc.epochs >= budget_epoch_bound(tc.max_minutes):
        return "?"
    return str(tc.epochs)


def epoch_line(r: dict, epochs: int | str) -> str:
    """The one log line of an epoch's record: loss, images/s, input wait, time, skipped steps, validation Dice."""
    line = (
        f"epoch {r['epoch']}/{epochs}  loss {r['train_loss']:.4f}  {r['images_per_second']:.1f} img/s  "
        f"input wait {r['data_wait_fraction']:.0%}  {r['epoch_seconds']:.1f}s"
    )
    if r.get("skipped_steps"):
        line += f"  skipped {r['skipped_steps']} steps (non-finite gradient)"
    if "val_mean_dice" in r:
        per_class = "  ".join(f"{k} {v:.3f}" for k, v in r["val_dice"].items())
        line += f"  | val mean Dice {r['val_mean_dice']:.4f} ({per_class})"
    return line


class EpochLog(Callback):
    """One line per epoch on standard error (`epoch_line`)."""

    def on_epoch_end(self, trainer, epoch, record):
        print(epoch_line(record, epochs_shown(trainer)), file=sys.stderr, flush=True)


class TensorBoard(Callback):
    """Every number of each epoch's record as a TensorBoard scalar (dicts as `key/name`)."""

    def __init__(self, log_dir: str | Path):
        self.log_dir = Path(log_dir)
        self.writer = None

    def on_train_begin(self, trainer, start_epoch):
        import tensorflow as tf

        self.writer = tf.summary.create_file_writer(str(self.log_dir))

    def on_epoch_end(self, trainer, epoch, record):
        import tensorflow as tf

        with self.writer.as_default(step=record["epoch"]):
            for key, value in record.items():
                if isinstance(value, dict):
                    for name, v in value.items():
                        tf.summary.scalar(f"{key}/{name}", v)
                elif key != "epoch" and isinstance(value, (int, float)):  # not the time budget's reason line
                    tf.summary.scalar(key, value)
        self.writer.flush()

    def on_train_end(self, trainer, summary):
        if self.writer is not None:
            self.writer.close()


class Curves(Callback):
    """Redraws `training_curves.png` from the history after an epoch when `every_seconds` have passed since the
    last redraw or, for the first drawing, since training began, and at the end of training unless the last drawing
    already holds every epoch. A drawing costs about a second, so a run shorter than `every_seconds` draws once, at
    its end; with 0 every epoch draws."""

    def __init__(self, path: str | Path, every_seconds: float = 0.0):
        self.path = Path(path)
        self.every_seconds = every_seconds
        self.last_drawn = -math.inf
        self.drawn_records = -1

    def on_train_begin(self, trainer, start_epoch):
        self.last_drawn = time.monotonic()  # the first drawing waits every_seconds too

    def on_epoch_end(self, trainer, epoch, record):
        if time.monotonic() - self.last_drawn >= self.every_seconds:
            self._draw(trainer)

    def on_train_end(self, trainer, summary):
        if len(trainer.history.records) != self.drawn_records or not self.path.is_file():
            self._draw(trainer)

    def _draw(self, trainer):
        trainer.history.plot(self.path)
        self.last_drawn = time.monotonic()
        self.drawn_records = len(trainer.history.records)


class Resources(Callback):
    """Samples GPU utilisation and memory (NVML; else this process's CPU and RSS) during training into
    `resources.csv` in the run folder (`resources-from-epoch-N.csv` for a run resumed at epoch N), and
    draws `resources.png` at the end (`output.monitor_seconds`; `tfmis.profiling.ResourceMonitor`).

    Args:
        out: the run folder.
        interval_seconds: seconds between samples.
    """

    def __init__(self, out: str | Path, interval_seconds: float = 1.0):
        self.out = Path(out)
        self.interval = float(interval_seconds)
        self.monitor = None

    def on_train_begin(self, trainer, start_epoch):
        from tfmis.profiling import ResourceMonitor

        name = "resources.csv" if start_epoch == 1 else f"resources-from-epoch-{start_epoch}.csv"
        self.csv = self.out / name
        self.monitor = ResourceMonitor(self.csv, interval_s=self.interval).start()

    def on_train_end(self, trainer, summary):
        from tfmis.profiling import plot_resources

        self.monitor.stop()
        try:
            plot_resources(self.csv, self.csv.with_suffix(".png"), title=f"{self.out.name}: resources during training")
        except ValueError as e:  # a run shorter than one sample
            print(f"resources: no plot ({e})", file=sys.stderr)


class Profiler(Callback):
    """Records a TensorFlow profiler trace of `num_steps` optimizer steps from global step `start_step` (1-based)
    into `log_dir` (TensorBoard's Profile tab, with the plugin installed: `pip install tensorboard-plugin-profile`).

    The loop marks its phases with `tf.profiler.experimental.Trace` ranges (`train_step`, one per loop of
    `training.steps_per_loop` steps, and `validation`), the analogue of NVTX ranges in Nsight Systems; inside
    the loop the input fetch is under the `data_wait/` name scope and the step's ops under `train_step/`.
    With several steps per loop the trace covers whole loops: it starts before the loop holding `start_step`
    and stops after the loop holding the last requested step.
    """

    def __init__(self, log_dir: str | Path, start_step: int, num_steps: int):
        self.log_dir = Path(log_dir)
        self.start, self.stop = int(start_step), int(start_step) + int(num_steps)
        self.active = False

    def _global_step(self, trainer, epoch, step):
        return (epoch - 1) * trainer.steps_per_epoch + step + 1

    def on_step_begin(self, trainer, epoch, step):
        import tensorflow as tf

        if self._global_step(trainer, epoch, step) == self.start and not self.active:
            tf.profiler.experimental.start(str(self.log_dir))
            self.active = True

    def on_step_end(self, trainer, epoch, step, logs):
        if self.active and self._global_step(trainer, epoch, step) + 1 >= self.stop:
            self._finish()

    def on_train_end(self, trainer, summary):
        self._finish()

    def _finish(self):
        import tensorflow as tf

        if self.active:
            tf.profiler.experimental.stop()
            self.active = False
            print(f"profiler trace written to {self.log_dir} (TensorBoard: Profile tab)", file=sys.stderr)


def input_bound_diagnosis(config, records: list[dict], threshold: float = 0.10) -> dict | None:
    """Whether the run waited for input more than `threshold` of its step time, and the likely fix.

    Epoch 1 is left out when later epochs exist: it fills the cache and traces the step (a cold start, not a
    steady state). Returns None when the input kept up, else `{"data_wait_fraction", "epochs", "cause", "fix"}`.
    """
    p = config.pipeline
    warm = [r for r in records if r["epoch"] > 1] or records
    wait = sum(r["data_wait_seconds"] for r in warm)
    total = wait + sum(r["compute_seconds"] for r in warm)
    if not warm or total <= 0 or wait / total <= threshold:
        return None
    if p.cache == "none":
        cause = "pipeline.cache is none: every epoch reads and decodes the TFRecords again"
        fix = "set pipeline.cache=memory (or pipeline.cache=file with pipeline.cache_dir when host RAM is short)"
    elif p.cache == "partial":
        cause = (
            f"pipeline.cache is partial: each pass over the cached volumes waits for its new volumes "
            f"(pipeline.replace_rate={p.replace_rate:g} of them) to be read from the TFRecords"
        )
        fix = (
            "lower pipeline.replace_rate (e.g. 0.1), cache more volumes (pipeline.cache_num or pipeline.cache_rate), "
            f"or draw more crops per cached volume (pipeline.num_crops_per_image, now {p.num_crops_per_image})"
        )
    elif p.deterministic:
        cause = "pipeline.deterministic is true: reads, crops and augmentation run in a fixed order, one at a time"
        fix = "set pipeline.deterministic=false"
    else:
        cause = "the CPU cannot crop and augment as fast as the accelerator trains"
        fix = (
            f"draw more crops per cached volume (pipeline.num_crops_per_image, now {p.num_crops_per_image}), "
            "give tf.data more CPU cores, or lower the augmentation cost (pipeline.augment)"
        )
    return {"data_wait_fraction": wait / total, "epochs": [r["epoch"] for r in warm], "cause": cause, "fix": fix}


class InputBoundReport(Callback):
    """Says once, as soon as the input pipeline is the bottleneck, what to change; and adds the diagnosis to
    the summary (`input_bound`) at the end (see `input_bound_diagnosis`)."""

    def __init__(self, threshold: float = 0.10):
        self.threshold = float(threshold)
        self.warned = False

    def on_epoch_end(self, trainer, epoch, record):
        found = input_bound_diagnosis(trainer.config, trainer.history.records, self.threshold)
        if found and not self.warned and epoch > 1:
            self.warned = True
            print(
                f"input-bound: {found['data_wait_fraction']:.0%} of step time waits for input "
                f"(threshold {self.threshold:.0%}): {found['cause']}; {found['fix']}",
                file=sys.stderr,
                flush=True,
            )

    def on_train_end(self, trainer, summary):
        from tfmis.utils.io import atomic_write_json

        summary["input_bound"] = input_bound_diagnosis(trainer.config, trainer.history.records, self.threshold)
        atomic_write_json(trainer.out / "summary.json", summary)


def default_callbacks(trainer) -> list[Callback]:
    """What `tfmis.train` shows and writes around the loop; on the chief only (other workers write nothing)."""
    if not trainer.backend.is_chief:
        return []
    out = trainer.config.output
    callbacks = [Progress(out.progress_seconds)] if out.progress else []
    callbacks += [EpochLog(), InputBoundReport(trainer.config.profile.input_wait_threshold)]
    if out.tensorboard:
        callbacks.append(TensorBoard(trainer.out / "tensorboard"))
    callbacks.append(Curves(trainer.out / "training_curves.png", out.plot_seconds))
    if out.monitor_seconds:
        callbacks.append(Resources(trainer.out, out.monitor_seconds))
    profile = trainer.config.profile
    if profile.start_step is not None:
        callbacks.append(Profiler(trainer.out / "tensorboard", profile.start_step, profile.num_steps))
    return callbacks
