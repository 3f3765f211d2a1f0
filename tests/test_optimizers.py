"""Novograd against a NumPy transcription of the paper and one of MONAI's Novograd, in every execution
mode the trainer uses (eager, tf.function, loss scaling, MirroredStrategy, checkpoints); schedules and the
optimizer factory."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmis.optimizers import (
    OPTIMIZER_NAMES,
    ConstantLearningRate,
    CosineDecay,
    LinearWarmup,
    Novograd,
    PolyDecay,
    ScheduleLength,
    build_optimizer,
    build_schedule,
)

SHAPES = [(3, 4), (4,), (2, 2, 2, 1, 3)]  # a dense kernel, a bias, a 3D conv kernel
NUM_STEPS = 20


# ----------------------------------------------------------------------------------------------------------------
# Reference: Ginsburg et al. 2019, Algorithm 1, per variable, in float64.
# ----------------------------------------------------------------------------------------------------------------


def novograd_reference(
    weights,
    gradient_steps,
    learning_rates,
    beta_1=0.9,
    beta_2=0.999,
    epsilon=1e-8,
    weight_decay=0.0,
    grad_averaging=False,
    amsgrad=False,
):
    """Weights, first moments and second moments after applying `gradient_steps` (one list per step)."""
    w = [np.array(x, np.float64) for x in weights]
    m = [np.zeros_like(x) for x in w]
    v = [0.0] * len(w)
    v_max = [0.0] * len(w)
    for t, (grads, lr) in enumerate(zip(gradient_steps, learning_rates), start=1):
        for i, g in enumerate(grads):
            g = np.asarray(g, np.float64)
            norm_sq = float(np.sum(g * g))
            v[i] = norm_sq if t == 1 else beta_2 * v[i] + (1.0 - beta_2) * norm_sq
            v_max[i] = max(v_max[i], v[i])
            u = g / (math.sqrt(v_max[i] if amsgrad else v[i]) + epsilon) + weight_decay * w[i]
            if grad_averaging and t > 1:
                u = (1.0 - beta_1) * u
            m[i] = beta_1 * m[i] + u
            w[i] = w[i] - lr * m[i]
    return w, m, v


def random_problem(seed=0, num_steps=NUM_STEPS):
    """Initial weights and a fixed gradient sequence whose size shrinks and grows again (so amsgrad's
    running maximum differs from v_t)."""
    rng = np.random.default_rng(seed)
    weights = [rng.normal(size=shape).astype(np.float32) for shape in SHAPES]
    magnitudes = 2.0 * 0.7 ** np.arange(num_steps) + 0.05 * np.arange(num_steps)
    steps = [[(rng.normal(size=shape) * mag).astype(np.float32) for shape in SHAPES] for mag in magnitudes]
    return weights, steps


def run_keras(optimizer, weights, gradient_steps, compiled=False):
    variables = [keras.Variable(w, dtype="float32") for w in weights]
    optimizer.build(variables)

    def apply(grads):
        optimizer.apply(grads, variables)

    apply = tf.function(apply) if compiled else apply
    for grads in gradient_steps:
        apply([tf.constant(g) for g in grads])
    return variables


def slots_of(optimizer, variables):
    index = [optimizer._get_variable_index(v) for v in variables]
    return (
        [optimizer._first_moments[i].numpy() for i in index],
        [float(optimizer._second_moments[i].numpy()) for i in index],
    )


def assert_close(actual, expected, rtol=1e-5, atol=1e-6):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(a), e, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------------------------------------------
# Novograd: numerics
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weight_decay, grad_averaging, amsgrad, compiled",
    [
        (0.0, False, False, False),
        (0.01, False, False, False),
        (0.0, True, False, False),
        (0.01, True, False, False),
        (0.0, False, True, False),
        (0.01, True, True, True),
    ],
)
def test_novograd_matches_numpy_reference(weight_decay, grad_averaging, amsgrad, compiled):
    weights, steps = random_problem()
    options = dict(
        beta_1=0.9, beta_2=0.98, epsilon=1e-8, weight_decay=weight_decay, grad_averaging=grad_averaging, amsgrad=amsgrad
    )
    optimizer = Novograd(learning_rate=0.05, **options)
    variables = run_keras(optimizer, weights, steps, compiled=compiled)
    expected_w, expected_m, expected_v = novograd_reference(weights, steps, [0.05] * NUM_STEPS, **options)
    assert_close(variables, expected_w)
    first, second = slots_of(optimizer, variables)
    assert_close(first, expected_m)
    np.testing.assert_allclose(second, expected_v, rtol=1e-5)
    assert int(optimizer.iterations.numpy()) == NUM_STEPS


def test_novograd_follows_learning_rate_schedule():
    weights, steps = random_problem(seed=1)
    schedule = PolyDecay(0.05, decay_steps=NUM_STEPS, power=0.9)
    variables = run_keras(Novograd(learning_rate=schedule), weights, steps, compiled=True)
    rates = [0.05 * (1 - t / NUM_STEPS) ** 0.9 for t in range(NUM_STEPS)]  # lr of step t uses iterations = t
    assert_close(variables, novograd_reference(weights, steps, rates)[0])


def test_first_update_initialises_second_moment_even_when_not_iteration_zero():
    """With gradient accumulation the first real update happens at iteration 1: it must still use
    v_1 = ||g_1||² (the per-variable rule), not the decayed (1 − β2)·||g_1||²."""
    weights, steps = random_problem(seed=2, num_steps=2 * 6)
    optimizer = Novograd(learning_rate=0.05, weight_decay=0.01, gradient_accumulation_steps=2)
    variables = run_keras(optimizer, weights, steps)
    averaged = [[(a + b) / 2 for a, b in zip(steps[k], steps[k + 1])] for k in range(0, len(steps), 2)]
    expected_w, _, expected_v = novograd_reference(weights, averaged, [0.05] * len(averaged), weight_decay=0.01)
    assert_close(variables, expected_w)
    np.testing.assert_allclose(slots_of(optimizer, variables)[1], expected_v, rtol=1e-5)


def test_excluded_variables_get_no_weight_decay():
    weights, steps = random_problem(seed=3)
    optimizer = Novograd(learning_rate=0.05, weight_decay=0.1)
    variables = [keras.Variable(w, name=name) for w, name in zip(weights, ["kernel", "bias", "conv_kernel"])]
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    for grads in steps:
        optimizer.apply([tf.constant(g) for g in grads], variables)
    decayed = novograd_reference(weights, steps, [0.05] * NUM_STEPS, weight_decay=0.1)[0]
    plain = novograd_reference(weights, steps, [0.05] * NUM_STEPS, weight_decay=0.0)[0]
    assert_close([variables[0], variables[2]], [decayed[0], decayed[2]])
    assert_close([variables[1]], [plain[1]])


@pytest.mark.parametrize(
    "bad, key",
    [
        (dict(learning_rate=-0.01), "learning_rate"),
        (dict(learning_rate=0.0), "learning_rate"),
        (dict(learning_rate=float("nan")), "learning_rate"),
        (dict(beta_1=1.0), "beta_1"),
        (dict(beta_2=-0.1), "beta_2"),
        (dict(epsilon=-1.0), "epsilon"),
        (dict(weight_decay=-1e-3), "weight_decay"),
        (dict(weight_decay=float("inf")), "weight_decay"),
    ],
)
def test_novograd_rejects_invalid_hyperparameters_naming_the_key(bad, key):
    """A negative or zero learning rate, betas outside [0, 1), a negative epsilon or weight decay: a ValueError
    naming the argument and the value."""
    with pytest.raises(ValueError, match=rf"Novograd: {key} must be .*, got {bad[key]}"):
        Novograd(**bad)


def test_novograd_config_round_trip():
    schedule = build_schedule("cosine", 1e-2, total_steps=100, warmup_steps=10, min_learning_rate=1e-4)
    optimizer = Novograd(
        learning_rate=schedule, beta_2=0.98, weight_decay=1e-3, grad_averaging=True, amsgrad=True, clipnorm=1.0
    )
    config = optimizer.get_config()
    assert config["weight_decay"] == 1e-3 and config["grad_averaging"] and config["amsgrad"]
    assert config["clipnorm"] == 1.0
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert isinstance(restored, Novograd) and restored.get_config() == config
    assert float(restored.learning_rate) == pytest.approx(float(schedule(0)))


# ----------------------------------------------------------------------------------------------------------------
# Novograd against MONAI's Novograd (monai/optimizers/novograd.py, MONAI 1.6.1), written out in NumPy
# ----------------------------------------------------------------------------------------------------------------


def monai_novograd(
    weights, gradient_steps, lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0, grad_averaging=False, amsgrad=False
):
    """MONAI `Novograd.step`, one tensor at a time, in float64: weights, `exp_avg`, `exp_avg_sq` after all
    steps. Transcribed from MONAI's source, independently of tfmis' optimizer and of `novograd_reference`."""
    beta1, beta2 = betas
    params = [np.array(w, np.float64) for w in weights]
    state = [dict(exp_avg=np.zeros_like(p), exp_avg_sq=0.0, max_exp_avg_sq=0.0) for p in params]
    for grads in gradient_steps:
        for p, g, st in zip(params, grads, state):
            grad = np.array(g, np.float64)
            norm = np.sum(grad**2)
            if st["exp_avg_sq"] == 0:
                st["exp_avg_sq"] = norm
            else:
                st["exp_avg_sq"] = st["exp_avg_sq"] * beta2 + (1 - beta2) * norm
            if amsgrad:
                st["max_exp_avg_sq"] = max(st["max_exp_avg_sq"], st["exp_avg_sq"])
                denom = math.sqrt(st["max_exp_avg_sq"]) + eps
            else:
                denom = math.sqrt(st["exp_avg_sq"]) + eps
            grad = grad / denom
            if weight_decay != 0:
                grad = grad + weight_decay * p
            if grad_averaging:
                grad = grad * (1 - beta1)
            st["exp_avg"] = beta1 * st["exp_avg"] + grad
            p -= lr * st["exp_avg"]  # in place, as p.data.add_
    return params, [st["exp_avg"] for st in state], [st["exp_avg_sq"] for st in state]


@pytest.mark.parametrize(
    "weight_decay, amsgrad, compiled",
    [
        (0.01, False, False),
        (0.01, True, False),
        (0.05, True, True),
    ],
)
def test_novograd_matches_monai_update_rule(weight_decay, amsgrad, compiled):
    """Without grad_averaging, tfmis' Novograd with MONAI's β2 = 0.98 takes MONAI's steps exactly over 20
    steps with weight decay: second moment initialised to ||g_1||², g / (sqrt(v) + ε), decay added after
    the normalisation, amsgrad's running maximum."""
    weights, steps = random_problem(seed=7)
    optimizer = Novograd(
        learning_rate=0.05, beta_1=0.9, beta_2=0.98, epsilon=1e-8, weight_decay=weight_decay, amsgrad=amsgrad
    )
    variables = run_keras(optimizer, weights, steps, compiled=compiled)
    expected_w, expected_m, expected_v = monai_novograd(
        weights, steps, 0.05, weight_decay=weight_decay, amsgrad=amsgrad
    )
    assert_close(variables, expected_w)
    first, second = slots_of(optimizer, variables)
    assert_close(first, expected_m)
    np.testing.assert_allclose(second, expected_v, rtol=1e-5)


