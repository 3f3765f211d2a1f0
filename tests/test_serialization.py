"""One serialisation harness for every custom Keras object in tfmis (keras-hub's `run_serialization_test`).

For each case of `CASES` (a custom layer, the U-Net built from them, a loss, a learning-rate schedule or an
optimizer, constructed with non-default arguments) `run_serialization_test` checks:

1. keras-hub's rule, "`get_config` returns the constructor's arguments": every `__init__` parameter of the
   class (and of the tfmis base classes its `**kwargs` reach), except `name`, `dtype` and `trainable`, which
   Keras handles, is a key of `get_config()`, and every argument the case passed is there with the value
   passed (tuples compared as the JSON lists they are saved as);
2. the class is registered for Keras serialisation under `tfmis>ClassName`;
3. `get_config` → JSON → `from_config` gives an object of the same class whose `get_config()` is identical
   (as sorted JSON) and which has the same attributes (`dir`), and the same for
   `keras.saving.serialize_keras_object` → JSON → `deserialize_keras_object`;
4. each revived object computes what the original does: a layer or model, given the original's variables,
   the same outputs in inference and in training mode (dropout masks included); a loss, the same value; a
   schedule, the same rates at steps 0 … 100, eagerly and in a graph with a variable step (as the trainer
   calls it); an optimizer, the same variables after the same three gradient steps from the same start;
5. save → load (`keras.saving.save_model` / `load_model` of a `.keras` file, without `custom_objects`):
   a layer inside a `keras.Model` (or the U-Net model itself) comes back as the same class with the same
   config and the same outputs; a loss compiled into a model comes back with the same config and value; a
   schedule driving a saved optimizer gives the same rates; an optimizer compiled into a model and stepped
   twice comes back with the same config and slot variables and takes the same third step.

`test_every_custom_keras_class_has_a_case` fails when a custom Keras class is added to tfmis without a
case here. `DeepSupervisionLoss` is not a Keras object (it wraps a Python callable): its own test says what
is checked instead. Small tensors (1×8×8×8×2) keep the file fast on a CPU.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import re
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmis
from tfmis.losses import DeepSupervisionLoss, DiceCELoss, DiceFocalLoss, DiceLoss
from tfmis.networks.blocks import ConvNormAct, InstanceNormalization, RecomputableBlock, ResidualUnit, UpBlock
from tfmis.networks.unet import UNetConfig
from tfmis.optimizers.fused_adam import FusedAdam, FusedAdamW
from tfmis.optimizers.novograd import Novograd
from tfmis.optimizers.schedules import (
    ConstantLearningRate,
    CosineDecay,
    LinearWarmup,
    OncePerStep,
    PolyDecay,
)

LearningRateSchedule = keras.optimizers.schedules.LearningRateSchedule
KERAS_BASES = (keras.layers.Layer, keras.losses.Loss, LearningRateSchedule, keras.optimizers.Optimizer)
# constructor arguments Keras itself handles (they need not be, or are not, in a custom get_config)
KERAS_HANDLED = {"self", "name", "dtype", "trainable"}
SCHEDULE_STEPS = (0, 1, 2, 5, 10, 11, 50, 100)
# the packages whose Keras subclasses must have a case (scanned by import); every file of tfmis is also
# scanned for `register_keras_serializable`
MODEL_PACKAGES = ("tfmis.networks", "tfmis.losses", "tfmis.optimizers", "tfmis.metrics")
# custom Keras classes with no case of their own, and why
NOT_INSTANTIATED = {
    RecomputableBlock: "abstract base of ConvNormAct/ResidualUnit/UpBlock (`forward` raises "
    "NotImplementedError); its only argument, `recompute`, is checked through them",
}


def random_array(shape, seed=0, low=None, high=None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if low is not None:
        return rng.uniform(low, high, size=shape).astype("float32")
    return rng.normal(size=shape).astype("float32")


def as_json(value) -> str:
    """Sorted JSON: what a `.keras` file stores, with tuples and lists alike."""
    return json.dumps(value, sort_keys=True, indent=1)


def same_json(a, b) -> bool:
    """Equal once saved as JSON, floats to float32 precision (Keras keeps a float learning rate in a float32
    variable: `get_config()` returns 0.1 as 0.10000000149011612)."""
    a, b = json.loads(as_json(a)), json.loads(as_json(b))
    if isinstance(a, float) or isinstance(b, float):
        numbers = isinstance(a, (int, float)) and isinstance(b, (int, float))
        return numbers and bool(np.isclose(a, b, rtol=1e-7, atol=0))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def to_numpy(structure):
    return [keras.ops.convert_to_numpy(x) for x in keras.tree.flatten(structure)]


def assert_same_values(expected, actual, what: str, rtol=1e-6, atol=1e-6):
    expected, actual = to_numpy(expected), to_numpy(actual)
    assert len(expected) == len(actual), f"{what}: {len(actual)} values instead of {len(expected)}"
    for i, (e, a) in enumerate(zip(expected, actual)):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"{what} (value {i})")


# ------------------------------------------------------------------------------------- config checks


def constructor_parameters(cls) -> dict[str, inspect.Parameter]:
    """Parameters of the constructor of `cls` and of the tfmis base classes' constructors its `**kwargs` reach
    (those a Keras base class takes, e.g. a layer's `name`, are Keras' to handle)."""
    parameters, first = {}, True
    for base in cls.__mro__:
        if "__init__" not in vars(base):
            continue
        if not first and not base.__module__.startswith("tfmis."):
            break
        first = False
        signature = inspect.signature(base.__init__).parameters
        parameters.update({k: p for k, p in signature.items() if k not in parameters})
        if not any(p.kind is p.VAR_KEYWORD for p in signature.values()):
            break
    return {
        k: p
        for k, p in parameters.items()
        if k not in KERAS_HANDLED and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }


def check_config_has_constructor_arguments(instance, init_kwargs: dict) -> None:
    """keras-hub's rule: every constructor argument is in `get_config()`, with the value that was passed."""
    config = instance.get_config()
    missing = sorted(set(constructor_parameters(type(instance))) - set(config))
    assert not missing, f"{type(instance).__name__}.get_config() lacks constructor arguments {missing}"
    for key, value in init_kwargs.items():
        if key in KERAS_HANDLED:
            continue
        if isinstance(value, (LearningRateSchedule, keras.losses.Loss)):
            value = keras.saving.serialize_keras_object(value)
        assert same_json(config[key], value), (
            f"{type(instance).__name__}.get_config()[{key!r}] is {config[key]!r}, the constructor got {value!r}"
        )


