"""Resuming a run: a new random stream, exactly the committed state, and one commit point per epoch."""

from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_config

from tfmis.data.pipeline import build_train_dataset

WHOLE_VOLUMES = [  # a patch larger than every volume: each crop is its whole (padded) volume, unaugmented,
    # so a batch shows which volumes the stream visited, whatever the crop seeds are
    "pipeline.patch_size=[32,32,32]",
    "pipeline.num_crops_per_image=1",
    "pipeline.num_images_per_batch=1",
    "pipeline.augment.flip_prob=0",
    "pipeline.augment.rot90_prob=0",
    "pipeline.augment.intensity_prob=0",
    "pipeline.augment.noise_prob=0",
    "pipeline.shuffle_crops=1",  # no crop buffer mixing one pass into the next
]


def _volume_order(config, seed_offset, steps=6):
    import keras

    keras.utils.set_random_seed(config.training.seed)  # as the trainer does before building its pipeline
    return [
        float(images.sum())
        for images, _ in build_train_dataset(config, seed_offset=seed_offset).take(steps).as_numpy_iterator()
    ]


def test_resumed_stream_does_not_replay_the_first_epochs_volume_order(converted_dataset, tmp_path):
    """The train stream of a run resumed at epoch 4 (seed_offset 3) visits the volumes in another order
    than epoch 1 did; the same offset gives the same order again."""
    config = tiny_config(converted_dataset, tmp_path, *WHOLE_VOLUMES)
    first = _volume_order(config, 0)
    assert len(set(first)) == 6  # six distinct training volumes, one per step
    resumed = _volume_order(config, 3)
    assert sorted(resumed) == sorted(first)  # the same six volumes, one pass...
    assert resumed != first  # ...in another order
    assert _volume_order(config, 3) == resumed


class SimulatedCrash(BaseException):
    """Stands in for a kill: nothing in the trainer catches it, and nothing runs after it."""


def _rising_validation(trainer):
    """Real validation, with the mean Dice replaced by a rising sequence so that every epoch is a new best."""
    real, calls = trainer.evaluate, []

    def evaluate(dataset):
        calls.append(1)
        return {**real(dataset), "mean_dice": 0.1 * len(calls)}

    trainer.evaluate = evaluate


def _model_weights_in_checkpoint(config, prefix):
    from tfmis.engine.trainer import Trainer

    model = Trainer(config).model
    import tensorflow as tf

    tf.train.Checkpoint(model=model).read(prefix).expect_partial().assert_existing_objects_matched()
    return [w.numpy() for w in model.weights]


@pytest.mark.parametrize("crash", ["in the checkpoint save", "after the checkpoint"])
def test_a_crash_between_an_epochs_outputs_leaves_them_consistent(converted_dataset, tmp_path, crash, monkeypatch):
    """A crash at epoch 2 (simulated by an exception) either inside the checkpoint save (before the commit
    point) or right after it (while the history is written): after --resume, history epochs, checkpoint
    and best.weights.h5 all describe the same committed epochs."""
    import json

    from tfmis.engine.history import History
    from tfmis.engine.trainer import BEST_WEIGHTS, Trainer

    config = tiny_config(converted_dataset, tmp_path / "run", "training.epochs=3", "training.keep_checkpoints=5")
    trainer = Trainer(config)
    _rising_validation(trainer)
    if crash == "in the checkpoint save":
        save = trainer.manager.save

        def crashing_save(checkpoint_number=None, **kwargs):
            if checkpoint_number == 2:
                raise SimulatedCrash()
            return save(checkpoint_number=checkpoint_number, **kwargs)

        monkeypatch.setattr(trainer.manager, "save", crashing_save)
        committed = 1
    else:
        append = History.append

        def crashing_append(self, record):
            if record["epoch"] == 2:
                raise SimulatedCrash()
            return append(self, record)

        monkeypatch.setattr(History, "append", crashing_append)
        committed = 2
    with pytest.raises(SimulatedCrash):
        trainer.fit()
    monkeypatch.undo()
    run = tmp_path / "run"
    assert tf_latest(run) == f"ckpt-{committed}"
    resumed_config = tiny_config(converted_dataset, run, f"training.epochs={committed}", "training.keep_checkpoints=5")
    Trainer(resumed_config).fit(resume=True)  # nothing left to train: only the recovery runs
    epochs = [json.loads(line)["epoch"] for line in (run / "history.jsonl").read_text().splitlines()]
    assert epochs == list(range(1, committed + 1))
    best = json.loads((run / "summary.json").read_text())["best_epoch"]
    assert best == committed  # every epoch was a new best
    model = Trainer(resumed_config).model
    model.load_weights(str(run / BEST_WEIGHTS))
    for a, b in zip(
        [w.numpy() for w in model.weights],
        _model_weights_in_checkpoint(resumed_config, str(run / "checkpoints" / f"ckpt-{best}")),
    ):
        np.testing.assert_array_equal(a, b)


