"""The fused Adam/AdamW (`tfmis.optimizers.fused_adam`) against Adam with decoupled weight decay written out in
NumPy from Kingma & Ba (step-size form) and Loshchilov & Hutter, against Keras' own AdamW, in the execution modes
the trainer uses (eager, tf.function, loss scaling, MirroredStrategy, checkpoints from Keras' AdamW), and the size
of the step graph it exists to shrink."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmis.optimizers import build_optimizer, build_schedule
from tfmis.optimizers.fused_adam import FusedAdam, FusedAdamW

SHAPES = [(3, 4), (4,), (2, 2, 2, 1, 3)]  # a dense kernel, a bias, a 3D conv kernel


def adam_reference(weights, gradient_steps, learning_rates, beta_1=0.9, beta_2=0.999, epsilon=1e-8, weight_decay=0.0):
    """Weights after the steps, in float64: w ← w − lr·wd·w, then m ← β1·m + (1−β1)·g, v ← β2·v + (1−β2)·g²,
    w ← w − lr·√(1−β2ᵗ)/(1−β1ᵗ) · m / (√v + ε)."""
    w = [np.array(x, np.float64) for x in weights]
    m = [np.zeros_like(x) for x in w]
    v = [np.zeros_like(x) for x in w]
    for t, (grads, lr) in enumerate(zip(gradient_steps, learning_rates), start=1):
        for i, g in enumerate(grads):
            g = np.asarray(g, np.float64)
            w[i] = w[i] - lr * weight_decay * w[i]
            m[i] = beta_1 * m[i] + (1 - beta_1) * g
            v[i] = beta_2 * v[i] + (1 - beta_2) * g * g
            w[i] = w[i] - lr * np.sqrt(1 - beta_2**t) / (1 - beta_1**t) * m[i] / (np.sqrt(v[i]) + epsilon)
    return w


def random_problem(seed=0, num_steps=12):
    rng = np.random.default_rng(seed)
    weights = [rng.normal(size=shape).astype(np.float32) for shape in SHAPES]
    steps = [[(rng.normal(size=shape) * 2.0 * 0.8**k).astype(np.float32) for shape in SHAPES] for k in range(num_steps)]
    return weights, steps


def run(optimizer, weights, gradient_steps, compiled):
    variables = [keras.Variable(w, dtype="float32") for w in weights]
    optimizer.build(variables)
    apply = lambda grads: optimizer.apply(grads, variables)  # noqa: E731
    apply = tf.function(apply) if compiled else apply
    for grads in gradient_steps:
        apply([tf.constant(g) for g in grads])
    return [v.numpy() for v in variables]


@pytest.mark.parametrize(
    "name, weight_decay, compiled",
    [("adam", 0.0, False), ("adam", 0.0, True), ("adamw", 0.05, False), ("adamw", 0.05, True), ("adam", 0.05, True)],
)
def test_fused_adam_matches_numpy_adam_with_decoupled_decay_and_keras_adamw(name, weight_decay, compiled):
    """Twelve steps under a warm-up + cosine schedule: the weights equal the NumPy transcription (float64) to
    float32 rounding, and Keras' own AdamW/Adam given the same gradients."""
    weights, steps = random_problem()
    schedule = build_schedule("cosine", 0.05, total_steps=12, warmup_steps=3)
    rates = [float(schedule(t)) for t in range(len(steps))]
    fused = build_optimizer(name, schedule, weight_decay=weight_decay)
    assert isinstance(fused, FusedAdamW if name == "adamw" else FusedAdam)
    result = run(fused, weights, steps, compiled)
    expected = adam_reference(weights, steps, rates, weight_decay=weight_decay)
    for a, e in zip(result, expected):
        np.testing.assert_allclose(a, e, rtol=2e-5, atol=2e-6)
    keras_class = keras.optimizers.AdamW if name == "adamw" else keras.optimizers.Adam
    reference = run(
        keras_class(learning_rate=schedule, epsilon=1e-8, weight_decay=weight_decay or None), weights, steps, compiled
    )
    for a, e in zip(result, reference):  # float32 either way; the two order the moment arithmetic differently
        np.testing.assert_allclose(a, e, rtol=2e-5, atol=2e-6)


def test_fused_adam_step_graph_holds_one_kernel_per_variable_and_a_fraction_of_keras_ops():
    """The compiled apply over the demo-sized variable list: one ResourceApplyAdam per variable, and fewer than
    half the ops of Keras' AdamW step (the first epoch's tracing and graph optimisation scale with them)."""
    rng = np.random.default_rng(1)
    shapes = [(3, 3, 3, 8, 8), (8,), (8,)] * 20
    weights = [rng.normal(size=s).astype(np.float32) for s in shapes]
    grads = [tf.constant(rng.normal(size=s).astype(np.float32)) for s in shapes]

    def graph_ops(optimizer):
        variables = [keras.Variable(w) for w in weights]
        optimizer.build(variables)
        graph = tf.function(lambda: optimizer.apply(grads, variables)).get_concrete_function().graph
        return [op.type for op in graph.get_operations()]

    fused = graph_ops(build_optimizer("adamw", 1e-3, weight_decay=1e-5))
    keras_ops = graph_ops(keras.optimizers.AdamW(learning_rate=1e-3, weight_decay=1e-5))
    assert fused.count("ResourceApplyAdam") == len(shapes)
    assert "ResourceApplyAdam" not in keras_ops
    assert len(fused) < 0.5 * len(keras_ops), (len(fused), len(keras_ops))


