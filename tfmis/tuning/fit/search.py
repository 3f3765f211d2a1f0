"""GPU-fit search: batch size, sliding-window batch size, placement (recompute, model parallelism) from measured
memory and speed.

Keras Tuner proposes configurations (Bayesian optimisation by default, an exhaustive grid on
request) over a search space declared up front; each one is measured in a fresh subprocess
(`tfmis.tuning.fit.trial`: the real model, loss, optimizer, precision and jit_compile, warm-up and timed
calls of the loop of `training.steps_per_loop` steps that training runs, one sliding-window pass over a volume
of the dataset's 99.5th-percentile shape).

- Objective (minimised): the estimated epoch time, training patches per epoch ÷ measured images/s
  + validation cases × measured sliding-window seconds ÷ `val_interval`.
- Memory is measured, never guessed: a trial that runs out of memory, goes over the budget, times
  out or crashes is a failed trial with its reason, and the search goes on.
- A memory model (linear in the batch size for training, in the sw batch size for validation,
  fitted on the trials so far, as YOLOv5's autobatch and DeepSpeed's autotuner do) marks a
  candidate whose predicted peak clearly exceeds the budget as pruned without running it; a
  candidate at least as large as one that ran out of memory is pruned too.
- The choice: the fastest measured configuration whose peak is within `memory_margin` of the budget.
- Model parallelism (`range_model_parallel`: `none`, `spatial:2`, `pipeline:2`, ...): a candidate runs the
  model over N devices (`runtime.model_parallel.mode` / `devices`, `runtime.distribution: none`): N GPUs, or
  on a machine without GPUs N logical CPU devices. A candidate that cannot run here (more GPUs than are
  visible, `training.jit_compile`, a batch the pipeline's micro-batches do not divide, a patch that cannot be cut
  into its slabs, a setting that already failed to set up) is `skipped` with its reason, without a trial; a
  `range_model_parallel` of which nothing can run is a specs error (`check_model_parallel_range`).
- The result is cached by device (name, total memory), TensorFlow version, the measured part of
  the config, the dataset shape and the specs — never by free memory — and reused at once.

This module runs the search (`GpuFitSearch`, `fit_config`, `cached_choice`); its parts are modules of their own:
`candidates.py` (the searched values, the objective, the choice), `strategies.py` (the search space and each
strategy's oracle), `cache.py` (the key, reading and reusing a report), `report.py` (the report, the files written,
the table and plot).

Example:
```python
result = GpuFitSearch(load_config("configs/demo.yaml"), load_specs("specs.yaml"), output_dir="runs/fit").run()
print(result["chosen"]["values"])          # {"num_images_per_batch": 4, "num_sw_batch_size": 8, ...}
```
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tfmis.config import Config, to_dict
from tfmis.errors import ResourceError
from tfmis.hardware import usable_cpu_count
from tfmis.tuning.fit import cache as fit_cache
from tfmis.tuning.fit import strategies
from tfmis.tuning.fit.cache import cache_key, default_cache_dir
from tfmis.tuning.fit.candidates import (
    OBJECTIVE,
    apply_values,
    check_model_parallel_range,
    choose,
    estimated_epoch_seconds,
    fitted_config,
    model_parallel_settings,
    model_parallel_skip_reason,
    search_context,
)
from tfmis.tuning.fit.memory import NO_MODEL_PARALLEL, MemoryModel, is_memory_failure, model_parallel_of
from tfmis.tuning.fit.report import (
    REPORT_FILE,
    no_fit_message,
    search_report,
    update_progress,
    write_outputs,
)
from tfmis.tuning.fit.specs import FitSpecs, load_specs, parse_model_parallel
from tfmis.utils.io import atomic_write_json


class NoConfigurationFits(ResourceError, RuntimeError):
    """No measured configuration stayed within the memory budget's safety margin."""


# ---------------------------------------------------------------------------------------------- the search


