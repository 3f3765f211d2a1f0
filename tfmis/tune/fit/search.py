"""GPU-fit search: batch size, sliding-window batch size, placement (recompute, model parallelism) from measured
memory and speed.

Keras Tuner proposes configurations (Bayesian optimisation by default, an exhaustive grid on
request) over a search space declared up front; each one is measured in a fresh subprocess
(`tfmis.tune.fit.trial`: the real model, loss, optimizer, precision and jit_compile, warm-up and timed
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
  visible, `training.jit_compile`, a batch the pipeline's micro-batches do not divide, a setting that
  already failed to set up) is `skipped` with its reason, without a trial.
- The result is cached by device (name, total memory), TensorFlow version, the measured part of
  the config, the dataset shape and the specs — never by free memory — and reused at once.

Example:
```python
result = GpuFitSearch(load_config("configs/demo.yaml"), load_specs("specs.yaml"), output_dir="runs/fit").run()
print(result["chosen"]["values"])          # {"num_images_per_batch": 4, "num_sw_batch_size": 8, ...}
```
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from tfmis.config import Config, from_dict, save_config, to_dict
from tfmis.errors import DataError, MissingInput, ResourceError
from tfmis.hardware import usable_cpu_count
from tfmis.tune.fit.memory import NO_MODEL_PARALLEL, MemoryModel, is_memory_failure, model_parallel_of
from tfmis.tune.fit.specs import FitSpecs, load_specs, model_parallel_setting, parse_model_parallel, specs_to_dict
from tfmis.utils.io import atomic_write_json

OBJECTIVE = "epoch_seconds"
REPORT_FILE = "fit_report.json"
CONFIG_FILE = "fit.yaml"
PLOT_FILE = "memory.png"
CACHE_VERSION = 2  # 2: trials time the loop of training.steps_per_loop steps (1 timed single steps)

# the searched values and where they live in the config
VALUE_KEYS = {
    "num_images_per_batch": ("pipeline", "num_images_per_batch"),
    "num_sw_batch_size": ("validation", "num_sw_batch_size"),
    "validation_data_device": ("validation", "validation_data_device"),
    "recompute": ("model", "recompute"),
    # `none` or `mode:devices`: runtime.model_parallel.mode and .devices (apply_values)
    "model_parallel": ("runtime", "model_parallel"),
}


class NoConfigurationFits(ResourceError, RuntimeError):
    """No measured configuration stayed within the memory budget's safety margin."""


def default_cache_dir() -> Path:
    """`$TFMIS_CACHE_DIR/gpu_fit`, else `~/.cache/tfmis/gpu_fit`."""
    root = os.environ.get("TFMIS_CACHE_DIR") or Path.home() / ".cache" / "tfmis"
    return Path(root) / "gpu_fit"


# ---------------------------------------------------------------------------------------------- what is measured


def search_context(config: Config) -> dict:
    """What the trials and the objective need from the converted dataset (index.json, fingerprint.json)."""
    from tfmis.data.records import load_index, split_entry

    dataset_dir = Path(config.data.dataset_dir)
    index = load_index(dataset_dir)
    fingerprint_path = dataset_dir / "fingerprint.json"
    if not fingerprint_path.is_file():
        raise MissingInput(
            f"{fingerprint_path}: not found; the GPU-fit search sizes its sliding-window test "
            "volume from the dataset fingerprint: convert the dataset again with tfmis-convert"
        )
    fingerprint = json.loads(fingerprint_path.read_text())
    volume_shape = [int(s) for s in fingerprint["dataset"]["shape_p99_5"]]
    try:
        train_cases = len(split_entry(index, config.data.train_split)["cases"])
        val_cases = len(split_entry(index, config.data.val_split)["cases"])
    except KeyError as e:
        raise DataError(f"data: {e.args[0]} ({dataset_dir})") from None
    if config.validation.max_cases is not None:
        val_cases = min(val_cases, config.validation.max_cases)
    return {
        "volume_shape": volume_shape,
        "in_channels": len(index["source"]["modalities"]),
        "num_classes": len(index["source"]["labels"]),
        "train_patches_per_epoch": train_cases * config.pipeline.num_crops_per_image,
        "validation_cases": val_cases,
        "val_interval": config.validation.val_interval,
    }


