import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import make_msd_dataset, tiny_config

from tfmis.data.pipeline import build_train_dataset
from tfmis.engine.bookkeeping import RunExists, TrainingDiverged
from tfmis.engine.trainer import Trainer

TESTS = Path(__file__).resolve().parent
PLAIN_SGD = [
    "optimizer.name=sgd",
    "optimizer.momentum=0.0",
    "optimizer.nesterov=false",
    "optimizer.schedule=constant",
    "optimizer.learning_rate=0.5",
    "optimizer.weight_decay=0.0",
]


def fixed_batch(config, size: int):
    images, labels = next(iter(build_train_dataset(config).unbatch().batch(size)))
    return images, labels


def run_step(trainer, batch) -> tuple[float, float]:
    """One optimizer step through the trainer's compiled step: (mean loss, 1.0 if it was skipped else 0.0)."""
    loss, skipped = trainer.train_step(batch)
    return float(loss), float(skipped)


def with_foreground_norm_term(loss_fn, weight: float = 1e-3):
    """`loss_fn` plus `weight` × the batch mean of ‖foreground logits‖₂ (an L2 regulariser on the logits
    inside the label).

    The value is finite, but d‖x‖/dx = x/‖x‖ is 0/0 = NaN for an image without foreground voxels: the
    classic "finite loss, NaN gradient" case (a norm or sqrt evaluated at zero).
    """

    def loss(y_true, y_pred):
        foreground = tf.cast(tf.reshape(y_true, tf.shape(y_pred)[:-1]) > 0, y_pred.dtype)[..., None]
        per_image = tf.reshape(y_pred * foreground, [tf.shape(y_pred)[0], -1])
        return loss_fn(y_true, y_pred) + weight * tf.reduce_mean(tf.norm(per_image, axis=1))

    return loss


def trainer_state(trainer) -> list[np.ndarray]:
    """Every float variable of the model (weights, BatchNorm moving statistics) and of the optimizer."""
    variables = list(trainer.model.variables) + list(trainer.optimizer.variables)
    return [keras.ops.convert_to_numpy(v) for v in variables]


def test_gradient_accumulation_equals_one_bigger_batch(converted_dataset, tmp_path):
    """2 micro-batches of 2, accumulated, take the same optimizer step as one batch of 4."""
    big = Trainer(tiny_config(converted_dataset, tmp_path / "a", *PLAIN_SGD, "pipeline.num_images_per_batch=4"))
    accumulated = Trainer(
        tiny_config(
            converted_dataset,
            tmp_path / "b",
            *PLAIN_SGD,
            "pipeline.num_images_per_batch=2",
            "training.accumulation_steps=2",
        )
    )
    accumulated.model.set_weights(big.model.get_weights())
    start = [w.copy() for w in big.model.get_weights()]
    batch = fixed_batch(big.config, 4)
    assert run_step(big, batch)[0] == pytest.approx(run_step(accumulated, batch)[0], rel=1e-5)
    assert max(np.abs(a - b).max() for a, b in zip(big.model.get_weights(), start)) > 1e-4
    for a, b in zip(big.model.get_weights(), accumulated.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


MIRRORED_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    sys.path.insert(0, sys.argv[3])
    from conftest import tiny_config
    from test_training import PLAIN_SGD, fixed_batch, run_step
    from tfmis.engine.trainer import Trainer
    dataset_dir, out = sys.argv[1], sys.argv[2]
    single = Trainer(tiny_config(dataset_dir, out + "/single", *PLAIN_SGD, "pipeline.num_images_per_batch=4"))
    mirrored = Trainer(tiny_config(dataset_dir, out + "/mirrored", *PLAIN_SGD, "pipeline.num_images_per_batch=2",
                                   "runtime.distribution=mirrored", 'runtime.devices=["/cpu:0","/cpu:1"]'))
    mirrored.model.set_weights(single.model.get_weights())
    start = [w.copy() for w in single.model.get_weights()]
    batch = fixed_batch(single.config, 4)
    loss_single = run_step(single, batch)[0]
    strategy = mirrored.backend.strategy
    distributed = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(batch))))
    per_replica_shapes = [v.shape.as_list() for v in strategy.experimental_local_results(distributed[0])]
    loss_mirrored = run_step(mirrored, distributed)[0]
    replica_weights = [[v.numpy() for v in strategy.experimental_local_results(var.value)]
                       for var in mirrored.model.trainable_variables]
    diff = max(float(np.abs(a - b).max()) for a, b in zip(single.model.get_weights(), mirrored.model.get_weights()))
    moved = max(float(np.abs(a - b).max()) for a, b in zip(single.model.get_weights(), start))
    replicas_agree = all(np.array_equal(r[0], r[1]) for r in replica_weights)
    # and a short real fit: two epochs with validation, through the distributed input pipeline
    summary = mirrored.fit()
    # then --resume with one more epoch (the same strategy: a second one would reuse its collective keys)
    resumed = Trainer(tiny_config(dataset_dir, out + "/mirrored", *PLAIN_SGD, "pipeline.num_images_per_batch=2",
                                  "training.epochs=3", "runtime.distribution=mirrored",
                                  'runtime.devices=["/cpu:0","/cpu:1"]'), backend=mirrored.backend)
    resumed_summary = resumed.fit(resume=True)
    print(json.dumps({"replicas": mirrored.backend.num_replicas, "shapes": per_replica_shapes,
                      "loss_single": loss_single, "loss_mirrored": loss_mirrored, "max_weight_diff": diff,
                      "moved": moved, "replicas_agree": replicas_agree, "fit_epochs": summary["epochs"],
                      "fit_dice": summary["final_mean_dice"], "resumed_epochs": resumed_summary["epochs"]}))
