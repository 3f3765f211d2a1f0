from pathlib import Path

import pytest

from tfmis.config import Config, ConfigError, load_config, save_config

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["demo.yaml", "spleen.yaml", "brats.yaml"])
def test_shipped_configs_load(name):
    config = load_config(REPO / "configs" / name)
    assert isinstance(config, Config) and len(config.pipeline.patch_size) == 3


def test_defaults_and_overrides():
    config = load_config(
        None,
        [
            "training.epochs=3",
            "pipeline.patch_size=[48, 48, 32]",
            "loss.name=dice_focal",
            "optimizer.learning_rate=1e-4",
            "validation.roi_size=null",
        ],
    )
    assert config.training.epochs == 3
    assert config.pipeline.patch_size == [48, 48, 32]
    assert config.loss.name == "dice_focal" and config.optimizer.learning_rate == 1e-4
    assert config.validation.roi_size is None and config.model.norm == "instance"


def test_unknown_key_is_named_with_a_suggestion(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("pipeline:\n  patch_sise: [64, 64, 64]\n")
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'pipeline.patch_sise'; did you mean "
        r"'pipeline.patch_size'\?",
    ):
        load_config(path)
    with pytest.raises(ConfigError, match="unknown config key 'trainig'; did you mean 'training'"):
        load_config(None, ["trainig.epochs=3"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("training.epochs=three", "training.epochs: expected an integer, got str 'three'"),
        ("training.epochs=2.5", "training.epochs: expected an integer"),
        ("pipeline.patch_size=64", "pipeline.patch_size: expected a list of int"),
        ("pipeline.patch_size=[64, x, 64]", r"pipeline.patch_size\[1\]: expected an integer"),
        ("training.precision=fp16", "training.precision: 'fp16' is not one of"),
        ("loss.name=dice_cee", "did you mean 'dice_ce'"),
        ("output.tensorboard=1", "output.tensorboard: expected true/false"),
        ("pipeline.patch_size=[64, 64]", "pipeline.patch_size: expected three positive sizes"),
        ("validation.overlap=1.0", r"validation.overlap must be in \[0, 1\)"),
        ("validation.val_interval=0", r"validation: val_interval must be >= 1 \(epochs between validations\), got 0"),
        ("validation.validations=0", r"validation: validations must be >= 1 \(validations over a time-budgeted run\)"),
        ("model.filters=[8, 16, 32]", r"model: strides needs one entry per level of filters \(8, 16, 32\)"),
        ("training.epochs", "expected key=value"),
        (
            "pipeline.cache=memroy",
            r"pipeline.cache: 'memroy' is not one of \['memory', 'none', 'file', 'partial', 'patches'\] "
            r"\(did you mean 'memory'\?\)",
        ),
        ("pipeline.cache=/scratch/cache/demo", r"pipeline.cache: '/scratch/cache/demo' is not one of"),
        ("pipeline.cache=file", r"pipeline.cache is 'file' but pipeline.cache_dir is not set"),
        ("optimizer.learning_rate=-0.001", r"optimizer.learning_rate must be a number > 0 \(e.g. 0.001\), got -0.001"),
        ("optimizer.learning_rate=0", r"optimizer.learning_rate must be a number > 0"),
        ("optimizer.learning_rate=.nan", r"optimizer.learning_rate must be a number > 0"),
        ("optimizer.weight_decay=-1e-5", r"optimizer.weight_decay must be a number >= 0 \(0 = off\)"),
        ("optimizer.beta_2=1.0", r"optimizer.beta_2 must be in \[0, 1\)"),
        ("optimizer.momentum=-0.9", r"optimizer.momentum must be in \[0, 1\)"),
        ("optimizer.warmup_epochs=-1", r"optimizer.warmup_epochs must be a number >= 0"),
        ("optimizer.min_learning_rate=-1e-6", r"optimizer.min_learning_rate must be a number >= 0"),
        ("optimizer.clipnorm=0", r"optimizer.clipnorm must be > 0 \(or null = no clipping\)"),
        ("optimizer.power=0", r"optimizer.power must be > 0"),
    ],
)
def test_wrong_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_file_cache_takes_its_folder_from_cache_dir():
    config = load_config(None, ["pipeline.cache=file", "pipeline.cache_dir=cache/spleen"])
    assert config.pipeline.cache == "file" and config.pipeline.cache_dir == "cache/spleen"
    assert load_config(None).pipeline.cache == "memory" and load_config(None).pipeline.cache_dir is None


def test_resolved_config_round_trips(tmp_path):
    config = load_config(REPO / "configs" / "demo.yaml", ["training.epochs=7"])
    save_config(config, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == config


def test_cli_reports_config_errors():
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfmis.train",
            "--config",
            str(REPO / "configs" / "demo.yaml"),
            "--set",
            "model.nrom=batch",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "unknown config key 'model.nrom'; did you mean 'model.norm'?" in result.stderr
