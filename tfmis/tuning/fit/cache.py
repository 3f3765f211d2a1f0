"""The GPU-fit search's cache: a finished search's report, kept by what decides its result and reused at once.

The key (`cache_key`) hashes the device (name, total memory; the GPU count when model-parallel settings are
searched), TensorFlow's version, the measured part of the config, the dataset shape and the specs, never the free
memory. A cached report is reused unless it was searched under a smaller budget in which something ran out of memory
(`read_cache`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from tfmis.config import Config, to_dict
from tfmis.tuning.fit.candidates import model_parallel_settings
from tfmis.tuning.fit.memory import NO_MODEL_PARALLEL, is_memory_failure
from tfmis.tuning.fit.specs import FitSpecs, specs_to_dict

CACHE_VERSION = 2  # 2: trials time the loop of training.steps_per_loop steps (1 timed single steps)


def default_cache_dir() -> Path:
    """`$TFMIS_CACHE_DIR/gpu_fit`, else `~/.cache/tfmis/gpu_fit`."""
    root = os.environ.get("TFMIS_CACHE_DIR") or Path.home() / ".cache" / "tfmis"
    return Path(root) / "gpu_fit"


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


def cache_file(cache_dir: Path, key: str) -> Path:
    """The cache file of the search whose key is `key`: its name holds the key's first 24 hex digits."""
    return Path(cache_dir) / f"gpu_fit-{key[:24]}.json"


def read_cache(path: Path, key: str, budget_mb: float) -> dict | None:
    """The cached report of the search `key` at `path`, if one was made under a budget that still holds; else None.

    A file that cannot be read, is not JSON or holds another key is no cache. Trials measured under a larger budget
    are valid under a smaller one; under a larger budget the candidates that did not fit before might fit now, so
    a report in which something ran out of memory is not reused then (a line on standard error says so).
    """
    if not path.is_file():
        return None
    try:
        cached = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if cached.get("cache", {}).get("key") != key:
        return None
    if budget_mb > cached["budget_mb"] and any(is_memory_failure(r) for r in cached["trials"]):
        print(
            f"GPU-fit cache {path} was searched under a smaller budget ({cached['budget_mb']:.0f} MB < "
            f"{budget_mb:.0f} MB) and some configurations did not fit then: searching again",
            file=sys.stderr,
        )
        return None
    return cached
