"""GPU-fit search (`tfmis.tune`): specs, the memory model, the choice, and real searches end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tfmis.config import Config, ConfigError
from tfmis.tuning.fit.candidates import apply_values, choose, model_parallel_settings, model_parallel_skip_reason
from tfmis.tuning.fit.memory import MemoryModel, fit_line
from tfmis.tuning.fit.specs import FitSpecs, load_specs

# ---------------------------------------------------------------------------------------------- specs


def test_specs_read_auto3dseg_shape_with_model_section_overriding_universal(tmp_path):
    """A MONAI Auto3DSeg specs file works as is: `universal` keys, the `unet` section overrides them,
    other algorithms' sections are ignored with a note; JSON is read as well as YAML."""
    path = tmp_path / "specs.json"
    path.write_text(
        json.dumps(
            {
                "universal": {
                    "num_trials": 12,
                    "range_num_images_per_batch": [1, 20],
                    "range_num_sw_batch_size": [2, 40],
                },
                "unet": {"num_trials": 6, "search_recompute": True},
                "segresnet": {"num_trials": 99},
            }
        )
    )
    specs = load_specs(path)
    assert specs.num_trials == 6 and specs.search_recompute
    assert specs.range_num_images_per_batch == (1, 20) and specs.range_num_sw_batch_size == (2, 40)
    assert load_specs(path, num_trials=3).num_trials == 3  # --num-trials
    assert load_specs(None) == FitSpecs()


@pytest.mark.parametrize(
    "data, message",
    [
        ({"universl": {}}, "unknown section 'universl'; did you mean 'universal'?"),
        ({"universal": {"num_trial": 3}}, "unknown config key 'specs.num_trial'; did you mean 'specs.num_trials'?"),
        ({"universal": {"range_num_sw_batch_size": [8, 2]}}, "range_num_sw_batch_size must be [low, high]"),
        ({"universal": {"range_num_images_per_batch": [1, 2, 3]}}, "expected 2 values"),
        ({"universal": {"memory_margin": 1.5}}, "memory_margin must be in (0, 1]"),
        ({"universal": {"range_validation_data_device": ["gpu"]}}, "'gpu' is not one of ['accelerator', 'cpu']"),
    ],
)
def test_specs_errors_name_the_key(data, message):
    with pytest.raises(ConfigError) as e:
        load_specs(data)
    assert message in str(e.value)


def test_specs_range_model_parallel_reads_yaml_entries_in_canonical_form(tmp_path):
    """`range_model_parallel: [none, spatial:2, Spatial:2, pipeline:4]` in YAML: entries lower-cased, repeats
    dropped, order kept; left out, the search keeps the config's own setting (none, or the config's mode:devices)."""
    path = tmp_path / "specs.yaml"
    path.write_text("universal:\n  range_model_parallel: [none, spatial:2, Spatial:2, pipeline:4]\n")
    assert load_specs(path).range_model_parallel == ("none", "spatial:2", "pipeline:4")
    assert load_specs(None).range_model_parallel is None
    config = Config()
    assert model_parallel_settings(config, load_specs(None)) == ["none"]
    config.runtime.model_parallel.mode, config.runtime.model_parallel.devices = "spatial", 4
    assert model_parallel_settings(config, load_specs(None)) == ["spatial:4"]
    assert model_parallel_settings(config, load_specs(path)) == ["none", "spatial:2", "pipeline:4"]


@pytest.mark.parametrize(
    "entries, message",
    [
        (["spatial"], "range_model_parallel: 'spatial' names no device count: write spatial:2 (mode:devices)"),
        (
            ["spatil:2"],
            "range_model_parallel: 'spatil:2' is not a model-parallel setting (did you mean 'spatial'?): write none, "
            "or mode:devices with mode pipeline or spatial and 2 or more devices, e.g. spatial:2",
        ),
        (["pipeline:1"], "range_model_parallel: 'pipeline:1': the device count must be an integer >= 2"),
        (["spatial:two"], "range_model_parallel: 'spatial:two': the device count must be an integer >= 2"),
        (
            ["none", {"spatial": 2}],
            "specs.range_model_parallel: {spatial: 2} is a mapping; write the entry without a space after the "
            "colon or quote it, e.g. spatial:2",
        ),
        ([], "range_model_parallel must name at least one setting, e.g. [none, spatial:2]"),
    ],
)
def test_specs_range_model_parallel_errors_name_the_key_and_the_fix(entries, message):
    with pytest.raises(ConfigError) as e:
        load_specs({"unet": {"range_model_parallel": entries}})
    assert message in str(e.value)


