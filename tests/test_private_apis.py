"""The TensorFlow, Keras and Python private names tfmis relies on, where no public API exists: each is used in one
module only, and each is checked here against the installed TensorFlow/Keras, so that an upgrade that renames or
changes one fails here, naming it and its one user. (Keras Tuner's are in `tfmis.tuning.kt`, checked by
tests/test_tune_kt.py.) What each is relied on for is tested through its user elsewhere, as noted.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf


def test_keras_tensorflow_optimizer_has_the_gradient_all_reduce_the_trainer_replaces():
    """`tfmis.engine.distribution.StrategyBackend.prepare_optimizer` replaces `_all_reduce_sum_gradients`, which
    Keras' TensorFlow optimizer calls inside `apply()` in a replica context, so that clipping sees the gradient
    summed once by the trainer (behaviour: tests/test_training.py, clipnorm over replicas)."""
    optimizer = keras.optimizers.SGD(0.1)
    assert callable(getattr(optimizer, "_all_reduce_sum_gradients", None))


def test_keras_optimizer_hooks_the_fused_adam_and_novograd_subclass():
    """`tfmis.optimizers.fused_adam` and `tfmis.optimizers.novograd` subclass Keras' optimizer through the hooks
    Keras' own optimizers use: `_backend_update_step`, `_apply_weight_decay`, `_get_variable_index`,
    `_use_weight_decay`, `_distribution_strategy` and Adam's `_momentums` / `_velocities` (behaviour:
    tests/test_fused_adam.py and tests/test_optimizers.py compare them with Keras and with formulas)."""
    variable = keras.Variable(np.ones((2, 2), dtype="float32"))
    optimizer = keras.optimizers.AdamW(0.1, weight_decay=0.01)
    optimizer.build([variable])
    for name in ("_backend_update_step", "_apply_weight_decay", "_get_variable_index", "_use_weight_decay"):
        assert callable(getattr(optimizer, name, None)), name
    assert optimizer._get_variable_index(variable) == 0
    assert optimizer._use_weight_decay(variable) is True
    assert len(optimizer._momentums) == len(optimizer._velocities) == 1
    assert hasattr(optimizer, "_distribution_strategy")


def test_tensorflow_internal_distribute_functions_exist():
    """`tf.__internal__.distribute.strategy_supports_no_merge_call` (`tfmis.engine.distribution`, the skip of a
    non-finite step on every replica) and `tf.__internal__.distribute.interim.maybe_merge_call`
    (`tfmis.optimizers.fused_adam`, weight decay under a strategy): no public equivalents."""
    assert isinstance(tf.__internal__.distribute.strategy_supports_no_merge_call(), bool)
    assert callable(tf.__internal__.distribute.interim.maybe_merge_call)


def test_slurm_task_list_expansion_reads_slurms_compressed_form():
    """`tfmis.engine.distribution` reads SLURM_STEP_TASKS_PER_NODE with TensorFlow's own parser (the one
    SlurmClusterResolver uses): `2(x3),1` is three nodes of 2 tasks and one of 1."""
    from tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver import expand_tasks_per_node

    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]


def test_eager_context_has_the_coordination_service_barrier():
    """`tensorflow.python.eager.context.context().wait_at_barrier(barrier_id, timeout_in_ms)`
    (`StrategyBackend.finish`, the ordered end of a multi-worker run) exists with that signature."""
    import inspect

    from tensorflow.python.eager import context

    assert list(inspect.signature(context.context().wait_at_barrier).parameters) == ["barrier_id", "timeout_in_ms"]


def test_keras_tensorflow_variable_holds_its_tf_variable_in_value_and_makes_it_in_initialize():
    """`tfmis.networks.pipeline_stages.place_stage_variables` replaces a Keras 3 variable's `tf.Variable`
    (`_value`, read as `value`) by one `_initialize(value)` makes under the stage's `tf.device`, so that Keras
    names, dtypes and aggregation it as its own; `colocate_updates` wraps the optimizer's `update_step`,
    `_apply_weight_decay` and `_all_reduce_sum_gradients` (checked above) per variable's device (behaviour:
    tests/test_model_parallel_placement.py)."""
    variable = keras.Variable(np.ones((2, 2), dtype="float32"), name="w")
    assert variable._value is variable.value and isinstance(variable.value, tf.Variable)
    variable._value = None
    variable._initialize(tf.fill((2, 2), 3.0))
    assert isinstance(variable.value, tf.Variable) and float(variable.numpy().sum()) == 12.0


ATEXIT_SCRIPT = """
import atexit, os
calls = []
atexit.register(lambda: calls.append("handler"))
atexit._run_exitfuncs()
print(calls)
os._exit(0)
"""


def test_python_atexit_run_exitfuncs_runs_the_registered_handlers():
    """`atexit._run_exitfuncs` (CPython), which `tfmis.utils.cli.end_command_process` calls before `os._exit` so
    that a command's exit handlers (Horovod's shutdown) still run, runs the registered handlers, in a real process
    (behaviour: tests/test_training.py, a command's process that ends without waiting for an unjoined thread)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", ATEXIT_SCRIPT], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "['handler']", result.stderr
