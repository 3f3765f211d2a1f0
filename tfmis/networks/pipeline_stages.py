"""Pipeline model parallelism's stages: the model's top-level layers in execution order, each sized by its forward
tensors and parameters at the patch size, cut into contiguous stages of about equal bytes (`cut_stages`, by
`balanced_cuts`), each stage's variables moved to its device (`place_stage_variables`) with their optimizer
updates (`colocate_updates`), and the table that shows them (`stage_table`).

Used by `tfmis.networks.parallel.ModelParallel` in pipeline mode, which runs each stage's layers on its device.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import keras
import tensorflow as tf
from keras import layers

from tfmis.networks.devices import canonical_device


def cut_stages(
    model: keras.Model, parts: int, patch_size: Sequence[int] | None = None, in_channels: int | None = None
) -> tuple[dict[str, int], list[dict], dict[str, dict]]:
    """Cuts the top-level layers (in execution order) into `parts` contiguous stages of about equal bytes.

    Returns:
        (stages, stage_costs, layer_costs): top-level layer name -> stage; per stage its `layers`, `bytes` and
        `parameter_bytes`; per layer its `bytes` and `parameter_bytes` (`layer_bytes`).
    """
    order = [layer for layer in _execution_order(model) if not isinstance(layer, layers.InputLayer)]
    costs = layer_bytes(model, order, patch_size, in_channels)
    cut = balanced_cuts([costs[layer.name]["bytes"] for layer in order], parts)
    stages = {}
    stage_costs = [{"layers": [], "bytes": 0, "parameter_bytes": 0} for _ in range(parts)]
    for layer, stage in zip(order, cut):
        stages[layer.name] = stage
        entry = stage_costs[stage]
        entry["layers"].append(layer.name)
        entry["bytes"] += costs[layer.name]["bytes"]
        entry["parameter_bytes"] += costs[layer.name]["parameter_bytes"]
    return stages, stage_costs, costs


def layer_bytes(
    model: keras.Model, order, patch_size: Sequence[int] | None = None, in_channels: int | None = None
) -> dict[str, dict]:
    """Each top-level layer's forward tensor bytes (one micro-batch image at the patch size, from the traced
    training forward pass, by the layer's name scope) plus its parameter bytes (only these without `patch_size`
    and `in_channels`)."""
    costs = {layer.name: {"bytes": 0, "parameter_bytes": 0} for layer in order}
    for layer in order:
        params = sum(math.prod(v.shape) * 4 for v in layer.trainable_variables)
        costs[layer.name]["parameter_bytes"] = params
        costs[layer.name]["bytes"] += params
    if patch_size is None or in_channels is None:
        return costs
    spec = tf.TensorSpec((1, *patch_size, in_channels), tf.float32)
    graph = tf.function(lambda x: model(x, training=True), autograph=False).get_concrete_function(spec).graph
    names = set(costs)
    for op in graph.get_operations():
        # a scope traced again is uniquified with a suffix: "encoder0_1"
        scopes = [c for part in op.name.split("/") for c in (part, re.sub(r"_\d+$", "", part))]
        owner = next((scope for scope in scopes if scope in names), None)
        if owner is None:
            continue
        for tensor in op.outputs:
            if tensor.shape.is_fully_defined() and tensor.dtype.size:
                costs[owner]["bytes"] += tensor.shape.num_elements() * tensor.dtype.size
    return costs


def place_stage_variables(model: keras.Model, stages: dict[str, int], devices: Sequence[str]) -> dict[str, int]:
    """Moves every variable of each staged top-level layer of `model` to its stage's device (`devices[stage]`),
    keeping its value, name, dtype, trainability and aggregation; returns the variable bytes now on each device.

    A Keras 3 variable holds a `tf.Variable` (`variable.value`), created on the default device when the model
    was built; it is replaced by one made under `tf.device(devices[stage])`. The Keras variable objects stay the
    same, so the layers, the model's variable lists and checkpoints (`tf.train.Checkpoint` and `save_weights`
    store values and paths, no devices: a pipeline run resumes and predicts on one device) see no change; the
    reads, the gradient sums of `tf.gradients` (colocated with the reads) and the optimizer's slots (Keras'
    TensorFlow optimizer makes them under `colocate_vars_with` the variable) then live on the stage's device.

    Call it before any `tf.function` traces the model and before an optimizer is built over the variables
    (both keep the `tf.Variable` they saw). A variable already on its device is left as it is; a layer not in
    `stages` keeps its variables where they are.
    """
    placed: dict[str, int] = {}
    seen: set[int] = set()
    for layer in model.layers:
        stage = stages.get(layer.name)
        if stage is None:
            continue
        device = devices[stage]
        for variable in layer.variables:
            if id(variable) in seen:  # a variable shared by two layers stays with the first
                continue
            seen.add(id(variable))
            old = variable.value
            if canonical_device(old.device) != canonical_device(device):
                with tf.init_scope(), tf.device(device):
                    variable._value = None  # Keras' own creation (name, dtype, aggregation) on this device
                    variable._initialize(tf.identity(old))
            nbytes = math.prod(int(d) for d in variable.shape) * old.dtype.size
            placed[device] = placed.get(device, 0) + nbytes
    return placed


def colocate_updates(optimizer) -> None:
    """Makes each variable's optimizer update run on the variable's device, for an optimizer of one replica (the
    model-parallel trainer's: `runtime.distribution: none`). Keras' TensorFlow optimizer runs unplaced, so on the
    default device, which for a pipeline stage's variables would copy their gradients and slots to the first
    device and the results back: (1) its gradient "all-reduce" over the one replica, an `IdentityN` of every
    gradient at once, is skipped (the gradients are already the step's); (2) each variable's `update_step` (the
    slot and weight arithmetic) and the weight decay (`_apply_weight_decay`, called once per device with that
    device's variables) run under `tf.device` of the variables. All are wrapped on the optimizer (or a
    `LossScaleOptimizer`'s inner one).

    Raises:
        ValueError: the optimizer is used under a strategy of several replicas.
    """
    target = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(target, "_tfmis_colocated_updates", False):
        return
    if tf.distribute.get_strategy().num_replicas_in_sync != 1:
        raise ValueError("colocate_updates: the optimizer of a model over several devices runs in one replica")
    update_step = target.update_step

    def placed_update_step(gradient, variable, learning_rate):
        with tf.device(_device_of(variable)):
            return update_step(gradient, variable, learning_rate)

    apply_weight_decay = target._apply_weight_decay

    def placed_weight_decay(variables):
        by_device: dict[str, list] = {}
        for variable in variables:
            by_device.setdefault(_device_of(variable), []).append(variable)
        for device, group in by_device.items():
            with tf.device(device):
                apply_weight_decay(group)

    target.update_step = placed_update_step
    target._apply_weight_decay = placed_weight_decay
    target._all_reduce_sum_gradients = _one_replica
    target._tfmis_colocated_updates = True


def _one_replica(grads_and_vars):
    return list(grads_and_vars)


def _device_of(variable) -> str:
    """The full device name of a Keras or TensorFlow variable."""
    return (variable.value if isinstance(variable, keras.Variable) else variable).device


def variable_bytes_by_device(variables) -> dict[str, int]:
    """Bytes of `variables` (Keras or TensorFlow variables) per device ("/CPU:1"), read from the variables' own
    placement (`tf.Variable.device`)."""
    out: dict[str, int] = {}
    for variable in variables:
        device = canonical_device(_device_of(variable))
        out[device] = out.get(device, 0) + math.prod(int(d) for d in variable.shape) * tf.as_dtype(variable.dtype).size
    return out


def stage_table(
    stage_costs: list[dict], devices: Sequence[str], micro_batches: int, placed: dict[str, int] | None = None
) -> str:
    """The pipeline's stages: device, layers, forward bytes per image (activations + parameters), and the bytes
    of the variables that live on the stage's device (`placed`, from `place_stage_variables`; without it, the
    stage's trainable parameter bytes)."""
    lines = [f"pipeline over {len(devices)} devices x {micro_batches} micro-batches (bytes per image at the patch):"]
    for stage, entry in enumerate(stage_costs):
        params = entry["parameter_bytes"] if placed is None else placed.get(devices[stage], 0)
        where = " on it" if placed is not None else ""
        lines.append(
            f"  stage {stage} on {devices[stage]}: {entry['bytes'] / 2**20:8.1f} MiB "
            f"(parameters{where} {params / 2**20:.2f} MiB)  {', '.join(entry['layers'])}"
        )
    return "\n".join(lines)


def _execution_order(model: keras.Model) -> list:
    """The model's top-level layers in the order `_run_through_graph` calls them."""
    order = []

    def record(layer):
        order.append(layer)
        return lambda *args, **kwargs: _symbolic(layer, *args, **kwargs)

    specs = [keras.KerasTensor(x.shape, x.dtype) for x in model.inputs]
    model._run_through_graph(specs if len(specs) > 1 else specs[0], operation_fn=record)
    return order


def _symbolic(layer, *args, **kwargs):
    return layer.compute_output_spec(*args, **kwargs)


def balanced_cuts(costs: Sequence[float], parts: int) -> list[int]:
    """Stage of each item: `parts` contiguous groups (none empty while items last) minimising the largest sum."""
    n = len(costs)
    parts = min(parts, n)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest possible largest group of the first i items in k groups
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    stages, i = [0] * n, n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        for item in range(j, i):
            stages[item] = k - 1
        i = j
    return stages