def test_novograd_grad_averaging_differs_from_monai_only_by_the_documented_first_step():
    """With grad_averaging, MONAI scales the first step's u_1 = g_1 / (||g_1|| + ε) by (1 − β1) too; tfmis
    (the paper's m_1 = u_1, as tensorflow-addons) does not. Without weight decay the gradients do not
    depend on the weights, so the momenta then differ by exactly β1^t · u_1 and the weights by
    −lr · u_1 · (β1 + β1² + ... + β1^t): the only difference from MONAI."""
    weights, steps = random_problem(seed=8)
    beta_1, lr = 0.9, 0.05
    optimizer = Novograd(learning_rate=lr, beta_1=beta_1, beta_2=0.98, grad_averaging=True)
    variables = run_keras(optimizer, weights, steps)
    monai_w, monai_m, monai_v = monai_novograd(weights, steps, lr, grad_averaging=True)
    u_1 = [np.asarray(g, np.float64) / (np.linalg.norm(np.asarray(g, np.float64)) + 1e-8) for g in steps[0]]
    t = len(steps)
    assert_close(slots_of(optimizer, variables)[0], [m + beta_1**t * u for m, u in zip(monai_m, u_1)])
    shift = sum(beta_1**k for k in range(1, t + 1))
    assert_close(variables, [w - lr * shift * u for w, u in zip(monai_w, u_1)])
    np.testing.assert_allclose(slots_of(optimizer, variables)[1], monai_v, rtol=1e-5)
    # the difference is real: as large as several learning-rate steps
    assert max(np.abs(v.numpy() - w).max() for v, w in zip(variables, monai_w)) > 2 * lr


