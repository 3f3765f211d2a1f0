"""What a run folder holds and how prediction loads it: checkpoints that must match the model, and a
run folder that is enough on its own to predict with."""

import numpy as np
import pytest
import tensorflow as tf

from tfmis.inference.predictor import load_weights
from tfmis.networks.unet import build_unet


def _weights(model):
    return [w.numpy().copy() for w in model.weights]


@pytest.mark.parametrize("saved", ["no model", "shallower model", "other classes"])
def test_tf_checkpoint_that_does_not_fit_the_model_is_refused(tmp_path, saved):
    """A tf.train checkpoint without this model's variables fails naming the checkpoint, never loads nothing."""
    model = build_unet(2, 3, filters=(4, 8, 16), strides=(1, 2, 2), num_res_units=0)
    if saved == "no model":
        prefix = tf.train.Checkpoint(epoch=tf.Variable(3)).save(str(tmp_path / "ckpt"))
    elif saved == "shallower model":
        other = build_unet(2, 3, filters=(4, 8), strides=(1, 2), num_res_units=0)
        prefix = tf.train.Checkpoint(model=other).save(str(tmp_path / "ckpt"))
    else:
        other = build_unet(2, 5, filters=(4, 8, 16), strides=(1, 2, 2), num_res_units=0)
        prefix = tf.train.Checkpoint(model=other).save(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match=rf"checkpoint {prefix}.*does not fit"):
        load_weights(model, prefix)


def test_tf_checkpoint_of_the_same_model_loads_every_weight(tmp_path):
    """A trainer-style checkpoint (model + other state) restores exactly the saved weights."""
    saved = build_unet(2, 3, filters=(4, 8, 16), strides=(1, 2, 2), num_res_units=0)
    prefix = tf.train.Checkpoint(model=saved, epoch=tf.Variable(7)).save(str(tmp_path / "checkpoints" / "ckpt"))
    model = build_unet(2, 3, filters=(4, 8, 16), strides=(1, 2, 2), num_res_units=0)
    assert not all(np.array_equal(a, b) for a, b in zip(_weights(saved), _weights(model)))
    assert str(load_weights(model, tmp_path / "checkpoints")) == prefix  # the folder means its latest checkpoint
    for a, b in zip(_weights(saved), _weights(model)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_predict_from_a_run_folder_alone_after_the_tfrecords_are_gone(tmp_path):
    """`python -m tfmis.predict --checkpoint RUN` works with no --config after the TFRecord folder is deleted
    and the run folder moved, and writes the same label maps as before."""
    import shutil
    import subprocess
    import sys

    import nibabel as nib
    from conftest import make_msd_dataset, tiny_config

    from tfmis.config import save_config
    from tfmis.data.convert import ConversionConfig, convert
    from tfmis.engine.trainer import Trainer

    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=4)
    records = tmp_path / "tfrecords"
    convert(ConversionConfig(str(source), str(records), split=(0.75, 0.25), shards=1, workers=1, progress=False))
    config = tiny_config(records, tmp_path / "run", "training.epochs=1")
    Trainer(config).fit()
    save_config(config, tmp_path / "run" / "config.yaml")  # as `python -m tfmis.train` leaves it

    def predict(run, output, *extra):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "tfmis.predict",
                "--checkpoint",
                str(run),
                "--input",
                str(source / "imagesTs"),
                "--output",
                str(output),
                "--quiet",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )

    before = predict(tmp_path / "run", tmp_path / "before", "--config", str(tmp_path / "run" / "config.yaml"))
    assert before.returncode == 0, before.stderr[-2000:]
    shutil.rmtree(records)
    shutil.move(tmp_path / "run", tmp_path / "moved" / "run")
    after = predict(tmp_path / "moved" / "run", tmp_path / "after")
    assert after.returncode == 0, after.stderr[-2000:]
    for name in ("case_900.nii.gz",):
        a, b = nib.load(str(tmp_path / "before" / name)), nib.load(str(tmp_path / "after" / name))
        np.testing.assert_array_equal(np.asarray(a.dataobj), np.asarray(b.dataobj))
        np.testing.assert_array_equal(a.affine, b.affine)


def test_predict_without_config_outside_a_run_folder_says_what_to_give(tmp_path, capsys):
    """No --config and no config.yaml in or above --checkpoint: exit 1 naming --config."""
    from tfmis.predict import main as predict_main

    (tmp_path / "loose.weights.h5").write_bytes(b"")
    code = predict_main(
        [
            "--checkpoint",
            str(tmp_path / "loose.weights.h5"),
            "--input",
            str(tmp_path),
            "--output",
            str(tmp_path / "out"),
        ]
    )
    assert code == 1
    assert f"no config.yaml in or above --checkpoint {tmp_path / 'loose.weights.h5'}" in capsys.readouterr().err
