"""The patch-read layout (`pipeline.cache: patches`, `tfmis.data.patch_layout`): crops read from memory-mapped arrays
equal the crops the volume pipeline cuts from the decoded volumes, the arrays are written resumably, the input says
what it holds and refuses a memory cache above its budget, and the planner picks the layout when the decoded data do
not fit. Real converted datasets (TFRecords from NIfTI) throughout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import tiny_config
from tfmis.data.memory_budget import check_input_memory, input_memory
from tfmis.data.patch_layout import (
    PatchArrays,
    arrays_dir,
    arrays_size,
    check_locations,
    layout_status,
    locations_file,
    training_cases,
    write_patch_layout,
)
from tfmis.data.pipeline import build_train_dataset
from tfmis.data.records import load_index, read_record, split_cases
from tfmis.errors import ConfigError
from tfmis.transforms.augment import window

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def layout_dataset(converted_dataset, tmp_path) -> Path:
    """A private copy of the session's converted dataset (so each test writes its own arrays)."""
    import shutil

    copy = tmp_path / "tfrecords"
    shutil.copytree(converted_dataset, copy, ignore=shutil.ignore_patterns("arrays"))
    return copy


def _write(dataset: Path, seed: int = 0, max_per_class: int = 20000) -> dict:
    index = load_index(dataset)
    return write_patch_layout(
        dataset, training_cases(dataset, "train"), len(index["source"]["labels"]), max_per_class, seed
    )


def _assert_arrays_equal_records(dataset: Path, cases: list[str]) -> None:
    """Every training case's whole-volume window from `PatchArrays` equals its current record, image and label."""
    _assert_arrays_equal_records_of(dataset, "train", cases)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        [
            "pipeline.augment.rotate_prob=0.5",
            "pipeline.augment.scale_prob=0.5",
            "pipeline.augment.elastic_prob=0.3",
            "pipeline.class_ratios=[1,2,3]",
            "pipeline.max_foreground_indices=50",  # classes subsampled: the locations keep the same 50
        ],
        ["pipeline.augment.placement=step", "pipeline.patch_size=[24,16,20]", "pipeline.augment.rot90_prob=0"],
    ],
    ids=[
        "flips-intensity",
        "rotation-scaling-elastic-class-ratios-subsampled",
        "placement-step-patch-beyond-the-volume",
    ],
)
def test_patch_read_stream_equals_the_memory_cache_stream_batch_for_batch(layout_dataset, tmp_path, overrides):
    """With pipeline.deterministic and the same seed, cache: patches yields exactly cache: memory's batches over three
    epochs of reshuffled volumes: the same crop centres (class locations indexed when the arrays were written, the
    background draws looking up the memory-mapped labels), the same windows (zeros outside a volume smaller than the
    patch), the same augmentation (with the spatial ones, the window resampled as in its volume)."""
    base = ["pipeline.patch_size=[12,12,12]", "pipeline.num_crops_per_image=3", "pipeline.shuffle_volumes=4"]
    memory = tiny_config(layout_dataset, tmp_path, *base, *overrides)
    patches = tiny_config(layout_dataset, tmp_path, *base, *overrides, "pipeline.cache=patches")
    with pytest.raises(Exception, match="has no patch-read arrays"):
        build_train_dataset(patches)
    _write(layout_dataset, max_per_class=patches.pipeline.max_foreground_indices)
    a, b = build_train_dataset(memory), build_train_dataset(patches)
    assert a.element_spec == b.element_spec
    batches = 3 * 6 * 3 // 2  # three epochs: 6 volumes x 3 crops, batch 2
    for x, y in zip(a.take(batches), b.take(batches)):
        for u, v in zip(x, y):
            np.testing.assert_array_equal(u.numpy(), v.numpy())


def test_a_window_reads_as_the_decoded_volume_window_inside_across_and_outside_the_edges(layout_dataset):
    """`PatchArrays.window` from the memory-mapped arrays equals `augment.window` on the decoded record (float16
    image to float32, uint8 label) for a window inside, across each edge, larger than the volume, and wholly outside;
    `labels_at` gives the record's labels; the locations are the classes' voxels."""
    _write(layout_dataset)
    index = load_index(layout_dataset)
    cases = training_cases(layout_dataset, "train")
    arrays = PatchArrays(layout_dataset, cases)
    for number in (0, 3):
        record = read_record(layout_dataset, "train", number)
        assert record["case_id"] == cases[number]
        volume = tf.cast(tf.constant(record["image"]), tf.float32)
        label = tf.constant(record["label"])
        shape = np.array(record["label"].shape)
        for origin, size in [
            ([2, 3, 1], [8, 8, 8]),
            ([-5, 10, -2], [12, 12, 12]),
            ([shape[0] - 4, -3, shape[2] - 6], [10, 9, 11]),
            ([-4, -4, -4], list(shape + 8)),
            ([shape[0] + 2, 0, 0], [4, 4, 4]),
        ]:
            want_image, want_label = window(volume, label, tf.constant(origin), size)
            got_image, got_label = arrays.window(number, origin, size)
            assert got_image.dtype == np.float32 and got_label.dtype == np.uint8
            np.testing.assert_array_equal(got_image, want_image.numpy())
            np.testing.assert_array_equal(got_label, want_label.numpy())
        indices = np.argwhere(np.ones(shape, bool))[::37].astype(np.int32)
        np.testing.assert_array_equal(arrays.labels_at(number, indices), record["label"][tuple(indices.T)])
        fg, fg_class = arrays.locations(number)
        assert len(fg) == int((record["label"] > 0).sum())  # fewer than max_per_class: every foreground voxel
        np.testing.assert_array_equal(record["label"][tuple(fg.T)], fg_class)
    assert len(index["source"]["labels"]) == 3


