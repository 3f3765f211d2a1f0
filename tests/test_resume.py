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


# A training process that SIGKILLs itself at one point of epoch 2's commit (RunBookkeeping.commit_epoch): inside
# TensorFlow's real checkpoint save, or just after it. argv: config.yaml, where.
KILLED_RUN = r"""
import os, signal, sys

from tensorflow.python.checkpoint import checkpoint_management, functional_saver

from tfmis.config import load_config
from tfmis.engine.history import History
from tfmis.engine.trainer import Trainer

where = sys.argv[2]


def kill():
    os.kill(os.getpid(), signal.SIGKILL)


if where == "shards written, not merged":  # ckpt-2_temp/part-*: the save's data written, its files not yet made
    merge = functional_saver.gen_io_ops.merge_v2_checkpoints

    def merge_or_kill(checkpoint_prefixes, destination_prefix, *args, **kwargs):
        if destination_prefix.numpy().decode().endswith("ckpt-2"):
            kill()
        return merge(checkpoint_prefixes, destination_prefix, *args, **kwargs)

    functional_saver.gen_io_ops.merge_v2_checkpoints = merge_or_kill
elif where == "files written, not indexed":  # ckpt-2.index/.data complete, the `checkpoint` file not updated
    update = checkpoint_management.update_checkpoint_state_internal

    def update_or_kill(save_dir, model_checkpoint_path, *args, **kwargs):
        if model_checkpoint_path.endswith("ckpt-2"):
            kill()
        return update(save_dir, model_checkpoint_path, *args, **kwargs)

    checkpoint_management.update_checkpoint_state_internal = update_or_kill
else:  # "after the checkpoint": committed, the history record not yet appended
    append = History.append

    def append_or_kill(self, record):
        if record["epoch"] == 2:
            kill()
        return append(self, record)

    History.append = append_or_kill

trainer = Trainer(load_config(sys.argv[1]))
real, calls = trainer.evaluate, []


def rising(dataset):  # real validation, the mean Dice rising so that every epoch is a new best
    calls.append(1)
    return {**real(dataset), "mean_dice": 0.1 * len(calls)}


trainer.evaluate = rising
trainer.fit()
"""


def _model_weights_in_checkpoint(config, prefix):
    from tfmis.engine.trainer import Trainer

    model = Trainer(config).model
    import tensorflow as tf

    tf.train.Checkpoint(model=model).read(prefix).expect_partial().assert_existing_objects_matched()
    return [w.numpy() for w in model.weights]


@pytest.mark.parametrize(
    "crash, committed",
    [("shards written, not merged", 1), ("files written, not indexed", 1), ("after the checkpoint", 2)],
)
@pytest.mark.slow
def test_a_kill_inside_or_after_the_real_checkpoint_save_leaves_the_epochs_outputs_consistent(
    converted_dataset, tmp_path, crash, committed
):
    """A real training process SIGKILLs itself during epoch 2's commit: inside TensorFlow's checkpoint save
    (after the shard files under ckpt-2_temp/ are written, before the merge makes ckpt-2.index/.data), between
    the finished ckpt-2 files and the `checkpoint` file that names them, or after the commit (before the history
    record is appended). On disk: the half-written ckpt-2 files and epoch 2's staged outputs are left behind, and
    `latest_checkpoint` is the committed epoch. After --resume with nothing left to train, history epochs,
    summary's best epoch and best.weights.h5 (= that checkpoint's weights) all describe the committed epochs and
    the staged files are gone; resuming on to epoch 3 then trains epochs committed+1..3 once each and leaves
    neither a ckpt-*_temp folder nor staged files."""
    import json
    import subprocess
    import sys

    from tfmis.config import save_config
    from tfmis.engine.bookkeeping import STAGED_BEST, STAGED_EPOCH
    from tfmis.engine.trainer import Trainer
    from tfmis.utils.run_files import BEST_WEIGHTS

    run = tmp_path / "run"
    config = tiny_config(converted_dataset, run, "training.epochs=3", "training.keep_checkpoints=5")
    save_config(config, tmp_path / "config.yaml")
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, str(tmp_path / "config.yaml"), crash], capture_output=True, timeout=600
    )
    assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL, at the chosen point
    checkpoints = run / "checkpoints"
    assert tf_latest(run) == f"ckpt-{committed}"
    assert (run / STAGED_EPOCH).is_file() and (run / STAGED_BEST).is_file()  # epoch 2's, never published
    if crash == "shards written, not merged":
        assert list((checkpoints / "ckpt-2_temp").glob("part-*")) and not list(checkpoints.glob("ckpt-2.*"))
    if crash == "files written, not indexed":
        assert (checkpoints / "ckpt-2.index").is_file()  # complete but never committed: must be ignored

    resumed_config = tiny_config(converted_dataset, run, f"training.epochs={committed}", "training.keep_checkpoints=5")
    Trainer(resumed_config).fit(resume=True)  # nothing left to train: only the recovery runs
    epochs = [json.loads(line)["epoch"] for line in (run / "history.jsonl").read_text().splitlines()]
    assert epochs == list(range(1, committed + 1))
    best = json.loads((run / "summary.json").read_text())["best_epoch"]
    assert best == committed  # every epoch was a new best
    assert sorted(p.name for p in run.glob("*.staged*")) == []
    model = Trainer(resumed_config).model
    model.load_weights(str(run / BEST_WEIGHTS))
    for a, b in zip(
        [w.numpy() for w in model.weights],
        _model_weights_in_checkpoint(resumed_config, str(checkpoints / f"ckpt-{best}")),
    ):
        np.testing.assert_array_equal(a, b)

    Trainer(config).fit(resume=True)  # on to epoch 3: the uncommitted epoch 2 is trained again, over its leftovers
    epochs = [json.loads(line)["epoch"] for line in (run / "history.jsonl").read_text().splitlines()]
    assert epochs == [1, 2, 3] and tf_latest(run) == "ckpt-3"
    assert not list(checkpoints.glob("*_temp")) and not list(run.glob("*.staged*"))


def tf_latest(run):
    import tensorflow as tf

    return Path(tf.train.latest_checkpoint(str(run / "checkpoints"))).name


@pytest.mark.slow
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