def test_amsgrad_falls_back_to_keras_update():
    weights, steps = random_problem(seed=2, num_steps=6)
    fused = run(FusedAdam(learning_rate=0.01, amsgrad=True), weights, steps, compiled=True)
    reference = run(keras.optimizers.Adam(learning_rate=0.01, amsgrad=True), weights, steps, compiled=True)
    for a, e in zip(fused, reference):
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7)


def test_loss_scale_optimizer_around_fused_adamw_unscales_and_skips_non_finite_steps():
    weights, steps = random_problem(seed=3, num_steps=5)
    plain = run(FusedAdamW(learning_rate=0.02, weight_decay=0.01), weights, steps, compiled=True)
    scaled = keras.optimizers.LossScaleOptimizer(
        FusedAdamW(learning_rate=0.02, weight_decay=0.01), initial_scale=1024.0
    )
    variables = [keras.Variable(w) for w in weights]
    scaled.build(variables)
    apply = tf.function(lambda grads: scaled.apply(grads, variables))
    for grads in steps:
        apply([tf.constant(g * 1024.0) for g in grads])
    for a, e in zip([v.numpy() for v in variables], plain):
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7)
    before = [v.numpy().copy() for v in variables + scaled.inner_optimizer.variables]
    apply([tf.constant(np.full(s, np.inf, np.float32)) for s in SHAPES])
    for a, e in zip([v.numpy() for v in variables + scaled.inner_optimizer.variables], before):
        np.testing.assert_array_equal(a, e)  # weights, moments and iterations untouched


def test_checkpoint_of_keras_adamw_restores_into_fused_adamw_and_continues_identically(tmp_path):
    """Runs trained before the fused optimizer (Keras' AdamW) resume with it: same slot variables, same steps."""
    weights, steps = random_problem(seed=4, num_steps=8)
    variables = [keras.Variable(w) for w in weights]
    original = keras.optimizers.AdamW(learning_rate=0.01, weight_decay=0.01, epsilon=1e-8)
    original.build(variables)
    for grads in steps[:4]:
        original.apply([tf.constant(g) for g in grads], variables)
    path = tf.train.Checkpoint(optimizer=original, weights=variables).save(str(tmp_path / "ckpt"))

    restored_vars = [keras.Variable(np.zeros_like(w)) for w in weights]
    fused = FusedAdamW(learning_rate=0.01, weight_decay=0.01, epsilon=1e-8)
    fused.build(restored_vars)
    tf.train.Checkpoint(optimizer=fused, weights=restored_vars).restore(path).assert_existing_objects_matched()
    assert int(fused.iterations.numpy()) == 4
    for grads in steps[4:]:
        original.apply([tf.constant(g) for g in grads], variables)
        fused.apply([tf.constant(g) for g in grads], restored_vars)
    for a, e in zip(restored_vars, variables):
        np.testing.assert_allclose(a.numpy(), e.numpy(), rtol=2e-5, atol=2e-6)


MIRRORED_SCRIPT = textwrap.dedent("""
    import json, os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    import numpy as np
    from tfmis.optimizers import build_optimizer

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype(np.float32)
    y = (x[:, :1] - x[:, 1:2]).astype(np.float32)
    keras.utils.set_random_seed(0)
    template = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    initial = template.get_weights()

    def train(strategy):
        with strategy.scope():
            model = keras.models.clone_model(template)
            model.set_weights(initial)
            optimizer = build_optimizer("adamw", 0.02, weight_decay=1e-3)
            optimizer.build(model.trainable_variables)

        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(model(xb) - yb)) / 16.0
            grads = tape.gradient(loss, model.trainable_variables)
            grads = tf.distribute.get_replica_context().all_reduce("sum", grads)
            optimizer.apply(grads, model.trainable_variables)
            return loss

        @tf.function
        def step(xb, yb):
            return strategy.run(replica_step, args=(xb, yb))

        dataset = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat(3))
        for xb, yb in dataset:
            step(xb, yb)
        return model, optimizer

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    single, _ = train(tf.distribute.get_strategy())
    mirrored, optimizer = train(strategy)
    slots = [v for v in optimizer.variables if "momentum" in v.name or "velocity" in v.name]
    replicas_agree = all(
        np.array_equal(*[r.numpy() for r in strategy.experimental_local_results(v.value)]) for v in slots)
    max_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(single.get_weights(), mirrored.get_weights()))
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(initial, mirrored.get_weights()))
    print("RESULT " + json.dumps(dict(
        replicas=strategy.num_replicas_in_sync, slots=len(slots),
        slot_types=sorted({type(v.value).__name__ for v in slots}), replicas_agree=replicas_agree,
        max_weight_diff=max_diff, moved=moved)))
""")


@pytest.mark.slow
def test_fused_adamw_under_mirrored_strategy_matches_single_device():
    """Each replica's ResourceApplyAdam updates its own copy of the weights and moments: after 12 steps on
    2 logical CPUs (a fresh interpreter: they must be configured before TensorFlow starts) the replicas agree
    and the weights equal one device's."""
    proc = subprocess.run([sys.executable, "-c", MIRRORED_SCRIPT], capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["replicas"] == 2 and result["slots"] == 8
    assert result["slot_types"] == ["MirroredVariable"] and result["replicas_agree"]
    assert result["moved"] > 1e-2 and result["max_weight_diff"] < 1e-5, result