def test_writing_the_arrays_resumes_rewrites_a_reconverted_case_and_reindexes_only_the_locations(layout_dataset):
    """A second writing writes nothing; a case without its manifest (a writer stopped mid-case, its .npy files left
    behind) and a case whose record moved (a new conversion) are written again, the others left alone; another
    training seed indexes its own class locations only, beside the first seed's, which a run of that seed goes on
    reading unchanged; the arrays always equal the records."""
    cases = training_cases(layout_dataset, "train")
    first = _write(layout_dataset)
    assert first["written"] == len(cases) == 6 and first["bytes"] > 0
    assert _write(layout_dataset)["written"] == 0
    folder = arrays_dir(layout_dataset)
    (folder / f"{cases[1]}.json").unlink()  # stopped before its manifest
    manifest = json.loads((folder / f"{cases[4]}.json").read_text())
    manifest["record"]["offset"] += 1  # index.json now places the case elsewhere
    (folder / f"{cases[4]}.json").write_text(json.dumps(manifest))
    stamps = {c: (folder / f"{c}.image.npy").stat().st_mtime_ns for c in cases}
    status = layout_status(layout_dataset, cases, 20000, 0)
    assert sorted(status["missing"]) == sorted([cases[1], cases[4]]) and len(status["done"]) == 4
    again = _write(layout_dataset)
    assert again["written"] == 2 and again["relocated"] == 0
    for c in cases:
        changed = (folder / f"{c}.image.npy").stat().st_mtime_ns != stamps[c]
        assert changed == (c in (cases[1], cases[4])), c
    seed0 = {c: locations_file(folder, c, 20000, 0).read_bytes() for c in cases}
    reading = PatchArrays(layout_dataset, cases)
    check_locations(reading, 20000, 0)  # a run of seed 0, reading while a run of seed 5 indexes its own
    other_seed = _write(layout_dataset, seed=5)
    assert other_seed["written"] == 0 and other_seed["relocated"] == len(cases)
    assert all(locations_file(folder, c, 20000, 0).read_bytes() == seed0[c] for c in cases)  # left alone
    assert all(locations_file(folder, c, 20000, 5).is_file() for c in cases)
    assert layout_status(layout_dataset, cases, 20000, 0)["done"] == cases  # both sets indexed
    for number, case_id in enumerate(cases):
        with np.load(locations_file(folder, case_id, 20000, 0)) as stored:
            np.testing.assert_array_equal(reading.locations(number)[0], stored["fg"])
    _assert_arrays_equal_records(layout_dataset, cases)
    assert not list(folder.glob("*.tmp*")) and not list(folder.glob(".*"))


@pytest.fixture
def larger_dataset(tmp_path) -> Path:
    """A converted dataset of 8 training cases of 96 x 96 x 80 (2 channels): a case takes a writer long enough to be
    killed between two cases."""
    from tests.conftest import make_msd_dataset
    from tfmis.data.conversion_options import ConversionConfig
    from tfmis.data.convert import convert

    source = make_msd_dataset(tmp_path / "Task98_Larger", num_cases=10, shape=(96, 96, 80))
    target = tmp_path / "larger"
    convert(ConversionConfig(str(source), str(target), split=(0.8, 0.2), shards=2, workers=1, progress=False))
    return target