def test_apply_values_sets_the_model_parallel_keys_and_distribution_none():
    """`spatial:2` sets runtime.model_parallel.mode/devices and runtime.distribution none, keeping the config's
    micro_batches, axis and data; `none` sets only the mode."""
    config = Config()
    config.runtime.model_parallel.micro_batches, config.runtime.model_parallel.axis = 4, 1
    spatial = apply_values(config, {"model_parallel": "spatial:2", "num_images_per_batch": 4})
    mp = spatial.runtime.model_parallel
    assert (mp.mode, mp.devices, mp.micro_batches, mp.axis, mp.data) == ("spatial", 2, 4, 1, 1)
    assert spatial.runtime.distribution == "none" and spatial.pipeline.num_images_per_batch == 4
    assert config.runtime.model_parallel.mode == "none" and config.runtime.distribution == "auto"  # a copy
    one = apply_values(spatial, {"model_parallel": "none"})
    assert one.runtime.model_parallel.mode == "none" and not one.runtime.model_parallel.enabled


def test_model_parallel_skip_reasons_more_gpus_than_visible_jit_and_micro_batches():
    """What makes a model-parallel candidate unrunnable here, without a trial: more GPUs than visible (not on a
    CPU machine: logical devices), training.jit_compile, a batch the data groups x micro-batches do not divide."""
    config = Config()
    values = {"model_parallel": "spatial:4", "num_images_per_batch": 3}
    assert model_parallel_skip_reason(config, values, gpu_count=2) == (
        "spatial:4 needs 4 GPUs (devices 4 x runtime.model_parallel.data 1) but 2 are visible"
    )
    assert model_parallel_skip_reason(config, values, gpu_count=4) is None
    assert model_parallel_skip_reason(config, values, gpu_count=None) is None
    assert model_parallel_skip_reason(config, {**values, "model_parallel": "none"}, gpu_count=1) is None
    pipeline = {"model_parallel": "pipeline:2", "num_images_per_batch": 3}
    assert model_parallel_skip_reason(config, pipeline, gpu_count=None) == (
        "pipeline:2: batch 3 is not a multiple of runtime.model_parallel.data 1 x micro_batches 2 (the step's "
        "images are split over them)"
    )
    assert model_parallel_skip_reason(config, {**pipeline, "num_images_per_batch": 4}, gpu_count=None) is None
    config.training.jit_compile = True
    assert model_parallel_skip_reason(config, values, gpu_count=None).startswith(
        "spatial:4: training.jit_compile: true does not work with runtime.model_parallel"
    )


# ---------------------------------------------------------------------------------------------- memory model


def _record(
    n,
    batch,
    sw,
    train=None,
    validation=None,
    status="ok",
    phase=None,
    placement="cpu",
    recompute=False,
    reason=None,
    model_parallel="none",
):
    peak = max(p for p in (train, validation, 0) if p is not None)
    return {
        "trial": n,
        "values": {
            "num_images_per_batch": batch,
            "num_sw_batch_size": sw,
            "validation_data_device": placement,
            "recompute": recompute,
            "model_parallel": model_parallel,
        },
        "status": status,
        "failed_phase": phase,
        "reason": reason,
        "train_peak_mb": train,
        "validation_peak_mb": validation,
        "peak_mb": peak,
        "epoch_seconds": 10.0 + n,
    }


def test_fit_line_is_ordinary_least_squares():
    """Against the closed-form least-squares formulas: slope = cov(x, y) / var(x), intercept = ȳ - slope·x̄."""
    points = [(1, 820.0), (2, 905.0), (4, 1110.0), (8, 1460.0)]
    x, y = np.array(points).T
    slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    intercept = y.mean() - slope * x.mean()
    assert fit_line(points) == pytest.approx((intercept, slope))
    assert fit_line([(2, 1.0), (2, 3.0)]) is None  # one distinct batch size determines no line


