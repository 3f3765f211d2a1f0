"""The regular-vs-fast benchmark (tools/benchmark.py): the regular input pipeline against the fast one on
real NIfTI files and the real TFRecords converted from them, and the benchmark tool in real subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from conftest import TINY_TRAINING, tiny_config

from tfmis.data.pipeline import build_train_dataset, volume_order
from tfmis.data.records import load_index, read_record, split_cases
from tfmis.data.regular import RegularSource, build_regular_train_dataset

ROOT = Path(__file__).resolve().parents[1]


def test_regular_source_reads_the_converted_voxels_from_nifti(converted_dataset):
    """Every training case decoded from its NIfTI files and preprocessed by RegularSource (float32) is the
    TFRecord's case once cast to the stored float16, bit for bit; labels are identical."""
    source = RegularSource.from_config(tiny_config(converted_dataset, converted_dataset / "unused"))
    assert source.dataset.root == (converted_dataset.parent / "Task99_Test").resolve()  # found through index.json
    index = load_index(converted_dataset)
    assert index["preprocessing"]["image_dtype"] == "float16"
    for sample, entry in enumerate(split_cases(index, "train")):
        record = read_record(converted_dataset, "train", sample)
        image, label = source.load(entry["case_id"])
        assert image.dtype == np.float32 and label.dtype == np.uint8
        assert image.shape == record["image"].shape and label.shape == record["label"].shape
        np.testing.assert_array_equal(image.astype(np.float16), record["image"])
        np.testing.assert_array_equal(label, record["label"])
        assert np.abs(image - record["image"].astype(np.float32)).max() > 0  # float32, not the float16 values


def test_volume_order_is_the_order_the_fast_pipeline_reads(converted_dataset):
    """The order computed from index.json equals the order the fast pipeline's interleaved shard reads produce."""
    from tfmis.data.pipeline import read_records

    index = load_index(converted_dataset)
    files = [str(converted_dataset / s["file"]) for s in index["splits"]["train"]["shards"]]
    read = [meta["case_id"].numpy().decode() for _, _, meta in read_records(files, index, deterministic=True)]
    assert volume_order(index, converted_dataset, "train") == read
    assert len(read) == 6 and len(files) == 2


@pytest.mark.parametrize("augment", [True, False])
def test_regular_stream_equals_fast_stream_batch_for_batch(converted_dataset, tmp_path, augment):
    """With pipeline.deterministic the regular pipeline (NIfTI, no cache) yields the fast pipeline's batches over
    three epochs of reshuffled volumes: same shapes and dtypes, same labels, images equal up to float16 rounding."""
    overrides = ["pipeline.patch_size=[12,12,12]", "pipeline.num_crops_per_image=3", "pipeline.shuffle_volumes=4"]
    if not augment:
        overrides += [
            "pipeline.augment.flip_prob=0",
            "pipeline.augment.rot90_prob=0",
            "pipeline.augment.intensity_prob=0",
        ]
    config = tiny_config(converted_dataset, tmp_path, *overrides)
    fast = build_train_dataset(config)
    regular = build_regular_train_dataset(config)
    assert regular.element_spec == fast.element_spec
    batches = 3 * 6 * 3 // 2  # three epochs: 6 volumes x 3 crops, batch 2
    for (fi, fl), (ri, rl) in zip(fast.take(batches), regular.take(batches)):
        assert ri.dtype == tf.float32 and rl.dtype == tf.int32 and ri.shape == (2, 12, 12, 12, 2)
        np.testing.assert_array_equal(rl.numpy(), fl.numpy())
        np.testing.assert_allclose(ri.numpy(), fi.numpy(), rtol=1e-3, atol=5e-3)


def test_regular_pipeline_refuses_a_source_folder_that_was_not_converted(converted_dataset, tmp_path):
    """A data.source_dir whose dataset.json differs from the converted one is refused, naming the fix."""
    from conftest import make_msd_dataset

    other = make_msd_dataset(tmp_path / "Other", num_cases=3, seed=5)
    config = tiny_config(converted_dataset, tmp_path, f"data.source_dir={other}")
    with pytest.raises(ValueError, match="set data.source_dir to that folder"):
        build_regular_train_dataset(config)


# ---------------------------------------------------------------- tools/benchmark.py in real subprocesses


