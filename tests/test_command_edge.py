"""The command edge (`tfmis.utils.cli.run_command`, `tfmis.errors`): every command gives the same exit code and the
same kind of one line for the same cause, and a bug keeps its traceback.

The commands run in this process (`main(argv)`, as their console scripts call it) on real files; stderr is
captured. docs/exit-codes.md is checked against the error classes.
"""

import re
from pathlib import Path

import pytest
from conftest import make_msd_dataset

from tfmis import auto, benchmark, convert, crossval, plan, predict, train, tune, visualize
from tfmis.errors import (
    ConfigError,
    DataError,
    PartialFailure,
    ResourceError,
    RunStateError,
    TfmisError,
    TrainingFailed,
    UsageError,
    exit_codes,
)
from tfmis.utils.cli import run_command

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo.yaml"


def outcome(main, argv, capsys) -> tuple[int, str]:
    """(exit status, stderr) of a command's `main(argv)`; argparse's SystemExit counts as its status."""
    try:
        status = main([str(a) for a in argv])
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err


def last_line(err: str) -> str:
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


# commands that read a config, each as (name, main, argv before the config's path, argv after it)
CONFIG_COMMANDS = [
    ("train", train.main, ["--config"], []),
    ("tune fit", tune.main, ["fit", "--config"], []),
    ("tune hpo", tune.main, ["hpo", "--config"], ["--space", REPO / "configs" / "hpo_space.yaml"]),
    ("benchmark", benchmark.main, ["--config"], []),
    ("crossval", crossval.main, ["--config"], ["--folds", "2", "--output", "OUT"]),
]


def _config_argv(before, path, after, tmp_path):
    return [*before, path, *[tmp_path / "cv" if a == "OUT" else a for a in after]]


@pytest.mark.parametrize("name, main, before, after", CONFIG_COMMANDS, ids=[c[0] for c in CONFIG_COMMANDS])
def test_a_config_that_is_a_yaml_list_is_exit_2_and_one_config_error_line_in_every_command(
    tmp_path, capsys, name, main, before, after
):
    """The same unusable config (a YAML list) given to every config-reading command: exit 2 and the same line."""
    path = tmp_path / "config.yaml"
    path.write_text("- data\n- pipeline\n")
    status, err = outcome(main, _config_argv(before, path, after, tmp_path), capsys)
    assert status == 2, err
    assert last_line(err) == (
        f"config error: {path}: expected a mapping of config sections (data:, pipeline:, model:, ...), got list"
    )


@pytest.mark.parametrize("name, main, before, after", CONFIG_COMMANDS, ids=[c[0] for c in CONFIG_COMMANDS])
def test_a_missing_config_file_is_exit_2_naming_it_in_every_command(tmp_path, capsys, name, main, before, after):
    """A config path that does not exist: exit 2, one `config error:` line naming the path."""
    path = tmp_path / "nowhere.yaml"
    status, err = outcome(main, _config_argv(before, path, after, tmp_path), capsys)
    assert status == 2, err
    line = last_line(err)
    assert line.startswith("config error: ") and str(path) in line


@pytest.mark.parametrize("name, main, before, after", CONFIG_COMMANDS, ids=[c[0] for c in CONFIG_COMMANDS])
def test_an_unknown_set_key_is_exit_2_naming_the_key_in_every_command(tmp_path, capsys, name, main, before, after):
    """`--set training.epoch=3` (a typo of training.epochs): exit 2, one line naming the key and the close match."""
    argv = [*_config_argv(before, DEMO, after, tmp_path), "--set", "training.epoch=3"]
    status, err = outcome(main, argv, capsys)
    assert status == 2, err
    line = last_line(err)
    assert line.startswith("config error: ") and "training.epoch" in line and "epochs" in line


