"""Trains a run while recording its model's weights at the end of every epoch: the reference that
tests/test_weights_sources.py compares every saved source of the run's weights with.

In the test's process (`train_recording(config)`), or in a fresh one for a run that needs logical devices made before
TensorFlow initialises its devices (runtime.model_parallel on the CPU): `python weights_sources.py CONFIG.yaml
OUT.npz` trains the config and writes the record (`read_record(OUT.npz)`).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

from tfmis.engine.callbacks import Callback


@dataclasses.dataclass
class Record:
    """The weights of the trainer's model ({path: array}) after each epoch's commit, and the best epoch."""

    epochs: dict[int, dict[str, np.ndarray]]
    best_epoch: int
    parallel: str = ""  # how runtime.model_parallel ran the training model ("" on one device)

    @property
    def last_epoch(self) -> int:
        return max(self.epochs)


class EpochWeights(Callback):
    """After each epoch's commit (its checkpoint `ckpt-<epoch>` written, and `best.weights.h5` when it improved),
    the trainer's model's weights, by path."""

    def __init__(self):
        self.record = Record({}, 0)

    def on_train_begin(self, trainer, start_epoch):
        self.record.parallel = trainer.parallel.describe() if trainer.parallel is not None else ""

    def on_epoch_end(self, trainer, epoch, record):
        self.record.epochs[epoch] = {w.path: np.array(w.numpy()) for w in trainer.model.weights}
        self.record.best_epoch = int(trainer.state.best_epoch.numpy())


def train_recording(config, **trainer_kwargs) -> Record:
    """Trains `config` from scratch; returns its record."""
    from tfmis.engine.trainer import Trainer

    recorder = EpochWeights()
    Trainer(config, callbacks=[recorder], **trainer_kwargs).fit()
    return recorder.record


def save_record(record: Record, path: str | Path) -> None:
    arrays = {f"{epoch}:{p}": value for epoch, weights in record.epochs.items() for p, value in weights.items()}
    np.savez(path, best_epoch=np.int64(record.best_epoch), parallel=np.str_(record.parallel), **arrays)


def read_record(path: str | Path) -> Record:
    with np.load(path) as saved:
        epochs: dict[int, dict[str, np.ndarray]] = {}
        for key in saved.files:
            if key not in ("best_epoch", "parallel"):
                epoch, weight_path = key.split(":", 1)
                epochs.setdefault(int(epoch), {})[weight_path] = saved[key]
        return Record(epochs, int(saved["best_epoch"]), str(saved["parallel"]))


if __name__ == "__main__":
    from tfmis.config import load_config

    save_record(train_recording(load_config(sys.argv[1])), sys.argv[2])