""")


@pytest.mark.slow
def test_mirrored_strategy_step_matches_single_device(converted_dataset, tmp_path):
    """One real training step under MirroredStrategy over two logical CPUs equals the single-device step; a
    two-epoch fit, then a resumed fit to epoch 3, run under the same strategy."""
    script = tmp_path / "mirrored.py"
    script.write_text(MIRRORED_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), str(converted_dataset), str(tmp_path), str(TESTS)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["replicas"] == 2 and out["shapes"] == [[2, 16, 16, 16, 2], [2, 16, 16, 16, 2]]
    assert out["loss_mirrored"] == pytest.approx(out["loss_single"], rel=1e-5)
    assert out["moved"] > 1e-4  # the step did change the weights...
    assert out["max_weight_diff"] < 1e-5  # ...identically on one device and on two replicas
    assert out["replicas_agree"]
    assert out["fit_epochs"] == 2 and 0 <= out["fit_dice"] <= 1
    assert out["resumed_epochs"] == 3  # --resume under MirroredStrategy: epochs 1-2 restored, epoch 3 trained


REPLICAS_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    sys.path.insert(0, sys.argv[3])
    from conftest import tiny_config
    from test_training import CLIPNORM, PLAIN_SGD, fixed_batch, run_step, with_foreground_norm_term
    from tfmis.engine.distribution import make_backend
    from tfmis.engine.trainer import Trainer
    dataset_dir, out = sys.argv[1], sys.argv[2]
    MIRRORED = ["runtime.distribution=mirrored", 'runtime.devices=["/cpu:0","/cpu:1"]']
    # one strategy for every two-replica trainer: two MirroredStrategy objects in one process would reuse
    # the same collective-op keys
    BACKEND = make_backend("mirrored", ["/cpu:0", "/cpu:1"])
    results = {}

    def pair(name, *overrides, accumulation=1):
        # global micro-batch of 4 images: 4 on one device, 2 per replica on two; same initial weights
        n = accumulation
        common = [*PLAIN_SGD, *overrides, f"training.accumulation_steps={n}"]
        single = Trainer(tiny_config(dataset_dir, f"{out}/{name}-single", *common,
                                     f"pipeline.num_images_per_batch={4 * n}"))
        mirrored = Trainer(tiny_config(dataset_dir, f"{out}/{name}-mirrored", *common, *MIRRORED,
                                       f"pipeline.num_images_per_batch={2 * n}"), backend=BACKEND)
        mirrored.model.set_weights(single.model.get_weights())
        return single, mirrored

    def step_both(single, mirrored, images, labels):
        # replica r takes images[2n r : 2n (r + 1)] and splits them into n micro-batches of 2; the single device
        # gets the same global micro-batches (replica 0's 2 images, then replica 1's) in the same order
        n = single.config.training.accumulation_steps
        order = [2 * n * r + 2 * k + i for k in range(n) for r in range(2) for i in range(2)]
        loss_single, skipped_single = run_step(single, (tf.gather(images, order), tf.gather(labels, order)))
        strategy = mirrored.backend.strategy
        distributed = next(iter(strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensors((images, labels)))))
        loss_mirrored, skipped_mirrored = run_step(mirrored, distributed)
        return dict(loss_single=loss_single, loss_mirrored=loss_mirrored, skipped_single=skipped_single,
                    skipped_mirrored=skipped_mirrored)

    def per_replica(trainer, variables):
        strategy = trainer.backend.strategy
        return [[v.numpy() for v in strategy.experimental_local_results(var.value)] for var in variables]

    def max_diff(a, b):
        return max(float(np.abs(x - y).max()) for x, y in zip(a, b))

    def compare(single, mirrored, variables_of=lambda t: t.model.variables):
        replicas = per_replica(mirrored, variables_of(mirrored))
        return dict(single_vs_replica0=max_diff([v.numpy() for v in variables_of(single)], [r[0] for r in replicas]),
                    replica0_vs_replica1=max_diff([r[0] for r in replicas], [r[1] for r in replicas]))

    # ---- item 2: optimizer.clipnorm clips the global gradient, whatever the replica count
    single, mirrored = pair("clip", f"optimizer.clipnorm={CLIPNORM}")
    free = Trainer(tiny_config(dataset_dir, f"{out}/clip-free", *PLAIN_SGD, "pipeline.num_images_per_batch=4"))
    free.model.set_weights(single.model.get_weights())
    start = [v.numpy() for v in single.model.trainable_variables]
    images, labels = fixed_batch(single.config, 4)
    step_both(single, mirrored, images, labels)
    run_step(free, (images, labels))
    lr = single.config.optimizer.learning_rate
    # reference: plain SGD on the unclipped batch gradient g, with Keras' per-variable rule g * c / max(|g|, c)
    expected, norms = [], []
    for w0, w in zip(start, [v.numpy() for v in free.model.trainable_variables]):
        g = (w0 - w) / lr
        norms.append(float(np.linalg.norm(g)))
        expected.append(-lr * g * CLIPNORM / max(norms[-1], CLIPNORM))
    updates = {"single": [v.numpy() - w0 for v, w0 in zip(single.model.trainable_variables, start)],
               "mirrored": [r[0] - w0 for r, w0 in zip(per_replica(mirrored, mirrored.model.trainable_variables),
                                                       start)]}
    results["clip"] = dict(
        bound=sum(n > CLIPNORM for n in norms), variables=len(norms),
        **{f"{k}_vs_reference": max_diff(u, expected) for k, u in updates.items()},
        **{f"{k}_update_norm_ratio": max(float(np.linalg.norm(a) / np.linalg.norm(e)) for a, e in zip(u, expected))
           for k, u in updates.items()},
        reference_max_update=max(float(np.abs(e).max()) for e in expected),
        **compare(single, mirrored))

    # ---- item 3: BatchNorm statistics of the global (micro-)batch, the same on every replica
    for name, n, extra in (("bn", 1, []), ("bn_accumulated", 2, []),
                           ("bn_recompute", 2, ["model.recompute=true", "model.num_res_units=1"])):
        single, mirrored = pair(name, "model.norm=batch", *extra, accumulation=n)
        images, labels = fixed_batch(single.config, 4 * n)
        losses = step_both(single, mirrored, images, labels)
        moving = lambda t: [v for v in t.model.non_trainable_variables if "moving" in v.path]
        results[name] = dict(**losses, moving=compare(single, mirrored, moving),
                             moving_changed=max_diff([v.numpy() for v in moving(single)],
                                                     [np.zeros(v.shape) if "mean" in v.path else np.ones(v.shape)
                                                      for v in moving(single)]),
                             weights=compare(single, mirrored, lambda t: t.model.trainable_variables),
                             synchronized=[layer.synchronized for layer in mirrored.model._flatten_layers()
                                           if "BatchNormalization" in type(layer).__name__])

    # ---- item 4: a NaN gradient on one replica only skips the step on every replica
    for precision in ("float32", "mixed_float16"):
        single, mirrored = pair(f"nan_{precision}", "model.norm=batch", f"training.precision={precision}")
        for t in (single, mirrored):
            t.loss_fn = with_foreground_norm_term(t.loss_fn)
        images, labels = fixed_batch(single.config, 4)
        # the model and the optimizer proper (a loss scaler's own scale is allowed to change)
        optimizer = getattr(mirrored.optimizer, "inner_optimizer", mirrored.optimizer)
        state = lambda: [per_replica(mirrored, mirrored.model.variables), per_replica(mirrored, optimizer.variables)]
        before = state()
        bad_labels = tf.concat([tf.zeros_like(labels[:1]), labels[1:]], axis=0)  # image 0 (replica 0): no foreground
        skipped = step_both(single, mirrored, images, bad_labels)
        after = state()
        changed = [max(float(np.abs(b[r] - a[r]).max()) if np.issubdtype(np.asarray(b[r]).dtype, np.floating) else 0.0
                       for group_b, group_a in zip(before, after) for b, a in zip(group_b, group_a))
                   for r in range(2)]
        non_finite = [sum(int(not np.isfinite(a[r]).all()) for group in after for a in group
                          if np.issubdtype(np.asarray(a[r]).dtype, np.floating)) for r in range(2)]
        scale = [float(np.asarray(s)) for s in per_replica(mirrored, [mirrored.optimizer.dynamic_scale])[0]] \\
            if precision == "mixed_float16" else None
        start = [v.numpy() for v in single.model.variables]
        normal = step_both(single, mirrored, images, labels)
        moved = max_diff(start, [v.numpy() for v in single.model.variables])
        results[f"nan_{precision}"] = dict(skipped=skipped, changed_per_replica=changed, moved=moved,
                                           non_finite_per_replica=non_finite, loss_scale_per_replica=scale,
                                           then=normal, **compare(single, mirrored))
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def replica_results(converted_dataset, tmp_path_factory) -> dict:
    """Runs REPLICAS_SCRIPT once: one device vs MirroredStrategy over two logical CPUs, same global batch."""
    out = tmp_path_factory.mktemp("replicas")
    script = out / "replicas.py"
    script.write_text(REPLICAS_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), str(converted_dataset), str(out), str(TESTS)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


CLIPNORM = 0.01  # below every per-variable gradient norm of the tiny model's first step: clipping binds


@pytest.mark.slow
def test_clipnorm_clips_the_gradient_summed_over_replicas(replica_results):
    """optimizer.clipnorm bounds the per-variable norm of the global gradient, on one device or two replicas.

    Reference: plain SGD's update with the unclipped gradient g of the same batch, scaled by Keras' documented
    per-variable rule c / max(‖g‖, c). Clipping each replica's partial gradient instead would let the
    update grow with the replica count (up to 2c here) and change its direction.
    """
    r = replica_results["clip"]
    assert r["bound"] == r["variables"]  # the threshold binds for every variable
    assert r["reference_max_update"] > 1e-3
    assert r["single_vs_reference"] < 2e-6 and r["mirrored_vs_reference"] < 2e-6  # float32 rounding of the weights
    assert r["mirrored_update_norm_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert r["single_vs_replica0"] < 1e-6 and r["replica0_vs_replica1"] == 0.0


@pytest.mark.parametrize("case", ["bn", "bn_accumulated", "bn_recompute"])
@pytest.mark.slow
def test_batchnorm_statistics_are_the_global_batch_statistics_on_every_replica(replica_results, case):
    """norm=batch under MirroredStrategy: batch statistics over all replicas' images (synchronised BatchNorm).

    Both replicas end a step with identical moving statistics, equal to those of one device given the same
    global (micro-)batches; with gradient accumulation each micro-batch's forward pass updates them once
    (as in PyTorch), from that micro-batch's statistics over every replica; also with recomputed
    (rematerialised) residual blocks. Weights agree as well.
    """
    r = replica_results[case]
    assert r["synchronized"] and all(r["synchronized"])
    assert r["moving_changed"] > 1e-3  # the step did update the moving statistics...
    assert r["moving"]["replica0_vs_replica1"] == 0.0  # ...identically on both replicas...
    assert r["moving"]["single_vs_replica0"] < 1e-5  # ...and as on one device with the global batch
    assert r["loss_mirrored"] == pytest.approx(r["loss_single"], rel=1e-5)
    assert r["weights"]["single_vs_replica0"] < 1e-5 and r["weights"]["replica0_vs_replica1"] == 0.0


@pytest.mark.parametrize("precision", ["float32", "mixed_float16"])
@pytest.mark.slow
def test_non_finite_gradient_on_one_replica_skips_the_step_on_every_replica(replica_results, precision):
    """A NaN gradient (finite loss) on replica 0 only: both replicas skip the step, the model and optimizer
    state stay exactly as they were (moving statistics included), and the next step trains normally."""
    r = replica_results[f"nan_{precision}"]
    s = r["skipped"]
    assert np.isfinite(s["loss_single"]) and np.isfinite(s["loss_mirrored"])
    assert s["skipped_single"] == 1.0 and s["skipped_mirrored"] == 1.0
    assert r["non_finite_per_replica"] == [0, 0]
    assert r["changed_per_replica"] == [0.0, 0.0]
    if precision == "mixed_float16":  # the loss scaler lowered its scale, the same on both replicas
        assert len(set(r["loss_scale_per_replica"])) == 1 and r["loss_scale_per_replica"][0] < 32768
    assert r["then"]["skipped_single"] == 0.0 and r["then"]["skipped_mirrored"] == 0.0
    assert r["replica0_vs_replica1"] == 0.0 and r["moved"] > 1e-2
    # float16 convolutions round differently on one device (batch 4) and two replicas (batch 2 each)
    assert r["single_vs_replica0"] < (1e-5 if precision == "float32" else 0.05 * r["moved"])


def test_fit_writes_history_checkpoints_and_reports(converted_dataset, tmp_path):
    config = tiny_config(converted_dataset, tmp_path / "run", "output.tensorboard=true", "validation.hd95=true")
    summary = Trainer(config).fit()
    run = tmp_path / "run"
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in history] == [1, 2]
    for r in history:
        assert np.isfinite(r["train_loss"]) and set(r["val_dice"]) == {"organ", "core"}
        assert r["images_per_second"] > 0 and 0 <= r["data_wait_fraction"] <= 1
        assert r["data_wait_seconds"] + r["compute_seconds"] <= r["epoch_seconds"]
        assert "val_mean_hd95" in r
    header = (run / "history.csv").read_text().splitlines()[0].split(",")
    assert {"epoch", "train_loss", "val_mean_dice", "val_dice/organ", "epoch_seconds", "data_wait_seconds"} <= set(
        header
    )
    assert (run / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "best.weights.h5").is_file() and (run / "config.yaml").is_file()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((run / "summary.json").read_text()) == summary
    assert summary["best_mean_dice"] == max(r["val_mean_dice"] for r in history)
    with pytest.raises(RunExists, match="--resume"):
        Trainer(config).fit()


def test_nan_loss_stops_with_a_clear_message(converted_dataset, tmp_path):
    config = tiny_config(
        converted_dataset,
        tmp_path / "nan",
        "optimizer.name=sgd",
        "optimizer.learning_rate=1e30",
        "optimizer.schedule=constant",
        "training.epochs=3",
        "training.steps_per_epoch=4",
    )
    with pytest.raises(TrainingDiverged, match=r"the training loss became nan at epoch 1, step \d"):
        Trainer(config).fit()
    assert not (tmp_path / "nan" / "history.jsonl").exists()


@pytest.mark.parametrize("precision", ["float32", "mixed_bfloat16"])
def test_non_finite_gradient_with_finite_loss_skips_the_step(converted_dataset, tmp_path, precision):
    """A finite loss whose gradient is NaN (a norm at zero) through the real step: the step is skipped and
    every weight, BatchNorm moving statistic and AdamW state (moments, iteration count) is left exactly as
    it was; the next, healthy batch trains normally."""
    trainer = Trainer(
        tiny_config(
            converted_dataset,
            tmp_path / "run",
            f"training.precision={precision}",
            "model.norm=batch",
            "optimizer.name=adamw",
            "optimizer.weight_decay=1e-2",
        )
    )
    trainer.loss_fn = with_foreground_norm_term(trainer.loss_fn)
    images, labels = fixed_batch(trainer.config, 2)
    assert all(np.any(labels[i] > 0) for i in range(2))  # healthy batch: foreground in every image
    before = trainer_state(trainer)
    loss, skipped = run_step(trainer, (images, tf.concat([labels[:1], tf.zeros_like(labels[1:])], axis=0)))
    assert np.isfinite(loss) and skipped == 1.0
    for a, b in zip(trainer_state(trainer), before):
        np.testing.assert_array_equal(a, b)
    loss, skipped = run_step(trainer, (images, labels))
    after = trainer_state(trainer)
    assert np.isfinite(loss) and skipped == 0.0
    assert all(np.isfinite(a).all() for a in after)
    assert max(float(np.abs(a - b).max()) for a, b in zip(after, before) if a.dtype.kind == "f") > 1e-4


@pytest.mark.parametrize(
    "steps, message",
    [(2, r"all 2 steps of epoch 1 were skipped"), (25, r"20 consecutive steps were skipped \(epoch 1, steps 1-20\)")],
)
def test_fit_stops_when_steps_keep_being_skipped(converted_dataset, tmp_path, steps, message):
    """Every gradient non-finite (the norm term over an empty region): fit stops with an error naming the
    epoch, after a whole epoch or 20 consecutive skipped steps, and writes no checkpoint, best weights or history."""
    config = tiny_config(converted_dataset, tmp_path / "run", f"training.steps_per_epoch={steps}")
    trainer = Trainer(config)
    base = trainer.loss_fn
    trainer.loss_fn = lambda y, p: (
        with_foreground_norm_term(base)(tf.zeros_like(y), p) + base(y, p) - base(tf.zeros_like(y), p)
    )
    with pytest.raises(TrainingDiverged, match=message):
        trainer.fit()
    run = tmp_path / "run"
    assert not list((run / "checkpoints").glob("ckpt-*")) and not (run / "best.weights.h5").exists()
    assert not (run / "history.jsonl").exists()


def test_skipped_steps_are_counted_in_the_history_and_epoch_line(converted_dataset, tmp_path, capsys):
    """Every second step has a NaN gradient (the norm term evaluated on zeros): training goes on, each
    2-step epoch reports 1 skipped step in history.jsonl and on its epoch line, and the checkpoints hold
    finite weights."""
    trainer = Trainer(tiny_config(converted_dataset, tmp_path / "run"))
    base, calls = trainer.loss_fn, tf.Variable(0)

    def loss(y_true, y_pred):
        odd = tf.cast(calls.assign_add(1) % 2, y_pred.dtype)  # 1 on the 1st, 3rd... call, 0 on the others
        return base(y_true, y_pred) + 1e-3 * tf.norm(y_pred * odd)

    trainer.loss_fn = loss
    trainer.fit()
    history = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in history] == [1, 1]
    assert capsys.readouterr().err.count("skipped 1 steps (non-finite gradient)") == 2
    reader = tf.train.load_checkpoint(trainer.state.manager.latest_checkpoint)
    tensors = [reader.get_tensor(name) for name in reader.get_variable_to_shape_map()]
    assert all(np.isfinite(t).all() for t in tensors if isinstance(t, np.ndarray) and t.dtype.kind == "f")


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e39 in float32, on purpose
def test_non_finite_weights_are_never_saved(converted_dataset, tmp_path):
    """A finite loss and finite gradients, but a learning rate that overflows float32: the weights become
    non-finite after the epoch's last step. fit stops naming the epoch; no checkpoint or best weights hold them."""
    config = tiny_config(
        converted_dataset,
        tmp_path / "run",
        *PLAIN_SGD,
        "optimizer.learning_rate=1e39",
        "training.epochs=1",
        "training.steps_per_epoch=1",
    )
    with pytest.raises(TrainingDiverged, match=r"non-finite .* after epoch 1"):
        Trainer(config).fit()
    run = tmp_path / "run"
    assert not list((run / "checkpoints").glob("ckpt-*")) and not (run / "best.weights.h5").exists()