def test_a_folder_without_dataset_json_is_exit_2_in_plan_train_convert_auto_and_crossval(tmp_path, capsys):
    """An empty folder given as the MSD dataset, by argument or by `data.source_dir`: exit 2 in every command that
    reads one, each line naming the folder's dataset.json (or the flag) and that it is missing."""
    empty = tmp_path / "NotADataset"
    empty.mkdir()
    runs = {
        "plan": (plan.main, ["--source-dir", empty, "--output", tmp_path / "plan.yaml"]),
        "train --source-dir": (train.main, ["--source-dir", empty, "--set", f"output.dir={tmp_path / 'run1'}"]),
        "train --config": (
            train.main,
            ["--config", DEMO, "--set", f"data.source_dir={empty}", "--set", f"data.dataset_dir={tmp_path / 'c1'}"]
            + ["--set", f"output.dir={tmp_path / 'run2'}", "--set", "data.demo=false"],
        ),
        "convert": (convert.main, ["--source-dir", empty, "--target-dir", tmp_path / "c2", "--quiet"]),
        "auto": (auto.main, ["--source-dir", empty, "--output", tmp_path / "auto"]),
        "crossval": (
            crossval.main,
            ["--config", DEMO, "--folds", "2", "--output", tmp_path / "cv"]
            + ["--set", f"data.source_dir={empty}", "--set", f"data.dataset_dir={tmp_path / 'c3'}"]
            + ["--set", "data.demo=false"],
        ),
    }
    for name, (main, argv) in runs.items():
        status, err = outcome(main, argv, capsys)
        assert status == 2, (name, err)
        line = last_line(err)
        assert line.startswith("error: ") and str(empty) in line and "dataset.json" in line, (name, line)


def test_an_output_that_is_a_file_is_exit_1_naming_it_in_every_command(tmp_path, capsys):
    """A regular file where each command must make its output folder: exit 1, and the same line naming the file
    and the fix."""
    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=3)
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    runs = {
        "plan": (plan.main, ["--source-dir", source, "--output", blocker / "plan.yaml", "--quiet"]),
        "convert": (convert.main, ["--source-dir", source, "--target-dir", blocker / "tfr", "--quiet"]),
        "train": (
            train.main,
            ["--config", DEMO, "--set", f"data.source_dir={source}", "--set", f"data.dataset_dir={blocker / 'tfr'}"]
            + ["--set", "data.demo=false"],
        ),
        "tune fit": (
            tune.main,
            ["fit", "--config", DEMO, "--set", f"data.source_dir={source}", "--set", f"data.dataset_dir={blocker}/t"]
            + ["--set", "data.demo=false"],
        ),
        "benchmark": (benchmark.main, ["--config", DEMO, "--output", blocker / "bench", "--pipeline-only"]),
        "auto": (auto.main, ["--source-dir", source, "--output", blocker / "auto"]),
    }
    expected = f"error: {blocker} is a file, not a folder: remove it or give another folder"
    for name, (main, argv) in runs.items():
        status, err = outcome(main, argv, capsys)
        assert (status, last_line(err)) == (1, expected), (name, err)


def test_predict_with_a_missing_checkpoint_and_visualize_with_a_missing_image_are_exit_1(tmp_path, capsys):
    """Inputs that do not exist (a checkpoint folder, an image file): exit 1 and one `error:` line naming them."""
    missing = tmp_path / "missing"
    status, err = outcome(
        predict.main, ["--checkpoint", missing, "--input", tmp_path, "--output", tmp_path / "p"], capsys
    )
    assert status == 1 and str(missing) in last_line(err), err
    status, err = outcome(visualize.main, ["--image", missing / "ct.nii.gz", "--output", tmp_path / "x.png"], capsys)
    assert status == 1 and str(missing) in last_line(err), err


@pytest.mark.parametrize(
    "main, argv",
    [
        (train.main, ["--config", DEMO, "--no-such-flag"]),
        (predict.main, ["--checkpoint", "x", "--input", "y", "--output", "z", "--no-such-flag"]),
        (plan.main, ["--source-dir", "x", "--no-such-flag"]),
        (convert.main, ["--source-dir", "x", "--target-dir", "y", "--no-such-flag"]),
        (tune.main, ["fit", "--config", DEMO, "--no-such-flag"]),
        (benchmark.main, ["--config", DEMO, "--no-such-flag"]),
        (crossval.main, ["--config", DEMO, "--output", "x", "--no-such-flag"]),
        (visualize.main, ["--image", "x", "--no-such-flag"]),
        (auto.main, ["--source-dir", "x", "--output", "y", "--no-such-flag"]),
    ],
    ids=["train", "predict", "plan", "convert", "tune", "benchmark", "crossval", "visualize", "auto"],
)
def test_an_unknown_flag_is_exit_2_in_every_command(capsys, main, argv):
    """argparse's usage error: exit 2 in every command, naming the flag."""
    status, err = outcome(main, argv, capsys)
    assert status == 2 and "--no-such-flag" in err, err