# ----------------------------------------------------------------------------------------------------------------
# Novograd: loss scaling, checkpoints, MirroredStrategy
# ----------------------------------------------------------------------------------------------------------------


def test_loss_scale_optimizer_unscales_and_skips_non_finite_steps():
    weights, steps = random_problem(seed=4, num_steps=5)
    plain = Novograd(learning_rate=0.05, weight_decay=0.01)
    scaled = keras.optimizers.LossScaleOptimizer(Novograd(learning_rate=0.05, weight_decay=0.01), initial_scale=1024.0)
    plain_vars = run_keras(plain, weights, steps)
    scaled_vars = run_keras(scaled, weights, [[g * 1024.0 for g in grads] for grads in steps], compiled=True)
    assert_close(scaled_vars, [v.numpy() for v in plain_vars], rtol=1e-6, atol=1e-7)

    before = [v.numpy().copy() for v in scaled_vars + scaled.inner_optimizer.variables]
    overflow = [np.full(s, np.inf, np.float32) for s in SHAPES]
    scaled.apply([tf.constant(g) for g in overflow], scaled_vars)
    after = [v.numpy() for v in scaled_vars + scaled.inner_optimizer.variables]
    assert_close(after, before, rtol=0, atol=0)  # weights, moments and iterations untouched
    assert float(scaled.dynamic_scale.numpy()) == 512.0