def estimated_epoch_seconds(images_per_second: float, sw_seconds: float, context: dict) -> float:
    """Training patches ÷ images/s + validation cases × sliding-window seconds, per epoch."""
    train = context["train_patches_per_epoch"] / images_per_second
    validation = context["validation_cases"] * sw_seconds / context["val_interval"]
    return train + validation


def apply_values(config: Config, values: dict) -> Config:
    """A copy of `config` with the searched values set.

    `model_parallel` (`none`, `spatial:2`, ...) sets `runtime.model_parallel.mode` and `.devices`, and with a
    mode `runtime.distribution: none` (one process runs the model over its devices); `micro_batches`, `axis`
    and `data` stay the config's.
    """
    data = to_dict(config)
    for name, value in values.items():
        section, key = VALUE_KEYS[name]
        if name == "model_parallel":
            mode, devices = parse_model_parallel(value)
            data["runtime"]["model_parallel"]["mode"] = mode
            if mode != NO_MODEL_PARALLEL:
                data["runtime"]["model_parallel"]["devices"] = devices
                data["runtime"]["distribution"] = "none"
            continue
        data[section][key] = value
    return from_dict(Config, data)


def model_parallel_settings(config: Config, specs: FitSpecs) -> list[str]:
    """The model-parallel settings searched: the specs' `range_model_parallel`, else the config's own one."""
    if specs.range_model_parallel is not None:
        return list(specs.range_model_parallel)
    mp = config.runtime.model_parallel
    return [model_parallel_setting(mp.mode, mp.devices) if mp.enabled else NO_MODEL_PARALLEL]


def model_parallel_skip_reason(config: Config, values: dict, gpu_count: int | None) -> str | None:
    """Why a candidate's model-parallel setting cannot run here (no trial is started), or None.

    Args:
        config: the searched config (its `runtime.model_parallel.data`, `micro_batches`, `training.jit_compile`).
        values: the candidate (`model_parallel`, `num_images_per_batch`).
        gpu_count: the GPUs visible to the search; None on a machine without GPUs (logical CPU devices: any N).

    Example:
        >>> from tfmis.config import Config
        >>> values = {"model_parallel": "spatial:4", "num_images_per_batch": 2}
        >>> model_parallel_skip_reason(Config(), values, gpu_count=2)
        'spatial:4 needs 4 GPUs (devices 4 x runtime.model_parallel.data 1) but 2 are visible'
        >>> model_parallel_skip_reason(Config(), values, gpu_count=None) is None
        True
    """
    setting = values.get("model_parallel") or NO_MODEL_PARALLEL
    mode, devices = parse_model_parallel(setting)
    if mode == NO_MODEL_PARALLEL:
        return None
    mp = config.runtime.model_parallel
    needed = devices * mp.data
    if gpu_count is not None and needed > gpu_count:
        return (
            f"{setting} needs {needed} GPUs (devices {devices} x runtime.model_parallel.data {mp.data}) "
            f"but {gpu_count} {'is' if gpu_count == 1 else 'are'} visible"
        )
    if config.training.jit_compile:
        return (
            f"{setting}: training.jit_compile: true does not work with runtime.model_parallel (XLA compiles for one "
            "device); search with training.jit_compile=false to measure it"
        )
    groups = mp.data * (mp.micro_batches if mode == "pipeline" else 1)
    batch = values["num_images_per_batch"]
    if batch % groups:
        what = f"data {mp.data} x micro_batches {mp.micro_batches}" if mode == "pipeline" else f"data {mp.data}"
        return (
            f"{setting}: batch {batch} is not a multiple of runtime.model_parallel.{what} (the step's images are "
            "split over them)"
        )
    return None


