"""The GPU-fit search over model parallelism (`range_model_parallel`), measured for real on this CPU.

Every trial is a fresh `python -m tfmis.tuning.fit.trial` process with the real Trainer: a model-parallel
candidate runs over 2 logical CPU devices (set up by `make_backend` before TensorFlow initialises), and
its peak is the process's resident memory, which the logical devices share.
"""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import tiny_config

from tfmis.config import to_dict
from tfmis.tuning.fit.candidates import apply_values, fitted_config
from tfmis.tuning.fit.search import fit_config
from tfmis.tuning.fit.specs import load_specs
from tfmis.tuning.fit.trial import run_trial


@pytest.mark.slow
def test_spatial_2_trial_runs_over_two_logical_cpu_devices_and_reports_the_process_rss(converted_dataset, tmp_path):
    """One real trial of the config as the search makes it for `spatial:2` (runtime.model_parallel spatial over 2
    devices, distribution none) on this CPU: it finishes, its model ran over /CPU:0 and /CPU:1, and its peak is
    the process's peak RSS (logical devices share one memory; no per-GPU peaks)."""
    config = apply_values(tiny_config(converted_dataset, tmp_path / "run"), {"model_parallel": "spatial:2"})
    result = run_trial(
        {"config": to_dict(config), "volume_shape": [20, 22, 18], "warmup_steps": 1, "timed_steps": 2},
        workdir=tmp_path / "trial",
    )
    assert result["status"] == "ok", result["reason"]
    assert result["model_devices"] == ["/CPU:0", "/CPU:1"]
    assert result["images_per_second"] > 0 and result["sw_seconds"] > 0
    assert result["peak_mb"] == result["rss_peak_mb"] > 0 and result["peak_mb_by_device"] is None


def test_setting_that_cannot_cut_the_patch_or_failed_to_set_up_is_skipped_with_its_reason(converted_dataset, tmp_path):
    """A grid search of `spatial:16` and `pipeline:2` on 16³ patches (strides 1, 2: at most 8 slabs of 2), batch 2
    to 4. Every `spatial:16` candidate is skipped up front with the slabs' reason, no trial started; the first
    `pipeline:2` trial fails in setup (a fake runner stands in for the trial process), and the next batch size of
    that setting is skipped naming that trial; nothing is chosen."""
    from tfmis.tuning.fit.search import GpuFitSearch, NoConfigurationFits

    config = tiny_config(converted_dataset, tmp_path / "run")
    specs = load_specs(
        {
            "universal": {
                "range_num_images_per_batch": [2, 4],
                "range_num_sw_batch_size": [1, 1],
                "range_model_parallel": ["spatial:16", "pipeline:2"],
            }
        }
    )
    calls = []

    def runner(request, workdir, **kwargs):
        calls.append(request["config"]["runtime"]["model_parallel"])
        return {"status": "failed", "failed_phase": "setup", "out_of_memory": False, "reason": "ValueError in setup: x"}

    search = GpuFitSearch(
        config,
        specs,
        tmp_path / "fit",
        strategy="grid",
        cache_dir=tmp_path / "cache",
        use_cache=False,
        progress=False,
        runner=runner,
    )
    with pytest.raises(NoConfigurationFits):
        search.run()
    spatial = [r for r in search.records if r["values"]["model_parallel"] == "spatial:16"]
    pipeline = [r for r in search.records if r["values"]["model_parallel"] == "pipeline:2"]
    assert len(spatial) == len(pipeline) == 3 and len(calls) == 1 and calls[0]["mode"] == "pipeline"  # batch 2, 3, 4
    for r in spatial:
        assert r["status"] == "skipped" and r["reason"].startswith("spatial:16: "), r["reason"]
        assert "cannot be cut into 16 slabs" in r["reason"] and "at most 8 fit" in r["reason"], r["reason"]
    first, odd, second = pipeline
    assert odd["status"] == "skipped" and "batch 3 is not a multiple" in odd["reason"]
    assert first["status"] == "failed" and first["failed_phase"] == "setup" and not first["out_of_memory"]
    assert second["status"] == "skipped"
    assert second["reason"].startswith(f"pipeline:2 failed to set up in trial {first['trial']}: ")
    report = json.loads((tmp_path / "fit" / "fit_report.json").read_text())
    assert report["counts"] == {"ok": 0, "failed": 1, "pruned": 0, "skipped": 5, "run": 1}