def test_run_command_maps_each_error_class_to_its_exit_code_and_keeps_a_bugs_traceback(capsys, monkeypatch):
    """`run_command`: each `tfmis.errors` class exits with its code and prints `<label>: <first line>`; an OS error
    is 1; Ctrl-C is 130; any other exception propagates (a bug keeps its traceback); TFMIS_DEBUG=1 prints the
    traceback of a handled error before its line."""

    def raising(error):
        def command(argv):
            raise error

        return command

    cases = [
        (UsageError("--x: bad"), 2, "error: --x: bad"),
        (ConfigError("a.yaml: key b: bad\nmore"), 2, "config error: a.yaml: key b: bad"),
        (DataError("case 3: no label"), 1, "error: case 3: no label"),
        (RunStateError("run exists"), 1, "error: run exists"),
        (ResourceError("out of memory"), 1, "error: out of memory"),
        (TrainingFailed("diverged"), 1, "error: diverged"),
        (PartialFailure("2 of 5 case(s) failed"), 3, "error: 2 of 5 case(s) failed"),
        (FileNotFoundError(2, "No such file or directory", "ckpt"), 1, "error: ckpt: not found: check the path"),
        (KeyboardInterrupt(), 130, "interrupted"),
    ]
    for error, code, line in cases:
        assert run_command(raising(error)) == code
        assert capsys.readouterr().err == line + "\n"
    with pytest.raises(KeyError):  # a programming error is not turned into a line
        run_command(raising(KeyError("spacing")))
    monkeypatch.setenv("TFMIS_DEBUG", "1")
    assert run_command(raising(DataError("case 3: no label"))) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith("error: case 3: no label\n")


def test_the_exit_code_table_in_the_docs_matches_the_error_classes():
    """docs/exit-codes.md's table of error classes lists every class of tfmis.errors with its exit code."""
    text = (REPO / "docs" / "exit-codes.md").read_text()
    documented = dict(re.findall(r"^\| `(\w+)` \| (\d) \|", text, flags=re.M))
    assert {name: int(code) for name, code in documented.items()} == exit_codes()
    assert exit_codes()["TfmisError"] == 1 and set(exit_codes()) >= {"UsageError", "ConfigError", "PartialFailure"}
    assert issubclass(ConfigError, ValueError) and issubclass(DataError, ValueError)  # library callers keep working
    assert all(issubclass(c, TfmisError) for c in (UsageError, DataError, RunStateError, ResourceError))


def test_every_error_class_in_the_package_exits_with_its_documented_base_code():
    """Every TfmisError subclass anywhere in tfmis (every module imported) exits with the code of its nearest class
    in tfmis.errors, the classes docs/exit-codes.md lists: a subclass elsewhere cannot change its exit code
    unseen."""
    import importlib
    import pkgutil

    import tfmis

    for module in pkgutil.walk_packages(tfmis.__path__, "tfmis."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    documented = exit_codes()
    seen, todo = set(), [TfmisError]
    while todo:
        cls = todo.pop()
        todo.extend(c for c in cls.__subclasses__() if c not in seen)
        seen.add(cls)
    elsewhere = [c for c in seen if c.__module__ != "tfmis.errors"]
    assert elsewhere, "no subclass outside tfmis.errors was found: the walk imported nothing"
    for cls in elsewhere:
        base = next(b for b in cls.__mro__ if b.__module__ == "tfmis.errors")
        assert cls.exit_code == documented[base.__name__], (
            f"{cls.__module__}.{cls.__name__} exits {cls.exit_code}, its documented base {base.__name__} "
            f"{documented[base.__name__]}"
        )


_COMMAND_IMPORTING_TENSORFLOW = """
import json, sys
from tfmis.utils.cli import command

@command
def body(argv):  # a command run as its process's own (its module is __main__), as `python -m tfmis.X` runs one
    import tensorflow  # noqa: F401
    import keras.src.wrappers.sklearn_wrapper as wrappers
    from keras_tuner.src.tuners import bayesian

    print(json.dumps({"with_tensorflow": wrappers.sklearn is not None, "bayesian": bayesian.sklearn is not None}))
    return 0

body()
"""


def test_a_command_process_imports_tensorflow_without_scikit_learn_and_keras_tuner_still_gets_it(tmp_path):
    """In a process whose command is its own (`command` with no argv), TensorFlow's import leaves Keras' scikit-learn
    wrappers without scikit-learn (1.3-1.7 s of every command's start), while keras-tuner's Bayesian oracle, imported
    after, finds it; the same import in this test process (not a command) keeps Keras' wrappers as installed."""
    import json
    import subprocess
    import sys

    import keras.src.wrappers.sklearn_wrapper as wrappers

    result = subprocess.run(
        [sys.executable, "-c", _COMMAND_IMPORTING_TENSORFLOW], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"with_tensorflow": False, "bayesian": True}
    assert wrappers.sklearn is not None
