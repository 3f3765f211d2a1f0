"""Model-parallel settings a user can get wrong (`runtime.model_parallel`, `--model-parallel`, `range_model_parallel`):
each is exit 2 with one `config error:` (or `specs error:`) line naming the setting and the fix, before anything is
converted, built or trained, in train, predict and the GPU-fit search; a candidate of the search that cannot cut the
patch is skipped with its reason instead of running a trial (docs/model-parallel.md, "Settings checked up front").

One subprocess per command family shows the real command's stderr; the rest call the commands' `main(argv)` in this
process, as their console scripts do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tfmis import predict, train, tune
from tfmis.config import load_config

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo.yaml"  # strides (2, 2, 2, 1): slabs are multiples of 8; patch 48^3
ENV = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0"}
MP = "runtime.model_parallel"


def sets(*overrides) -> list[str]:
    return [arg for override in overrides for arg in ("--set", override)]


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *map(str, args)], capture_output=True, text=True, timeout=120, env=ENV)


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def outcome(main, argv, capsys) -> tuple[int, str]:
    """(exit status, the last stderr line) of a command's `main(argv)` run in this process."""
    try:
        status = main([str(a) for a in argv])
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return status, err.strip().splitlines()[-1]


def test_train_with_more_spatial_devices_than_the_patch_has_slabs_is_exit_2_before_anything(tmp_path):
    """The issue's command: `--set runtime.model_parallel.mode=spatial --set runtime.model_parallel.devices=16` on
    the demo's 48^3 patch (slabs multiples of 8: at most 6). One line naming the setting and the fix; no run folder,
    nothing converted."""
    out = tmp_path / "run"
    result = run(
        "tfmis.train",
        "--config",
        DEMO,
        *sets(f"{MP}.mode=spatial", f"{MP}.devices=16", f"output.dir={out}", f"data.dataset_dir={tmp_path / 'tfr'}"),
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert one_line(result.stderr) == (
        f"config error: {MP}.mode=spatial, {MP}.devices=16: pipeline.patch_size [48, 48, 48] cannot be cut into 16 "
        "slabs whose sides are multiples of the strides' product (8, 8, 8) (model.strides): at most 6 fit (along "
        f"axis 0); set {MP}.devices=6 or fewer, or make pipeline.patch_size larger"
    )
    assert not out.exists() and not (tmp_path / "tfr").exists()


# (overrides, what the one line must hold): every model-parallel setting a user can get wrong in a training config
TRAIN_CASES = {
    "devices malformed": ([f"{MP}.mode=spatial", f"{MP}.devices=two"], [f"{MP}.devices: expected an integer"]),
    "devices zero": ([f"{MP}.mode=spatial", f"{MP}.devices=0"], [f"{MP}: devices must be >= 1 (devices per model)"]),
    "axis out of range": ([f"{MP}.mode=spatial", f"{MP}.axis=3"], [f"{MP}: axis must be a patch axis 0, 1 or 2"]),
    "axis too short": (
        [f"{MP}.mode=spatial", f"{MP}.devices=4", f"{MP}.axis=2", "pipeline.patch_size=[64,64,16]"],
        ["pipeline.patch_size [64, 64, 16] cannot be cut along axis 2", "at most 2 fit", f"{MP}.devices=2 or fewer"],
    ),
    "validation window too small": (
        [f"{MP}.mode=spatial", f"{MP}.devices=4", "validation.roi_size=[16,16,16]"],
        ["validation.roi_size [16, 16, 16] cannot be cut into 4 slabs", "make validation.roi_size larger"],
    ),
    "a layer the slabs cannot split": (
        [f"{MP}.mode=spatial", "model.kernel_size=1"],
        ["cannot split this network", "model.kernel_size=1", f"use {MP}.mode=pipeline"],
    ),
    "XLA": ([f"{MP}.mode=pipeline", "training.jit_compile=true"], ["training.jit_compile=true does not work"]),
    "another strategy": (
        [f"{MP}.mode=spatial", "runtime.distribution=mirrored"],
        ["runtime.distribution=mirrored does not work", "set runtime.distribution=none"],
    ),
    "micro-batches not dividing the batch": (
        [f"{MP}.mode=pipeline", f"{MP}.micro_batches=3"],
        ["pipeline.num_images_per_batch=2 is not a multiple of", f"{MP}.micro_batches (3)"],
    ),
}


@pytest.mark.parametrize("overrides, expected", TRAIN_CASES.values(), ids=TRAIN_CASES)
def test_each_wrong_model_parallel_setting_is_one_config_error_line_and_exit_2_in_train(
    tmp_path, capsys, overrides, expected
):
    status, line = outcome(train.main, ["--config", DEMO, *sets(*overrides, f"output.dir={tmp_path}/run")], capsys)
    assert status == 2 and line.startswith("config error: "), line
    for part in expected:
        assert part in line, line
    assert not (tmp_path / "run").exists()


def test_tune_fit_with_a_setting_that_cannot_cut_the_patch_is_exit_2_before_converting(tmp_path, capsys):
    """The config's own setting (the search measures it when the specs give no range) and a range none of whose
    settings can run: exit 2, one line, the dataset never converted."""
    tfr = tmp_path / "tfr"
    base = ["fit", "--config", DEMO, *sets(f"data.dataset_dir={tfr}", f"output.dir={tmp_path}/run")]
    status, line = outcome(tune.main, [*base, *sets(f"{MP}.mode=spatial", f"{MP}.devices=16")], capsys)
    assert status == 2 and line.startswith(f"config error: {MP}.mode=spatial, {MP}.devices=16: "), line
    specs = tmp_path / "specs.yaml"
    specs.write_text("universal:\n  range_model_parallel: [spatial:8, spatial:16]\n")
    status, line = outcome(tune.main, [*base, "--specs", specs], capsys)
    assert status == 2 and line.startswith("specs error: range_model_parallel: none of spatial:8, spatial:16 can "), (
        line
    )
    assert "at most 6 fit" in line
    assert not tfr.exists()


def test_search_skips_a_candidate_that_cannot_cut_the_patch_with_its_reason_and_no_trial():
    """`model_parallel_skip_reason` of spatial:16 on the demo's patch: the slabs' reason (the search writes it as the
    candidate's line, status skipped, without starting a trial); spatial:2 runs."""
    from tfmis.tuning.fit.candidates import model_parallel_skip_reason

    config = load_config(DEMO)
    reason = model_parallel_skip_reason(config, {"model_parallel": "spatial:16", "num_images_per_batch": 2}, None)
    assert reason.startswith("spatial:16: ") and "cannot be cut into 16 slabs" in reason and "at most 6" in reason
    assert model_parallel_skip_reason(config, {"model_parallel": "spatial:2", "num_images_per_batch": 2}, None) is None


@pytest.fixture
def run_folder(tmp_path) -> Path:
    """A run folder as far as predict's flags are checked: its config.yaml (the demo's: slabs multiples of 8)."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(DEMO, run / "config.yaml")
    return run


@pytest.mark.slow  # a real tfmis-predict process (about 6 s); the same check in-process stays in the default run
def test_predict_with_a_window_too_small_for_the_slabs_is_exit_2_naming_the_flags(run_folder, tmp_path):
    """The issue's command: `--model-parallel spatial:8 --roi-size 32,32,32` (at most 4 slabs of 8): one line naming
    both flags and the fix, before any model is built."""
    result = run(
        "tfmis.predict",
        *("--checkpoint", run_folder, "--input", tmp_path, "--output", tmp_path / "out"),
        *("--model-parallel", "spatial:8", "--roi-size", "32,32,32"),
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert one_line(result.stderr) == (
        "config error: --model-parallel spatial:8: --roi-size [32, 32, 32] cannot be cut into 8 slabs whose sides "
        "are multiples of the strides' product (8, 8, 8) (model.strides): at most 4 fit (along axis 0); set "
        "--model-parallel spatial:4 or fewer, or make --roi-size larger"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--model-parallel", "spatial:x"], "--model-parallel: expected none, spatial:N or pipeline:N"),
        (["--model-parallel", "spatial:3", "--roi-size", "16,16,16"], "at most 2 fit"),
        (["--model-parallel", "spatial:8"], "pipeline.patch_size [48, 48, 48] cannot be cut into 8 slabs"),
    ],
    ids=["malformed", "window", "config's window"],
)
def test_predict_model_parallel_flags_that_cannot_work_are_exit_2(run_folder, tmp_path, capsys, flags, expected):
    argv = ["--checkpoint", run_folder, "--input", tmp_path, "--output", tmp_path / "out", *flags]
    status, line = outcome(predict.main, argv, capsys)
    assert status == 2 and expected in line, line


def test_a_layer_the_slabs_cannot_split_found_while_tracing_is_one_config_error_line(capsys):
    """A network with a layer spatial partitioning has no slab-wise version of (a library user's own model): found
    when the step is traced, inside AutoGraph, which re-raises it as its own StagingError; the command's edge still
    prints the config error's one line and exits 2."""
    import keras
    import tensorflow as tf

    from tfmis.networks.parallel import ModelParallel
    from tfmis.utils.cli import run_command

    x = keras.Input((8, 8, 8, 1))
    y = keras.layers.UpSampling3D(1, name="up")(keras.layers.Conv3D(2, 3, padding="same", name="conv")(x))
    parallel = ModelParallel(keras.Model(x, y), "spatial", [["/CPU:0", "/CPU:0"]], (1,), patch_size=(8, 8, 8))

    def body(argv):
        tf.function(lambda images: parallel(images)).get_concrete_function(tf.TensorSpec((1, 8, 8, 8, 1)))
        return 0

    assert run_command(body) == 2
    assert capsys.readouterr().err.strip() == (
        f"config error: {MP}.mode=spatial cannot split this network: spatial partitioning has no slab-wise version "
        f"of UpSampling3D (up); use {MP}.mode=pipeline (or none) for it"
    )


def test_a_pipeline_of_more_stages_than_the_network_has_layers_is_a_config_error():
    """pipeline:8 over a 2-level U-Net of 5 top-level layers: 3 devices would hold nothing; the error names the
    layers and the most devices that can work."""
    from tfmis.errors import ConfigError
    from tfmis.networks.parallel import ModelParallel
    from tfmis.networks.unet import UNetConfig

    model = UNetConfig(1, 2, filters=(4, 8), strides=(1, 2), num_res_units=0).build()
    with pytest.raises(ConfigError) as raised:
        ModelParallel(model, "pipeline", [["/CPU:0"] * 8], (1, 2))
    assert str(raised.value) == (
        f"{MP}.mode=pipeline, {MP}.devices=8: the network has 5 top-level layers to cut into stages (encoder0, "
        f"bottleneck, decoder0, head, logits), so 3 devices would hold none: set {MP}.devices=5 or fewer, or use "
        f"{MP}.mode=spatial"
    )


def test_train_gpu_customization_with_a_range_of_which_nothing_can_run_is_exit_2(tmp_path, capsys):
    """`tfmis-train --gpu-customization` checks `range_model_parallel` against the config as `tfmis-tune fit` does,
    before anything is converted."""
    specs = tmp_path / "specs.yaml"
    specs.write_text("universal:\n  range_model_parallel: [spatial:16]\n")
    argv = ["--config", DEMO, "--gpu-customization", "--gpu-customization-specs", specs]
    status, line = outcome(train.main, [*argv, *sets(f"data.dataset_dir={tmp_path}/tfr")], capsys)
    assert status == 2 and line.startswith("specs error: range_model_parallel: none of spatial:16 can run"), line
    assert not (tmp_path / "tfr").exists()