def check_registered(cls) -> None:
    """The class is registered as `tfmis>ClassName`, so a `.keras` file loads without `custom_objects`."""
    name = keras.saving.get_registered_name(cls)
    assert name == f"tfmis>{cls.__name__}", f"{cls.__name__} is not registered for Keras serialisation"
    assert keras.saving.get_registered_object(name) is cls


def revive(instance) -> list[tuple[str, object]]:
    """The object revived both ways (keras-hub's two round trips), each through JSON, checked for the same
    class, the same `get_config()` and the same attributes; returned as (how, revived object)."""
    cls = type(instance)
    config_json = as_json(instance.get_config())
    revived = [
        ("get_config/from_config", cls.from_config(json.loads(config_json))),
        (
            "serialize/deserialize_keras_object",
            keras.saving.deserialize_keras_object(json.loads(as_json(keras.saving.serialize_keras_object(instance)))),
        ),
    ]
    reference_dir = set(dir(instance)) - {"__annotations__"}
    for how, obj in revived:
        assert type(obj) is cls, f"{how}: got a {type(obj).__name__}, not a {cls.__name__}"
        assert as_json(obj.get_config()) == config_json, f"{how}: get_config() changed"
        assert set(dir(obj)) - {"__annotations__"} == reference_dir, f"{how}: attributes differ"
    return revived


# ---------------------------------------------------------------------------------------- per kind


def randomise_weights(layer, seed=1) -> None:
    """Random weights everywhere (norm scales, PReLU slopes, moving statistics too), so that any setting
    the revived layer lost shows in its outputs; variances stay positive."""
    for i, weight in enumerate(layer.weights):
        if "variance" in weight.path:
            weight.assign(random_array(weight.shape, seed + i, 0.5, 1.5))
        else:
            weight.assign(0.5 * random_array(weight.shape, seed + i))


