"""One schema per concept: the conversion options and the U-Net architecture are each defined once, and the
config file, the converter, the command line, training and prediction all read that one definition."""

import dataclasses
import json

import pytest
from conftest import make_msd_dataset

from tfmis.config import ConfigError, load_config
from tfmis.convert import build_parser
from tfmis.data.conversion_options import ConversionConfig, ConversionOptions
from tfmis.networks.architecture import UNetArchitecture
from tfmis.networks.unet import UNetConfig

# a non-default value for every conversion option, as YAML and as command-line flags
NON_DEFAULT_CONVERSION = {
    "folds": 3,
    "spacing": [1.5, 1.5, 2.5],
    "shards": 1,
    "compression": "ZLIB",
    "workers": 1,
    "seed": 7,
    "image_dtype": "float32",
    "ct_window": [-50.0, 150.0],
    "crop_foreground": False,
    "crop_margin": 2,
    "ct_normalization": "zscore",
    "crop_to_label_mm": 15.0,
}
NON_DEFAULT_FLAGS = [
    "--folds",
    "3",
    "--spacing",
    "1.5,1.5,2.5",
    "--shards",
    "1",
    "--compression",
    "ZLIB",
    "--workers",
    "1",
    "--seed",
    "7",
    "--image-dtype",
    "float32",
    "--ct-window",
    "-50,150",
    "--no-crop",
    "--crop-margin",
    "2",
    "--ct-normalization",
    "zscore",
    "--crop-to-label-mm",
    "15",
]


def test_every_conversion_option_is_settable_from_the_config_and_the_command_line():
    """Each field of ConversionOptions can be set in data.conversion and by a tfmis-convert flag, and both
    give the same ConversionConfig."""
    names = {f.name for f in dataclasses.fields(ConversionOptions)}
    assert names == set(NON_DEFAULT_CONVERSION) | {"split", "reshape"}
    config = load_config(None, [f"data.conversion.{k}={json.dumps(v)}" for k, v in NON_DEFAULT_CONVERSION.items()])
    from_yaml = ConversionConfig(source_dir="S", target_dir="T", **dataclasses.asdict(config.data.conversion))
    args = build_parser().parse_args(["--source-dir", "S", "--target-dir", "T", *NON_DEFAULT_FLAGS])
    from_cli = ConversionConfig.from_args(args)
    assert from_cli == from_yaml
    for name, value in NON_DEFAULT_CONVERSION.items():
        assert getattr(from_cli, name) == (tuple(value) if isinstance(value, list) else value), name
    reshaped = ConversionConfig.from_args(
        build_parser().parse_args(["--source-dir", "S", "--target-dir", "T", "--reshape", "32,32,16"])
    )
    assert reshaped.reshape == (32, 32, 16) and reshaped.split == (0.7, 0.15, 0.15) and reshaped.folds is None


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "data.conversion.compression=gzip",
            r"data.conversion.compression: 'gzip' is not one of .* \(did you mean 'GZIP'\?\)",
        ),
        ("data.conversion.spacing=[1.5, 2]", r"data.conversion.spacing: expected 3 values, got 2"),
        ("data.conversion.split=[0.5, 0.5]", None),
        ("data.conversion.crop_margin=-1", r"data.conversion: crop_margin must be >= 0"),
    ],
)
def test_conversion_section_errors_name_the_key(override, message):
    """Bad conversion options fail at config load, naming the key (a good one loads)."""
    overrides = [override, "data.conversion.folds=3"] if "split" in override else [override]
    if message is None:  # split and folds together
        with pytest.raises(ConfigError, match="data.conversion: set only one of split .* and folds"):
            load_config(None, overrides)
        assert load_config(None, [override]).data.conversion.split == (0.5, 0.5)
    else:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)


def test_training_converts_with_folds_crop_margin_and_no_crop_from_the_config(tmp_path):
    """data.conversion.folds / crop_margin / crop_foreground reach the converter that training runs."""
    from tfmis.data.prepare import prepare_dataset
    from tfmis.data.records import load_index

    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=4)
    config = load_config(
        None,
        [
            f"data.source_dir={source}",
            f"data.dataset_dir={tmp_path / 'tfr'}",
            "data.conversion.folds=2",
            "data.conversion.crop_margin=1",
            "data.conversion.crop_foreground=false",
            "data.conversion.workers=1",
            "data.train_split=fold0",
            "data.val_split=fold1",
        ],
    )
    prepare_dataset(config.data, progress=False)
    index = load_index(tmp_path / "tfr")
    assert sorted(index["splits"]) == ["fold0", "fold1"]
    assert index["preprocessing"]["crop_foreground"] is False and index["preprocessing"]["crop_margin"] == 1


def test_the_model_section_is_the_unet_architecture():
    """config.model is the U-Net's own architecture dataclass: every U-Net option (anisotropic strides,
    kernel size, activation) is settable in the config and builds that network."""
    assert set(f.name for f in dataclasses.fields(UNetConfig)) == set(
        f.name for f in dataclasses.fields(UNetArchitecture)
    ) | {"in_channels", "num_classes"}
    config = load_config(
        None,
        [
            "model.filters=[4, 8, 16]",
            "model.strides=[1, 2, [2, 2, 1]]",
            "model.kernel_size=[3, 3, 1]",
            "model.activation=leaky_relu",
            "model.num_res_units=0",
        ],
    )
    assert isinstance(config.model, UNetArchitecture)
    unet = UNetConfig(in_channels=2, num_classes=3, **dataclasses.asdict(config.model))
    assert unet.patch_divisor == (4, 4, 2)
    model = unet.build()
    assert model.get_layer("bottleneck").get_config()["strides"] == (2, 2, 1)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.norm=layer", r"model.norm: 'layer' is not one of"),
        ("model.strides=[1, 2, [2, 2]]", r"model.strides\[2\]: expected an integer or 3 values"),
        ("model.filters=[8, 16, 32]", r"model: strides needs one entry per level"),
    ],
)
def test_model_section_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_trainer_and_predictor_build_the_same_network_from_the_model_section(converted_dataset, tmp_path):
    """The network built for training and the one built for prediction have the same weights layout,
    including options only the U-Net schema had before (kernel size, activation)."""
    from conftest import tiny_config

    from tfmis.engine.trainer import Trainer
    from tfmis.inference.predictor import Predictor

    config = tiny_config(
        converted_dataset,
        tmp_path / "run",
        "model.kernel_size=[3, 3, 1]",
        "model.activation=leaky_relu",
        "training.epochs=1",
    )
    trainer = Trainer(config)
    trainer.fit()
    predictor = Predictor(config, tmp_path / "run")
    assert [w.shape for w in predictor.model.weights] == [w.shape for w in trainer.model.weights]
    assert predictor.model.weights[0].shape[:3] == (3, 3, 1)
