import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from conftest import tiny_config
from tfmis.config import save_config
from tfmis.data.pipeline import build_train_dataset
from tfmis.engine.trainer import RunExists, Trainer, TrainingDiverged

TESTS = Path(__file__).resolve().parent
PLAIN_SGD = ["optimizer.name=sgd", "optimizer.momentum=0.0", "optimizer.nesterov=false", "optimizer.schedule=constant",
             "optimizer.learning_rate=0.5", "optimizer.weight_decay=0.0"]


def fixed_batch(config, size: int):
    images, labels = next(iter(build_train_dataset(config).unbatch().batch(size)))
    return images, labels


def test_gradient_accumulation_equals_one_bigger_batch(converted_dataset, tmp_path):
    """2 micro-batches of 2, accumulated, take the same optimizer step as one batch of 4."""
    big = Trainer(tiny_config(converted_dataset, tmp_path / "a", *PLAIN_SGD, "pipeline.num_images_per_batch=4"))
    accumulated = Trainer(tiny_config(converted_dataset, tmp_path / "b", *PLAIN_SGD,
                                      "pipeline.num_images_per_batch=2", "training.accumulation_steps=2"))
    accumulated.model.set_weights(big.model.get_weights())
    start = [w.copy() for w in big.model.get_weights()]
    batch = fixed_batch(big.config, 4)
    assert float(big._train_step(batch)) == pytest.approx(float(accumulated._train_step(batch)), rel=1e-5)
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
    from test_training import PLAIN_SGD, fixed_batch
    from tfmis.engine.trainer import Trainer
    dataset_dir, out = sys.argv[1], sys.argv[2]
    single = Trainer(tiny_config(dataset_dir, out + "/single", *PLAIN_SGD, "pipeline.num_images_per_batch=4"))
    mirrored = Trainer(tiny_config(dataset_dir, out + "/mirrored", *PLAIN_SGD, "pipeline.num_images_per_batch=2",
                                   "training.distribution=mirrored", 'training.devices=["/cpu:0","/cpu:1"]'))
    mirrored.model.set_weights(single.model.get_weights())
    start = [w.copy() for w in single.model.get_weights()]
    batch = fixed_batch(single.config, 4)
    loss_single = float(single._train_step(batch))
    strategy = mirrored.backend.strategy
    distributed = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(batch))))
    per_replica_shapes = [v.shape.as_list() for v in strategy.experimental_local_results(distributed[0])]
    loss_mirrored = float(mirrored._train_step(distributed))
    replica_weights = [[v.numpy() for v in strategy.experimental_local_results(var.value)]
                       for var in mirrored.model.trainable_variables]
    diff = max(float(np.abs(a - b).max()) for a, b in zip(single.model.get_weights(), mirrored.model.get_weights()))
    moved = max(float(np.abs(a - b).max()) for a, b in zip(single.model.get_weights(), start))
    replicas_agree = all(np.array_equal(r[0], r[1]) for r in replica_weights)
    # and a short real fit: two epochs with validation, through the distributed input pipeline
    summary = mirrored.fit()
    print(json.dumps({"replicas": mirrored.backend.num_replicas, "shapes": per_replica_shapes,
                      "loss_single": loss_single, "loss_mirrored": loss_mirrored, "max_weight_diff": diff,
                      "moved": moved, "replicas_agree": replicas_agree, "fit_epochs": summary["epochs"],
                      "fit_dice": summary["final_mean_dice"]}))
""")


def test_mirrored_strategy_step_matches_single_device(converted_dataset, tmp_path):
    """One real training step under MirroredStrategy over two logical CPUs equals the single-device step."""
    script = tmp_path / "mirrored.py"
    script.write_text(MIRRORED_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(converted_dataset), str(tmp_path), str(TESTS)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["replicas"] == 2 and out["shapes"] == [[2, 16, 16, 16, 2], [2, 16, 16, 16, 2]]
    assert out["loss_mirrored"] == pytest.approx(out["loss_single"], rel=1e-5)
    assert out["moved"] > 1e-4  # the step did change the weights...
    assert out["max_weight_diff"] < 1e-5  # ...identically on one device and on two replicas
    assert out["replicas_agree"]
    assert out["fit_epochs"] == 2 and 0 <= out["fit_dice"] <= 1


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
    assert {"epoch", "train_loss", "val_mean_dice", "val_dice/organ", "epoch_seconds", "data_wait_seconds"} <= set(header)
    assert (run / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "best.weights.h5").is_file() and (run / "config.yaml").is_file()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((run / "summary.json").read_text()) == summary
    assert summary["best_mean_dice"] == max(r["val_mean_dice"] for r in history)
    with pytest.raises(RunExists, match="--resume"):
        Trainer(config).fit()


def test_nan_loss_stops_with_a_clear_message(converted_dataset, tmp_path):
    config = tiny_config(converted_dataset, tmp_path / "nan", "optimizer.name=sgd", "optimizer.learning_rate=1e30",
                         "optimizer.schedule=constant", "training.epochs=3", "training.steps_per_epoch=4")
    with pytest.raises(TrainingDiverged, match=r"the training loss became nan at epoch 1, step \d"):
        Trainer(config).fit()
    assert not (tmp_path / "nan" / "history.jsonl").exists()


def test_kill_and_resume_continues_from_the_last_epoch(converted_dataset, tmp_path):
    config = tiny_config(converted_dataset, tmp_path / "run", "training.epochs=6", "training.steps_per_epoch=3")
    save_config(config, tmp_path / "config.yaml")
    command = [sys.executable, "-m", "tfmis.train", "--config", str(tmp_path / "config.yaml")]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    history = tmp_path / "run" / "history.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (history.is_file() and history.read_text()):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(history.read_text().splitlines())
    assert 1 <= done < 6, "the run was not interrupted mid-way"
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and "already holds a training run" in again.stderr
    resumed = subprocess.run(command + ["--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resuming from" in resumed.stderr
    epochs = [json.loads(line)["epoch"] for line in history.read_text().splitlines()]
    assert epochs == [1, 2, 3, 4, 5, 6]
    assert "best mean Dice" in resumed.stdout


@pytest.mark.parametrize("precision, jit", [("mixed_float16", False), ("mixed_bfloat16", False), ("float32", True)])
def test_precisions_and_xla_train(converted_dataset, tmp_path, precision, jit):
    config = tiny_config(converted_dataset, tmp_path / "run", f"training.precision={precision}",
                         f"training.jit_compile={str(jit).lower()}", "training.epochs=1")
    trainer = Trainer(config)
    assert trainer.model.outputs[0].dtype == "float32"  # logits stay float32 under any policy
    summary = trainer.fit()
    record = json.loads((tmp_path / "run" / "history.jsonl").read_text())
    assert np.isfinite(record["train_loss"]) and summary["epochs"] == 1
    assert ("loss_scale" in record) == (precision == "mixed_float16")


def test_target_dice_stops_training(converted_dataset, tmp_path):
    config = tiny_config(converted_dataset, tmp_path / "run", "training.epochs=5", "training.target_dice=0.0")
    assert Trainer(config).fit()["epochs"] == 1