class GpuFitSearch:
    """Runs (or reads from the cache) the GPU-fit search for a config and writes its outputs.

    Args:
        config: the training `Config` (its dataset must be converted).
        specs: a `FitSpecs`.
        output_dir: where fit.yaml, fit_report.json, memory.png and the trial logs go.
        memory_budget_mb: the budget (default: the GPU's total memory less `GPU_RESERVED_MB` for the
            CUDA context, which TensorFlow's allocator does not count; on a CPU-only machine the
            available RAM).
        strategy: `bayesian` or `grid` (exhaustive over the ranges; ignores num_trials).
        cache_dir: the cache folder (default `default_cache_dir()`); `use_cache=False` searches anew.
        progress: show a progress bar over trials.
        runner: the trial runner (default `tfmis.tuning.fit.trial.run_trial`).
    """

    def __init__(
        self,
        config: Config,
        specs: FitSpecs,
        output_dir,
        *,
        memory_budget_mb: float | None = None,
        strategy: str = "bayesian",
        cache_dir=None,
        use_cache: bool = True,
        progress: bool = True,
        runner=None,
    ):
        if strategy not in strategies.STRATEGIES:
            raise ValueError(f"strategy must be 'bayesian' or 'grid', got {strategy!r}")
        from tfmis.hardware import GPU_RESERVED_MB, accelerators, host_memory
        from tfmis.tuning.fit.trial import run_trial, trial_device

        self.config, self.specs, self.strategy = config, specs, strategy
        check_model_parallel_range(config, specs)  # a range of which nothing can run: exit 2, before measuring
        self.output_dir = Path(output_dir)
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.use_cache, self.progress = use_cache, progress
        self.runner = runner or run_trial
        self.context = search_context(config)
        gpus = accelerators()
        gpu = trial_device(gpus)
        # a trial over N GPUs takes the N with the least memory (the first is `trial_device`'s); the budget is per GPU
        self.gpus = sorted(gpus, key=lambda a: (a["total_mb"], a["index"]))
        host = host_memory()
        if gpu is not None:
            self.device = {
                "kind": "gpu",
                "index": gpu["index"],
                "name": gpu["name"],
                "total_mb": gpu["total_mb"],
                "gpu_count": len(gpus),
            }
            # the CUDA context and libraries sit outside TensorFlow's allocator, whose peak is measured
            default_budget = gpu["total_mb"] - GPU_RESERVED_MB
        else:
            self.device = {
                "kind": "cpu",
                "name": host.get("cpu_name", "cpu"),
                "total_mb": host["total_mb"],
                "cpu_count": usable_cpu_count(),
            }
            default_budget = host["available_mb"]
        self.budget_mb = float(memory_budget_mb or default_budget)
        self.placements = list(dict.fromkeys(specs.range_validation_data_device))
        if gpu is None and self.placements != ["cpu"]:
            print(
                "No accelerator visible: the validation placement collapses to the CPU; searching the rest.",
                file=sys.stderr,
            )
            self.placements = ["cpu"]
        self.model_parallel = model_parallel_settings(config, specs)
        if gpu is None and self.model_parallel != [NO_MODEL_PARALLEL]:
            print(
                "No accelerator visible: model-parallel candidates run on logical CPU devices sharing one memory "
                "(their peak is the process's).",
                file=sys.stderr,
            )
        self.records: list[dict] = []
        self.model = MemoryModel(self.budget_mb, specs.prune_tolerance)
        self.key = cache_key(config, self.context, self.device, specs, strategy)
        self._bar = None

    # -------------------------------------------------------------- search space (tfmis.tuning.fit.strategies)

    def hyperparameters(self):
        """The Keras Tuner search space, declared up front."""
        return strategies.search_space(self.specs, self.placements, self.config.model.recompute, self.model_parallel)

    def grid_size(self) -> int:
        return strategies.grid_size(self.hyperparameters())

    # -------------------------------------------------------------- one candidate

    def evaluate(self, values: dict) -> dict:
        """Prunes or measures one candidate; returns its record (also kept in `self.records`)."""
        # Keras Tuner's grid hands integers over as floats (8.0)
        values = {
            "num_images_per_batch": int(values["num_images_per_batch"]),
            "num_sw_batch_size": int(values["num_sw_batch_size"]),
            "validation_data_device": str(values["validation_data_device"]),
            "recompute": bool(values["recompute"]),
            "model_parallel": str(values.get("model_parallel") or NO_MODEL_PARALLEL),
        }
        n = len(self.records) + 1
        record = {"trial": n, "values": values, "status": None, "reason": None}
        skip_reason = self._skip_reason(values)
        if skip_reason:
            record.update(status="skipped", reason=skip_reason, out_of_memory=False)
            self.records.append(record)
            self._report_progress(record)
            return record
        predicted, prune_reason = self.model.verdict(values)
        record["predicted_peak_mb"] = predicted
        if prune_reason and self.specs.prune:
            record.update(status="pruned", reason=prune_reason, out_of_memory=True)
            self.records.append(record)
            self._report_progress(record)
            return record
        trial_config = apply_values(self.config, values)
        trial_config.output.progress = False
        trial_config.output.tensorboard = False
        workdir = self.output_dir / "trials" / f"trial_{n:03d}"
        request = {
            "config": to_dict(trial_config),
            "volume_shape": self.context["volume_shape"],
            "warmup_steps": self.specs.warmup_steps,
            "timed_steps": self.specs.timed_steps,
        }
        gpu = None
        if self.device["kind"] == "gpu":
            mp = trial_config.runtime.model_parallel
            # one GPU, or the N x data GPUs the model runs over (the trial sees exactly these)
            gpu = [g["index"] for g in self.gpus[: mp.devices * mp.data]] if mp.enabled else self.device["index"]
        result = self.runner(
            request,
            workdir=workdir,
            memory_budget_mb=self.budget_mb,
            timeout_s=self.specs.trial_timeout_s,
            gpu=gpu,
        )
        keep = (
            "steps_per_loop",
            "reason",
            "failed_phase",
            "out_of_memory",
            "images_per_second",
            "step_seconds",
            "step_seconds_all",
            "sw_seconds",
            "sw_windows",
            "train_peak_mb",
            "validation_peak_mb",
            "peak_mb",
            "rss_peak_mb",
            "wall_seconds",
            "device",
            "model_devices",
            "peak_mb_by_device",
        )
        record.update({k: result.get(k) for k in keep if k in result})
        record["status"] = "ok" if result["status"] == "ok" else "failed"
        record["log"] = str(workdir)
        if record["status"] == "ok":
            record[OBJECTIVE] = estimated_epoch_seconds(record["images_per_second"], record["sw_seconds"], self.context)
            record["within_margin"] = record["peak_mb"] <= self.specs.memory_margin * self.budget_mb
        self.records.append(record)
        self.model.add(record)
        self._report_progress(record)
        return record

    def _skip_reason(self, values: dict) -> str | None:
        """Why this candidate's model-parallel setting cannot run here (`model_parallel_skip_reason`), or why a
        trial of the same setting (and recompute) already failed to set up, for a reason other than memory (a
        patch that cannot be cut into the slabs, a model the stages cannot split: the same for every batch)."""
        gpu_count = len(self.gpus) if self.device["kind"] == "gpu" else None
        reason = model_parallel_skip_reason(self.config, values, gpu_count)
        if reason or values["model_parallel"] == NO_MODEL_PARALLEL:
            return reason
        for r in self.records:
            if (
                r["status"] == "failed"
                and r.get("failed_phase") == "setup"
                and not is_memory_failure(r)
                and not (r.get("reason") or "").startswith("timed out")
                and model_parallel_of(r["values"]) == values["model_parallel"]
                and r["values"]["recompute"] == values["recompute"]
            ):
                return f"{values['model_parallel']} failed to set up in trial {r['trial']}: {r['reason']}"
        return None

    def runs(self) -> int:
        return sum(r["status"] in ("ok", "failed") for r in self.records)

    def finished(self) -> bool:
        """Bayesian: num_trials measured, or far more candidates pruned than measured (nothing left to try)."""
        if self.strategy == "grid":
            return False
        return self.runs() >= self.specs.num_trials or len(self.records) >= 10 * self.specs.num_trials + 50

    def _report_progress(self, record: dict) -> None:
        if self._bar is None:
            return
        update_progress(self._bar, record, self.records, self.budget_mb, self.specs.memory_margin, self.strategy)

    # -------------------------------------------------------------- the whole search

    def run(self) -> dict:
        """Searches (or reads the cache), writes fit.yaml, fit_report.json and memory.png; returns the report.

        Raises:
            NoConfigurationFits: no measured configuration is within the budget's margin.
        """
        start = time.perf_counter()
        cache_file = self.cache_file
        cached = self.read_cache() if self.use_cache else None
        if cached is not None:
            self.records = cached["trials"]
            for r in self.records:
                self.model.add(r)
            print(
                f"GPU-fit search: used the cache {cache_file} (searched {cached['created']} under a budget of "
                f"{cached['budget_mb']:.0f} MB); rerun with --no-cache to measure again",
                file=sys.stderr,
            )
        else:
            self._search()
        report = self._report(cached is not None, cache_file, time.perf_counter() - start)
        if cached is None:
            atomic_write_json(cache_file, report)
        self._write_outputs(report)
        if report["chosen"] is None:
            raise NoConfigurationFits(
                no_fit_message(self.records, self.specs.memory_margin, self.budget_mb, self.output_dir / REPORT_FILE)
            )
        return report

    @property
    def cache_file(self) -> Path:
        """This search's cache file: its key names the device, TensorFlow, the measured config, data and specs."""
        return fit_cache.cache_file(self.cache_dir, self.key)

    def read_cache(self) -> dict | None:
        """The cached report of this very search, if one was made under a budget that still holds; else None."""
        return fit_cache.read_cache(self.cache_file, self.key, self.budget_mb)

    def _search(self) -> None:
        from tfmis.tuning import kt
        from tfmis.utils.progress import progress_bar

        hp = self.hyperparameters()
        oracle = strategies.make_oracle(self.strategy, self.specs, hp, OBJECTIVE, self.finished)
        tuner = kt.make_tuner(
            self._trial,
            OBJECTIVE,
            oracle=oracle,
            directory=str(self.output_dir / "keras_tuner"),
            project_name="gpu_fit",
            overwrite=True,
        )
        total = self.grid_size() if self.strategy == "grid" else self.specs.num_trials
        print(
            f"GPU-fit search ({self.strategy}, {total} trials) on {self.device['name']} "
            f"({self.device['kind']}, budget {self.budget_mb:.0f} MB, choosing within "
            f"{self.specs.memory_margin:.0%}): {strategies.describe_space(hp)}",
            file=sys.stderr,
        )
        self._bar = progress_bar(total, "GPU-fit trials", "trial", disable=not self.progress)
        try:
            kt.run_search(tuner)  # a trial that does not fit is an expected outcome, reported with its reason
        finally:
            self._bar.close()
            self._bar = None

    def _trial(self, trial_id: str, values: dict) -> tuple[float | None, str | None]:
        """One Keras Tuner trial: (estimated epoch seconds, None), or (None, why it failed or was pruned)."""
        record = self.evaluate(values)
        if record["status"] != "ok":
            return None, f"{record['status']}: {record['reason']}"
        return record[OBJECTIVE], None

    def _report(self, from_cache: bool, cache_file: Path, elapsed: float) -> dict:
        return search_report(self, from_cache, cache_file, elapsed)

    def _write_outputs(self, report: dict) -> None:
        write_outputs(self, report)


