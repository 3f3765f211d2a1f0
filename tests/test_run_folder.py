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