def _tool(cwd: Path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "benchmark.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _tiny_yaml(tmp_path: Path, dataset_dir: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(f"data:\n  dataset_dir: {dataset_dir}\n")
    return path


def _tiny_sets(*extra: str) -> list[str]:
    return [a for s in (*TINY_TRAINING, *extra) for a in ("--set", s)]


def _md_row(md: str, label: str) -> list[str]:
    """The cells after the label of the Markdown table row starting with `| label |`."""
    for line in md.splitlines():
        if line.startswith(f"| {label} |"):
            return [c.strip() for c in line.strip().strip("|").split("|")[1:]]
    raise AssertionError(f"no row {label!r} in:\n{md}")


@pytest.mark.slow
def test_pipeline_only_writes_samples_per_second_of_both_pipelines(converted_dataset, tmp_path):
    """--pipeline-only times the regular (NIfTI) and fast (TFRecord) pipelines without a model: positive samples/s
    for both in benchmark.json and the same numbers in benchmark.md; no training run folder is made."""
    out = tmp_path / "bench"
    _tool(
        tmp_path,
        "--config",
        str(_tiny_yaml(tmp_path, converted_dataset)),
        "--output",
        str(out),
        "--pipeline-only",
        "--pipeline-batches",
        "3",
        "--quiet",
        *_tiny_sets(),
    )
    result = json.loads((out / "benchmark.json").read_text())
    assert "training" not in result and not (out / "regular").exists() and not (out / "fast").exists()
    p = result["pipeline"]
    for arm, batch in (("regular", 1), ("fast", 2)):
        assert p[arm]["samples_per_second"] > 0 and p[arm]["timed_batches"] == 3
        assert p[arm]["batch_size"] == batch and p[arm]["timed_images"] == 3 * batch
        assert 0 < p[arm]["first_batch_seconds"] <= p[arm]["first_epoch_seconds"]
    assert p["samples_per_second_ratio"] == pytest.approx(
        p["fast"]["samples_per_second"] / p["regular"]["samples_per_second"]
    )
    md = (out / "benchmark.md").read_text()
    regular, fast, ratio = _md_row(md, "samples/s (steady state)")
    assert float(regular) == pytest.approx(p["regular"]["samples_per_second"], abs=0.0051)
    assert float(fast) == pytest.approx(p["fast"]["samples_per_second"], abs=0.0051)
    assert float(ratio.rstrip("x")) == pytest.approx(p["samples_per_second_ratio"], abs=0.0051)


@pytest.mark.slow
def test_benchmark_trains_both_arms_and_reports_ratios_from_their_histories(converted_dataset, tmp_path):
    """tools/benchmark.py trains the regular arm (NIfTI, batch 1, float32, Dice, Adam) and the fast arm (the config)
    in subprocesses with the real Trainer, writes every PNG, benchmark.json and benchmark.md, and every number in
    the md's training table equals the one recomputed here from the arms' history.jsonl."""
    out = tmp_path / "bench"
    _tool(
        tmp_path,
        "--config",
        str(_tiny_yaml(tmp_path, converted_dataset)),
        "--output",
        str(out),
        "--max-minutes",
        "10",
        "--pipeline-batches",
        "2",
        "--quiet",
        *_tiny_sets("training.epochs=3", "training.dice_thresholds=[0.0,0.99]"),
    )
    for name in ("curves_vs_epoch.png", "curves_vs_time.png", "epoch_time.png", "time_to_dice.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        import matplotlib.image

        assert min(matplotlib.image.imread(out / name).shape[:2]) > 200, name
    result = json.loads((out / "benchmark.json").read_text())
    md = (out / "benchmark.md").read_text()

    import yaml

    regular_cfg = yaml.safe_load((out / "regular" / "config.yaml").read_text())
    fast_cfg = yaml.safe_load((out / "fast" / "config.yaml").read_text())
    assert (
        regular_cfg["pipeline"]["num_images_per_batch"],
        regular_cfg["training"]["precision"],
        regular_cfg["loss"]["name"],
        regular_cfg["optimizer"]["name"],
        regular_cfg["pipeline"]["cache"],
    ) == (1, "float32", "dice", "adam", "none")
    assert (
        fast_cfg["pipeline"]["num_images_per_batch"],
        fast_cfg["loss"]["name"],
        fast_cfg["optimizer"]["name"],
        fast_cfg["pipeline"]["cache"],
    ) == (2, "dice_ce", "adamw", "memory")
    assert regular_cfg["training"]["steps_per_epoch"] == 4 and fast_cfg["training"]["steps_per_epoch"] == 2
    assert regular_cfg["training"]["max_minutes"] == fast_cfg["training"]["max_minutes"] == 10

    histories = {
        arm: [json.loads(line) for line in (out / arm / "history.jsonl").read_text().splitlines()]
        for arm in ("regular", "fast")
    }
    expected = {}
    for arm, records in histories.items():
        assert [r["epoch"] for r in records] == [1, 2, 3]
        assert json.loads((out / arm / "summary.json").read_text())["stop_reason"] == "epochs"
        steady = records[1:]
        first = {
            t: next((r["elapsed_seconds"] for r in records if r.get("val_mean_dice", -1) >= t), None)
            for t in (0.0, 0.99)
        }
        expected[arm] = {
            "epoch": sum(r["data_wait_seconds"] + r["compute_seconds"] for r in steady) / len(steady),
            "ips": sum(r["images_per_second"] for r in steady) / len(steady),
            "wait": sum(r["data_wait_seconds"] for r in records)
            / sum(r["data_wait_seconds"] + r["compute_seconds"] for r in records),
            "dice": max(r["val_mean_dice"] for r in records),
            "first": first,
        }
    reg, fast = expected["regular"], expected["fast"]
    assert reg["first"][0.0] is not None and fast["first"][0.0] is not None  # the first validation reaches 0
    assert reg["first"][0.99] is None and fast["first"][0.99] is None

    def close(cell: str, value: float, scale: float = 1.0, decimals: int = 2):
        assert float(cell.rstrip("x%")) == pytest.approx(value * scale, abs=0.51 * 10**-decimals), (cell, value)

    r, f, ratio = _md_row(md, "epoch time, s")
    close(r, reg["epoch"]), close(f, fast["epoch"]), close(ratio, reg["epoch"] / fast["epoch"])
    r, f, ratio = _md_row(md, "images/s")
    close(r, reg["ips"]), close(f, fast["ips"]), close(ratio, fast["ips"] / reg["ips"])
    r, f, _ = _md_row(md, "data-wait share of step time")
    close(r, reg["wait"], 100, 1), close(f, fast["wait"], 100, 1)
    r, f, _ = _md_row(md, "best validation mean Dice")
    close(r, reg["dice"], decimals=4), close(f, fast["dice"], decimals=4)
    r, f, ratio = _md_row(md, "time to mean Dice >= 0.00, s")
    close(r.split()[0], reg["first"][0.0], decimals=1), close(f.split()[0], fast["first"][0.0], decimals=1)
    close(ratio, reg["first"][0.0] / fast["first"][0.0])
    assert _md_row(md, "time to mean Dice >= 0.99, s") == ["not reached (3 epochs)", "not reached (3 epochs)", "-"]
    assert _md_row(md, "epochs trained (stop reason)")[:2] == ["3 (epochs)", "3 (epochs)"]

    ratios = result["training"]["ratios"]
    assert ratios["epoch_time"] == pytest.approx(reg["epoch"] / fast["epoch"], rel=1e-9)
    assert ratios["images_per_second"] == pytest.approx(fast["ips"] / reg["ips"], rel=1e-9)
    assert ratios["time_to_dice"] == pytest.approx({"0.00": reg["first"][0.0] / fast["first"][0.0]}, rel=1e-9)
    assert min(result["pipeline"][arm]["samples_per_second"] for arm in ("regular", "fast")) > 0
    assert (out / "regular.log").read_text().count("epoch 3/3") == 1  # the arm's own output, kept


def test_bad_config_key_stops_before_any_arm_runs(converted_dataset, tmp_path):
    """A misspelt --set key exits with status 2 and names the key and its likely fix; no arm folder is made."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "benchmark.py"),
            "--config",
            str(_tiny_yaml(tmp_path, converted_dataset)),
            "--output",
            str(tmp_path / "bench"),
            "--set",
            "pipeline.patch_sise=[16,16,16]",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "pipeline.patch_sise" in proc.stderr and "pipeline.patch_size" in proc.stderr
    assert not (tmp_path / "bench" / "regular").exists()