def cache_key(config: Config, context: dict, device: dict, specs: FitSpecs, strategy: str) -> str:
    """Hash of what decides the result: device, TensorFlow, the measured config, data shape, specs, strategy."""
    import tensorflow as tf

    c = to_dict(config)
    measured = {
        "model": c["model"],
        "loss": c["loss"],
        "optimizer": c["optimizer"],
        "patch_size": c["pipeline"]["patch_size"],
        "training": {k: c["training"][k] for k in ("precision", "jit_compile", "accumulation_steps", "steps_per_loop")},
        "augment_placement": c["pipeline"]["augment"]["placement"],
        "validation": {k: c["validation"][k] for k in ("roi_size", "overlap", "mode")},
    }
    device_keys = ["kind", "name", "total_mb", "cpu_count"]
    specs_dict = specs_to_dict(specs)
    if model_parallel_settings(config, specs) != [NO_MODEL_PARALLEL]:
        # micro_batches, axis and data shape the trials; how many GPUs there are decides which settings run
        measured["model_parallel"] = c["runtime"]["model_parallel"]
        device_keys.append("gpu_count")
    if specs.range_model_parallel is None:  # the default: the key of a search without it is what it was before
        specs_dict["universal"].pop("range_model_parallel")
    identity = {
        "version": CACHE_VERSION,
        "tensorflow": tf.__version__,
        "device": {k: device.get(k) for k in device_keys},
        "config": measured,
        "context": context,
        "specs": specs_dict,
        "strategy": strategy,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- choosing


def choose(records: list[dict], budget_mb: float, margin: float) -> dict | None:
    """The measured trial with the shortest estimated epoch whose peak is within margin × budget."""
    eligible = [r for r in records if r["status"] == "ok" and r["peak_mb"] <= margin * budget_mb]
    if not eligible:
        return None
    return min(eligible, key=lambda r: (r[OBJECTIVE], r["peak_mb"]))


def fitted_config(config: Config, chosen: dict, records: list[dict], context: dict) -> Config:
    """The config with the chosen values, its validation placement turned into a memory policy.

    A chosen accelerator placement becomes `auto` (volumes larger than the measured 99.5th
    percentile fall back instead of ending the run). When the accelerator ran out of memory on
    the test volume at the chosen sw batch, the CPU is chosen but smaller volumes may still fit:
    `auto` with `cpu_from_voxels` seeded with that volume's size sends the large ones to the CPU
    straight away.
    """
    values = dict(chosen["values"])
    extra = {}
    placement = values["validation_data_device"]
    voxels = int(np.prod(context["volume_shape"]))
    policy_known = "cpu_from_voxels" in {f.name for f in dataclasses.fields(type(config.validation))}
    if policy_known and placement == "accelerator":
        values["validation_data_device"] = "auto"
    elif (
        policy_known
        and placement == "cpu"
        and any(
            is_memory_failure(r)
            and r.get("failed_phase") == "validation"
            and r["values"]["validation_data_device"] == "accelerator"
            and r["values"]["num_sw_batch_size"] <= values["num_sw_batch_size"]
            for r in records
        )
    ):
        values["validation_data_device"] = "auto"
        extra["cpu_from_voxels"] = voxels
    fitted = apply_values(config, values)
    for key, value in extra.items():
        setattr(fitted.validation, key, value)
    return fitted


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
        runner: the trial runner (default `tfmis.tune.fit.trial.run_trial`).
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
        if strategy not in ("bayesian", "grid"):
            raise ValueError(f"strategy must be 'bayesian' or 'grid', got {strategy!r}")
        from tfmis.hardware import GPU_RESERVED_MB, accelerators, host_memory
        from tfmis.tune.fit.trial import run_trial, trial_device

        self.config, self.specs, self.strategy = config, specs, strategy
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

    # -------------------------------------------------------------- search space

    def hyperparameters(self):
        """The Keras Tuner search space, declared up front."""
        import keras_tuner

        s = self.specs
        hp = keras_tuner.HyperParameters()
        log = s.sampling == "log"
        for name, (lo, hi) in (
            ("num_images_per_batch", s.range_num_images_per_batch),
            ("num_sw_batch_size", s.range_num_sw_batch_size),
        ):
            if lo == hi:
                hp.Fixed(name, lo)
            else:
                hp.Int(name, lo, hi, step=2 if log else 1, sampling="log" if log else "linear")
        if len(self.placements) > 1:
            hp.Choice("validation_data_device", self.placements)
        else:
            hp.Fixed("validation_data_device", self.placements[0])
        if s.search_recompute:
            hp.Boolean("recompute")
        else:
            hp.Fixed("recompute", bool(self.config.model.recompute))
        if len(self.model_parallel) > 1:
            hp.Choice("model_parallel", self.model_parallel)
        else:
            hp.Fixed("model_parallel", self.model_parallel[0])
        return hp

    def grid_size(self) -> int:
        sizes = []
        for hp in self.hyperparameters().space:
            values = getattr(hp, "values", None)
            sizes.append(len(list(values)) if values is not None else 1)
        return int(np.prod(sizes))

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
        from tfmis.tune.fit.report import trial_line

        self._bar.write(trial_line(record, self.budget_mb))
        if record["status"] in ("ok", "failed") or self.strategy == "grid":  # the bar counts runs, or grid points
            self._bar.update(1)
        best = choose(self.records, self.budget_mb, self.specs.memory_margin)
        if best is not None:
            self._bar.set_postfix(best=f"trial {best['trial']}: {best[OBJECTIVE]:.1f} s/epoch")

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
            smallest = min((r for r in self.records if r.get("peak_mb")), key=lambda r: r["peak_mb"], default=None)
            hint = (
                f"; the smallest measured peak was {smallest['peak_mb']:.0f} MB (trial {smallest['trial']})"
                if smallest
                else ""
            )
            raise NoConfigurationFits(
                f"no configuration fits within {self.specs.memory_margin:.0%} of the {self.budget_mb:.0f} MB memory "
                f"budget{hint}. Lower pipeline.patch_size, try model.recompute or training.precision=mixed_float16, "
                f"or raise --memory-budget-mb. Details: {self.output_dir / REPORT_FILE}"
            )
        return report

    @property
    def cache_file(self) -> Path:
        """This search's cache file: its key names the device, TensorFlow, the measured config, data and specs."""
        return self.cache_dir / f"gpu_fit-{self.key[:24]}.json"

    def read_cache(self) -> dict | None:
        """The cached report of this very search, if one was made under a budget that still holds; else None."""
        path = self.cache_file
        if not path.is_file():
            return None
        try:
            cached = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if cached.get("cache", {}).get("key") != self.key:
            return None
        # trials measured under a larger budget are valid under a smaller one; under a larger budget
        # the candidates that did not fit before might fit now, unless nothing ran out of memory
        if self.budget_mb > cached["budget_mb"] and any(is_memory_failure(r) for r in cached["trials"]):
            print(
                f"GPU-fit cache {path} was searched under a smaller budget ({cached['budget_mb']:.0f} MB < "
                f"{self.budget_mb:.0f} MB) and some configurations did not fit then: searching again",
                file=sys.stderr,
            )
            return None
        return cached

    def _search(self) -> None:
        from tfmis.tune import kt
        from tfmis.utils.progress import progress_bar

        hp = self.hyperparameters()
        common = {
            "objective": OBJECTIVE,
            "direction": "min",
            "hyperparameters": hp,
            "seed": self.specs.seed,
            "stop_when": self.finished,
        }
        if self.strategy == "bayesian":
            num_initial = self.specs.num_initial_points or max(3, self.specs.num_trials // 3)
            # the Gaussian process may propose a point already tried: a random unseen one instead
            oracle = kt.make_oracle(
                "bayesian",
                max_trials=10 * self.specs.num_trials + 50,
                num_initial_points=num_initial,
                replace_repeats=True,
                **common,
            )
        else:
            oracle = kt.make_oracle("grid", replace_repeats=False, **common)
        tuner = kt.make_tuner(
            self._trial,
            OBJECTIVE,
            oracle=oracle,
            directory=str(self.output_dir / "keras_tuner"),
            project_name="gpu_fit",
            overwrite=True,
        )
        total = self.grid_size() if self.strategy == "grid" else self.specs.num_trials
        space = ", ".join(f"{h.name} {_describe_hp(h)}" for h in hp.space)
        print(
            f"GPU-fit search ({self.strategy}, {total} trials) on {self.device['name']} "
            f"({self.device['kind']}, budget {self.budget_mb:.0f} MB, choosing within "
            f"{self.specs.memory_margin:.0%}): {space}",
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
        chosen = choose(self.records, self.budget_mb, self.specs.memory_margin)
        for r in self.records:
            r["chosen"] = chosen is not None and r["trial"] == chosen["trial"]
        statuses = ("ok", "failed", "pruned", "skipped")
        counts = {status: sum(r["status"] == status for r in self.records) for status in statuses}
        counts["run"] = counts["ok"] + counts["failed"]
        return {
            "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": self.device,
            "budget_mb": self.budget_mb,
            "memory_margin": self.specs.memory_margin,
            "strategy": self.strategy,
            "specs": specs_to_dict(self.specs),
            "context": self.context,
            "objective": f"{OBJECTIVE}: training patches per epoch / images per second + validation cases x "
            "sliding-window seconds / val_interval (minimised)",
            "trials": self.records,
            "counts": counts,
            "chosen": None
            if chosen is None
            else {
                k: chosen.get(k)
                for k in ("trial", "values", OBJECTIVE, "images_per_second", "step_seconds", "sw_seconds", "peak_mb")
            },
            "memory_model": self.model.summary(),
            "cache": {"key": self.key, "file": str(cache_file), "hit": from_cache},
            "elapsed_seconds": elapsed,
        }

    def _write_outputs(self, report: dict) -> None:
        from tfmis.tune.fit.report import plot_memory, trials_table

        self.output_dir.mkdir(parents=True, exist_ok=True)
        chosen = next((r for r in self.records if r.get("chosen")), None)
        if chosen is not None:
            fitted = fitted_config(self.config, chosen, self.records, self.context)
            report["fitted"] = {
                "pipeline.num_images_per_batch": fitted.pipeline.num_images_per_batch,
                "validation.num_sw_batch_size": fitted.validation.num_sw_batch_size,
                "validation.validation_data_device": fitted.validation.validation_data_device,
                "model.recompute": fitted.model.recompute,
                "runtime.model_parallel.mode": fitted.runtime.model_parallel.mode,
            }
            if fitted.runtime.model_parallel.enabled:
                report["fitted"]["runtime.model_parallel.devices"] = fitted.runtime.model_parallel.devices
                report["fitted"]["runtime.distribution"] = fitted.runtime.distribution
            if getattr(fitted.validation, "cpu_from_voxels", None) is not None:
                report["fitted"]["validation.cpu_from_voxels"] = fitted.validation.cpu_from_voxels
            save_config(fitted, self.output_dir / CONFIG_FILE)
        atomic_write_json(self.output_dir / REPORT_FILE, report)
        plot_memory(report, self.output_dir / PLOT_FILE)
        print(trials_table(report))


def _describe_hp(hp) -> str:
    values = getattr(hp, "values", None)
    if values is not None:
        values = [int(v) if isinstance(v, float) and v.is_integer() else v for v in values]
        return f"{values}" if len(values) <= 8 else f"[{values[0]}..{values[-1]}] ({len(values)} values)"
    return f"= {hp.value}"


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