def test_memory_model_prunes_predicted_over_budget_and_sizes_beyond_an_out_of_memory():
    model = MemoryModel(budget_mb=1500, tolerance=0.1)
    model.add(_record(1, 1, 4, train=800, validation=700))
    model.add(_record(2, 3, 4, train=1000, validation=950))
    # training line: 700 + 100 * batch
    assert model.predict(
        {"num_images_per_batch": 6, "num_sw_batch_size": 4, "validation_data_device": "cpu", "recompute": False}
    ) == pytest.approx(1300)
    predicted, reason = model.verdict(
        {"num_images_per_batch": 10, "num_sw_batch_size": 4, "validation_data_device": "cpu", "recompute": False}
    )
    assert predicted == pytest.approx(1700) and reason == "predicted 1700 MB > budget 1500 MB"
    # 1600 MB is over the budget but within the 10 % tolerance: measured, not pruned
    assert (
        model.verdict(
            {"num_images_per_batch": 9, "num_sw_batch_size": 4, "validation_data_device": "cpu", "recompute": False}
        )[1]
        is None
    )
    # another recompute value has no line yet: nothing is predicted for it
    assert model.verdict(
        {"num_images_per_batch": 10, "num_sw_batch_size": 4, "validation_data_device": "cpu", "recompute": True}
    ) == (None, None)
    model.add(
        _record(
            3,
            5,
            2,
            train=None,
            status="failed",
            phase="training",
            reason="out of memory in training: ResourceExhaustedError: OOM when allocating tensor",
        )
    )
    _, reason = model.verdict(
        {"num_images_per_batch": 5, "num_sw_batch_size": 1, "validation_data_device": "cpu", "recompute": False}
    )
    assert reason == "batch 5 >= 5, which ran out of memory in training in trial 3"
    assert (
        model.verdict(
            {"num_images_per_batch": 4, "num_sw_batch_size": 40, "validation_data_device": "cpu", "recompute": False}
        )[1]
        is None
    )


def test_memory_model_validation_line_uses_only_trials_where_validation_stood_out():
    """On a CPU the validation phase's resident memory includes what training left behind: a trial
    whose validation peak is not above its training peak says nothing about the sw batch."""
    model = MemoryModel(budget_mb=2000)
    model.add(_record(1, 8, 1, train=1400, validation=1400))  # flat: training's memory
    model.add(_record(2, 1, 8, train=800, validation=1000))
    assert model.validation_line("cpu") is None
    model.add(_record(3, 1, 16, train=800, validation=1200))
    assert model.validation_line("cpu") == pytest.approx((800.0, 25.0))
    model.add(
        _record(
            4,
            1,
            24,
            train=800,
            validation=None,
            status="failed",
            phase="validation",
            reason="peak RSS 2100 MB > budget 2000 MB (stopped during validation)",
        )
    )
    _, reason = model.verdict(
        {"num_images_per_batch": 2, "num_sw_batch_size": 30, "validation_data_device": "cpu", "recompute": False}
    )
    assert "sw batch 30 >= 24, which ran out of memory in validation in trial 4" in reason
    # the failure at sw 24 says nothing about another placement
    assert (
        model.verdict(
            {
                "num_images_per_batch": 2,
                "num_sw_batch_size": 30,
                "validation_data_device": "accelerator",
                "recompute": False,
            }
        )[1]
        is None
    )


def test_memory_model_keeps_one_line_per_recompute_and_model_parallel_setting():
    """Trials on one device and trials of the model over 2 devices are fitted apart (training and validation),
    and an out-of-memory at batch 4 on one device does not prune batch 4 over 2 devices."""
    model = MemoryModel(budget_mb=2000, tolerance=0.1)
    model.add(_record(1, 1, 1, train=800, validation=900))
    model.add(_record(2, 2, 2, train=1000, validation=1100))  # one device: 600 + 200 per image
    model.add(_record(3, 1, 1, train=700, validation=760, model_parallel="spatial:2"))
    model.add(_record(4, 3, 2, train=850, validation=900, model_parallel="spatial:2"))  # 625 + 75 per image
    assert model.train_line(False) == pytest.approx((600.0, 200.0))
    assert model.train_line(False, "spatial:2") == pytest.approx((625.0, 75.0))
    assert model.validation_line("cpu") == pytest.approx((700.0, 200.0))
    assert model.validation_line("cpu", "spatial:2") == pytest.approx((620.0, 140.0))
    assert model.train_line(True, "spatial:2") is None
    model.add(
        _record(
            5,
            4,
            1,
            status="failed",
            phase="training",
            reason="out of memory in training: ResourceExhaustedError: OOM when allocating tensor",
        )
    )
    one = {"num_images_per_batch": 4, "num_sw_batch_size": 1, "validation_data_device": "cpu", "recompute": False}
    assert model.verdict({**one, "model_parallel": "none"})[1] == (
        "batch 4 >= 4, which ran out of memory in training in trial 5"
    )
    predicted, reason = model.verdict({**one, "model_parallel": "spatial:2"})
    assert reason is None and predicted == pytest.approx(max(625 + 75 * 4, 620 + 140 * 1))
    assert model.verdict({**one, "num_images_per_batch": 8, "model_parallel": "spatial:2"})[0] == pytest.approx(1225)
    lines = model.summary()["lines"]
    assert set(lines) == {
        "training (recompute=false)",
        "training (recompute=false, model_parallel=spatial:2)",
        "validation (cpu)",
        "validation (cpu, model_parallel=spatial:2)",
    }
    # a record read from a cache made before the key existed ran on one device
    old = _record(6, 3, 1, train=1200)
    del old["values"]["model_parallel"]
    model.add(old)
    assert model.train_line(False) == pytest.approx((600.0, 200.0))


