"""What a run folder holds and how prediction loads it: checkpoints that must match the model, and a
run folder that is enough on its own to predict with."""

import numpy as np
import pytest
import tensorflow as tf

from tfmis.errors import DataError
from tfmis.inference.inputs import load_weights
from tfmis.networks.unet import build_unet

DATA_INFO = {"source": {"modalities": ["MR0", "MR1"], "labels": {"0": "background", "1": "organ", "2": "core"}}}


def _weights(model):
    return [w.numpy().copy() for w in model.weights]


def _task(tmp_path, *overrides):
    from conftest import TINY_TRAINING

    from tfmis.config import load_config
    from tfmis.task import SegmentationTask

    config = load_config(None, [*TINY_TRAINING, f"output.dir={tmp_path / 'run'}", *overrides])
    return SegmentationTask(config, data_info=DATA_INFO)


@pytest.mark.parametrize("saved", ["no model", "shallower model", "other classes"])
def test_tf_checkpoint_that_does_not_fit_the_model_is_refused(tmp_path, saved):
    """A tf.train checkpoint without this model's variables fails naming the checkpoint, never loads nothing."""
    task = _task(tmp_path, "model.filters=[4,8,16]", "model.strides=[1,2,2]")
    model = task.build_inference_model()
    if saved == "no model":
        prefix = tf.train.Checkpoint(epoch=tf.Variable(3)).save(str(tmp_path / "ckpt"))
    elif saved == "shallower model":
        other = build_unet(2, 3, filters=(4, 8), strides=(1, 2), num_res_units=0)
        prefix = tf.train.Checkpoint(model=other).save(str(tmp_path / "ckpt"))
    else:
        other = build_unet(2, 5, filters=(4, 8, 16), strides=(1, 2, 2), num_res_units=0)
        prefix = tf.train.Checkpoint(model=other).save(str(tmp_path / "ckpt"))
    with pytest.raises(DataError, match=rf"checkpoint {prefix}.*does not fit"):
        load_weights(model, prefix, task=task)


@pytest.mark.parametrize("saved", ["shallower model", "deeper model", "other classes"])
def test_weights_file_of_another_model_is_refused_in_one_line(tmp_path, saved):
    """A `.weights.h5` of another network (Keras raises an error of many lines, or for a group of layers missing
    from the file only warns and keeps their fresh weights) is one `DataError` line naming the file and a weight
    that does not fit."""
    model = build_unet(2, 3, filters=(4, 8, 16), strides=(1, 2, 2), num_res_units=0)
    other = {
        "shallower model": lambda: build_unet(2, 3, filters=(4, 8), strides=(1, 2), num_res_units=0),
        "deeper model": lambda: build_unet(2, 3, filters=(4, 8, 16, 32), strides=(1, 2, 2, 2), num_res_units=0),
        "other classes": lambda: build_unet(2, 5, filters=(4, 8, 16), strides=(1, 2, 2), num_res_units=0),
    }[saved]()
    path = tmp_path / "best.weights.h5"
    other.save_weights(str(path))
    with pytest.raises(DataError) as refused:
        load_weights(model, path)
    message = str(refused.value)
    assert message.startswith(f"weights file {path} does not fit this model") and "\n" not in message, message
    assert "not fit, e.g." in message or "expected 1 variables" in message


def test_a_run_without_final_weights_names_the_command_that_finishes_it(converted_dataset, tmp_path):
    """`load_weights(run, "final")` on a run folder without final.weights.h5 (unfinished, or an older tfmis) is one
    `MissingInput` line naming the `--resume` command; after that command the file is there and loads."""
    from conftest import tiny_config

    from tfmis.engine.trainer import Trainer
    from tfmis.errors import MissingInput

    config = tiny_config(converted_dataset, tmp_path / "run", "training.epochs=1")
    Trainer(config).fit()
    run = tmp_path / "run"
    (run / "final.weights.h5").unlink()
    model = Trainer(config).task.build_inference_model()
    with pytest.raises(MissingInput, match=r"has no final.weights.h5.*--resume"):
        load_weights(model, run, "final")
    Trainer(config).fit(resume=True)  # nothing left to train: it writes the final weights and the summary
    assert (run / "final.weights.h5").is_file()
    load_weights(model, run, "final")