def test_batchnorm_moving_statistics_update_once_per_micro_batch(converted_dataset, tmp_path):
    """norm=batch with gradient accumulation (2 micro-batches of 2): the moving statistics take one momentum
    update per micro-batch forward pass, as in PyTorch, from that micro-batch's (biased) statistics.

    Reference, written out: m ← 0.9 m + 0.1 μ₁, then m ← 0.9 m + 0.1 μ₂ (the same for the variance), with
    μₖ the per-channel statistics of the first encoder convolution's output on micro-batch k.
    """
    trainer = Trainer(
        tiny_config(
            converted_dataset,
            tmp_path / "run",
            *PLAIN_SGD,
            "model.norm=batch",
            "pipeline.num_images_per_batch=4",
            "training.accumulation_steps=2",
        )
    )
    layer = trainer.model.get_layer("encoder0")
    images, labels = fixed_batch(trainer.config, 4)
    mean, var = layer.normalization.moving_mean.numpy(), layer.normalization.moving_variance.numpy()
    for k in range(2):  # the convolution's output with the weights of this step (unchanged between micro-batches)
        features = layer.conv(images[2 * k : 2 * k + 2]).numpy().astype(np.float64)
        mean = 0.9 * mean + 0.1 * features.mean(axis=(0, 1, 2, 3))
        var = 0.9 * var + 0.1 * features.var(axis=(0, 1, 2, 3))
    run_step(trainer, (images, labels))
    np.testing.assert_allclose(layer.normalization.moving_mean.numpy(), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.normalization.moving_variance.numpy(), var, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("precision, jit", [("mixed_float16", False), ("mixed_bfloat16", False), ("float32", True)])
def test_precisions_and_xla_train(converted_dataset, tmp_path, precision, jit):
    config = tiny_config(
        converted_dataset,
        tmp_path / "run",
        f"training.precision={precision}",
        f"training.jit_compile={str(jit).lower()}",
        "training.epochs=1",
    )
    trainer = Trainer(config)
    assert trainer.model.outputs[0].dtype == "float32"  # logits stay float32 under any policy
    summary = trainer.fit()
    record = json.loads((tmp_path / "run" / "history.jsonl").read_text())
    assert np.isfinite(record["train_loss"]) and summary["epochs"] == 1
    assert ("loss_scale" in record) == (precision == "mixed_float16")


def test_target_dice_stops_training(converted_dataset, tmp_path):
    config = tiny_config(converted_dataset, tmp_path / "run", "training.epochs=5", "training.target_dice=0.0")
    summary = Trainer(config).fit()
    assert summary["epochs"] == 1 and summary["stop_reason"] == "target_dice"


@pytest.mark.slow
def test_max_minutes_stops_after_the_epoch_that_crosses_it_and_counts_resumed_time(converted_dataset, tmp_path):
    """training.max_minutes=0.001 (60 ms) is crossed by the first epoch: training stops after it, validating it
    although val_interval is 3; a resumed run starts with that time already spent and stops after one more
    epoch. Without a budget all 5 epochs run."""
    budget = ["training.epochs=5", "validation.val_interval=3", "training.max_minutes=0.001"]
    summary = Trainer(tiny_config(converted_dataset, tmp_path / "run", *budget)).fit()
    history = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert summary["stop_reason"] == "max_minutes" and [r["epoch"] for r in history] == [1]
    assert "val_mean_dice" in history[0] and history[0]["elapsed_seconds"] >= 0.06
    resumed = Trainer(tiny_config(converted_dataset, tmp_path / "run", *budget)).fit(resume=True)
    assert resumed["stop_reason"] == "max_minutes" and resumed["epochs"] == 2
    free = Trainer(
        tiny_config(converted_dataset, tmp_path / "free", "training.epochs=5", "validation.val_interval=3")
    ).fit()
    assert free["stop_reason"] == "epochs" and free["epochs"] == 5


@pytest.mark.parametrize("loss", ["dice", "dice_ce", "dice_focal"])
def test_every_configured_loss_trains_a_step(converted_dataset, tmp_path, loss):
    """loss.name dice / dice_ce / dice_focal each build through the trainer and take a finite step."""
    trainer = Trainer(tiny_config(converted_dataset, tmp_path, f"loss.name={loss}"))
    loss_value, skipped = run_step(trainer, fixed_batch(trainer.config, 2))
    assert np.isfinite(loss_value) and skipped == 0.0


@pytest.mark.slow
def test_train_dataset_fn_replaces_the_training_input(converted_dataset, tmp_path):
    """Trainer(train_dataset_fn=...) trains on the stream that function builds (here: the standard pipeline with
    its labels set to background), called once per input pipeline with the resume offset."""
    calls = []

    def background_only(config, input_context, seed_offset):
        calls.append(seed_offset)
        return build_train_dataset(config, input_context, seed_offset).map(lambda x, y: (x, tf.zeros_like(y)))

    config = tiny_config(
        converted_dataset, tmp_path / "run", "training.epochs=1", "loss.include_background=true", "loss.name=dice"
    )
    Trainer(config, train_dataset_fn=background_only).fit()
    assert calls == [0]
    plain_loss = json.loads((tmp_path / "run" / "history.jsonl").read_text())["train_loss"]
    standard = Trainer(
        tiny_config(
            converted_dataset, tmp_path / "std", "training.epochs=1", "loss.include_background=true", "loss.name=dice"
        )
    ).fit()
    standard_loss = json.loads((tmp_path / "std" / "history.jsonl").read_text())["train_loss"]
    assert standard["epochs"] == 1 and plain_loss != pytest.approx(standard_loss, rel=1e-3)


def test_callbacks_see_every_event_in_order_and_only_committed_epochs(converted_dataset, tmp_path):
    """A user callback passed to Trainer gets train/epoch/step/validation events in order; at on_epoch_end the
    epoch's record is already in history.jsonl and its checkpoint written; on_train_end gets the summary."""
    from tfmis.engine.callbacks import Callback

    events = []

    class Recorder(Callback):
        def on_train_begin(self, trainer, start_epoch):
            events.append(("train_begin", start_epoch))

        def on_epoch_begin(self, trainer, epoch):
            events.append(("epoch_begin", epoch))

        def on_step_begin(self, trainer, epoch, step):
            events.append(("step_begin", epoch, step))

        def on_step_end(self, trainer, epoch, step, logs):
            events.append(("step_end", epoch, step, np.isfinite(logs["loss"]), logs["wait_seconds"] >= 0))

        def on_validation_end(self, trainer, epoch, result):
            events.append(("validation_end", epoch, 0 <= result["mean_dice"] <= 1))

        def on_epoch_end(self, trainer, epoch, record):
            lines = (trainer.out / "history.jsonl").read_text().splitlines()
            committed = json.loads(lines[-1]) == json.loads(json.dumps(record))
            events.append(
                ("epoch_end", epoch, committed, trainer.state.manager.latest_checkpoint.endswith(f"-{epoch}"))
            )

        def on_train_end(self, trainer, summary):
            events.append(("train_end", summary["epochs"]))

    config = tiny_config(converted_dataset, tmp_path / "run", "validation.val_interval=2", "training.epochs=2")
    Trainer(config, callbacks=[Recorder()]).fit()

    def steps(e):
        return [
            ("step_begin", e, 0),
            ("step_end", e, 0, True, True),
            ("step_begin", e, 1),
            ("step_end", e, 1, True, True),
        ]

    assert events == [
        ("train_begin", 1),
        ("epoch_begin", 1),
        *steps(1),
        ("epoch_end", 1, True, True),
        ("epoch_begin", 2),
        *steps(2),
        ("validation_end", 2, True),
        ("epoch_end", 2, True, True),
        ("train_end", 2),
    ]


@pytest.mark.slow
def test_progress_to_a_log_file_is_plain_lines_without_bar_frames(converted_dataset, tmp_path):
    """`python -m tfmis.train` with standard error redirected to a file (not a terminal) and progress on writes
    no carriage-return bar frames: a plain line per step (output.progress_seconds=0) and one line per epoch."""
    from tfmis.config import save_config

    config = tiny_config(
        converted_dataset,
        tmp_path / "run",
        "output.progress=true",
        "output.progress_seconds=0",
        "training.steps_per_epoch=3",
    )
    save_config(config, tmp_path / "tiny.yaml")
    with open(tmp_path / "train.log", "w") as log:
        result = subprocess.run(
            [sys.executable, "-m", "tfmis.train", "--config", str(tmp_path / "tiny.yaml")],
            stdout=subprocess.DEVNULL,
            stderr=log,
            timeout=300,
        )
    text = (tmp_path / "train.log").read_text()
    assert result.returncode == 0, text[-3000:]
    assert "\r" not in text
    assert [line.split("  ")[1] for line in text.splitlines() if line.startswith("epoch 1/2  step")] == [
        "step 1/3",
        "step 2/3",
    ]  # the last step's line is the epoch line
    assert len([line for line in text.splitlines() if line.startswith("epoch ") and "img/s" in line]) == 2


def test_monitor_switch_writes_resources_csv_and_png_during_training(converted_dataset, tmp_path):
    """output.monitor_seconds samples this process during fit (CPU fallback here): resources.csv holds rows with
    RSS above 50 MB (TensorFlow alone holds more) spanning the run, and resources.png is drawn at the end.
    "Spanning" is a ratio measured in this run: the last row's elapsed time is at least half the fit's own
    elapsed_seconds (the sampler starts just after fit() does and adds a last row at its end: a busy machine
    delays both clocks alike; a monitor stopped after the first epoch would cover well under half), and a
    2-epoch fit of several seconds gives at least 3 rows at 0.2 s."""
    import csv

    config = tiny_config(converted_dataset, tmp_path / "run", "output.monitor_seconds=0.2", "training.epochs=2")
    summary = Trainer(config).fit()
    with open(tmp_path / "run" / "resources.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 3 and all(float(r["memory_used_mb"]) > 50 for r in rows)
    assert float(rows[-1]["elapsed_s"]) >= 0.5 * summary["elapsed_seconds"]
    assert (tmp_path / "run" / "resources.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_curves_png_is_redrawn_at_most_every_plot_seconds_and_always_at_the_end(converted_dataset, tmp_path):
    """output.plot_seconds bounds how often training_curves.png is drawn (a drawing is not free), counted from the
    start of training: with 3600 s a 3-epoch fit draws it at the end of training only (none after any epoch, then a
    PNG); with 0 it is redrawn after every epoch, and not again at the end (the file is the one written after epoch
    3, not rewritten)."""
    from tfmis.engine.callbacks import Callback

    class PngAfterEpoch(Callback):  # runs after the default callbacks: sees what Curves left after each epoch
        def __init__(self, path):
            self.path, self.seen, self.written = path, [], []

        def on_epoch_end(self, trainer, epoch, record):
            self.seen.append(self.path.read_bytes() if self.path.exists() else None)
            self.written.append(self.path.stat().st_mtime_ns if self.path.exists() else None)

    for seconds in (3600, 0):
        run = tmp_path / f"every{seconds}"
        png = run / "training_curves.png"
        watcher = PngAfterEpoch(png)
        Trainer(
            tiny_config(converted_dataset, run, "training.epochs=3", f"output.plot_seconds={seconds}"),
            callbacks=[watcher],
        ).fit()
        first, second, third = watcher.seen
        if seconds:
            assert first is None and second is None and third is None
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the end of training drew it
        else:
            assert first is not None and first[:8] == b"\x89PNG\r\n\x1a\n"
            assert second != first and third != second
            assert png.read_bytes() == third and png.stat().st_mtime_ns == watcher.written[-1]


def test_profile_section_writes_a_profiler_trace_of_the_chosen_steps(converted_dataset, tmp_path):
    """profile.start_step=2, num_steps=2 writes one TensorFlow profiler trace (an .xplane.pb under
    tensorboard/plugins/profile/<run>/, the files TensorBoard's Profile tab reads) holding the loop's
    train_step and data_wait ranges and the step's ops under the forward/ and optimizer_step/ name scopes."""
    config = tiny_config(
        converted_dataset, tmp_path / "run", "profile.start_step=2", "profile.num_steps=2", "training.epochs=2"
    )
    Trainer(config).fit()
    traces = list((tmp_path / "run" / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1
    content = traces[0].read_bytes()
    assert b"train_step" in content and b"data_wait" in content
    assert b"forward/" in content and b"optimizer_step/" in content


@pytest.fixture(scope="module")
def large_volume_dataset(tmp_path_factory) -> Path:
    """4 train + 2 val cases of 128^3 voxels: reading and decoding a volume costs more than a small step."""
    from tfmis.data.conversion_options import ConversionConfig
    from tfmis.data.convert import convert

    root = tmp_path_factory.mktemp("large")
    source = make_msd_dataset(root / "Task98_Large", num_cases=6, shape=(128, 128, 128))
    convert(
        ConversionConfig(str(source), str(root / "tfrecords"), split=(0.67, 0.33), shards=2, workers=1, progress=False)
    )
    return root / "tfrecords"


@pytest.mark.slow
def test_input_bound_report_diagnoses_the_uncached_pipeline_and_agrees_with_its_measured_wait(
    large_volume_dataset, tmp_path, capsys
):
    """The same small step fed with 8 16^3 crops of 8 different 128^3 volumes by the parallel pipeline
    (deterministic=false), with pipeline.cache=none (every volume read and decoded again) and with
    pipeline.cache=memory, both in this test:

    - ordering, measured within this run: the uncached run's input-wait share of the epochs after the first is at
      least 2x the cached one's and 25 points above it (measured 73-78 % vs 3-5 % on an idle machine; on a busy
      2-core box two identical cached runs measured up to 14 % vs 4 %, so a ratio alone can be met by noise and
      the 25-point gap is what tells a cache=none that reads again from one that does not);
    - at a threshold between the two measured shares, `input_bound_diagnosis` names pipeline.cache and its fix for
      the uncached run and nothing for the cached one;
    - the report at the default 10 % threshold is consistent with each run's own measurement: summary.json's
      `input_bound` holds the measured share of epochs 2-3 (recomputed here from history.jsonl) when it is above
      10 %, else null; one `input-bound:` line with the cause and fix is printed if the running share (epoch 2,
      then epochs 2-3) was over 10 % at either epoch end, else none. (Whether a run lands above
      10 % depends on the machine's load; the asserts above do not.)"""
    from tfmis.engine.callbacks import input_bound_diagnosis

    # 16^3 crops and 8 steps per epoch: a CI run once measured under 10 % with 24^3 crops and 4 steps (here 31-37 %),
    # most likely the prefetch buffer filling during epoch-end work and covering a 4-step epoch; now 73-78 % vs 3-5 %
    # (uncached and deterministic then; both parallel now, so that the cache alone makes the difference)
    settings = [
        "training.epochs=3",
        "training.steps_per_epoch=8",
        "pipeline.patch_size=[16,16,16]",
        "pipeline.num_images_per_batch=8",
        "pipeline.num_crops_per_image=1",
        "validation.val_interval=10",
        "validation.roi_size=[64,64,64]",
    ]
    shares, configs, records = {}, {}, {}
    for name, cache in (("uncached", "none"), ("cached", "memory")):  # the cache is the only difference
        configs[name] = tiny_config(
            large_volume_dataset, tmp_path / name, *settings, f"pipeline.cache={cache}", "pipeline.deterministic=false"
        )
        summary = Trainer(configs[name]).fit()
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("input-bound:")]
        saved = json.loads((tmp_path / name / "summary.json").read_text())["input_bound"]
        records[name] = [json.loads(line) for line in (tmp_path / name / "history.jsonl").read_text().splitlines()]
        warm = records[name][1:]
        wait = sum(r["data_wait_seconds"] for r in warm)
        shares[name] = wait / (wait + sum(r["compute_seconds"] for r in warm))
        assert summary["input_bound"] == saved
        if shares[name] > 0.10:
            assert saved["data_wait_fraction"] == pytest.approx(shares[name]) and saved["epochs"] == [2, 3]
        else:
            assert saved is None, saved
        # the line: once, at the first epoch after the first whose running diagnosis (epochs 2..k) is over 10 %
        running = [input_bound_diagnosis(configs[name], records[name][:k]) for k in (2, 3)]
        first = next((d for d in running if d), None)
        assert len(lines) == (first is not None), lines
        if first:
            assert first["cause"] in lines[0] and first["fix"] in lines[0], lines
    assert shares["uncached"] >= 2 * shares["cached"] and shares["uncached"] - shares["cached"] >= 0.25, shares
    between = (shares["uncached"] + shares["cached"]) / 2
    diagnosis = input_bound_diagnosis(configs["uncached"], records["uncached"], threshold=between)
    assert diagnosis["data_wait_fraction"] == pytest.approx(shares["uncached"])
    assert "pipeline.cache is none" in diagnosis["cause"] and "pipeline.cache=memory" in diagnosis["fix"]
    assert input_bound_diagnosis(configs["cached"], records["cached"], threshold=between) is None
    assert input_bound_diagnosis(configs["uncached"], records["uncached"], threshold=1.0) is None


# ---------------------------------------------------------------- training.steps_per_loop


def fit_recording_steps(config, initial_weights=None, **trainer_kwargs):
    """Fits `config` (starting from `initial_weights` if given); returns (trainer, the step events in the order the
    callbacks saw them: ("begin", epoch, step) and ("end", epoch, step, loss, loop_steps))."""
    from tfmis.engine.callbacks import Callback

    events = []

    class Steps(Callback):
        def on_step_begin(self, trainer, epoch, step):
            events.append(("begin", epoch, step))

        def on_step_end(self, trainer, epoch, step, logs):
            events.append(("end", epoch, step, logs["loss"], logs["loop_steps"]))

    trainer = Trainer(config, callbacks=[Steps(), *trainer_kwargs.pop("callbacks", [])], **trainer_kwargs)
    if initial_weights is not None:
        trainer.model.set_weights(initial_weights)
    trainer.fit()
    return trainer, events


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_steps_per_loop_trains_the_same_steps_as_one_step_per_loop(converted_dataset, tmp_path, accumulation):
    """training.steps_per_loop=3 with 4 steps per epoch (a loop of 3, then a remainder loop of 1, over 2 epochs):
    the same per-step losses and the same final weights, optimizer state and iteration count as steps_per_loop=1
    from the same initial weights on the same deterministic stream (also with 2 accumulated micro-batches). The
    loop function is traced once per loop length; the callbacks get on_step_begin for every step of a loop before
    it and on_step_end for each after it, in step order; the history still reports the input wait."""
    common = [
        *PLAIN_SGD,
        "optimizer.learning_rate=0.05",
        "training.steps_per_epoch=4",
        "training.epochs=2",
        "validation.val_interval=2",
        f"training.accumulation_steps={accumulation}",
    ]
    start = Trainer(tiny_config(converted_dataset, tmp_path / "init", *common)).model.get_weights()
    one, one_events = fit_recording_steps(tiny_config(converted_dataset, tmp_path / "k1", *common), start)
    three, three_events = fit_recording_steps(
        tiny_config(converted_dataset, tmp_path / "k3", *common, "training.steps_per_loop=3"), start
    )
    losses = lambda events: [e[3] for e in events if e[0] == "end"]  # noqa: E731
    assert len(losses(three_events)) == 8
    np.testing.assert_allclose(losses(three_events), losses(one_events), rtol=1e-5)
    assert len(set(losses(one_events))) == 8  # the steps did train (each step's loss differs)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(one.model.get_weights(), start))
    assert moved > 1e-3
    for a, b in zip(trainer_state(three), trainer_state(one)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert int(three.optimizer.iterations.numpy()) == int(one.optimizer.iterations.numpy()) == 8
    assert three.steps.loop_function.experimental_get_tracing_count() == 2  # one per loop length: 3 and the remainder 1

    def per_epoch(e):  # a loop of 3 steps, then the remainder loop of 1
        return [
            *[("begin", e, s) for s in range(3)],
            *[("end", e, s, 3) for s in range(3)],
            ("begin", e, 3),
            ("end", e, 3, 1),
        ]

    assert [ev if ev[0] == "begin" else (*ev[:3], ev[4]) for ev in three_events] == per_epoch(1) + per_epoch(2)
    assert [(*ev[:3], ev[4]) for ev in one_events if ev[0] == "end"] == [
        ("end", e, s, 1) for e in (1, 2) for s in range(4)
    ]
    history = [json.loads(line) for line in (tmp_path / "k3" / "history.jsonl").read_text().splitlines()]
    assert [r["train_loss"] for r in history] == pytest.approx(
        [json.loads(line)["train_loss"] for line in (tmp_path / "k1" / "history.jsonl").read_text().splitlines()],
        rel=1e-5,
    )
    for r in history:
        assert 0 <= r["data_wait_fraction"] <= 1 and r["compute_seconds"] > 0 and r["images_per_second"] > 0
        assert r["data_wait_seconds"] + r["compute_seconds"] <= r["epoch_seconds"]
    assert history[0]["data_wait_seconds"] > 0  # epoch 1 reads the TFRecords into the cache: its first step waits


def test_nan_loss_inside_a_loop_stops_at_the_same_step_as_one_step_per_loop(converted_dataset, tmp_path):
    """A learning rate of 1e30 makes the loss NaN within the first epoch: with training.steps_per_loop=3 fit stops
    with the same message, naming the same epoch and step, as with one step per loop; nothing is committed."""
    common = [
        "optimizer.name=sgd",
        "optimizer.learning_rate=1e30",
        "optimizer.schedule=constant",
        "training.epochs=3",
        "training.steps_per_epoch=4",
    ]
    messages = []
    for k in (1, 3):
        config = tiny_config(converted_dataset, tmp_path / f"k{k}", *common, f"training.steps_per_loop={k}")
        with pytest.raises(TrainingDiverged, match=r"the training loss became nan at epoch 1, step \d") as error:
            Trainer(config).fit()
        messages.append(str(error.value).replace(f"k{k}", "k"))
        assert not (tmp_path / f"k{k}" / "history.jsonl").exists()
    assert messages[0] == messages[1]


@pytest.mark.parametrize(
    "steps, loop, message",
    [
        (2, 3, r"all 2 steps of epoch 1 were skipped"),
        (25, 6, r"20 consecutive steps were skipped \(epoch 1, steps 1-20\)"),
    ],
)
def test_skipped_steps_stop_fit_with_several_steps_per_loop(converted_dataset, tmp_path, steps, loop, message):
    """Every gradient non-finite, several steps per loop (a loop longer than the epoch is cut to the epoch; the
    20th consecutive skipped step lies inside a loop of 6): fit stops with the same message as one step per loop
    and commits nothing."""
    config = tiny_config(
        converted_dataset, tmp_path / "run", f"training.steps_per_epoch={steps}", f"training.steps_per_loop={loop}"
    )
    trainer = Trainer(config)
    base = trainer.loss_fn
    trainer.loss_fn = lambda y, p: (
        with_foreground_norm_term(base)(tf.zeros_like(y), p) + base(y, p) - base(tf.zeros_like(y), p)
    )
    with pytest.raises(TrainingDiverged, match=message):
        trainer.fit()
    assert not list((tmp_path / "run" / "checkpoints").glob("ckpt-*"))
    assert not (tmp_path / "run" / "history.jsonl").exists()


INPUT_DELAY = 0.25  # seconds every training batch takes to arrive in test_slow_input_is_counted_as_input_wait...


@pytest.mark.slow
def test_slow_input_is_counted_as_input_wait_with_several_steps_per_loop(converted_dataset, tmp_path):
    """A training stream whose every batch arrives INPUT_DELAY seconds late (a sleep after the prefetch, nothing
    fetched ahead), 4 steps per epoch in loops of 3 and 1: the history counts at least 4 × INPUT_DELAY of input
    wait per epoch, and after the first epoch (which traces the loop) the wait is most of the step time; the
    plain-line progress (not a terminal) prints a line per step with its input-wait share."""
    import io
    import time

    from tfmis.engine.callbacks import Progress

    def late(config, input_context, seed_offset):
        def sleep(images, labels):
            [images] = tf.py_function(lambda x: (time.sleep(INPUT_DELAY), x)[1], [images], [images.dtype])
            return tf.ensure_shape(images, labels.shape.as_list() + [None]), labels

        options = tf.data.Options()
        options.experimental_optimization.inject_prefetch = False  # no batch may be ready ahead of its step
        return build_train_dataset(config, input_context, seed_offset).map(sleep).with_options(options)

    stream = io.StringIO()
    config = tiny_config(
        converted_dataset,
        tmp_path / "run",
        "training.steps_per_epoch=4",
        "training.epochs=2",
        "training.steps_per_loop=3",
        "validation.val_interval=2",
    )
    Trainer(config, train_dataset_fn=late, callbacks=[Progress(0, stream=stream)]).fit()
    history = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    for r in history:
        assert r["data_wait_seconds"] >= 4 * INPUT_DELAY
        assert r["data_wait_seconds"] + r["compute_seconds"] <= r["epoch_seconds"]
    assert history[1]["data_wait_fraction"] > 0.5, history[1]
    lines = [line for line in stream.getvalue().splitlines() if line.startswith("epoch 2/2  step")]
    assert [line.split("  ")[1] for line in lines] == ["step 1/4", "step 2/4", "step 3/4"]
    assert all("input wait" in line for line in lines)


LOOP_MIRRORED_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    sys.path.insert(0, sys.argv[3])
    from conftest import tiny_config
    from test_training import PLAIN_SGD, fit_recording_steps
    from tfmis.engine.distribution import make_backend
    from tfmis.engine.trainer import Trainer
    dataset_dir, out = sys.argv[1], sys.argv[2]
    backend = make_backend("mirrored", ["/cpu:0", "/cpu:1"])  # one strategy for both trainers
    common = [*PLAIN_SGD, "optimizer.learning_rate=0.05", "training.steps_per_epoch=4", "training.epochs=1",
              "training.accumulation_steps=2", "runtime.distribution=mirrored", 'runtime.devices=["/cpu:0","/cpu:1"]']
    start = Trainer(tiny_config(dataset_dir, out + "/init", *common), backend=backend).model.get_weights()
    runs = {}
    for k in (1, 3):
        trainer, events = fit_recording_steps(tiny_config(dataset_dir, f"{out}/k{k}", *common,
                                                          f"training.steps_per_loop={k}"), start, backend=backend)
        strategy = trainer.backend.strategy
        replicas = [[v.numpy() for v in strategy.experimental_local_results(var.value)]
                    for var in trainer.model.trainable_variables]
        runs[k] = dict(losses=[e[3] for e in events if e[0] == "end"], weights=[r[0] for r in replicas],
                       agree=all(np.array_equal(r[0], r[1]) for r in replicas),
                       history=[json.loads(line) for line in open(f"{out}/k{k}/history.jsonl")])
    print(json.dumps({
        "replicas": backend.num_replicas, "losses": {k: r["losses"] for k, r in runs.items()},
        "max_weight_diff": max(float(np.abs(a - b).max()) for a, b in zip(runs[1]["weights"], runs[3]["weights"])),
        "moved": max(float(np.abs(a - b).max()) for a, b in zip(runs[1]["weights"], start)),
        "replicas_agree": [runs[1]["agree"], runs[3]["agree"]],
        "wait_fraction": [r["history"][0]["data_wait_fraction"] for r in runs.values()]}))
""")


@pytest.mark.slow
def test_steps_per_loop_under_mirrored_strategy_matches_one_step_per_loop(converted_dataset, tmp_path):
    """MirroredStrategy over two logical CPUs with 2 accumulated micro-batches: a fit with training.steps_per_loop=3
    (loops of 3 and 1 steps over the distributed iterator) gives the same 4 per-step losses and the same final
    weights as steps_per_loop=1 from the same initial weights, identical on both replicas; the input wait is
    reported."""
    script = tmp_path / "loop_mirrored.py"
    script.write_text(LOOP_MIRRORED_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), str(converted_dataset), str(tmp_path), str(TESTS)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["replicas"] == 2
    assert len(out["losses"]["3"]) == 4 and len(set(out["losses"]["1"])) == 4
    np.testing.assert_allclose(out["losses"]["3"], out["losses"]["1"], rtol=1e-5)
    assert out["moved"] > 1e-3 and out["max_weight_diff"] < 1e-5
    assert out["replicas_agree"] == [True, True]
    assert all(0 <= f <= 1 for f in out["wait_fraction"])


@pytest.mark.slow
def test_steps_per_loop_with_mixed_float16_loss_scaling_trains_as_one_step_per_loop(converted_dataset, tmp_path):
    """training.precision=mixed_float16 (LossScaleOptimizer) with training.steps_per_loop=3 over 4 steps: the same
    per-step losses, loss scale and weights as one step per loop from the same initial weights."""
    common = [
        *PLAIN_SGD,
        "optimizer.learning_rate=0.05",
        "training.precision=mixed_float16",
        "training.steps_per_epoch=4",
        "training.epochs=1",
    ]
    start = Trainer(tiny_config(converted_dataset, tmp_path / "init", *common)).model.get_weights()
    runs = [
        fit_recording_steps(
            tiny_config(converted_dataset, tmp_path / f"k{k}", *common, f"training.steps_per_loop={k}"), start
        )
        for k in (1, 3)
    ]
    (one, one_events), (three, three_events) = runs
    losses = [[e[3] for e in events if e[0] == "end"] for events in (one_events, three_events)]
    assert len(losses[1]) == 4 and all(np.isfinite(losses[1]))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    records = [json.loads((tmp_path / f"k{k}" / "history.jsonl").read_text()) for k in (1, 3)]
    assert records[1]["loss_scale"] == records[0]["loss_scale"]
    assert max(float(np.abs(a - b).max()) for a, b in zip(one.model.get_weights(), start)) > 1e-3
    for a, b in zip(three.model.get_weights(), one.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_profiler_trace_with_several_steps_per_loop(converted_dataset, tmp_path):
    """profile.start_step=2, num_steps=2 with training.steps_per_loop=2 (the trace covers the loops holding steps
    2 and 3): one profiler trace holding the host train_step range of the loops, the input fetch inside the loop
    under the data_wait/ name scope and the step's ops under train_step/forward/ and train_step/optimizer_step/."""
    config = tiny_config(
        converted_dataset,
        tmp_path / "run",
        "profile.start_step=2",
        "profile.num_steps=2",
        "training.epochs=2",
        "training.steps_per_loop=2",
    )
    Trainer(config).fit()
    traces = list((tmp_path / "run" / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1
    content = traces[0].read_bytes()
    assert b"data_wait/IteratorGetNext" in content  # the batch pulled inside the loop
    assert b"train_step/forward/" in content and b"train_step/optimizer_step/" in content


@pytest.mark.slow
@pytest.mark.parametrize("loop", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_augmentation_placed_in_the_step_trains_as_in_the_pipeline(converted_dataset, tmp_path, loop):
    """pipeline.augment.placement=step (un-augmented crops and their seeds from tf.data, augmented inside the
    compiled step) against placement=pipeline, same seed and initial weights, flips, quarter turns, intensity,
    rotation and scaling all on, 2 accumulated micro-batches: the same per-step losses and final weights over 2
    epochs of 2 steps (one or two steps per loop)."""
    common = [
        *PLAIN_SGD,
        "optimizer.learning_rate=0.05",
        "training.accumulation_steps=2",
        f"training.steps_per_loop={loop}",
        "validation.val_interval=2",
        "pipeline.augment.rotate_prob=0.5",
        "pipeline.augment.scale_prob=0.5",
    ]
    start = Trainer(tiny_config(converted_dataset, tmp_path / "init", *common)).model.get_weights()
    (piped, piped_events), (stepped, stepped_events) = (
        fit_recording_steps(
            tiny_config(converted_dataset, tmp_path / placement, *common, f"pipeline.augment.placement={placement}"),
            start,
        )
        for placement in ("pipeline", "step")
    )
    assert piped.steps.step_augment is None and stepped.steps.step_augment is not None
    losses = [[e[3] for e in events if e[0] == "end"] for events in (piped_events, stepped_events)]
    assert len(losses[1]) == 4 and len(set(losses[0])) == 4
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    assert max(float(np.abs(a - b).max()) for a, b in zip(piped.model.get_weights(), start)) > 1e-3
    for a, b in zip(stepped.model.get_weights(), piped.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_steps_per_loop_on_two_worker_processes_trains_as_one_step_per_loop(converted_dataset, tmp_path):
    """`python -m tfmis.launch --nproc 2 -- python -m tfmis.train` (MultiWorkerMirroredStrategy over two local
    worker processes), 4 steps per epoch: training.steps_per_loop=3 (loops of 3 and 1) gives the same epoch losses
    and validation Dice as one step per loop."""
    import os

    from tfmis.config import save_config

    records = {}
    for k in (1, 3):
        config = tiny_config(
            converted_dataset,
            tmp_path / f"k{k}",
            *PLAIN_SGD,
            "optimizer.learning_rate=0.05",
            "training.steps_per_epoch=4",
            "training.epochs=2",
            "validation.val_interval=2",
            "runtime.distribution=multiworker",
            f"training.steps_per_loop={k}",
        )
        save_config(config, tmp_path / f"k{k}.yaml")
        env = {
            **{key: v for key, v in os.environ.items() if key != "TF_CONFIG"},
            "TF_NUM_INTRAOP_THREADS": "1",
            "TF_NUM_INTEROP_THREADS": "1",
        }
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "tfmis.launch",
                "--nproc",
                "2",
                "--",
                sys.executable,
                "-m",
                "tfmis.train",
                "--config",
                str(tmp_path / f"k{k}.yaml"),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        records[k] = [json.loads(line) for line in (tmp_path / f"k{k}" / "history.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records[3]] == [1, 2]
    assert records[1][0]["train_loss"] != pytest.approx(records[1][1]["train_loss"], rel=1e-3)  # it trained
    for a, b in zip(records[3], records[1]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
    assert records[3][1]["val_mean_dice"] == pytest.approx(records[1][1]["val_mean_dice"], abs=1e-6)


# ---------------------------------------------------------------- model.deep_supervision


@pytest.mark.slow
def test_deep_supervision_trains_its_heads_and_saves_and_resumes_the_model(converted_dataset, tmp_path):
    """model.deep_supervision=2 on a U-Net whose first layer downsamples: a step's loss is the deep-supervision
    loss of the training model's three outputs and moves the heads' weights; fit writes best.weights.h5 that a
    model built from the run's config (no heads) loads, the checkpoint folder loads into that model too
    (tfmis.inference.predictor.load_weights), and --resume restores the last epoch and trains epoch 3."""
    import dataclasses

    from tfmis.inference.inputs import load_weights
    from tfmis.losses import DeepSupervisionLoss, build_loss
    from tfmis.networks.unet import UNetConfig

    ds = ["model.filters=[4,8,16]", "model.strides=[2,2,1]", "model.deep_supervision=2", "loss.name=dice_ce"]
    config = tiny_config(converted_dataset, tmp_path / "run", *ds)
    trainer = Trainer(config)
    assert len(trainer.training_model.outputs) == 3 and trainer.model is not trainer.training_model
    images, labels = batch = fixed_batch(config, 2)
    expected = DeepSupervisionLoss(build_loss("dice_ce", include_background=False), [(2, 2, 2), (4, 4, 4)])(
        labels, trainer.training_model(images, training=True)
    )

    def head_weights():
        return [
            w.numpy().copy()
            for level in (0, 1)
            for w in trainer.training_model.get_layer(f"deep_supervision{level}").weights
        ]

    before = head_weights()
    loss, skipped = run_step(trainer, batch)
    assert skipped == 0.0 and loss == pytest.approx(float(expected), rel=1e-5)
    assert all(np.abs(a - b).max() > 0 for a, b in zip(before, head_weights()))

    assert Trainer(config).fit()["epochs"] == 2
    build = functools.partial(
        UNetConfig, trainer.in_channels, len(trainer.class_names), **dataclasses.asdict(config.model)
    )
    build().build().load_weights(str(tmp_path / "run" / "best.weights.h5"))
    from_checkpoint = build().build()
    load_weights(from_checkpoint, tmp_path / "run" / "checkpoints")
    resumed = Trainer(tiny_config(converted_dataset, tmp_path / "run", *ds, "training.epochs=3"))
    assert resumed.restore(resume=True) == 2
    for a, b in zip(from_checkpoint.weights, resumed.model.weights):  # epoch 2's weights, the heads apart
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert resumed.fit(resume=True)["epochs"] == 3


def test_release_in_background_returns_before_a_slow_destructor_and_the_object_is_still_destroyed():
    """`release_in_background` (what `Trainer.fit` does with its training iterator, whose destructor joined tf.data's
    autotuning thread for ~30 s on a busy machine): the caller gets control back while the last reference's
    destructor is still blocked, and the destructor then runs to its end in the other thread."""
    import threading

    from tfmis.engine.trainer import release_in_background

    let_go, destroyed = threading.Event(), threading.Event()

    class SlowToDestroy:
        def __del__(self):
            let_go.wait(30)
            destroyed.set()

    holder = [SlowToDestroy()]
    release_in_background(holder)
    assert not destroyed.is_set()  # the caller has control back while the destructor still waits
    let_go.set()
    assert destroyed.wait(10) and holder == []


RELEASE_AT_EXIT_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from tfmis.engine.trainer import release_in_background
    class SlowToDestroy:
        def __del__(self):
            time.sleep(1.5)  # releases the GIL, as TensorFlow's destructor does while it joins its thread
            Path(sys.argv[1]).write_text("destroyed")
    release_in_background([SlowToDestroy()])
    print("main thread done", flush=True)
""")


COMMAND_END_SCRIPT = textwrap.dedent("""
    import atexit, sys, time
    from pathlib import Path
    from tfmis.utils.cli import command, start_unjoined
    marker = Path(sys.argv[1])
    atexit.register(lambda: marker.write_text("exit handlers ran"))
    @command
    def main(argv=None):
        start_unjoined(lambda: time.sleep(300), "tfmis-slow-to-end")  # a destructor that would hold up the end
        print("command done", flush=True)
        return 3
    sys.exit(main())
""")


@pytest.mark.parametrize("how", ["script", "python -m"])
def test_a_commands_process_ends_when_the_command_returns_without_waiting_for_an_unjoined_thread(tmp_path, how):
    """A real process whose `@command` main is its process's own command (a script named like an installed
    `tfmis-...` one, or a module run with `python -m`, as `python -m tfmis.train`) starts a `start_unjoined` thread
    that would run 300 s: the process ends when the command returns (well within the 120 s timeout), with the
    command's exit status 3, its output flushed and the exit handlers run (where Horovod's shutdown is). This is how
    `tfmis-train` ends while its last training iterator is still released."""
    marker = tmp_path / "atexit.txt"
    if how == "script":
        script = tmp_path / "tfmis-command-end.py"
        script.write_text(COMMAND_END_SCRIPT)
        command = [sys.executable, str(script), str(marker)]
    else:
        (tmp_path / "command_end.py").write_text(COMMAND_END_SCRIPT)
        command = [sys.executable, "-m", "command_end", str(marker)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 3, result.stderr[-2000:]
    assert result.stdout.strip() == "command done"
    assert marker.read_text() == "exit handlers ran"


def test_a_process_that_ends_while_an_iterator_is_released_waits_for_its_destructor(tmp_path):
    """A real subprocess (a plain script, not a command) that ends right after `release_in_background`: the
    interpreter waits for the releasing thread, whose destructor runs to its end (its file is written) and the exit
    status is 0. A daemon thread would be cut off at finalization: inside TensorFlow's destructor that aborted the
    process in CI (\"FATAL: exception not rethrown\", status -6)."""
    marker = tmp_path / "destroyed.txt"
    script = tmp_path / "release_at_exit.py"
    script.write_text(RELEASE_AT_EXIT_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(marker)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "main thread done"
    assert marker.read_text() == "destroyed"