def test_choice_is_the_fastest_trial_within_the_safety_margin():
    records = [_record(1, 1, 1, train=500), _record(2, 4, 4, train=950), _record(3, 2, 2, train=880)]
    records[0]["epoch_seconds"], records[1]["epoch_seconds"], records[2]["epoch_seconds"] = 30.0, 12.0, 20.0
    # trial 2 is fastest but its 950 MB peak is over 90 % of 1000 MB
    assert choose(records, budget_mb=1000, margin=0.9)["trial"] == 3
    assert choose(records, budget_mb=1100, margin=0.9)["trial"] == 2
    assert choose(records, budget_mb=500, margin=0.9) is None


# ---------------------------------------------------------------------------------------------- real searches

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import yaml  # noqa: E402
from conftest import tiny_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BIG_PATCH = "pipeline.patch_size=[48,48,48]"  # about 40 MB of resident memory per image of batch (tiny U-Net)


def _write_config(config, path: Path) -> Path:
    from tfmis.config import save_config

    save_config(config, path)
    return path


def _run(args, cwd, timeout=600):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def batch4_peak_mb(converted_dataset, tmp_path_factory) -> float:
    """The measured peak RSS of a real trial at batch 4 (the budget below is set from it)."""
    from tfmis.config import to_dict
    from tfmis.tuning.fit.trial import run_trial

    work = tmp_path_factory.mktemp("calibration")
    config = tiny_config(converted_dataset, work / "run", BIG_PATCH, "pipeline.num_images_per_batch=4")
    result = run_trial(
        {"config": to_dict(config), "volume_shape": [20, 22, 18], "warmup_steps": 1, "timed_steps": 2},
        workdir=work / "trial",
    )
    assert result["status"] == "ok", result["reason"]
    return result["peak_mb"]