def check_layer(instance, inputs, tmp_path: Path) -> None:
    """Layers and models: same outputs (inference and training) from the revived object given the original's
    variables; a `.keras` save → load gives back the same class, config and inference outputs."""
    revived = revive(instance)
    instance(inputs, training=False)  # builds it
    randomise_weights(instance)
    state = [v.numpy() for v in instance.variables]  # weights, moving statistics, dropout seed states
    expected_inference = instance(inputs, training=False)
    expected_training = instance(inputs, training=True)  # the recompute path when recompute=True
    for variable, value in zip(instance.variables, state):
        variable.assign(value)
    for how, obj in revived:
        obj(inputs, training=False)
        assert [tuple(v.shape) for v in obj.variables] == [tuple(v.shape) for v in instance.variables], (
            f"{how}: variables differ"
        )
        for variable, value in zip(obj.variables, state):
            variable.assign(value)
        assert_same_values(expected_inference, obj(inputs, training=False), f"{how}: inference outputs")
        assert_same_values(expected_training, obj(inputs, training=True), f"{how}: training outputs")

    if isinstance(instance, keras.Model):
        model = instance
    else:
        symbolic = keras.tree.map_structure(lambda x: keras.Input(x.shape[1:]), inputs)
        model = keras.Model(symbolic, instance(symbolic))
    path = tmp_path / "model.keras"
    keras.saving.save_model(model, path)
    loaded = keras.saving.load_model(path)
    if not isinstance(instance, keras.Model):
        loaded_layer = loaded.get_layer(instance.name)
        assert type(loaded_layer) is type(instance)
        assert as_json(loaded_layer.get_config()) == as_json(instance.get_config()), "saved → loaded: config"
    else:
        assert as_json(loaded.get_config()) == as_json(instance.get_config()), "saved → loaded: config"
    assert_same_values(expected_inference, loaded(inputs, training=False), "saved → loaded: inference outputs")


def tiny_model() -> keras.Model:
    """A 1×1×1 convolution from 2 to 3 channels, with fixed weights: a model to compile things into."""
    images = keras.Input((8, 8, 8, 2))
    model = keras.Model(images, keras.layers.Conv3D(3, 1, name="conv")(images))
    model.set_weights([random_array((1, 1, 1, 2, 3), 2), random_array((3,), 3)])
    return model


