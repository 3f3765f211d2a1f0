"""Runs U-Nets over several logical CPU devices (tfmis.networks.parallel) and on one device from the same weights,
and writes how far apart they are: `python model_parallel_cases.py OUT.json CASE...` (a fresh process: the logical
devices must be made before TensorFlow initialises its devices). Used by tests/test_model_parallel.py.

A case is `net:mode:devices[:option...]`:
    net       demo (the demo's U-Net: strides (2, 2, 2, 1), transposed-convolution output, deep supervision) or
              deep (5 levels, strides (2, 2, 1), an odd side of 13, deep supervision, instance norm)
    mode      spatial or pipeline
    devices   devices per model
    options   axisK (cut patch axis K), batch (BatchNorm), data2 (2 data groups), nohalo / nostats (spatial with
              the halo exchange / the cross-slab statistics taken out: must differ), mixed (mixed_float16),
              f64 (float64: the same arithmetic without float32's rounding), recompute (every block recomputed in
              the backward pass)

For each case: the largest |difference| of every output (inference), the loss, every gradient (relative to that
gradient's largest |value|), and the BatchNorm moving statistics after the step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

CASES = sys.argv[2:]
DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
DEVICES = 4
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * DEVICES)
if os.environ.get("TFMIS_TEST_GRAPH_OPTIMIZER") == "0":
    # Grappler's passes over each case's graphs (a one-call step: they cost more than they save) left out: both
    # sides of every comparison run the same unoptimised graph ops
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})

import keras  # noqa: E402

from tfmis.config import load_config  # noqa: E402
from tfmis.losses import DeepSupervisionLoss, build_loss  # noqa: E402
from tfmis.networks import parallel  # noqa: E402
from tfmis.networks.unet import UNetConfig  # noqa: E402

NETS = {
    # configs/demo.yaml's network (strides (2, 2, 2, 1), transposed output with the image, deep supervision 2)
    "demo": (
        dict(in_channels=2, num_classes=4, **dataclasses.asdict(load_config(DEMO_CONFIG).model)),
        (48, 32, 16),
    ),
    "deep": (
        dict(
            in_channels=1,
            num_classes=3,
            filters=(8, 12, 16, 24, 32),
            strides=(1, (2, 2, 1), (2, 2, 1), (2, 2, 1), (2, 2, 1)),
            deep_supervision=2,
        ),
        (48, 32, 13),
    ),
}


def without_halo(self, group, lo, hi, device):
    """Slabs.gather_range reading only the slab's own rows (zeros instead of the neighbours')."""
    own = next(i for i, (a, b) in enumerate(self.bounds) if a <= max(lo, 0) < b)
    a, b = self.bounds[own]
    start, stop = max(lo, a), min(hi, b)
    with tf.device(device):
        x = parallel.slice_along_axis(self.parts[group][own], self.axis, start - a, stop - a)
    return x, (start - lo, hi - stop)


def run(case: str) -> dict:
    net, mode, devices, *options = case.split(":")
    devices = int(devices)
    policy = "mixed_float16" if "mixed" in options else "float64" if "f64" in options else "float32"
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    arch, patch = NETS[net]
    arch = dict(arch, norm="batch" if "batch" in options else "instance", recompute="recompute" in options)
    config = UNetConfig(**arch)
    model, training_model = config.build_for_training()
    axis = next((int(o[4:]) for o in options if o.startswith("axis")), None)
    groups = 2 if "data2" in options else 1
    names = [[f"/cpu:{g * devices + i}" for i in range(devices)] for g in range(groups)]
    kwargs = dict(strides=config.strides, axis=axis, patch_size=patch, in_channels=config.in_channels)
    mp_train = parallel.ModelParallel(training_model, mode, names, micro_batches=2, **kwargs)
    mp_infer = parallel.ModelParallel(model, mode, names[:1], **kwargs)
    loss_fn = DeepSupervisionLoss(build_loss("dice_ce"), [f for _, f in config.deep_supervision_levels])
    rng = np.random.default_rng(1)
    batch = 4 if groups > 1 else 2
    images = tf.constant(rng.normal(size=(batch, *patch, config.in_channels)).astype("float32"))
    labels = tf.constant(rng.integers(0, config.num_classes, size=(batch, *patch)).astype("int32"))
    variables = training_model.trainable_variables
    state = [v for v in training_model.non_trainable_variables if "float" in str(v.dtype)]
    start = [v.numpy() for v in state]

    def step(forward_loss, forward, colocated=False):
        @tf.function(autograph=False)
        def fn(x, y):
            with tf.GradientTape() as tape:
                loss = forward_loss(x, y)
            grads = parallel.ModelParallel.gradients(loss, variables) if colocated else tape.gradient(loss, variables)
            return loss, grads, tf.nest.flatten(forward(x))

        for v, s in zip(state, start):
            v.assign(s)
        loss, grads, outputs = fn(images, labels)
        moved = [v.numpy() for v in state]
        return float(loss), [g.numpy() for g in grads], [o.numpy().astype(np.float64) for o in outputs], moved

    if groups > 1:  # one device: the mean of the groups' losses, as the mesh computes it

        def single_loss(x, y):
            halves = zip(tf.split(x, groups), tf.split(y, groups))
            return tf.add_n([loss_fn(b, training_model(a, training=True)) for a, b in halves]) / groups
    else:

        def single_loss(x, y):
            return loss_fn(y, training_model(x, training=True))

    if "batch" in options and groups > 1:  # BatchNorm statistics of the whole batch, as the mesh synchronises them

        def single_loss(x, y):  # noqa: F811
            outputs = training_model(x, training=True)
            return (
                tf.add_n(
                    [loss_fn(b, [o[i * 2 : i * 2 + 2] for o in outputs]) for i, b in enumerate(tf.split(y, groups))]
                )
                / groups
            )

    one = step(single_loss, lambda x: model(x, training=False))
    gather, norm = parallel.Slabs.gather_range, parallel.SpatialRunner.norm
    if "nohalo" in options:
        parallel.Slabs.gather_range = without_halo
    if "nostats" in options:

        def per_slab(self, layer, x, training):  # each slab normalised by its own statistics
            out = [[None] * len(row) for row in x.parts]
            for g, row in enumerate(x.parts):
                for i, part in enumerate(row):
                    single = parallel.Slabs([[part]], [x.bounds[i]], x.axis, [[x.devices[g][i]]])
                    out[g][i] = norm(self, layer, single, training).parts[0][0]
            return x.like(out)

        parallel.SpatialRunner.norm = per_slab
    try:
        many = step(  # the gradients as the trainer takes them: backward ops on their forward ops' devices
            lambda x, y: mp_train.loss(loss_fn, y, x, training=True),
            lambda x: mp_infer(x, training=False),
            colocated=True,
        )
    finally:
        parallel.Slabs.gather_range, parallel.SpatialRunner.norm = gather, norm
    exact = {}
    if policy == "float32":  # one device in float64 from the same weights: how far float32 rounding alone goes
        weights = [w.astype("float64") for w in training_model.get_weights()]
        keras.mixed_precision.set_global_policy("float64")
        _, twin = UNetConfig(**arch).build_for_training()
        twin.set_weights(weights)

        @tf.function(autograph=False)
        def exact_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, twin(x, training=True))
            return tape.gradient(loss, twin.trainable_variables)

        reference = [g.numpy() for g in exact_step(tf.cast(images, tf.float64), labels)]
        exact = {
            "one_device_float32_error": [float(np.max(np.abs(a - r))) for a, r in zip(one[1], reference)],
            "model_parallel_float32_error": [float(np.max(np.abs(b - r))) for b, r in zip(many[1], reference)],
        }
    return {
        **exact,
        "outputs": [float(np.max(np.abs(a - b))) for a, b in zip(one[2], many[2])],
        "output_scale": [float(np.max(np.abs(a))) for a in one[2]],
        "output_shapes": [list(a.shape) for a in many[2]],
        "loss": [one[0], many[0]],
        "gradients": [float(np.max(np.abs(a - b)) / (np.max(np.abs(a)) + 1e-30)) for a, b in zip(one[1], many[1])],
        "gradient_abs": [float(np.max(np.abs(a - b))) for a, b in zip(one[1], many[1])],
        "gradient_scale": max(float(np.max(np.abs(a))) for a in one[1]),
        "gradient_count": len(one[1]),
        "state": [float(np.max(np.abs(a - b))) for a, b in zip(one[3], many[3])],
        "state_count": len(one[3]),
        "describe": mp_train.describe(),
    }


if __name__ == "__main__":
    results = {}
    for case in CASES:
        results[case] = run(case)
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)
