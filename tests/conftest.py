"""Shared test helpers: real NIfTI files and MSD-style dataset folders on disk."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

# first, before any test module imports TensorFlow: tfmis decides oneDNN and the thread pools for this machine
# (TensorFlow reads both once, at its import), so the suite runs as fast as the commands do
import tfmis  # noqa: F401, E402

# In CI (.ci/run sets TFMIS_CI), a skip is a failure: CI installs every tool and package the tests need (Open MPI,
# SLURM, the extras, a cgroup as root), so a skip there means a step is broken, not that a tool is missing. The tests
# that may skip in CI too say why with `@pytest.mark.ci_may_skip("...")` (a GPU, MONAI, a run in another CI step).
IN_CI = bool(os.environ.get("TFMIS_CI"))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "ci_may_skip(reason): this test may skip in CI too (no CI machine has what it needs), saying why"
    )


def _skip_reason(report) -> str:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail") and not item.get_closest_marker("ci_may_skip"):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, which installs what this test needs (TFMIS_CI): {_skip_reason(report)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped:
        report.outcome = "failed"
        report.longrepr = f"module skipped in CI, which installs what it needs (TFMIS_CI): {_skip_reason(report)}"


def pytest_terminal_summary(terminalreporter):
    """The count of skips by reason, so a run's skips can be read at a glance (and compared between runs)."""
    reasons = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        reasons[_skip_reason(report)] += 1
    if reasons:
        terminalreporter.section("skips by reason")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"{count:4d}  {reason}")


def write_nifti(path: Path, data: np.ndarray, affine: np.ndarray, dtype=None) -> Path:
    """Writes `data` as NIfTI with the given on-disk dtype (e.g. '>i2' for big-endian int16)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    array = np.asarray(data)
    if dtype is not None:
        array = array.astype(dtype)
    # the header's byte order decides the file's: big-endian data needs a big-endian header
    header = nib.Nifti1Header(endianness=">" if array.dtype.byteorder == ">" else "<")
    img = nib.Nifti1Image(array, affine, header)
    img.set_data_dtype(array.dtype)
    nib.save(img, str(path))
    return path


def lps_affine(spacing=(1.5, 1.5, 2.0), origin=(10.0, 20.0, -30.0)) -> np.ndarray:
    affine = np.diag([-spacing[0], -spacing[1], spacing[2], 1.0])
    affine[:3, 3] = origin
    return affine


def brain_like_case(rng: np.random.Generator, shape=(20, 22, 18), channels=2, num_classes=3):
    """A small volume with a nonzero 'body' in a zero background and nested label blobs."""
    image = np.zeros(shape + (channels,), np.float32)
    body = tuple(slice(2, s - 2) for s in shape)
    image[body] = rng.normal(100, 10, tuple(s - 4 for s in shape) + (channels,))
    label = np.zeros(shape, np.uint8)
    label[5:13, 6:14, 5:12] = 1
    if num_classes > 2:
        label[7:10, 8:11, 7:9] = 2
    image[..., 0] += 30.0 * label  # classes are visible in the intensities
    return image, label


def make_msd_dataset(
    root: Path,
    num_cases: int = 6,
    channels: int = 2,
    seed: int = 0,
    modalities=None,
    labels=None,
    affine=None,
    shape=(20, 22, 18),
    dtype="int16",
) -> Path:
    """An MSD-style folder (dataset.json, imagesTr, labelsTr, imagesTs) of small synthetic cases."""
    rng = np.random.default_rng(seed)
    modalities = modalities or {str(i): f"MR{i}" for i in range(channels)}
    labels = labels or {"0": "background", "1": "organ", "2": "core"}
    affine = lps_affine() if affine is None else affine
    training = []
    for i in range(num_cases):
        image, label = brain_like_case(rng, shape, channels, len(labels))
        image = image[..., 0] if channels == 1 else image
        write_nifti(root / "imagesTr" / f"case_{i:03d}.nii.gz", image, affine, dtype)
        write_nifti(root / "labelsTr" / f"case_{i:03d}.nii.gz", label, affine, np.uint8)
        training.append({"image": f"./imagesTr/case_{i:03d}.nii.gz", "label": f"./labelsTr/case_{i:03d}.nii.gz"})
    image, _ = brain_like_case(rng, shape, channels, len(labels))
    write_nifti(root / "imagesTs" / "case_900.nii.gz", image[..., 0] if channels == 1 else image, affine, dtype)
    meta = {
        "name": "TaskTest",
        "description": "unit-test data",
        "tensorImageSize": "4D",
        "modality": modalities,
        "labels": labels,
        "numTraining": num_cases,
        "numTest": 1,
        "training": training,
        "test": ["./imagesTs/case_900.nii.gz"],
    }
    (root / "dataset.json").write_text(json.dumps(meta, indent=1))
    return root


def update_dataset_json(root: Path, **changes) -> None:
    meta = json.loads((root / "dataset.json").read_text())
    meta.update(changes)
    (root / "dataset.json").write_text(json.dumps(meta, indent=1))


@pytest.fixture
def msd_dataset(tmp_path) -> Path:
    return make_msd_dataset(tmp_path / "Task99_Test")


@pytest.fixture(scope="session")
def converted_dataset(tmp_path_factory) -> Path:
    """A real converted dataset (6 train + 2 val cases of 20x22x18, 2 channels, 3 classes)."""
    from tfmis.data.conversion_options import ConversionConfig
    from tfmis.data.convert import convert

    root = tmp_path_factory.mktemp("converted")
    source = make_msd_dataset(root / "Task99_Test", num_cases=8)
    convert(
        ConversionConfig(str(source), str(root / "tfrecords"), split=(0.75, 0.25), shards=2, workers=1, progress=False)
    )
    return root / "tfrecords"


TINY_TRAINING = [
    "model.filters=[4,8]",
    "model.strides=[1,2]",
    "model.num_res_units=0",
    "model.norm=instance",
    "pipeline.patch_size=[16,16,16]",
    "pipeline.num_images_per_batch=2",
    "pipeline.num_crops_per_image=2",
    "pipeline.deterministic=true",
    "training.epochs=2",
    "training.steps_per_epoch=2",
    "training.precision=float32",
    "validation.val_interval=1",
    "validation.num_sw_batch_size=2",
    "validation.overlap=0.25",
    "output.progress=false",
    "output.tensorboard=false",
]


def tiny_config(dataset_dir: Path, output_dir: Path, *overrides):
    """A training config small enough for a CPU test (real model, data and loop)."""
    from tfmis.config import load_config

    return load_config(
        None, [f"data.dataset_dir={dataset_dir}", f"output.dir={output_dir}", *TINY_TRAINING, *overrides]
    )


def tiny_config_file(tmp_path: Path, name: str, *overrides, cases: int = 6) -> Path:
    """`tiny_config` of a real synthetic MSD folder `tmp_path/Task99_Test` (made once, converted on first use), saved as
    `tmp_path/<name>.yaml`; returns its path."""
    from tfmis.config import save_config

    source = tmp_path / "Task99_Test"
    if not (source / "dataset.json").is_file():
        make_msd_dataset(source, num_cases=cases)
    config = tiny_config(
        tmp_path / "tfrecords",
        tmp_path / f"runs_{name}",
        f"data.source_dir={source}",
        "data.conversion.shards=1",
        *overrides,
    )
    path = tmp_path / f"{name}.yaml"
    save_config(config, path)
    return path