def fit_config(config: Config, specs: FitSpecs, output_dir, **kwargs) -> tuple[Config, dict]:
    """Runs the search (or reads its cache) and returns (the config with the chosen values, the report)."""
    search = GpuFitSearch(config, specs, output_dir, **kwargs)
    report = search.run()
    chosen = next(r for r in search.records if r.get("chosen"))
    return fitted_config(config, chosen, search.records, search.context), report


def cached_choice(config: Config, specs: FitSpecs | None = None) -> dict | None:
    """The cached GPU-fit choice for `config` on this machine's GPU, without searching (for the planner).

    None when there is no GPU, no converted dataset, or no cached search of exactly this config and device.

    Returns:
        {"num_images_per_batch", "num_sw_batch_size", "validation_data_device", "model_parallel_mode",
        "model_parallel_devices", "source"}; a chosen accelerator placement becomes `auto`; the model-parallel
        keys are `runtime.model_parallel.mode` / `.devices` of the choice (`none`, None without a mode).
    """
    import tempfile

    from tfmis.data.records import INDEX_FILE

    if not (Path(config.data.dataset_dir) / INDEX_FILE).is_file():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        search = GpuFitSearch(config, specs or load_specs(None), tmp, progress=False)
        if search.device["kind"] != "gpu":
            return None
        cached = search.read_cache()
    if cached is None:
        return None
    chosen = choose(cached["trials"], cached["budget_mb"], cached["memory_margin"])
    if chosen is None:
        return None
    values = dict(chosen["values"])
    if values["validation_data_device"] == "accelerator":
        values["validation_data_device"] = "auto"  # as fitted_config: larger volumes fall back, not fail
    mode, devices = parse_model_parallel(model_parallel_of(values))
    return {
        "num_images_per_batch": values["num_images_per_batch"],
        "num_sw_batch_size": values["num_sw_batch_size"],
        "validation_data_device": values["validation_data_device"],
        "model_parallel_mode": mode,
        "model_parallel_devices": devices if mode != NO_MODEL_PARALLEL else None,
        "source": f"cache {search.cache_file.name}",
    }