@pytest.mark.slow
def test_grid_search_cli_under_a_tight_budget_fails_prunes_chooses_within_margin_and_reruns_from_cache(
    converted_dataset, tmp_path, batch4_peak_mb
):
    """`python -m tfmis.tune fit --strategy grid` on a real dataset, with a peak-RSS budget 100 MB above
    batch 4's measured peak (batch 8 needs about 160 MB more): batch 8 goes over the budget and is
    stopped (a failed trial with its reason), every larger candidate is pruned by the memory model
    without running, batch 4 is chosen within the margin; fit.yaml, fit_report.json and memory.png
    are written; the same command again is answered from the cache without running a trial.

    Memory, not timing, and both sides measured in this session: the budget is batch 4's peak RSS from the
    calibration trial + 100 MB. Batch 8 measured about 160 MB over batch 4 (a 60 MB margin to fail), and the
    chosen batch 4 must re-measure within 0.95 x budget (about 70 MB above the calibration: RSS of the same trial
    varies by a few MB between runs; machine load does not change how much memory a trial holds)."""
    budget = batch4_peak_mb + 100
    config_path = _write_config(tiny_config(converted_dataset, tmp_path / "run", BIG_PATCH), tmp_path / "c.yaml")
    specs = tmp_path / "specs.yaml"
    specs.write_text(
        yaml.safe_dump(
            {
                "universal": {
                    "range_num_images_per_batch": [4, 16],
                    "range_num_sw_batch_size": [1, 2],
                    "sampling": "log",
                    "memory_margin": 0.95,
                    "prune_tolerance": 1.0,  # only the out-of-memory rule prunes here
                    "warmup_steps": 1,
                    "timed_steps": 2,
                }
            }
        )
    )
    output, cache = tmp_path / "fit", tmp_path / "cache"
    args = [
        "-m",
        "tfmis.tune",
        "fit",
        "--config",
        str(config_path),
        "--specs",
        str(specs),
        "--strategy",
        "grid",
        "--memory-budget-mb",
        f"{budget:.0f}",
        "--output",
        str(output),
        "--cache-dir",
        str(cache),
    ]
    done = _run(args, REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((output / "fit_report.json").read_text())
    trials = report["trials"]
    by_values = {(t["values"]["num_images_per_batch"], t["values"]["num_sw_batch_size"]): t for t in trials}
    assert sorted(by_values) == [(4, 1), (4, 2), (8, 1), (8, 2), (16, 1), (16, 2)]  # the whole grid
    assert [by_values[(4, s)]["status"] for s in (1, 2)] == ["ok", "ok"]
    failed = by_values[(8, 1)]
    assert failed["status"] == "failed" and failed["failed_phase"] == "training"
    assert f"> budget {budget:.0f} MB" in failed["reason"]
    for key in ((8, 2), (16, 1), (16, 2)):
        assert by_values[key]["status"] == "pruned"
        assert "which ran out of memory in training in trial 3" in by_values[key]["reason"]
        assert not (output / "trials" / f"trial_{by_values[key]['trial']:03d}").exists()  # never ran
    chosen = report["chosen"]
    assert chosen["values"]["num_images_per_batch"] == 4
    assert chosen["peak_mb"] <= 0.95 * budget
    assert all(t["peak_mb"] <= budget for t in trials if t["status"] == "ok")
    assert report["counts"] == {"ok": 2, "failed": 1, "pruned": 3, "skipped": 0, "run": 3}
    fitted = yaml.safe_load((output / "fit.yaml").read_text())
    assert fitted["pipeline"]["num_images_per_batch"] == 4
    assert fitted["validation"]["num_sw_batch_size"] == chosen["values"]["num_sw_batch_size"]
    assert fitted["validation"]["validation_data_device"] == "cpu"
    assert (output / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "pruned: batch 16 >= 8" in done.stdout and "chosen: trial" in done.stdout
    assert "placement collapses to the CPU" in done.stderr

    start = time.perf_counter()
    again = _run(args, REPO)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "used the cache" in again.stderr
    assert json.loads((output / "fit_report.json").read_text())["chosen"]["trial"] == chosen["trial"]
    assert json.loads((output / "fit_report.json").read_text())["cache"]["hit"] is True
    assert time.perf_counter() - start < 30  # no trial ran (one trial alone takes several seconds)


@pytest.mark.slow
def test_train_with_gpu_customization_runs_a_bayesian_search_and_trains_with_its_choice(converted_dataset, tmp_path):
    """`python -m tfmis.train --gpu-customization`: a real Bayesian search of 3 trials (Keras Tuner),
    then training with the chosen batch size and sw batch size, recorded in the run's config.yaml."""
    run = tmp_path / "run"
    config_path = _write_config(tiny_config(converted_dataset, run), tmp_path / "c.yaml")
    specs = tmp_path / "specs.json"
    specs.write_text(
        json.dumps(
            {
                "universal": {
                    "num_trials": 3,
                    "range_num_images_per_batch": [1, 4],
                    "range_num_sw_batch_size": [1, 4],
                    "warmup_steps": 1,
                    "timed_steps": 2,
                }
            }
        )
    )
    done = _run(
        [
            "-m",
            "tfmis.train",
            "--config",
            str(config_path),
            "--gpu-customization",
            "--gpu-customization-specs",
            str(specs),
            "--gpu-customization-cache-dir",
            str(tmp_path / "cache"),
        ],
        REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((run / "gpu_fit" / "fit_report.json").read_text())
    assert report["strategy"] == "bayesian" and report["counts"]["run"] == 3
    chosen = report["chosen"]["values"]
    assert min(t["epoch_seconds"] for t in report["trials"] if t["status"] == "ok") == report["chosen"]["epoch_seconds"]
    trained = yaml.safe_load((run / "config.yaml").read_text())
    assert trained["pipeline"]["num_images_per_batch"] == chosen["num_images_per_batch"]
    assert trained["validation"]["num_sw_batch_size"] == chosen["num_sw_batch_size"]
    assert f"pipeline.num_images_per_batch {chosen['num_images_per_batch']}" in done.stderr
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in history] == [1, 2]