def test_mixed_float16_training_with_loss_scaling():
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu", dtype="mixed_float16"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    optimizer = keras.optimizers.LossScaleOptimizer(Novograd(learning_rate=0.02))
    x = np.random.default_rng(5).normal(size=(64, 6)).astype(np.float32)
    y = x[:, :1] - 0.5 * x[:, 1:2]

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
            scaled_loss = optimizer.scale_loss(loss)
        optimizer.apply(tape.gradient(scaled_loss, model.trainable_variables), model.trainable_variables)
        return loss

    losses = [float(train_step()) for _ in range(40)]
    assert all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0]
    assert model.layers[0].kernel.dtype == "float32"
    assert all(v.dtype == "float32" for v in optimizer.inner_optimizer.variables if "moment" in v.name)


def make_regression_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])


def test_checkpoint_restores_identical_slots_and_continues_identically(tmp_path):
    rng = np.random.default_rng(6)
    x = rng.normal(size=(32, 5)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    model = make_regression_model(seed=0)
    model.compile(optimizer=Novograd(learning_rate=0.01, weight_decay=1e-3, amsgrad=True), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    path = tf.train.Checkpoint(optimizer=model.optimizer, model=model).save(str(tmp_path / "ckpt"))

    clone = make_regression_model(seed=1)  # different initial weights
    clone.compile(optimizer=Novograd(learning_rate=0.01, weight_decay=1e-3, amsgrad=True), loss="mse")
    # restored before the optimizer is built: its variables get their values when they are created
    tf.train.Checkpoint(optimizer=clone.optimizer, model=clone).restore(path).assert_existing_objects_matched()
    clone.optimizer.build(clone.trainable_variables)

    assert len(clone.optimizer.variables) == len(model.optimizer.variables) == 2 + 3 * 4
    for original, restored in zip(model.optimizer.variables, clone.optimizer.variables):
        assert original.shape == restored.shape
        np.testing.assert_array_equal(original.numpy(), restored.numpy())
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    clone.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert_close(clone.get_weights(), model.get_weights(), rtol=1e-6, atol=1e-7)


MIRRORED_SCRIPT = textwrap.dedent("""
    import json, os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    import numpy as np
    from tfmis.optimizers import Novograd

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype(np.float32)
    y = (x[:, :1] - x[:, 1:2]).astype(np.float32)
    keras.utils.set_random_seed(0)
    template = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    initial = template.get_weights()

    def train(scope, loss_scaling=False):
        with scope:
            model = keras.models.clone_model(template)
            model.set_weights(initial)
            optimizer = Novograd(learning_rate=0.02, weight_decay=1e-3, grad_averaging=True)
            if loss_scaling:
                optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=256.0)
            model.compile(optimizer=optimizer, loss="mse")
        history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
        return model, history.history["loss"]

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    single, single_loss = train(tf.distribute.get_strategy().scope())
    mirrored, mirrored_loss = train(strategy.scope())
    scaled, scaled_loss = train(strategy.scope(), loss_scaling=True)
    slots = [v for v in mirrored.optimizer.variables if "moment" in v.name]
    replicas_agree = all(
        np.array_equal(*[r.numpy() for r in strategy.experimental_local_results(v.value)]) for v in slots)
    max_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(single.get_weights(), mirrored.get_weights()))
    max_diff_scaled = max(float(np.max(np.abs(a - b))) for a, b in zip(single.get_weights(), scaled.get_weights()))
    print("RESULT " + json.dumps(dict(
        replicas=strategy.num_replicas_in_sync, slot_types=sorted({type(v.value).__name__ for v in slots}),
        replicas_agree=replicas_agree, max_weight_diff=max_diff, max_weight_diff_scaled=max_diff_scaled,
        single_loss=single_loss, mirrored_loss=mirrored_loss, scaled_loss=scaled_loss)))
""")


@pytest.mark.slow
def test_novograd_under_mirrored_strategy_matches_single_device():
    """2 logical CPUs must be configured before TensorFlow initialises, hence a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", MIRRORED_SCRIPT], capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["replicas"] == 2
    assert result["slot_types"] == ["MirroredVariable"] and result["replicas_agree"]
    assert result["max_weight_diff"] < 1e-5, result
    assert result["max_weight_diff_scaled"] < 1e-5, result
    np.testing.assert_allclose(result["mirrored_loss"], result["single_loss"], rtol=1e-4)
    assert result["single_loss"][-1] < result["single_loss"][0]


# ----------------------------------------------------------------------------------------------------------------
# Schedules
# ----------------------------------------------------------------------------------------------------------------


def values_at(schedule, steps):
    return [float(schedule(step)) for step in steps]


def test_constant_schedule_with_warmup():
    schedule = build_schedule("constant", 1e-3, warmup_steps=4)
    np.testing.assert_allclose(
        values_at(schedule, [0, 1, 2, 4, 5, 10_000]), [0.0, 2.5e-4, 5e-4, 1e-3, 1e-3, 1e-3], rtol=1e-6
    )
    assert float(build_schedule("constant", 3e-4)(123)) == pytest.approx(3e-4)


def test_poly_schedule_matches_nnunet_formula():
    schedule = build_schedule("poly", 0.01, total_steps=100, power=0.9)
    # 0.01 * (1 - s/100) ** 0.9: 0.5**0.9 = 0.535887, 0.75**0.9 = 0.771890, 0.01**0.9 = 0.015849
    np.testing.assert_allclose(
        values_at(schedule, [0, 25, 50, 99, 100, 500]),
        [0.01, 0.0077189, 0.00535887, 0.00015849, 0.0, 0.0],
        rtol=1e-5,
        atol=1e-9,
    )


def test_poly_schedule_with_warmup_and_floor():
    schedule = build_schedule("poly", 0.01, total_steps=110, warmup_steps=10, power=1.0, min_learning_rate=0.001)
    # warm-up 0 → 0.01 over 10 steps, then linear decay 0.01 → 0.001 over the remaining 100 steps
    np.testing.assert_allclose(
        values_at(schedule, [0, 5, 10, 35, 60, 110, 200]), [0.0, 0.005, 0.01, 0.00775, 0.0055, 0.001, 0.001], rtol=1e-5
    )


def test_cosine_schedule_with_warmup_and_floor():
    schedule = build_schedule("cosine", 0.01, total_steps=120, warmup_steps=20, min_learning_rate=1e-4)
    # 1e-4 + 0.0099 * (1 + cos(pi * (s - 20) / 100)) / 2;  (1 + cos(pi/4)) / 2 = 0.8535534
    np.testing.assert_allclose(
        values_at(schedule, [0, 10, 20, 45, 70, 120, 121]),
        [0.0, 0.005, 0.01, 0.0085502, 0.00505, 1e-4, 1e-4],
        rtol=1e-5,
    )


def test_once_per_step_schedule_trains_as_the_schedule_with_one_evaluation_per_step():
    """AdamW with weight decay under OncePerStep(schedule) takes the same steps as under the schedule itself
    (weights equal after 6 compiled steps through warm-up and decay), while its step graph evaluates the schedule
    once instead of once per variable and once more (Keras' TensorFlow optimizer reads the rate per variable for
    weight decay)."""
    from tfmis.optimizers.schedules import OncePerStep

    def train(learning_rate):
        variables = [keras.Variable(np.full(shape, 0.5, np.float32)) for shape in SHAPES]
        # Keras' own AdamW (the factory's fused one reads the rate once per dtype); SGD's decay reads it as this does
        optimizer = keras.optimizers.AdamW(learning_rate, weight_decay=0.1)
        optimizer.build(variables)
        step = tf.function(lambda: optimizer.apply([v * 2.0 + 1.0 for v in variables], variables))
        for _ in range(6):
            step()
        cosines = sum(op.type == "Cos" for op in step.get_concrete_function().graph.get_operations())
        return [v.numpy() for v in variables], cosines, optimizer

    schedule = build_schedule("cosine", 0.05, total_steps=8, warmup_steps=2)
    plain, plain_cosines, _ = train(schedule)
    once, once_cosines, optimizer = train(OncePerStep(schedule))
    for a, b in zip(plain, once):
        np.testing.assert_array_equal(a, b)
    iterations = tf.Variable(0, dtype=tf.int64)
    evaluation = tf.function(lambda: schedule(iterations)).get_concrete_function().graph
    per_evaluation = sum(op.type == "Cos" for op in evaluation.get_operations())  # the warm-up reads two
    assert once_cosines == per_evaluation and plain_cosines == (len(SHAPES) + 1) * per_evaluation
    assert float(optimizer.learning_rate) == pytest.approx(float(schedule(6)))  # eager reads evaluate it
    restored = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(OncePerStep(schedule)))
    assert float(restored(tf.constant(3))) == pytest.approx(float(schedule(3)))


def test_schedules_work_in_graph_mode_with_int64_steps():
    schedule = build_schedule("cosine", 0.01, total_steps=120, warmup_steps=20, min_learning_rate=1e-4)
    compiled = tf.function(lambda step: schedule(step))
    assert float(compiled(tf.constant(70, tf.int64))) == pytest.approx(0.00505, rel=1e-5)
    assert float(compiled(tf.constant(10, tf.int64))) == pytest.approx(0.005, rel=1e-5)


@pytest.mark.parametrize(
    "schedule",
    [
        ConstantLearningRate(1e-3),
        PolyDecay(1e-2, decay_steps=50, power=0.9, min_learning_rate=1e-5),
        CosineDecay(1e-2, decay_steps=50, min_learning_rate=1e-5),
        LinearWarmup(PolyDecay(1e-2, decay_steps=50), warmup_steps=5),
    ],
)
def test_schedule_config_round_trip(schedule):
    restored = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(schedule))
    assert type(restored) is type(schedule) and restored.get_config() == schedule.get_config()
    np.testing.assert_allclose(values_at(restored, [0, 3, 20, 60]), values_at(schedule, [0, 3, 20, 60]))


def _cosine_with_warmup(step: int, total: int, warmup: int, base: float, floor: float) -> float:
    """The closed form, written out here independently of tfmis: linear warm-up from 0, then a half cosine from
    `base` to `floor` over the remaining `total - warmup` steps, `floor` after."""
    if step < warmup:
        return base * step / warmup
    progress = min(1.0, (step - warmup) / (total - warmup))
    return floor + (base - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def test_schedule_length_variable_sets_where_the_schedule_ends_without_retracing():
    """A schedule built on a `ScheduleLength` reads its total steps from the variable: after `assign(total)` its
    value at step k equals the closed-form cosine for that total, eagerly and in a graph traced before the
    assignment (one trace); `get_config` records the length of the moment."""
    base, floor, warmup = 0.01, 1e-4, 20
    length = ScheduleLength(1000, warmup_steps=warmup)
    schedule = build_schedule("cosine", base, total_steps=length, warmup_steps=warmup, min_learning_rate=floor)
    traces = []

    @tf.function
    def rate(step):
        traces.append(1)
        return schedule(step)

    steps = [0, 10, 20, 45, 70, 119, 120, 200]
    for total in (1000, 120, 300):
        length.assign(total)
        assert length.total_steps == total and int(length) == total - warmup
        expected = [_cosine_with_warmup(k, total, warmup, base, floor) for k in steps]
        np.testing.assert_allclose([float(schedule(k)) for k in steps], expected, rtol=1e-5, atol=1e-9)
        compiled = [float(rate(tf.constant(k, tf.int64))) for k in steps]
        np.testing.assert_allclose(compiled, expected, rtol=1e-5, atol=1e-9)
        assert float(schedule(total)) == pytest.approx(floor, abs=1e-9)  # the end value at the last step
        assert schedule.get_config()["schedule"]["config"]["decay_steps"] == total - warmup
    assert len(traces) == 1


def test_schedule_length_poly_and_checkpoint_round_trip(tmp_path):
    """Poly without warm-up on a `ScheduleLength` follows nnU-Net's formula for the assigned total; the variable
    is saved and restored by a `tf.train.Checkpoint` (a resumed run continues the same schedule); a length whose
    warm-up differs from the schedule's is refused."""
    length = ScheduleLength(500)
    schedule = build_schedule("poly", 0.01, total_steps=length, power=0.9)
    length.assign(80)
    for k in (0, 40, 79, 80, 100):
        assert float(schedule(k)) == pytest.approx(0.01 * (1 - min(k, 80) / 80) ** 0.9, abs=1e-8)
    path = tf.train.Checkpoint(schedule_steps=length.variable).save(str(tmp_path / "ckpt"))
    other = ScheduleLength(500)
    tf.train.Checkpoint(schedule_steps=other.variable).restore(path).assert_consumed()
    assert other.total_steps == 80
    with pytest.raises(ValueError, match="warmup_steps"):
        build_schedule("cosine", 0.01, total_steps=ScheduleLength(100, warmup_steps=5), warmup_steps=10)


def test_build_schedule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="constant, poly, cosine"):
        build_schedule("step", 1e-3, total_steps=10)
    with pytest.raises(ValueError, match="total_steps"):
        build_schedule("poly", 1e-3, total_steps=10, warmup_steps=10)
    with pytest.raises(ValueError, match="total_steps"):
        build_schedule("cosine", 1e-3)


# ----------------------------------------------------------------------------------------------------------------
# Factory
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
@pytest.mark.parametrize("use_schedule", [False, True])
def test_build_optimizer_step_reduces_quadratic_loss(name, use_schedule):
    learning_rate = build_schedule("poly", 0.05, total_steps=100) if use_schedule else 0.05
    optimizer = build_optimizer(name.upper(), learning_rate, weight_decay=1e-4, clipnorm=10.0)
    w = keras.Variable(np.array([1.0, -2.0, 3.0], np.float32))

    def loss():
        return tf.reduce_sum(tf.square(w.value - tf.constant([0.5, 0.5, 0.5])))

    before = float(loss())
    with tf.GradientTape() as tape:
        value = loss()
    optimizer.apply(tape.gradient(value, [w.value]), [w])
    assert float(loss()) < before
    assert optimizer.clipnorm == 10.0


def test_build_optimizer_passes_hyperparameters():
    sgd = build_optimizer("sgd", 0.01, weight_decay=3e-5, momentum=0.95, nesterov=False)
    assert isinstance(sgd, keras.optimizers.SGD)
    assert (sgd.momentum, sgd.nesterov, sgd.weight_decay) == (0.95, False, 3e-5)
    assert build_optimizer("sgd", 0.01).weight_decay is None
    adamw = build_optimizer("adamw", 1e-3, weight_decay=0.05, beta_2=0.99, epsilon=1e-6)
    assert isinstance(adamw, keras.optimizers.AdamW)
    assert (adamw.weight_decay, adamw.beta_2, adamw.epsilon) == (0.05, 0.99, 1e-6)
    novograd = build_optimizer(
        "novograd", 1e-3, weight_decay=1e-3, beta_2=0.98, grad_averaging=True, global_clipnorm=None
    )
    assert isinstance(novograd, Novograd)
    assert (novograd.weight_decay, novograd.beta_2, novograd.grad_averaging) == (1e-3, 0.98, True)


def test_build_optimizer_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="adam, adamw, sgd, novograd"):
        build_optimizer("rmsprop", 1e-3)