def test_a_writer_killed_mid_way_leaves_whole_files_and_the_rerun_completes(larger_dataset):
    """A real writing process SIGKILLed after its first case leaves no partial array under a final name (each file
    is renamed when whole); the rerun writes only the cases it had not finished and the arrays equal the records."""
    layout_dataset = larger_dataset
    cases = training_cases(layout_dataset, "train")
    folder = arrays_dir(layout_dataset)
    script = (
        "import sys; from tests.test_patch_layout import _write; from pathlib import Path; _write(Path(sys.argv[1]))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    process = subprocess.Popen([sys.executable, "-c", script, str(layout_dataset)], cwd=REPO, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(folder.glob("*.json")):
        time.sleep(0.02)
    process.kill()
    process.wait()
    finished = {p.stem for p in folder.glob("*.json")}
    assert finished and len(finished) < len(cases), "kill the writer between its first and its last case"
    rerun = _write(layout_dataset)
    assert rerun["written"] == len(cases) - len(finished)
    arrays = PatchArrays(layout_dataset, cases)
    for number in range(len(cases)):
        record = read_record(layout_dataset, "train", number)
        image, label = arrays.window(number, [0, 0, 0], record["label"].shape)
        np.testing.assert_array_equal(image, record["image"].astype(np.float32))
        np.testing.assert_array_equal(label, record["label"])


def test_the_input_says_what_it_holds_and_refuses_a_memory_cache_above_its_budget(layout_dataset, tmp_path):
    """cache: memory holds every decoded training and validation volume: what it says it holds is the bytes of the
    records decoded here, one by one (image and label arrays as `read_record` gives them); above
    pipeline.memory_budget it is one ConfigError naming cache=patches, and so is a partial cache whose bound (cached,
    read-ahead and in-flight volumes) is above it."""
    index = load_index(layout_dataset)
    decoded = 0
    for split in ("train", "val"):
        for number in range(len(split_cases(index, split))):
            record = read_record(layout_dataset, split, number)
            decoded += record["image"].nbytes + record["label"].nbytes
    assert decoded > 0
    memory = tiny_config(layout_dataset, tmp_path, "pipeline.memory_budget=1GB")
    held = check_input_memory(memory, index)
    assert held["held_mb"] == pytest.approx(decoded / 2**20) and held["fits"] and "budget 1,024 MB" in held["line"]
    budget = f"pipeline.memory_budget={decoded / 2**20 / 2:.3f}MB"
    with pytest.raises(ConfigError, match=r"pipeline.cache=memory would hold .* set pipeline.cache=patches"):
        check_input_memory(tiny_config(layout_dataset, tmp_path, budget), index)
    partial = tiny_config(layout_dataset, tmp_path, budget, "pipeline.cache=partial", "pipeline.cache_num=4")
    with pytest.raises(ConfigError, match=r"pipeline.cache=partial would hold .* lower pipeline.cache_num"):
        check_input_memory(partial, index)  # 4 cached + 1 read ahead + in flight: all 6 training volumes


_PATCH_INPUT_MEASURED = """
import json, sys, threading, time
from tfmis.config import load_config
from tfmis.data.memory_budget import input_memory
from tfmis.data.pipeline import build_train_dataset
from tfmis.data.records import load_index
from tfmis.hardware.processes import process_status_mb


def measure(path, batches):
    config = load_config(path)
    held = input_memory(config, load_index(config.data.dataset_dir))
    dataset = build_train_dataset(config)
    base = process_status_mb("self", "RssAnon")  # the interpreter, TensorFlow, the traced pipeline: nothing read
    peak, done = [base], threading.Event()

    def poll():
        while not done.is_set():
            peak[0] = max(peak[0], process_status_mb("self", "RssAnon"))
            time.sleep(0.002)

    thread = threading.Thread(target=poll)
    thread.start()
    for _ in dataset.take(batches):
        pass
    done.set()
    thread.join()
    return {"held_mb": held["held_mb"], "above_mb": peak[0] - base, "line": held["line"]}


print(json.dumps([measure(path, int(sys.argv[1])) for path in sys.argv[2:]]))
"""


def test_the_patch_read_input_holds_what_it_counts_measured_on_its_own_pipeline(layout_dataset, tmp_path):
    """cache: patches holds crops only, whatever the volumes, and what it says it holds is measured: the real
    pipeline alone (no model) in its own process, 60 batches of 16³ crops, then 60 of 96³ (flips, quarter turns,
    intensity), the process's peak anonymous memory (RssAnon, polled every 2 ms) above its own before the first batch.
    The 16³ run is the pipeline's fixed cost, which the count leaves out (tf.data's iterator and threads: 16-17 MB
    measured, of which the count's 16³ crops are 1.7 MB, beside its bound of the class locations loaded, which these
    tiny cases do not reach); the 96³ run's memory above it is between 0.9 and 1.15 of
    the count's increase (366 MB on 2 CPUs: the windows, the augmentation copies, the shuffled and batched crops).
    Measured on a busy 2-core machine over 21 runs: 0.948-1.025, and 1.066 beside another test worker (the count is
    the buffers at their fullest; tf.data's short-lived copies, a batch being assembled beside its crops, pass it by
    up to 7 %: the count is not yet a strict bound); a count more than 10 % over or 15 % under the measure fails.
    The small run goes first: memory the large pipeline freed would be reused by a later one without showing."""
    from tfmis.config import save_config

    configs = []
    for size in (16, 96):
        config = tiny_config(layout_dataset, tmp_path, "pipeline.cache=patches", f"pipeline.patch_size={[size] * 3}")
        configs.append(tmp_path / f"patches{size}.yaml")
        save_config(config, configs[-1])
    _write(layout_dataset, max_per_class=config.pipeline.max_foreground_indices, seed=config.training.seed)
    script = tmp_path / "patch_input_measured.py"
    script.write_text(_PATCH_INPUT_MEASURED)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(
        [sys.executable, str(script), "60", *map(str, configs)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    small, large = json.loads(done.stdout.strip().splitlines()[-1])
    from tfmis.data.patch_layout import LOCATION_CASES

    classes = len(load_index(layout_dataset)["source"]["labels"])
    locations = LOCATION_CASES * 16 * config.pipeline.max_foreground_indices * (classes - 1) / 2**20  # their bound
    assert f"class locations of {locations:.1f} MB" in small["line"], small["line"]
    assert "no volume" in large["line"] and small["held_mb"] - locations < 2 and large["held_mb"] > 300, (small, large)
    assert small["above_mb"] < 64, small  # the fixed cost is small beside what 96³ crops hold
    ratio = (large["above_mb"] - small["above_mb"]) / (large["held_mb"] - small["held_mb"])
    assert 0.9 <= ratio <= 1.15, (ratio, small, large)


def test_training_with_a_memory_cache_above_its_budget_exits_2_in_one_line(layout_dataset, tmp_path):
    """The real command: `python -m tfmis.train` with cache: memory and a budget below the decoded volumes prints
    one `config error` line naming pipeline.cache=patches, exit 2, no traceback, before any epoch."""
    config = tiny_config(layout_dataset, tmp_path / "run", "pipeline.memory_budget=0.01MB")
    from tfmis.config import save_config

    save_config(config, tmp_path / "config.yaml")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(
        [sys.executable, "-m", "tfmis.train", "--config", str(tmp_path / "config.yaml")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "epoch 1" not in done.stdout
    errors = [line for line in done.stderr.splitlines() if "pipeline.cache=memory would hold" in line]
    assert len(errors) == 1 and "pipeline.cache=patches" in errors[0]


@pytest.mark.slow
def test_training_with_cache_patches_writes_the_arrays_and_trains(layout_dataset, tmp_path):
    """`python -m tfmis.train` with cache: patches on a converted dataset: says what it holds, writes the training
    cases' arrays at start, trains its epochs, and a second run reuses the arrays (0 written)."""
    from tfmis.config import save_config

    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    outputs = []
    for run in ("a", "b"):
        config = tiny_config(layout_dataset, tmp_path / run, "pipeline.cache=patches")
        save_config(config, tmp_path / f"{run}.yaml")
        done = subprocess.run(
            [sys.executable, "-m", "tfmis.train", "--config", str(tmp_path / f"{run}.yaml")],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(done.stderr)
        assert json.loads((tmp_path / run / "summary.json").read_text())["epochs"] == 2
    assert "Input memory:" in outputs[0] and "no volume" in outputs[0]
    assert "Patch-read arrays: 6 training cases" in outputs[0] and "(6 written" in outputs[0]
    assert "(0 written" in outputs[1]


def test_planner_picks_the_patch_layout_when_the_decoded_volumes_do_not_fit():
    """The plan's pipeline.cache is memory while the decoded volumes (float16 image, uint8 label) fit in 30% of the
    available memory, patches when they do not, with both sizes in the plan's reason."""
    from tests.test_plan import _fingerprint
    from tfmis.hardware import Hardware
    from tfmis.planning import make_plan

    fp = _fingerprint([[0.8, 0.8, 2.5]] * 20, [[512, 512, 300]] * 20)  # ~30 GB decoded at its own spacing
    small = Hardware(cpu_name="test cpu", cpu_count=2, host_memory_mb=24000, host_available_mb=20000)
    large = Hardware(cpu_name="test cpu", cpu_count=2, host_memory_mb=512000, host_available_mb=500000)
    for hardware, cache in ((small, "patches"), (large, "memory")):
        plan = make_plan(fp, hardware)
        assert plan.values["pipeline.cache"] == cache
        reason = plan.reasons["pipeline.cache"]
        assert f"{hardware.host_available_mb / 1024:.1f} GB available" in reason
        assert plan.config().pipeline.cache == cache


@pytest.mark.slow
def test_convert_with_patch_layout_writes_the_arrays_of_every_labelled_case_once(tmp_path):
    """`tfmis-convert --patch-layout` (the real command) writes arrays and manifests for every labelled case (not the
    unlabelled test cases), says so in one line, and a rerun writes none again."""
    from tests.conftest import make_msd_dataset

    source = make_msd_dataset(tmp_path / "Task97_Convert", num_cases=5)
    target = tmp_path / "converted"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    command = [sys.executable, "-m", "tfmis.convert", "--source-dir", str(source), "--target-dir", str(target)]
    lines = []
    for _ in range(2):
        done = subprocess.run(
            [*command, "--patch-layout", "--quiet"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        lines.append([line for line in done.stdout.splitlines() if line.startswith("Patch-read arrays:")])
    index = load_index(target)
    labelled = sorted(c["case_id"] for c in index["cases"].values() if c.get("label"))
    assert len(labelled) == 5
    assert sorted(p.name.removesuffix(".json") for p in arrays_dir(target).glob("*.json")) == labelled
    assert len(lines[0]) == 1 and "5 cases" in lines[0][0] and "(5 written" in lines[0][0]
    assert "(0 written" in lines[1][0]


def write_large_label_dataset(root: Path, cases: int, shape=(384, 384, 160), suffix: str = ".nii.gz") -> Path:
    """An MSD CT dataset whose label box covers most of each volume (so the conversion keeps it nearly whole): int16
    HU with a noisy labelled organ filling all but a 16-voxel border; `suffix=".nii"` writes the files uncompressed
    (for tests where gzip's time is not what they measure)."""
    import nibabel as nib

    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    rng = np.random.default_rng(0)
    affine = np.diag([-0.8, -0.8, 2.5, 1.0])
    training = []
    for i in range(cases):
        case_id = f"ct_{i:03d}"
        image = np.full(shape, -1000, np.int16)
        label = np.zeros(shape, np.uint8)
        organ = tuple(slice(16, s - 16) for s in shape)
        label[organ] = 1
        label[organ][::7] = 0  # background inside the box, for the background crops
        image[organ] = 60 + rng.integers(-40, 40, label[organ].shape, dtype=np.int16)
        nib.save(nib.Nifti1Image(image, affine), root / "imagesTr" / f"{case_id}{suffix}")
        nib.save(nib.Nifti1Image(label, affine), root / "labelsTr" / f"{case_id}{suffix}")
        training.append({"image": f"./imagesTr/{case_id}{suffix}", "label": f"./labelsTr/{case_id}{suffix}"})
    meta = {"name": root.name, "modality": {"0": "CT"}, "labels": {"0": "background", "1": "organ"}}
    meta.update({"numTraining": cases, "training": training, "test": []})
    (root / "dataset.json").write_text(json.dumps(meta))
    return root


def _run_measured(limit_mb: float, args: list[str], timeout: float = 900) -> tuple[int, str, float]:
    """`python -m args` in a new memory cgroup of `limit_mb` (`run_measured`): (exit code, stderr, peak anonymous
    MB); skips the test where no cgroup can be made, fails there in CI (tests/conftest.py)."""
    from tests.test_case_memory import run_measured

    try:
        code, _, err, peak = run_measured(limit_mb, [sys.executable, "-m", *args], REPO, timeout)
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here (root and a writable cgroup memory controller): {e}")
    return code, err, peak


@pytest.mark.slow
def test_in_a_memory_limit_the_patch_read_input_trains_where_a_memory_cache_would_not_fit(tmp_path):
    """A real 1000 MB memory cgroup and a dataset whose decoded volumes (36 CT cases, ~413 MB) do not fit beside a
    training process in it:
    - `cache: patches` writes the arrays and trains (exit 0), its anonymous memory staying under the limit, and says
      its budget, read from the cgroup (at most half the limit);
    - `cache: memory` is refused at start, one line, exit 2, by that budget;
    - the same memory cache with the budget lifted, measured without the limit, needs more than the limit (so the
      refusal spared a kill) and holds at least half the decoded size more than the patch-read run."""
    from tfmis.config import save_config
    from tfmis.data.conversion_options import ConversionConfig
    from tfmis.data.convert import convert

    # uncompressed files and records: gzip's time (20 s writing, 20 s converting) is not what this test measures
    source = write_large_label_dataset(tmp_path / "Task96_Limit", 36, shape=(256, 256, 112), suffix=".nii")
    dataset = tmp_path / "converted"
    convert(
        ConversionConfig(
            str(source), str(dataset), split=(0.9, 0.1), shards=2, workers=2, progress=False, compression="NONE"
        )
    )
    decoded = input_memory(tiny_config(dataset, tmp_path), load_index(dataset))["held_mb"]
    assert decoded > 350
    # one validation, after the last of the 2 epochs (each takes ~7 s of whole 256x256x112 cases)
    fast_validation = ["validation.roi_size=[48,48,48]", "validation.overlap=0", "validation.val_interval=2"]
    arms = {
        "patches": ["pipeline.cache=patches"],
        "memory": [],
        "memory-unbounded": ["pipeline.memory_budget=100GB"],
    }
    for name, overrides in arms.items():
        save_config(tiny_config(dataset, tmp_path / name, *fast_validation, *overrides), tmp_path / f"{name}.yaml")
    limit = 1000.0
    code, err, patches_peak = _run_measured(limit, ["tfmis.train", "--config", str(tmp_path / "patches.yaml")])
    assert code == 0, err[-3000:]
    assert patches_peak < limit
    budget = [line for line in err.splitlines() if line.startswith("Input memory:")]
    assert len(budget) == 1 and "no volume" in budget[0]
    assert float(budget[0].rsplit("budget ", 1)[1].split()[0].replace(",", "")) <= limit / 2
    code, err, _ = _run_measured(limit, ["tfmis.train", "--config", str(tmp_path / "memory.yaml")])
    refused = [line for line in err.splitlines() if "pipeline.cache=memory would hold" in line]
    assert code == 2 and len(refused) == 1 and "Traceback" not in err, err[-3000:]
    code, err, memory_peak = _run_measured(8000, ["tfmis.train", "--config", str(tmp_path / "memory-unbounded.yaml")])
    assert code == 0, err[-3000:]
    assert memory_peak > limit and memory_peak > patches_peak + decoded / 2, (memory_peak, patches_peak, decoded)


def test_patch_readers_shrink_to_the_budget_and_a_window_too_large_for_one_reader_is_refused(layout_dataset, tmp_path):
    """With rotation, a 64³ patch reads windows larger than the patch: the readers drop (at least one) until their
    windows fit pipeline.memory_budget, what they hold stays within it while more than one reads, and a budget
    below one reader's windows is one ConfigError naming enlarge_crop and the patch size."""
    from tfmis.data.memory_budget import patch_input

    index = load_index(layout_dataset)
    spatial = ["pipeline.cache=patches", "pipeline.patch_size=[64,64,64]", "pipeline.augment.rotate_prob=0.2"]
    config = tiny_config(layout_dataset, tmp_path, *spatial)
    plans = {budget: patch_input(config.pipeline, 2, 1, budget) for budget in (1e6, 300.0, 150.0, 1.0)}
    readers = [plans[b]["readers"] for b in (1e6, 300.0, 150.0, 1.0)]
    assert readers == sorted(readers, reverse=True) and readers[0] > readers[2] and readers[-1] == 1
    assert plans[1e6]["window_mb"] > 64**3 * 9 / 2**20  # the window is larger than the patch
    for budget, plan in plans.items():
        assert plan["held_mb"] <= budget or plan["readers"] == 1
    tight = tiny_config(layout_dataset, tmp_path, *spatial, "pipeline.memory_budget=1MB")
    with pytest.raises(ConfigError, match=r"pipeline.cache=patches would hold .*enlarge_crop=false"):
        check_input_memory(tight, index)


_PIPELINE_ALONE = """
import json, sys
from tfmis.config import load_config
from tfmis.data.memory_budget import input_memory
from tfmis.data.pipeline import build_train_dataset
from tfmis.data.records import load_index
from tfmis.hardware.processes import process_status_mb

config = load_config(sys.argv[1])
held = input_memory(config, load_index(config.data.dataset_dir))
dataset = build_train_dataset(config)
base = process_status_mb("self", "RssAnon")  # interpreter, TensorFlow, the traced pipeline, nothing read yet
for _ in dataset.take(int(sys.argv[2])):
    pass
print(json.dumps({"held_mb": held["held_mb"], "base_mb": base, "line": held["line"]}))
"""


# the memory of the pipeline-alone run the patch-read input does not count, on top of its process's own before the
# first batch: the pipeline's fixed cost (tf.data's iterator and threads, ~16 MB measured on 16³ crops) and what
# the count's buffers pass it by at their fullest (up to 2.5% of it measured, 9 MB of 366)
UNCOUNTED_MB = 64


@pytest.mark.slow
def test_rotation_and_scaling_in_tf_data_stay_within_what_the_patch_read_input_counts(tmp_path):
    """The pipeline alone (no model) with every crop rotated and scaled in tf.data from the patch-read arrays, 96³
    patches from 6 CT-size cases, over 40 batches in a real memory cgroup whose limit is what the run is counted to
    need: its process's own memory before the first batch (the same script run first with no batch: the interpreter,
    TensorFlow, the traced pipeline; 313 MB measured) plus what the input says it holds (1,178 MB on 2 CPUs: the
    windows, one resampling per usable CPU with its buffers, the batched crops; pipeline.memory_budget set, so the
    count does not shrink with the limit) plus `UNCOUNTED_MB`. It finishes (an input holding more than it counts is
    killed at the limit), and the cgroup's peak anonymous memory above the process's own before its first batch is
    within the count and above a third of it (measured: 583 of 1,178 MB; the count takes each window whole, while
    rotation reads only the box its draws sample)."""
    from tfmis.config import save_config
    from tfmis.data.conversion_options import ConversionConfig
    from tfmis.data.convert import convert
    from tfmis.data.patch_layout import training_cases, write_patch_layout

    source = write_large_label_dataset(tmp_path / "Task95_Rotate", 6, shape=(192, 192, 96))
    dataset = tmp_path / "converted"
    convert(ConversionConfig(str(source), str(dataset), split=(1.0, 0.0), shards=1, workers=2, progress=False))
    config = tiny_config(
        dataset,
        tmp_path,
        "pipeline.cache=patches",
        "pipeline.patch_size=[96,96,96]",
        "pipeline.augment.rotate_prob=1.0",
        "pipeline.augment.scale_prob=1.0",
        "pipeline.num_images_per_batch=2",
        "pipeline.memory_budget=4GB",
    )
    write_patch_layout(dataset, training_cases(dataset, "train"), 2, config.pipeline.max_foreground_indices, 0)
    save_config(config, tmp_path / "rotate.yaml")
    held = input_memory(config, load_index(dataset))["held_mb"]
    assert held > 500
    script = tmp_path / "pipeline_alone.py"
    script.write_text(_PIPELINE_ALONE)
    command = [sys.executable, str(script), str(tmp_path / "rotate.yaml")]
    from tests.test_case_memory import run_measured

    try:
        code, out, err, _ = run_measured(held + 2000, [*command, "0"], REPO)  # no batch: the process's own memory
        assert code == 0, err[-3000:]
        own = json.loads(out.strip().splitlines()[-1])["base_mb"]
        limit = own + held + UNCOUNTED_MB
        code, out, err, peak = run_measured(limit, [*command, "40"], REPO)
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here (root and a writable cgroup memory controller): {e}")
    assert code == 0, f"exit {code} in a limit of {limit:.0f} MB (own {own:.0f} + count {held:.0f}): {err[-3000:]}"
    result = json.loads(out.strip().splitlines()[-1])
    assert "augmentations of" in result["line"] and result["held_mb"] == pytest.approx(held)
    assert held / 3 <= peak - result["base_mb"] <= held, (peak, limit, result)


def _ct_source(root: Path) -> Path:
    """A small CT set (int16 HU-like intensities, one channel, 5 labelled cases)."""
    from tests.conftest import make_msd_dataset

    return make_msd_dataset(root, num_cases=5, channels=1, modalities={"0": "CT"})


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB", "NONE"])
def test_a_reconversion_with_another_ct_window_rewrites_every_case_and_stale_arrays_are_refused(tmp_path, compression):
    """A real reconversion into the same folder that changes only the CT window (no foreground crop, so every
    record keeps its length and offset, as a CT's body box does): `--overwrite` removes the old arrays with the old
    records, the arrays written afterwards equal the new records case for case, and arrays left from the first
    conversion (put back by hand) are found stale (`layout_status`) and refused by `PatchArrays` in one line naming
    the case and the fix."""
    import shutil

    from tfmis.data.conversion_options import ConversionConfig
    from tfmis.data.convert import convert
    from tfmis.errors import DataError

    source, target = _ct_source(tmp_path / "Task98_CT"), tmp_path / "converted"

    def convert_with(window, overwrite=False):
        config = ConversionConfig(
            str(source), str(target), split=(0.8, 0.2), shards=1, workers=1, progress=False,
            compression=compression, ct_window=window, overwrite=overwrite, crop_foreground=False,
        )  # fmt: skip
        index = convert(config)
        cases = training_cases(target, "train")
        write_patch_layout(target, cases, len(index["source"]["labels"]), 20000, 0)
        return index, cases

    first, cases = convert_with([-100, 200])
    old = tmp_path / "old_arrays"
    shutil.copytree(arrays_dir(target), old)
    second, again = convert_with([0, 100], overwrite=True)
    assert again == cases
    for case_id in cases:  # the place is the same, the content is not: only the digest tells them apart
        a, b = first["cases"][case_id], second["cases"][case_id]
        assert (a["offset"], a["length"]) == (b["offset"], b["length"]) and a["sha256"] != b["sha256"], case_id
    _assert_arrays_equal_records(target, cases)
    stale = cases[1]
    for suffix in (".image.npy", ".json"):  # the first conversion's arrays of one case, back in place
        shutil.copy(old / f"{stale}{suffix}", arrays_dir(target) / f"{stale}{suffix}")
    assert layout_status(target, cases, 20000, 0)["missing"] == [stale]
    with pytest.raises(DataError) as refused:
        PatchArrays(target, cases)
    message = str(refused.value)
    assert f"case {stale!r}" in message and "tfmis-convert --patch-layout" in message and "\n" not in message


def test_the_writer_refuses_a_record_changed_after_its_conversion_naming_the_shard(tmp_path):
    """The writer reads records without TensorFlow (and so without its CRC check): a byte of an uncompressed shard
    changed inside a record's image after conversion is refused by the record's sha256 in index.json, in one line
    naming the shard and the fix; the cases before it in the shard are written, the changed one is not."""
    from tfmis.data.conversion_options import ConversionConfig
    from tfmis.data.convert import convert
    from tfmis.errors import DataError

    source, target = _ct_source(tmp_path / "Task98_CT"), tmp_path / "converted"
    index = convert(ConversionConfig(str(source), str(target), split=(0.8, 0.2), shards=1, workers=1, progress=False,
                                     compression="NONE"))  # fmt: skip
    cases = training_cases(target, "train")
    changed = index["cases"][cases[2]]
    shard = target / changed["file"]
    data = bytearray(shard.read_bytes())
    middle = changed["offset"] + 12 + changed["length"] // 2  # past the 12-byte record header, inside the image
    data[middle] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError) as refused:
        write_patch_layout(target, cases, len(index["source"]["labels"]), 20000, 0)
    message = str(refused.value)
    assert str(shard) in message and "sha256" in message and "convert the dataset again" in message
    assert "\n" not in message
    written = sorted(p.name.removesuffix(".json") for p in arrays_dir(target).glob("*.json"))
    before = sorted(c for c in cases if index["cases"][c]["offset"] < changed["offset"])
    assert written == before and cases[2] not in written


def test_open_array_files_stay_bounded_by_the_least_recently_used_cases(layout_dataset):
    """`PatchArrays(max_open=2)` over the real arrays: reading every case in turn keeps at most 2 cases' files (4
    file descriptors) open and the class locations of at most `LOCATION_CASES` cases loaded, a case read again
    after its files were closed reads the same window, and the most recently used case stays open."""
    from tfmis.data.patch_layout import LOCATION_CASES

    _write(layout_dataset)
    cases = training_cases(layout_dataset, "train")
    arrays = PatchArrays(layout_dataset, cases, max_open=2)
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    before = fds()
    first = arrays.window(0, [2, 3, 1], [8, 8, 8])
    for number in range(len(cases)):
        arrays.window(number, [0, 0, 0], [4, 4, 4])
        arrays.locations(number)
        assert arrays.open_cases <= 2 and fds() - before <= 4
        assert arrays.loaded_locations == min(number + 1, LOCATION_CASES)
    again = arrays.window(0, [2, 3, 1], [8, 8, 8])
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])
    assert list(arrays._files) == [len(cases) - 1, 0]


def test_a_thousand_cases_read_under_ulimit_256_open_files(tmp_path):
    """1,200 cases of real patch-read arrays (each a converted case's arrays under another case id, as
    `write_patch_layout` names them) read one window each, in a subprocess whose open-file limit is 256: no
    `Too many open files`, and at most `MAX_OPEN_CASES` cases' files open at the end. Under a limit of 100 the open
    cases shrink to what fits beside the files already open; under 40 `PatchArrays` refuses in one line with the fix."""
    import shutil

    from tests.conftest import make_msd_dataset
    from tfmis.data.conversion_options import ConversionConfig
    from tfmis.data.convert import convert

    source = make_msd_dataset(tmp_path / "Task96_Many", num_cases=2, shape=(12, 12, 10))
    target = tmp_path / "converted"
    index = convert(ConversionConfig(str(source), str(target), split=(1.0, 0.0), shards=1, workers=1, progress=False))
    cases = training_cases(target, "train")
    write_patch_layout(target, cases, len(index["source"]["labels"]), 20000, 0)
    folder, many = arrays_dir(target), []
    for number in range(1200):  # the index and the manifests name each copy as its own case
        case_id, original = f"copy_{number:04d}", cases[number % len(cases)]
        for suffix in (".image.npy", ".label.npy", ".locations-s0-n20000.npz"):
            shutil.copy(folder / f"{original}{suffix}", folder / f"{case_id}{suffix}")
        manifest = json.loads((folder / f"{original}.json").read_text())
        (folder / f"{case_id}.json").write_text(json.dumps({**manifest, "case_id": case_id}))
        index["cases"][case_id] = {**index["cases"][original], "case_id": case_id}
        many.append(case_id)
    (target / "index.json").write_text(json.dumps(index))
    (tmp_path / "cases.json").write_text(json.dumps(many))

    def read_all(limit: int) -> subprocess.CompletedProcess:
        script = (
            "import resource, sys, json\n"
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))\n"
            "from tfmis.data.patch_layout import PatchArrays, MAX_OPEN_CASES\n"
            f"cases = json.loads(open({str(tmp_path / 'cases.json')!r}).read())\n"
            f"arrays = PatchArrays({str(target)!r}, cases)\n"
            "for case in range(len(arrays.case_ids)):\n"
            "    arrays.window(case, [1, 1, 1], [6, 6, 6])\n"
            "print(json.dumps({'open': arrays.open_cases, 'max': MAX_OPEN_CASES}))\n"
        )
        return subprocess.run(
            [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip

    done = read_all(256)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["open"] == result["max"] == 64
    tight = read_all(100)
    assert tight.returncode == 0, tight.stderr[-2000:]
    assert 1 <= json.loads(tight.stdout.strip().splitlines()[-1])["open"] < 18  # (100 - open files - 64) / 2
    refused = read_all(40)
    assert refused.returncode != 0 and "the open-file limit 40 leaves no room" in refused.stderr
    assert "ulimit -n 4096" in refused.stderr.strip().splitlines()[-1]


def test_the_arrays_size_is_what_is_written_and_a_disk_too_small_is_refused_before_writing(layout_dataset):
    """`arrays_size` of the training cases' index entries equals the bytes of the `.npy` arrays `write_patch_layout`
    then writes, less their headers (128 bytes each); a need larger than the disk under the folder (cases of
    10^5 voxels a side on this real disk) is refused by `check_free_space` in one line naming the folder, both
    sizes and the fix."""
    from tfmis.data.patch_layout import arrays_size, check_free_space
    from tfmis.errors import ResourceError

    index = load_index(layout_dataset)
    cases = training_cases(layout_dataset, "train")
    entries = [index["cases"][c] for c in cases]
    need = arrays_size(entries, index["preprocessing"]["image_dtype"])
    _write(layout_dataset)
    folder = arrays_dir(layout_dataset)
    written = sum((folder / f"{c}{s}").stat().st_size - 128 for c in cases for s in (".image.npy", ".label.npy"))
    assert need == written
    huge = [{**entries[0], "image_shape": [100_000, 100_000, 100_000, 1]}]
    with pytest.raises(ResourceError) as refused:
        check_free_space(folder, huge, "float16")
    message = str(refused.value)
    assert message.startswith(f"{folder}: the patch-read arrays of 1 case(s) need ") and "GB free" in message
    assert "--target-dir on a larger disk" in message and "\n" not in message


def resident_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache now: mincore(2) over a map of it (mapping faults none in)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    with open(path, "rb") as f:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            vector = (ctypes.c_ubyte * pages)()
            if libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            libc.munmap(address, size)
    return sum(v & 1 for v in vector)


def _drop_from_page_cache(paths) -> None:
    os.sync()  # written pages are clean once on disk: only those can be dropped
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def test_reads_keep_their_pages_in_the_page_cache_only_without_drop_pages(layout_dataset):
    """Every training case read in 8³ windows over its whole volume, from arrays out of the page cache (mincore(2)
    counts each file's resident pages): without `drop_pages` the pages read stay cached (a later epoch reads
    memory); with it none of the arrays' pages is left (what a cgroup is charged for), and the windows are the
    same."""
    _write(layout_dataset)
    cases = training_cases(layout_dataset, "train")
    files = [arrays_dir(layout_dataset) / f"{c}{s}" for c in cases for s in (".image.npy", ".label.npy")]
    windows = {}
    for drop in (False, True):
        _drop_from_page_cache(files)
        assert sum(resident_pages(f) for f in files) == 0
        arrays = PatchArrays(layout_dataset, cases, drop_pages=drop)
        read = []
        for number in range(len(cases)):
            shape = arrays.shapes[number]
            for origin in np.ndindex(*[(int(n) + 7) // 8 for n in shape]):
                read.append(arrays.window(number, np.array(origin) * 8, [8, 8, 8]))
        windows[drop] = read
        resident = sum(resident_pages(f) for f in files)
        assert (resident == 0) if drop else resident >= len(files), (drop, resident)
    for (image, label), (image2, label2) in zip(windows[False], windows[True]):
        np.testing.assert_array_equal(image, image2)
        np.testing.assert_array_equal(label, label2)


def test_the_budget_is_measured_once_and_the_pipeline_uses_the_plan_its_line_printed(layout_dataset, tmp_path):
    """`pipeline.memory_budget: null`: the `Input memory:` line's budget, then 1 GB more of this process's memory
    used, then the pipeline's plan (`patch_read_plan`): the same budget and the same number of readers as the line
    (the budget was half the memory free at each call: two numbers); the arrays are read through the page cache
    when they fit beside the budget, with their pages dropped when they do not, and the line says which."""
    from tfmis.data.memory_budget import input_memory, patch_read_plan, pipeline_memory_budget

    _write(layout_dataset)
    index = load_index(layout_dataset)
    config = tiny_config(layout_dataset, tmp_path, "pipeline.cache=patches", "pipeline.memory_budget=null")
    held = input_memory(config, index)
    taken = np.ones(2**30 // 8)  # 1 GB touched: less memory free than when the line was made
    plan = patch_read_plan(config, index)
    assert pipeline_memory_budget(config.pipeline) == held["budget_mb"] and taken.sum() > 0
    assert f"per input pipeline {plan['readers']} readers" in held["line"]
    assert not plan["drop_pages"] and "the arrays read through the page cache" in held["line"]
    need = arrays_size([index["cases"][c] for c in training_cases(layout_dataset, "train")], "float16") / 2**20
    tight = tiny_config(
        layout_dataset, tmp_path, "pipeline.cache=patches", f"pipeline.memory_budget={plan['held_mb'] + need / 2}MB"
    )
    assert patch_read_plan(tight, index)["drop_pages"]
    assert "the arrays read with their pages dropped" in input_memory(tight, index)["line"]


def test_the_class_locations_loaded_stay_within_what_the_budget_counts(layout_dataset, tmp_path):
    """Every training case's class locations loaded in turn (indexed with up to 20,000 a class): the bytes of those
    loaded at any time stay within `patch_input`'s `locations_mb` for the dataset's classes."""
    from tfmis.data.memory_budget import patch_input

    _write(layout_dataset)
    index = load_index(layout_dataset)
    cases = training_cases(layout_dataset, "train")
    config = tiny_config(layout_dataset, tmp_path, "pipeline.cache=patches")
    counted = patch_input(config.pipeline, 2, 1, 1e6, 2, len(index["source"]["labels"]))["locations_mb"] * 2**20
    arrays = PatchArrays(layout_dataset, cases)
    for number in range(len(cases)):
        arrays.locations(number)
        loaded = sum(fg.nbytes + fg_class.nbytes for fg, fg_class in arrays._locations.values())
        assert 0 < loaded <= counted, (loaded, counted)


def test_a_k_fold_conversion_shares_the_arrays_of_the_train_val_conversion_of_the_same_data(tmp_path):
    """The same 6 cases converted as train/val (`<dir>`) and as 3 folds (`<dir>-folds3`, where cross-validation puts
    them): the fold conversion's layout links the arrays of the cases whose records have the same content (hard
    links: one inode, no second copy of their bytes) instead of writing them, and reads what its records hold;
    converting `<dir>` again (--overwrite) leaves the fold conversion's arrays as they were."""
    from tests.conftest import make_msd_dataset
    from tfmis.data.conversion_options import ConversionConfig
    from tfmis.data.convert import convert

    source = make_msd_dataset(tmp_path / "Task95_Shared", num_cases=6, shape=(20, 18, 12))
    plain, folded = tmp_path / "tfrecords", tmp_path / "tfrecords-folds3"
    index = convert(ConversionConfig(str(source), str(plain), split=(0.5, 0.5), workers=1, progress=False))
    convert(ConversionConfig(str(source), str(folded), folds=3, split=None, workers=1, progress=False))
    classes = len(index["source"]["labels"])
    plain_cases = training_cases(plain, "train")
    write_patch_layout(plain, plain_cases, classes, 20000, 0)
    fold_cases = training_cases(folded, "fold0+fold1+fold2")
    done = write_patch_layout(folded, fold_cases, classes, 20000, 0)
    assert done["shared"] == len(plain_cases) and done["written"] == len(fold_cases) - len(plain_cases)
    for case_id in plain_cases:
        for suffix in (".image.npy", ".label.npy", ".locations-s0-n20000.npz"):
            mine, theirs = arrays_dir(folded) / f"{case_id}{suffix}", arrays_dir(plain) / f"{case_id}{suffix}"
            assert mine.stat().st_ino == theirs.stat().st_ino and mine.stat().st_nlink == 2
    _assert_arrays_equal_records_of(folded, "fold0+fold1+fold2", fold_cases)
    before = {c: (arrays_dir(folded) / f"{c}.image.npy").read_bytes() for c in fold_cases}
    convert(ConversionConfig(str(source), str(plain), split=(0.5, 0.5), workers=1, progress=False, overwrite=True))
    assert all((arrays_dir(folded) / f"{c}.image.npy").read_bytes() == before[c] for c in fold_cases)
    assert write_patch_layout(folded, fold_cases, classes, 20000, 0)["written"] == 0


def _assert_arrays_equal_records_of(dataset: Path, split: str, cases: list[str]) -> None:
    """Every case's whole-volume window from `PatchArrays` equals its record in `split`, image and label."""
    arrays = PatchArrays(dataset, cases)
    for number, case_id in enumerate(cases):
        record = read_record(dataset, split, number)
        assert record["case_id"] == case_id
        image, label = arrays.window(number, [0, 0, 0], record["label"].shape)
        np.testing.assert_array_equal(image, record["image"].astype(np.float32))
        np.testing.assert_array_equal(label, record["label"])
