"""Bad inputs at the commands' edge: each ends in one line on stderr naming the file or key and the
fix, the documented exit code (docs/exit-codes.md), no traceback, and no half-written file left behind.

Every test runs the real command as a subprocess (`python -m tfmis.<command>`) on real files. TensorFlow's
own start-up lines are silenced (TF_CPP_MIN_LOG_LEVEL=3, TF_ENABLE_ONEDNN_OPTS=0) so that stderr holds only
what tfmis prints.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_TRAINING, make_msd_dataset

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0"}


def run(*args, timeout=120, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", *map(str, args)], capture_output=True, text=True, timeout=timeout, env=ENV, cwd=cwd
    )


def sets(*overrides) -> list[str]:
    return [arg for override in overrides for arg in ("--set", override)]


def one_line(result) -> str:
    """The one line a failed command printed on stderr (no traceback, nothing else)."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def temp_files(root: Path) -> list[Path]:
    return [p for p in Path(root).rglob("*") if ".tmp" in p.name]


def convert_args(source, target, *extra):
    return ("tfmis.convert", "--source-dir", source, "--target-dir", target, "--workers", "1", "--quiet", *extra)


# ---------------------------------------------------------------------------------------------- convert


@pytest.mark.slow
def test_convert_follows_symlinked_imagesTr_and_labelsTr_inside_the_dataset_folder(tmp_path):
    """imagesTr/ and labelsTr/ as symlinks to another folder (a cluster layout): every case converts (exit 0);
    the containment check is lexical, so a symlink inside the dataset folder is no escape."""
    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=3)
    storage = tmp_path / "storage"
    storage.mkdir()
    for name in ("imagesTr", "labelsTr"):
        (source / name).rename(storage / name)
        (source / name).symlink_to(storage / name, target_is_directory=True)
    result = run(*convert_args(source, tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert sorted(index["cases"]) == ["case_000", "case_001", "case_002"] and index["skipped"] == []


def test_dataset_paths_that_leave_the_folder_are_still_refused_but_symlinks_inside_are_not(tmp_path):
    """`..` and absolute paths elsewhere are refused (named with the case); a symlinked subfolder is not."""
    from tfmis.data.sources.errors import CaseError
    from tfmis.data.sources.msd import MSDDataset

    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=2)
    (tmp_path / "elsewhere").mkdir()
    (source / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    dataset = MSDDataset(source)
    case = dataset.training[0]
    assert dataset.resolve(case, "./linked/x.nii.gz") == source.resolve() / "linked" / "x.nii.gz"
    for escape in ("../elsewhere/x.nii.gz", "imagesTr/../../elsewhere/x.nii.gz", str(tmp_path / "x.nii.gz")):
        with pytest.raises(CaseError, match="leads outside the dataset folder"):
            dataset.resolve(case, escape)


@pytest.mark.slow
def test_convert_with_every_case_missing_exits_1_and_leaves_nothing_to_resume_from(tmp_path):
    """All image files missing: 0 records is a failure, exit 1, with a line saying why (the first case's reason);
    no index.json, shard or progress file stays, so a rerun after fixing the files starts afresh."""
    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=3)
    shutil.rmtree(source / "imagesTr")
    target = tmp_path / "out"
    result = run(*convert_args(source, target, "--spacing", "1.5,1.5,2.0"))
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert all(": skipped: " in line for line in lines[:-1])  # the per-case lines, as they happen
    assert lines[-1].startswith(f"error: {source.resolve()}: 0 of 3 cases converted, all skipped (first: case_000:")
    assert "does not exist" in lines[-1] and "fix the files dataset.json lists and rerun" in lines[-1]
    assert not (target / "index.json").exists()
    assert not list(target.glob("*.tfrecord*")) and not list((target / ".progress").glob("*"))
    result = run(*convert_args(source, tmp_path / "out2"))  # no --spacing: no header gives a median spacing
    assert result.returncode == 1, result.stderr
    line = one_line(result)
    assert line.startswith(f"error: {source.resolve()}: 0 of 3 cases readable, so nothing to convert (first: case_000:")
    assert "does not exist" in line and "fix the files dataset.json lists and rerun" in line


def test_convert_to_a_target_that_is_a_file_exits_1_naming_it(tmp_path):
    """--target-dir names an existing file (or a folder under one): one line naming that file, exit 1, and the
    file is left as it was."""
    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=2)
    target = tmp_path / "out"
    target.write_text("not a folder")
    for given in (target, target / "sub"):
        result = run(*convert_args(source, given))
        assert result.returncode == 1, result.stderr
        assert one_line(result) == f"error: {target} is a file, not a folder: remove it or give another folder"
    assert target.read_text() == "not a folder"


