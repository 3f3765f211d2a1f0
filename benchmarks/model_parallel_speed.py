"""Step time of one U-Net training step on 1, 2 and 4 logical CPU devices, spatial and pipeline (GPipe), and the
pipeline's bubble as the micro-batches grow.

    python benchmarks/model_parallel_speed.py [--patch 48] [--batch 8] [--steps 6]

Logical CPU devices share this machine's cores, so no speed-up is expected here (on 2 cores the split adds
its exchanges and halo rows to the same work); the numbers say what the split costs on one machine's cores, and
GPipe's bubble share (N - 1) / (M + N - 1) is printed next to the measured pipeline times. The CPU model is
printed with the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

DEVICES = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--patch", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * DEVICES)

    import keras

    from tfmis.config import load_config
    from tfmis.hardware import cpu_name, usable_cpu_count
    from tfmis.losses import DeepSupervisionLoss, build_loss
    from tfmis.networks.parallel import ModelParallel
    from tfmis.networks.unet import UNetConfig

    keras.utils.set_random_seed(0)
    demo = load_config(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")  # the demo's network
    config = UNetConfig(in_channels=2, num_classes=4, **dataclasses.asdict(demo.model))
    _, training_model = config.build_for_training()
    loss_fn = DeepSupervisionLoss(build_loss("dice_ce"), [f for _, f in config.deep_supervision_levels])
    optimizer = keras.optimizers.AdamW(1e-3)
    optimizer.build(training_model.trainable_variables)
    patch = (args.patch,) * 3
    rng = np.random.default_rng(0)
    images = tf.constant(rng.normal(size=(args.batch, *patch, 2)).astype("float32"))
    labels = tf.constant(rng.integers(0, 4, size=(args.batch, *patch)).astype("int32"))

    def timed(loss_of) -> float:
        @tf.function(autograph=False)
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_of(x, y)
            grads = tape.gradient(loss, training_model.trainable_variables)
            optimizer.apply(grads, training_model.trainable_variables)
            return loss

        step(images, labels).numpy()  # trace and warm up
        step(images, labels).numpy()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step(images, labels).numpy()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    rows = []
    one = timed(lambda x, y: loss_fn(y, training_model(x, training=True)))
    rows.append(("one device", 1, "-", one, None))
    for n in (2, 4):
        devices = [[f"/cpu:{i}" for i in range(n)]]
        spatial = ModelParallel(training_model, "spatial", devices, config.strides, patch_size=patch, in_channels=2)
        rows.append(("spatial", n, "-", timed(lambda x, y, p=spatial: p.loss(loss_fn, y, x)), None))
        for m in (1, 2, 4, 8):
            if args.batch % m:
                continue
            pipeline = ModelParallel(
                training_model, "pipeline", devices, config.strides, micro_batches=m, patch_size=patch, in_channels=2
            )
            bubble = (n - 1) / (m + n - 1)
            rows.append(("pipeline", n, m, timed(lambda x, y, p=pipeline: p.loss(loss_fn, y, x)), bubble))
    print(
        f"CPU: {cpu_name()}, {usable_cpu_count()} usable cores; {DEVICES} logical CPU devices; demo U-Net, batch "
        f"{args.batch}, patch {args.patch}^3, float32, median of {args.steps} steps"
    )
    print("| mode | devices | micro-batches | step (s) | vs one device | GPipe bubble (N-1)/(M+N-1) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for mode, n, m, seconds, bubble in rows:
        bubble_text = "" if bubble is None else f"{100 * bubble:.0f}%"
        print(f"| {mode} | {n} | {m} | {seconds:.3f} | {seconds / one:.2f}x | {bubble_text} |")


if __name__ == "__main__":
    main()