def check_loss(instance, inputs, tmp_path: Path) -> None:
    """Losses: the revived loss gives the same value on the same (labels, logits); compiled into a model
    saved as `.keras`, the loaded model's loss has the same class, config and value."""
    labels, logits = inputs
    expected = instance(labels, logits)
    assert np.isfinite(float(expected))
    for how, obj in revive(instance):
        assert_same_values(expected, obj(labels, logits), f"{how}: loss value")

    model = tiny_model()
    model.compile(optimizer="sgd", loss=instance)
    keras.saving.save_model(model, tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert type(loaded.loss) is type(instance)
    assert as_json(loaded.loss.get_config()) == as_json(instance.get_config()), "saved → loaded: config"
    assert_same_values(expected, loaded.loss(labels, logits), "saved → loaded: loss value")


def schedule_values(schedule) -> list:
    """Rates at `SCHEDULE_STEPS`, eagerly, then in one graph reading a variable step (as an optimizer does)."""
    eager = [schedule(step) for step in SCHEDULE_STEPS]
    step = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def in_graph():
        return schedule(step)

    graph = []
    for value in SCHEDULE_STEPS:
        step.assign(value)
        graph.append(in_graph())
    return eager + graph


def check_schedule(instance, inputs, tmp_path: Path) -> None:
    """Schedules: the revived schedule gives the same rates at steps 0 … 100; as the learning rate of an
    optimizer compiled into a model saved as `.keras`, the loaded optimizer gives the same rates."""
    expected = schedule_values(instance)
    assert len({round(float(v), 12) for v in expected}) > 1 or isinstance(instance, ConstantLearningRate)
    for how, obj in revive(instance):
        assert_same_values(expected, schedule_values(obj), f"{how}: rates")

    model = tiny_model()
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=instance), loss="mse")
    model.optimizer.build(model.trainable_variables)
    keras.saving.save_model(model, tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    saved_schedule = loaded.optimizer.get_config()["learning_rate"]
    assert saved_schedule["registered_name"] == keras.saving.get_registered_name(type(instance))
    rates = []
    for step in SCHEDULE_STEPS:
        loaded.optimizer.iterations.assign(step)
        rates.append(loaded.optimizer.learning_rate)
    assert_same_values(expected[: len(SCHEDULE_STEPS)], rates, "saved → loaded: the optimizer's rates")


def gradient_steps(variables, num_steps=3) -> list[list[np.ndarray]]:
    """Fixed gradients, shrinking step by step (so AMSGrad's running maximum and the first-step rules
    matter), with mixed signs."""
    return [
        [(2.0**-step) * random_array(v.shape, 10 * step + i) for i, v in enumerate(variables)]
        for step in range(num_steps)
    ]


def check_optimizer(instance, inputs, tmp_path: Path) -> None:
    """Optimizers: compiled into a model, stepped twice and saved as `.keras`, the loaded optimizer has the
    same config and slot variables and takes the same third step; each revived optimizer, stepping copies of
    the same starting variables with the same three gradients, ends at the same variables."""
    revived = revive(instance)  # before any step: unbuilt, like a config read from a file
    model = tiny_model()
    start = [v.numpy() for v in model.trainable_variables]
    model.compile(optimizer=instance, loss="mse")
    steps = gradient_steps(model.trainable_variables)
    for gradients in steps[:2]:
        instance.apply(gradients, model.trainable_variables)
    keras.saving.save_model(model, tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert type(loaded.optimizer) is type(instance)
    assert as_json(loaded.optimizer.get_config()) == as_json(instance.get_config()), "saved → loaded: config"
    assert [v.path for v in loaded.optimizer.variables] == [v.path for v in instance.variables]
    assert_same_values(
        instance.variables, loaded.optimizer.variables, "saved → loaded: optimizer variables", rtol=0, atol=0
    )
    instance.apply(steps[2], model.trainable_variables)
    loaded.optimizer.apply(steps[2], loaded.trainable_variables)
    expected = model.trainable_variables
    assert not all(np.array_equal(a, b) for a, b in zip(start, to_numpy(expected))), "the steps moved nothing"
    assert_same_values(expected, loaded.trainable_variables, "saved → loaded: variables after the third step")

    for how, obj in revived:
        variables = [keras.Variable(value, name=v.name) for value, v in zip(start, model.trainable_variables)]
        for gradients in steps:
            obj.apply(gradients, variables)
        assert_same_values(expected, variables, f"{how}: variables after three steps")


def check_by_kind(instance, inputs, tmp_path: Path) -> None:
    for kind, check in (
        (keras.layers.Layer, check_layer),
        (keras.losses.Loss, check_loss),
        (LearningRateSchedule, check_schedule),
        (keras.optimizers.Optimizer, check_optimizer),
    ):
        if isinstance(instance, kind):
            return check(instance, inputs, tmp_path)
    raise TypeError(f"no serialisation check for {type(instance).__name__}")


def run_serialization_test(instance, init_kwargs: dict | None, inputs, tmp_path: Path) -> None:
    """keras-hub's `run_serialization_test` for a tfmis object: the constructor-argument rule and the
    registration (for tfmis classes; `init_kwargs` None for a Keras-built object such as the functional
    U-Net), the two config round trips, the same outputs from the revived objects, and save → load."""
    if init_kwargs is not None:
        check_config_has_constructor_arguments(instance, init_kwargs)
        check_registered(type(instance))
    check_by_kind(instance, inputs, tmp_path)


# ------------------------------------------------------------------------------------------- cases


def unet(deep_supervision=False, **architecture):
    config = UNetConfig(in_channels=2, num_classes=3, **architecture)
    model, training_model = config.build_for_training()
    return training_model if deep_supervision else model


IMAGES = random_array((1, 8, 8, 8, 2))
# labels 0..2 in blobs and logits that partly agree with them: every loss term is away from its extremes
LABELS = np.zeros((1, 8, 8, 8), np.int32)
LABELS[:, 2:6, 2:7, 1:5] = 1
LABELS[:, 3:5, 3:5, 2:4] = 2
LOGITS = 2.0 * np.eye(3, dtype="float32")[LABELS] + random_array((1, 8, 8, 8, 3), 4)
SIGMOID_LOGITS = LOGITS[..., 1:] - 1.0  # two sigmoid channels (classes 1 and 2)
# the U-Net's decoder input pair: coarse features (stride (2, 2, 1) below) and the skip
UP_INPUTS = [random_array((1, 4, 4, 8, 4), 5), IMAGES]

# (id, factory, constructor kwargs or None, inputs); ids start with the class name
LAYER_CASES = [
    (
        "ConvNormAct-group-anisotropic-dropout-recompute",
        ConvNormAct,
        dict(
            filters=4,
            kernel_size=(3, 3, 1),
            strides=(2, 2, 1),
            norm="group",
            norm_groups=2,
            activation="leaky_relu",
            dropout=0.25,
            kernel_initializer="pytorch",
            recompute=True,
        ),
        IMAGES,
    ),
    (
        "ConvNormAct-transposed-batch",
        ConvNormAct,
        dict(filters=4, kernel_size=3, strides=(2, 1, 2), norm="batch", transposed=True, recompute=True),
        IMAGES,
    ),
    ("ConvNormAct-conv_only", ConvNormAct, dict(filters=3, kernel_size=1, conv_only=True), IMAGES),
    ("InstanceNormalization-no_center", InstanceNormalization, dict(epsilon=1e-3, center=False), IMAGES),
    (
        "ResidualUnit-batch-anisotropic-projection-recompute",
        ResidualUnit,
        dict(
            filters=4,
            strides=(2, 2, 1),
            subunits=3,
            kernel_size=(3, 3, 1),
            norm="batch",
            activation="leaky_relu",
            dropout=0.1,
            kernel_initializer="pytorch",
            recompute=True,
        ),
        IMAGES,
    ),
    (
        "ResidualUnit-instance-identity",
        ResidualUnit,
        dict(filters=2, strides=1, subunits=1, norm="instance", norm_groups=2),
        IMAGES,
    ),
    (
        "UpBlock-plain-group-recompute",
        UpBlock,
        dict(
            filters=4,
            strides=(2, 2, 1),
            num_res_units=0,
            kernel_size=3,
            norm="group",
            norm_groups=2,
            activation="leaky_relu",
            dropout=0.1,
            upsample_filters=6,
            kernel_initializer="pytorch",
            recompute=True,
        ),
        UP_INPUTS,
    ),
    (
        "UpBlock-residual-batch",
        UpBlock,
        dict(filters=4, strides=(2, 2, 1), num_res_units=2, norm="batch", upsample_filters=2),
        UP_INPUTS,
    ),
]
MODEL_CASES = [
    # the whole U-Net, output heads included; Functional models, so no constructor-argument check
    (
        "UNet-refine-deep_supervision-recompute-group",
        lambda: unet(
            deep_supervision=True,
            filters=(4, 8, 8),
            strides=((2, 2, 1), 2, 1),
            norm="group",
            norm_groups=2,
            recompute=True,
            dropout=0.1,
            output_upsampling="refine",
        ),
        None,
        IMAGES,
    ),
    (
        "UNet-transposed_image-batch-plain",
        lambda: unet(
            filters=(4, 8),
            strides=(2, (2, 2, 1)),
            num_res_units=0,
            norm="batch",
            activation="leaky_relu",
            kernel_initializer="pytorch",
            output_upsampling="transposed_image",
        ),
        None,
        IMAGES,
    ),
    (
        "UNet-light-instance",
        lambda: unet(filters=(4, 8), strides=(2, 2), num_res_units=1, norm="instance", output_upsampling="light"),
        None,
        IMAGES,
    ),
    (
        "UNet-full_resolution-deep_supervision",
        lambda: unet(deep_supervision=True, filters=(4, 8, 8), strides=(1, 2, (2, 2, 1)), kernel_size=(3, 3, 1)),
        None,
        IMAGES,
    ),
]
LOSS_CASES = [
    (
        "DiceLoss-sigmoid",
        DiceLoss,
        dict(
            include_background=False,
            activation="sigmoid",
            squared_pred=True,
            batch=True,
            smooth_nr=1e-3,
            smooth_dr=2e-3,
            reduction="sum",
        ),
        (LABELS, SIGMOID_LOGITS),
    ),
    (
        "DiceCELoss-lambdas",
        DiceCELoss,
        dict(
            lambda_dice=0.7,
            lambda_ce=1.3,
            include_background=False,
            squared_pred=True,
            smooth_nr=0.0,
            name="my_dice_ce",
        ),
        (LABELS, LOGITS),
    ),
    (
        "DiceFocalLoss-lambdas-alpha-softmax_focal",
        DiceFocalLoss,
        dict(gamma=1.5, lambda_dice=0.4, lambda_focal=2.0, alpha=0.3, focal_use_softmax=True, batch=True),
        (LABELS, LOGITS),
    ),
    (
        "DiceFocalLoss-sigmoid",
        DiceFocalLoss,
        dict(gamma=0.5, alpha=0.75, activation="sigmoid", include_background=False),
        (LABELS, SIGMOID_LOGITS),
    ),
    (
        "DiceCELoss-regions",
        DiceCELoss,
        dict(activation="sigmoid", regions=[[1, 2], [2]], batch=True),
        (LABELS, SIGMOID_LOGITS),
    ),
]
SCHEDULE_CASES = [
    ("ConstantLearningRate", ConstantLearningRate, dict(learning_rate=3e-4), None),
    ("PolyDecay", PolyDecay, dict(base_learning_rate=1e-2, decay_steps=50, power=2.0, min_learning_rate=1e-4), None),
    ("CosineDecay", CosineDecay, dict(base_learning_rate=1e-2, decay_steps=60, min_learning_rate=1e-3), None),
    (
        "LinearWarmup-PolyDecay",
        LinearWarmup,
        dict(schedule=PolyDecay(1e-2, decay_steps=90, power=0.5), warmup_steps=10),
        None,
    ),
    (
        "LinearWarmup-ConstantLearningRate",
        LinearWarmup,
        dict(schedule=ConstantLearningRate(1e-3), warmup_steps=5),
        None,
    ),
    (
        "OncePerStep-LinearWarmup-CosineDecay",
        OncePerStep,
        dict(schedule=LinearWarmup(CosineDecay(1e-2, decay_steps=40, min_learning_rate=1e-4), warmup_steps=10)),
        None,
    ),
]
OPTIMIZER_CASES = [
    (
        "Novograd-amsgrad-grad_averaging-warmup",
        Novograd,
        dict(
            learning_rate=OncePerStep(LinearWarmup(PolyDecay(5e-2, decay_steps=20), warmup_steps=2)),
            beta_1=0.8,
            beta_2=0.98,
            epsilon=1e-6,
            weight_decay=1e-2,
            grad_averaging=True,
            amsgrad=True,
            clipnorm=1.0,
        ),
        None,
    ),
    ("Novograd-defaults-float_rate", Novograd, dict(learning_rate=0.1), None),
    (
        "FusedAdam-weight_decay-warmup",
        FusedAdam,
        dict(
            learning_rate=LinearWarmup(CosineDecay(1e-1, decay_steps=10), warmup_steps=1),
            beta_1=0.8,
            beta_2=0.95,
            epsilon=1e-6,
            weight_decay=1e-2,
            global_clipnorm=5.0,
        ),
        None,
    ),
    ("FusedAdam-amsgrad", FusedAdam, dict(learning_rate=0.05, amsgrad=True), None),
    (
        "FusedAdamW",
        FusedAdamW,
        dict(
            learning_rate=OncePerStep(LinearWarmup(ConstantLearningRate(1e-1), warmup_steps=1)),
            weight_decay=0.1,
            beta_2=0.9,
            epsilon=1e-5,
        ),
        None,
    ),
]
CASES = LAYER_CASES + MODEL_CASES + LOSS_CASES + SCHEDULE_CASES + OPTIMIZER_CASES


@pytest.mark.parametrize("factory, init_kwargs, inputs", [case[1:] for case in CASES], ids=[c[0] for c in CASES])
def test_config_round_trip_and_save_load_keep_arguments_and_outputs(factory, init_kwargs, inputs, tmp_path):
    """`get_config` holds every constructor argument with its value; `get_config` → `from_config` and
    `serialize` → `deserialize_keras_object` (through JSON) give the same class, config and attributes and
    the same outputs (layer/model outputs in inference and training, loss values, schedule rates, optimizer
    steps); a `.keras` save → load without `custom_objects` gives the same config and outputs."""
    instance = factory() if init_kwargs is None else factory(**init_kwargs)
    run_serialization_test(instance, init_kwargs, inputs, tmp_path)


def test_deep_supervision_loss_rebuilt_from_its_serialised_parts():
    """`DeepSupervisionLoss` is not a Keras object and cannot be serialised as one: it wraps any Python
    callable `loss_fn` (a lambda or function has no config), and the trainer rebuilds it from the training
    config on every run, so it has no `get_config`. What is checked instead: its constructor takes exactly
    `loss_fn`, `factors` and `weights` (a new argument must be added here), and rebuilt from a Keras
    serialisation of its (Keras) `loss_fn` plus its `factors` and `weights` through JSON, it gives the same
    loss on the same outputs."""
    assert list(inspect.signature(DeepSupervisionLoss.__init__).parameters) == ["self", "loss_fn", "factors", "weights"]
    inner = DiceFocalLoss(gamma=1.0, lambda_focal=0.5, include_background=False)
    original = DeepSupervisionLoss(inner, factors=[(2, 2, 1), (4, 4, 2)], weights=[0.6, 0.3, 0.1])
    parts = json.loads(
        as_json(
            {
                "loss_fn": keras.saving.serialize_keras_object(original.loss_fn),
                "factors": original.factors,
                "weights": original.weights,
            }
        )
    )
    rebuilt = DeepSupervisionLoss(
        keras.saving.deserialize_keras_object(parts["loss_fn"]), parts["factors"], parts["weights"]
    )
    assert type(rebuilt.loss_fn) is DiceFocalLoss
    assert as_json(rebuilt.loss_fn.get_config()) == as_json(inner.get_config())
    assert rebuilt.factors == original.factors and rebuilt.weights == original.weights
    outputs = [LOGITS, LOGITS[:, 1::2, 1::2], LOGITS[:, 2::4, 2::4, 1::2]]
    expected = original(LABELS, outputs)
    assert_same_values(expected, rebuilt(LABELS, outputs), "rebuilt deep-supervision loss")
    # and the weights matter: a deep-supervision loss that lost them would not pass the line above
    assert not np.isclose(float(expected), float(DeepSupervisionLoss(inner, original.factors)(LABELS, outputs)))


def test_constructor_argument_check_sees_inherited_and_keras_defined_arguments():
    """The argument list `check_config_has_constructor_arguments` demands in `get_config()` includes the
    arguments a tfmis base class takes through `**kwargs` (`recompute`, the Dice options) and, for a class
    with Keras' constructor (FusedAdam), Keras' arguments; and leaves out `name`, `dtype` and `trainable`."""
    residual = constructor_parameters(ResidualUnit)
    assert {"filters", "strides", "subunits", "norm", "kernel_initializer", "recompute"} <= set(residual)
    assert {"lambda_ce", "include_background", "smooth_dr"} <= set(constructor_parameters(DiceCELoss))
    assert {"learning_rate", "amsgrad", "weight_decay", "clipnorm"} <= set(constructor_parameters(FusedAdam))
    assert {"schedule", "warmup_steps"} == set(constructor_parameters(LinearWarmup))
    assert not KERAS_HANDLED & (set(residual) | set(constructor_parameters(Novograd)))


def custom_keras_classes() -> set[type]:
    """Keras layers, losses, schedules and optimizers defined in tfmis' model packages, and every class any
    tfmis file decorates with `register_keras_serializable`."""
    found = set()
    for package_name in MODEL_PACKAGES:
        package = importlib.import_module(package_name)
        for module_info in pkgutil.walk_packages(package.__path__, package_name + "."):
            module = importlib.import_module(module_info.name)
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if cls.__module__ == module.__name__ and issubclass(cls, KERAS_BASES):
                    found.add(cls)
    root = Path(tfmis.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for class_name in re.findall(r"register_keras_serializable\([^)]*\)\s*\nclass (\w+)", text):
            module = importlib.import_module(".".join(path.relative_to(root.parent).with_suffix("").parts))
            found.add(getattr(module, class_name))
    return found


def test_every_custom_keras_class_has_a_case():
    """Every custom Keras layer, loss, schedule and optimizer of tfmis (found by import and by its
    `register_keras_serializable` decorator) is instantiated by a case of `CASES`, or listed in
    `NOT_INSTANTIATED` with the reason; and the scan finds the classes known today."""
    covered = {case[1] for case in CASES if inspect.isclass(case[1])}
    found = custom_keras_classes()
    assert {
        ConvNormAct,
        ResidualUnit,
        UpBlock,
        DiceLoss,
        DiceCELoss,
        DiceFocalLoss,
        ConstantLearningRate,
        PolyDecay,
        CosineDecay,
        LinearWarmup,
        OncePerStep,
        Novograd,
        FusedAdam,
        FusedAdamW,
        RecomputableBlock,
    } <= found
    uncovered = sorted(cls.__qualname__ for cls in found - covered - set(NOT_INSTANTIATED))
    assert not uncovered, f"custom Keras classes without a serialisation case: {uncovered}"