class FullDisk:
    """A 1 MB tmpfs filled up to `free_bytes`; `free()` removes the filler."""

    def __init__(self, mount: Path):
        self.mount, self.filler = mount, mount / "filler"

    def fill(self, free_bytes: int) -> None:
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"x" * 4096)
        except OSError:
            pass
        finally:
            os.close(fd)
        os.truncate(self.filler, max(0, self.filler.stat().st_size - free_bytes))

    def free(self) -> None:
        self.filler.unlink()


@pytest.fixture
def full_disk(tmp_path):
    """A real full file system (tmpfs); skipped where mounting is not permitted."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield FullDisk(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow
def test_convert_on_a_full_disk_exits_1_removes_the_half_written_shard_and_resumes_after(tmp_path, full_disk):
    """The disk fills during the first shard write (TensorFlow's ResourceExhaustedError, which names no file):
    one line naming the shard and the fix, exit 1, no temporary left; once space is freed the same command
    finishes (exit 0)."""
    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=3)
    target = full_disk.mount / "out"
    full_disk.fill(free_bytes=16 * 1024)  # room for conversion.json, not for a shard of ~31 KB cases
    args = convert_args(source, target, "--compression", "NONE")
    result = run(*args)
    assert result.returncode == 1, result.stderr
    shard = target / "train-000-of-002.tfrecord"  # the file being written, not its temporary
    assert one_line(result) == f"error: disk full writing {shard}: free space and rerun the same command (it resumes)"
    assert temp_files(target) == []
    full_disk.free()
    result = run(*args)
    assert result.returncode == 0, result.stderr
    assert len(json.loads((target / "index.json").read_text())["cases"]) == 3


@pytest.mark.slow
def test_train_on_a_full_disk_at_the_epoch_commit_exits_1_and_leaves_no_temp_weights(
    tmp_path, full_disk, converted_dataset
):
    """The run folder's disk fills before epoch 1's best weights are written (h5py would crash on a full disk, so
    the space is checked first): exit 1, the last stderr line names best.staged.weights.h5 and the fix (--resume),
    no traceback, and no `*.tmp*` file stays in the run folder."""
    config = tmp_path / "tiny.yaml"
    config.write_text("{}\n")
    out = full_disk.mount / "run"
    full_disk.fill(free_bytes=16 * 1024)  # config.yaml and training_data.json fit; the weights do not
    overrides = [*TINY_TRAINING, f"data.dataset_dir={converted_dataset}", f"output.dir={out}"]
    overrides += ["training.epochs=1", "training.steps_per_epoch=1"]
    result = run("tfmis.train", "--config", config, *sets(*overrides), timeout=300)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        f"error: disk full writing {out / 'best.staged.weights.h5'}: free space and rerun with --resume (it continues "
        "from the last committed epoch)"
    ]
    assert result.stderr.strip().splitlines()[-1] == errors[0]
    assert temp_files(out) == []


# ---------------------------------------------------------------------------------------------- configs


@pytest.mark.parametrize("command", [("tfmis.train",), ("tfmis.tune", "fit")])
def test_non_utf8_config_is_one_config_error_naming_the_file(tmp_path, command):
    """A config saved in Latin-1 (not UTF-8): exit 2, one line naming the file, the byte and the fix."""
    path = tmp_path / "latin1.yaml"
    path.write_bytes("# réglages\ntraining:\n  epochs: 2\n".encode("latin-1"))
    result = run(*command, "--config", path)
    assert result.returncode == 2, result.stderr
    assert one_line(result) == (
        f"config error: {path}: not UTF-8 text (byte b'\\xe9' at offset 3): save the config file as UTF-8"
    )


@pytest.mark.parametrize("document, kind", [("- data\n- pipeline\n", "list"), ("3\n", "int"), ("just text\n", "str")])
def test_yaml_list_or_scalar_as_config_is_one_config_error(tmp_path, document, kind):
    """A config whose top level is a list or a scalar: exit 2, one line naming the file and what was expected."""
    path = tmp_path / "config.yaml"
    path.write_text(document)
    result = run("tfmis.train", "--config", path)
    assert result.returncode == 2, result.stderr
    assert one_line(result) == (
        f"config error: {path}: expected a mapping of config sections (data:, pipeline:, model:, ...), got {kind}"
    )


def test_negative_learning_rate_is_refused_before_training(tmp_path):
    """optimizer.learning_rate=-0.01 (Novograd): exit 2, one line naming the key; no run folder is made."""
    out = tmp_path / "run"
    result = run(
        "tfmis.train",
        "--config",
        REPO / "configs" / "demo.yaml",
        *sets("optimizer.name=novograd", "optimizer.learning_rate=-0.01", f"output.dir={out}"),
    )
    assert result.returncode == 2, result.stderr
    assert one_line(result) == "config error: optimizer.learning_rate must be a number > 0 (e.g. 0.001), got -0.01"
    assert not out.exists()


def test_a_config_whose_source_folder_is_missing_fails_before_tensorflow_is_imported(tmp_path):
    """`tfmis.train --config` with data.source_dir a folder without dataset.json: exit 2, the one line naming the key
    and the fix, no run folder, and TensorFlow never imported in the process (its start takes seconds and prints
    its own log lines before the error)."""
    out = tmp_path / "run"
    argv = [
        "--config",
        str(REPO / "configs" / "demo.yaml"),
        *sets("data.demo=false", f"data.source_dir={tmp_path / 'Task09_Spleen'}", f"output.dir={out}"),
    ]
    script = (
        "import sys; from tfmis.train import main; code = main(sys.argv[1:]); "
        "print('tensorflow imported:', 'tensorflow' in sys.modules); sys.exit(code)"
    )
    result = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120, env=ENV)
    assert result.returncode == 2, result.stderr
    assert one_line(result).startswith(f"error: data.source_dir {tmp_path / 'Task09_Spleen'}: no dataset.json there")
    assert "tensorflow imported: False" in result.stdout
    assert not out.exists()


# ---------------------------------------------------------------------------------------------- tune fit


def test_tune_fit_checks_its_specs_before_converting_the_dataset(tmp_path):
    """A specs file with an unknown section and a config whose data must first be converted: exit 2, one line
    naming the specs file, and nothing is converted (the TFRecord folder is never made)."""
    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=2)
    converted = tmp_path / "tfrecords"
    specs = tmp_path / "specs.yaml"
    specs.write_text("univrsal:\n  num_trials: 2\n")
    result = run(
        "tfmis.tune",
        "fit",
        "--config",
        REPO / "configs" / "demo.yaml",
        "--specs",
        specs,
        *sets(f"data.source_dir={source}", f"data.dataset_dir={converted}", f"output.dir={tmp_path / 'run'}"),
    )
    assert result.returncode == 2, result.stderr
    assert one_line(result) == f"specs error: {specs}: unknown section 'univrsal'; did you mean 'universal'?"
    assert not converted.exists()


def test_train_gpu_customization_checks_its_specs_before_converting_the_dataset(tmp_path):
    """`tfmis.train --gpu-customization` with a non-UTF-8 specs file: exit 2, one line naming it, nothing
    converted or trained."""
    source = make_msd_dataset(tmp_path / "Task99_Test", num_cases=2)
    converted = tmp_path / "tfrecords"
    specs = tmp_path / "specs.yaml"
    specs.write_bytes(b"universal:\n  num_trials: 2 \xff\n")
    result = run(
        "tfmis.train",
        "--config",
        REPO / "configs" / "demo.yaml",
        "--gpu-customization",
        "--gpu-customization-specs",
        specs,
        *sets(f"data.source_dir={source}", f"data.dataset_dir={converted}", f"output.dir={tmp_path / 'run'}"),
    )
    assert result.returncode == 2, result.stderr
    line = one_line(result)
    assert line.startswith(f"specs error: {specs}: not UTF-8 text") and "save the specs file as UTF-8" in line
    assert not converted.exists() and not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------- launch


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nproc", "0"], "error: --nproc must be >= 1 (worker processes on this machine), got 0"),
        (["--nproc", "-2"], "error: --nproc must be >= 1 (worker processes on this machine), got -2"),
        (["--nproc", "1", "--gpus-per-worker", "-1"], "error: --gpus-per-worker must be >= 0"),
    ],
)
def test_launch_with_bad_counts_exits_2_with_one_line(flags, message):
    """`tfmis.launch --nproc 0` (and other counts below their minimum): exit 2, one line naming the flag."""
    result = run("tfmis.launch", *flags, "--", sys.executable, "-c", "pass", timeout=60)
    assert result.returncode == 2, result.stderr
    assert one_line(result).startswith(message)


def test_launch_of_a_missing_program_exits_2_naming_it(tmp_path):
    """The program after `--` does not exist, or is a file without execute permission: exit 2, one line
    naming it; no worker is started."""
    result = run("tfmis.launch", "--nproc", "2", "--", "no-such-program-tfmis", "--flag", timeout=60)
    assert result.returncode == 2, result.stderr
    assert one_line(result) == (
        "error: program 'no-such-program-tfmis' after -- is not found (on PATH or as a path): check the command"
    )
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    result = run("tfmis.launch", "--nproc", "1", "--", script, timeout=60)
    assert result.returncode == 2, result.stderr
    assert one_line(result) == f"error: program '{script}' after -- is not an executable file: check the command"


# ---------------------------------------------------------------------------------------------- the one line


def test_os_error_line_names_the_file_and_the_fix(tmp_path):
    """tfmis.utils.cli.os_error_line, which every command's edge uses: a full disk (ENOSPC, EFBIG, or a
    library's text), a file in the way of a folder, a permission problem, a missing file."""
    import errno

    from tfmis.utils.cli import os_error_line
    from tfmis.utils.io import is_disk_full

    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "a.tmp"))
    assert os_error_line(full, rerun="rerun with --resume") == (
        f"disk full writing {tmp_path / 'a.tmp'}: free space and rerun with --resume"
    )
    assert os_error_line(OSError(errno.EFBIG, "File too large"), writing="x.h5").startswith("disk full writing x.h5")
    assert is_disk_full(RuntimeError("file write failed: errno = 28, error message = 'No space left on device'"))
    assert not is_disk_full(RuntimeError("OOM when allocating tensor"))
    blocker = tmp_path / "file"
    blocker.write_text("")
    error = NotADirectoryError(errno.ENOTDIR, "Not a directory", str(blocker / "sub" / ".progress"))
    assert os_error_line(error) == f"{blocker} is a file, not a folder: remove it or give another folder"
    denied = PermissionError(errno.EACCES, "Permission denied", "/root/x")
    assert os_error_line(denied) == "/root/x: permission denied: change its permissions or choose another path"
    missing = FileNotFoundError(errno.ENOENT, "No such file or directory", "ckpt")
    assert os_error_line(missing) == "ckpt: not found: check the path"
