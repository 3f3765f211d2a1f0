"""Pipeline model parallelism's stages: the model's top-level layers in execution order, each sized by its forward
tensors and parameters at the patch size, cut into contiguous stages of about equal bytes (`cut_stages`, by
`_balanced_cuts`), and the table that shows them (`stage_table`).

Used by `tfmis.networks.parallel.ModelParallel` in pipeline mode, which runs each stage's layers on its device.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import keras
import tensorflow as tf
from keras import layers


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
    cut = _balanced_cuts([costs[layer.name]["bytes"] for layer in order], parts)
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


def stage_table(stage_costs: list[dict], devices: Sequence[str], micro_batches: int) -> str:
    """The pipeline's stages: device, layers, forward bytes per image (activations + parameters)."""
    lines = [f"pipeline over {len(devices)} devices x {micro_batches} micro-batches (bytes per image at the patch):"]
    for stage, entry in enumerate(stage_costs):
        lines.append(
            f"  stage {stage} on {devices[stage]}: {entry['bytes'] / 2**20:8.1f} MiB "
            f"(parameters {entry['parameter_bytes'] / 2**20:.2f} MiB)  {', '.join(entry['layers'])}"
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


def _balanced_cuts(costs: Sequence[float], parts: int) -> list[int]:
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