@pytest.mark.slow
def test_predict_from_a_run_folder_alone_after_the_tfrecords_are_gone(tmp_path):
    """`python -m tfmis.predict --checkpoint RUN` works with no --config after the TFRecord folder is deleted
    and the run folder moved, and writes the same label maps as before."""
    import shutil
    import subprocess
    import sys

    import nibabel as nib
    from conftest import make_msd_dataset, tiny_config

    from tfmis.config import save_config
    from tfmis.data.conversion_options import ConversionConfig
    from tfmis.data.convert import convert
    from tfmis.engine.trainer import Trainer

    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=4)
    records = tmp_path / "tfrecords"
    convert(ConversionConfig(str(source), str(records), split=(0.75, 0.25), shards=1, workers=1, progress=False))
    config = tiny_config(records, tmp_path / "run", "training.epochs=1")
    Trainer(config).fit()
    save_config(config, tmp_path / "run" / "config.yaml")  # as `python -m tfmis.train` leaves it

    def predict(run, output, *extra):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "tfmis.predict",
                "--checkpoint",
                str(run),
                "--input",
                str(source / "imagesTs"),
                "--output",
                str(output),
                "--quiet",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )

    before = predict(tmp_path / "run", tmp_path / "before", "--config", str(tmp_path / "run" / "config.yaml"))
    assert before.returncode == 0, before.stderr[-2000:]
    shutil.rmtree(records)
    shutil.move(tmp_path / "run", tmp_path / "moved" / "run")
    after = predict(tmp_path / "moved" / "run", tmp_path / "after")
    assert after.returncode == 0, after.stderr[-2000:]
    for name in ("case_900.nii.gz",):
        a, b = nib.load(str(tmp_path / "before" / name)), nib.load(str(tmp_path / "after" / name))
        np.testing.assert_array_equal(np.asarray(a.dataobj), np.asarray(b.dataobj))
        np.testing.assert_array_equal(a.affine, b.affine)


def test_predict_without_config_outside_a_run_folder_says_what_to_give(tmp_path, capsys):
    """No --config and no config.yaml in or above --checkpoint: exit 1 (an unusable checkpoint) naming --config; a
    --checkpoint that does not exist: exit 1 saying so, before any config is looked for."""
    from tfmis.predict import main as predict_main

    (tmp_path / "loose.weights.h5").write_bytes(b"")
    code = predict_main(
        [
            "--checkpoint",
            str(tmp_path / "loose.weights.h5"),
            "--input",
            str(tmp_path),
            "--output",
            str(tmp_path / "out"),
        ]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert f"--checkpoint {tmp_path / 'loose.weights.h5'}: no config.yaml in or above it" in err and "--config" in err
    missing = ["--checkpoint", str(tmp_path / "missing"), "--input", str(tmp_path), "--output", str(tmp_path)]
    assert predict_main(missing) == 1
    assert f"--checkpoint {tmp_path / 'missing'}: no such file or folder" in capsys.readouterr().err


def test_predict_from_a_plan_folder_not_yet_trained_says_to_train_it_first(tmp_path, capsys):
    """`tfmis-predict --checkpoint <folder of tfmis-plan>` before any training (a real plan written by
    `python -m tfmis.plan`, no config.yaml or weights there): exit 1, one line saying the plan has not been trained
    and naming the training command for its plan.yaml."""
    import subprocess
    import sys

    from tests.conftest import make_msd_dataset
    from tfmis.predict import main as predict_main

    source = make_msd_dataset(tmp_path / "Task95_Plan", num_cases=4)
    plan_dir = tmp_path / "plan"
    command = [sys.executable, "-m", "tfmis.plan", "--source-dir", str(source), "--output-dir", str(plan_dir)]
    done = subprocess.run([*command, "--quiet"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and (plan_dir / "plan.yaml").is_file(), done.stderr[-2000:]
    code = predict_main(["--checkpoint", str(plan_dir), "--input", str(source / "imagesTs"), "--output", str(tmp_path)])
    assert code == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "has not been trained yet" in lines[0]
    assert f"python -m tfmis.train --config {plan_dir / 'plan.yaml'}" in lines[0]