@pytest.mark.slow
def test_grid_search_measures_none_and_spatial_2_on_logical_cpu_devices_and_writes_the_choice_back(
    converted_dataset, tmp_path, capsys
):
    """A real grid search with `range_model_parallel: [none, spatial:2]` (batch 2, sw batch 2) on the tiny
    dataset: two trials, both ok with measured images/s, step and sliding-window seconds and peak RSS; the
    spatial one ran its model over /CPU:0 and /CPU:1, the other over /CPU:0 only. The faster one (shorter
    estimated epoch) is chosen, and fit.yaml, report["fitted"] and the returned config carry its
    runtime.model_parallel.mode (and devices, distribution none for spatial); the table shows both settings.
    The spatial record, passed to `fitted_config` as a choice, gives mode spatial, 2 devices, distribution none."""
    config = tiny_config(converted_dataset, tmp_path / "run")
    specs = load_specs(
        {
            "universal": {
                "range_num_images_per_batch": [2, 2],
                "range_num_sw_batch_size": [2, 2],
                "range_model_parallel": ["none", "spatial:2"],
                "warmup_steps": 1,
                "timed_steps": 2,
            }
        }
    )
    output = tmp_path / "fit"
    fitted, report = fit_config(
        config, specs, output, strategy="grid", cache_dir=tmp_path / "cache", use_cache=False, progress=False
    )

    trials = {t["values"]["model_parallel"]: t for t in report["trials"]}
    assert sorted(trials) == ["none", "spatial:2"] and report["counts"]["run"] == 2
    for trial in trials.values():
        assert trial["status"] == "ok", trial["reason"]
        assert trial["values"]["num_images_per_batch"] == 2 and trial["values"]["num_sw_batch_size"] == 2
        assert trial["images_per_second"] > 0 and trial["step_seconds"] > 0 and trial["sw_seconds"] > 0
        assert trial["train_peak_mb"] > 0 and trial["peak_mb"] == trial["rss_peak_mb"] > 0  # the process's RSS
        assert trial["epoch_seconds"] > 0
    assert trials["none"]["model_devices"] == ["/CPU:0"]
    assert trials["spatial:2"]["model_devices"] == ["/CPU:0", "/CPU:1"]

    chosen = min(trials.values(), key=lambda t: t["epoch_seconds"])
    assert report["chosen"]["trial"] == chosen["trial"]
    mode = "none" if chosen["values"]["model_parallel"] == "none" else "spatial"
    written = yaml.safe_load((output / "fit.yaml").read_text())
    assert written["runtime"]["model_parallel"]["mode"] == mode == fitted.runtime.model_parallel.mode
    assert report["fitted"]["runtime.model_parallel.mode"] == mode
    assert json.loads((output / "fit_report.json").read_text())["fitted"] == report["fitted"]
    if mode == "spatial":
        assert written["runtime"]["model_parallel"]["devices"] == 2 and written["runtime"]["distribution"] == "none"
        assert report["fitted"]["runtime.model_parallel.devices"] == 2
    else:
        assert "runtime.model_parallel.devices" not in report["fitted"]

    spatial = fitted_config(config, trials["spatial:2"], report["trials"], report["context"])
    mp = spatial.runtime.model_parallel
    assert (mp.mode, mp.devices, spatial.runtime.distribution) == ("spatial", 2, "none")

    table = capsys.readouterr().out
    assert "model parallel" in table and "spatial:2" in table
    assert f"model parallel {chosen['values']['model_parallel']}:" in table  # the "chosen:" line
