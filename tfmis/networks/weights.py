"""Model weights in a tf.train checkpoint under their own names, so that another build of the model reads them back.

A tf.train checkpoint matches a Keras model's variables by their position in the object graph, and two builds of the
same U-Net do not always give the same graph (on the demo network 44 of 73 weights landed in the wrong place). The
trainer therefore also saves every weight of its training model in a dictionary keyed by the weight's path
(`encoder0/unit0/conv/kernel`), and prediction reads that dictionary into the inference model: matched by name.

Example:
```python
tf.train.Checkpoint(model=training_model, weights_by_path=weights_by_path(training_model)).save(prefix)
read_weights_by_path(inference_model, prefix)      # every weight of the inference model, by name
```
"""

from __future__ import annotations

import tensorflow as tf

CHECKPOINT_KEY = "weights_by_path"
_LEGACY_TRAINABLE = "optimizer/_trainable_variables/{}/.ATTRIBUTES/VARIABLE_VALUE"


class WeightsByPath(tf.Module):
    """A trackable dictionary {weight path: variable} of a Keras model's weights."""

    def __init__(self, model):
        super().__init__(name="weights_by_path")
        self.weights_dict = {w.path: w.value if hasattr(w, "value") else w for w in model.weights}


def weights_by_path(model) -> WeightsByPath:
    """The model's weights keyed by path, to pass to `tf.train.Checkpoint` as `weights_by_path=`."""
    return WeightsByPath(model)


def has_weights_by_path(prefix: str) -> bool:
    """Whether the checkpoint at `prefix` holds the weights under their names (written by this version's trainer)."""
    return any(name.startswith(CHECKPOINT_KEY + "/") for name, _ in tf.train.list_variables(prefix))


def _key(path: str) -> str:
    """The checkpoint key of a weight's path in the named dictionary (TensorFlow escapes "." as ".." and "/" as
    ".S" in object names)."""
    return f"{CHECKPOINT_KEY}/weights_dict/{path.replace('.', '..').replace('/', '.S')}/.ATTRIBUTES/VARIABLE_VALUE"


def read_weights_by_path(model, prefix: str) -> list[str]:
    """Reads every weight of `model` from the checkpoint's named weights; returns the paths not found there (or of
    another shape), having assigned none when any is missing."""
    reader = tf.train.load_checkpoint(prefix)
    shapes = reader.get_variable_to_shape_map()
    missing = [w.path for w in model.weights if tuple(shapes.get(_key(w.path), ())) != tuple(w.shape)]
    if missing:
        return missing
    for w in model.weights:
        w.assign(reader.get_tensor(_key(w.path)))
    return []


def read_legacy_trainable(training_model, prefix: str) -> list[str]:
    """For a checkpoint written before the named weights: reads the training model's trainable weights from the
    optimizer's list (the trainer builds its optimizer on `training_model.trainable_variables`, in that order);
    returns the paths that are missing or of another shape (then assigns none). Non-trainable weights are not in
    that list: they count as missing."""
    reader = tf.train.load_checkpoint(prefix)
    shapes = reader.get_variable_to_shape_map()
    missing = [w.path for w in training_model.non_trainable_variables]
    values = []
    for i, w in enumerate(training_model.trainable_variables):
        key = _LEGACY_TRAINABLE.format(i)
        if key not in shapes or tuple(shapes[key]) != tuple(w.shape):
            missing.append(w.path)
        else:
            values.append((w, key))
    if missing:
        return missing
    for w, key in values:
        w.assign(reader.get_tensor(key))
    return []