def tf_latest(run):
    import tensorflow as tf

    return Path(tf.train.latest_checkpoint(str(run / "checkpoints"))).name


def test_killed_run_resumes_with_the_committed_weights_optimizer_state_and_learning_rate(converted_dataset, tmp_path):
    """SIGKILL a real training process mid-run; a resumed trainer holds exactly the last checkpoint's model
    and optimizer variables, optimizer.iterations = epochs done x steps per epoch, and the cosine learning
    rate of that step (MONAI/PyTorch CosineAnnealing formula written out); the resumed run then finishes
    every epoch once."""
    import json
    import math
    import signal
    import subprocess
    import sys
    import time

    import tensorflow as tf

    from tfmis.config import save_config
    from tfmis.engine.trainer import Trainer

    config = tiny_config(
        converted_dataset,
        tmp_path / "run",
        "training.epochs=8",
        "training.steps_per_epoch=3",
        "optimizer.name=adamw",
        "optimizer.schedule=cosine",
        "optimizer.learning_rate=0.01",
    )
    save_config(config, tmp_path / "config.yaml")
    command = [sys.executable, "-m", "tfmis.train", "--config", str(tmp_path / "config.yaml")]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = tmp_path / "run" / "checkpoints"
    deadline = time.time() + 300
    while (
        time.time() < deadline
        and proc.poll() is None
        and not (tf.train.latest_checkpoint(str(checkpoints)) or "").endswith("ckpt-2")
    ):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    latest = tf.train.latest_checkpoint(str(checkpoints))
    done = int(latest.rsplit("-", 1)[1])
    assert 2 <= done < 8, "the run was not interrupted mid-way"

    trainer = Trainer(config)
    assert trainer.restore(resume=True) == done
    reader = tf.train.load_checkpoint(latest)
    saved = [
        np.asarray(reader.get_tensor(k))
        for k in reader.get_variable_to_shape_map()
        if k != "_CHECKPOINTABLE_OBJECT_GRAPH"
    ]
    restored = list(trainer.model.weights) + list(trainer.optimizer.variables)  # weights, moments, iterations
    for v in restored:  # every variable equals a saved tensor: none was left at its initial value
        assert any(s.shape == tuple(v.shape) and np.array_equal(s, v.numpy()) for s in saved), v.path
    steps = done * 3
    assert int(trainer.optimizer.iterations.numpy()) == steps
    assert reader.get_tensor("optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE") == steps
    expected_lr = 0.5 * 0.01 * (1 + math.cos(math.pi * steps / (8 * 3)))
    assert float(trainer.optimizer.learning_rate.numpy()) == pytest.approx(expected_lr, rel=1e-6)
    history = [json.loads(line)["epoch"] for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert history == list(range(1, done + 1))

    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and "already holds a training run" in again.stderr and "--resume" in again.stderr
    resumed = subprocess.run(command + ["--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resuming from {latest}" in resumed.stderr and "best mean Dice" in resumed.stdout
    epochs = [json.loads(line)["epoch"] for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert epochs == list(range(1, 9))
