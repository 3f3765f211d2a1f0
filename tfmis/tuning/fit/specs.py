"""GPU-fit search specs, in the shape of MONAI Auto3DSeg's `gpu_customization_specs`.

A YAML or JSON file (or dict) with a `universal` section and optional per-model sections that
override it key by key (tfmis trains one model, `unet`). Sections of Auto3DSeg's other algorithms
(`dints`, `segresnet`, ...) are accepted and ignored, so a MONAI specs file can be reused as is.

Example (YAML):
```yaml
universal:
  num_trials: 20
  range_num_images_per_batch: [1, 20]
  range_num_sw_batch_size: [1, 40]
unet:
  search_recompute: true       # also try activation recomputation, so that a larger batch can fit
  range_model_parallel: [none, spatial:2]   # also try the model cut into 2 slabs over 2 devices
```
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from pathlib import Path
from typing import Literal, Optional

from tfmis.config import ConfigError, from_dict, read_yaml

MODEL_NAME = "unet"
MODEL_PARALLEL_KEY = "range_model_parallel"
MODEL_PARALLEL_MODES = ("pipeline", "spatial")  # tfmis.networks.parallel.MODES
# Auto3DSeg's algorithm names: their sections are read by MONAI, not by tfmis
AUTO3DSEG_ALGOS = ("dints", "segresnet", "segresnet2d", "swinunetr")


@dataclasses.dataclass(kw_only=True, frozen=True)
class FitSpecs:
    """What the GPU-fit search varies, how many trials it measures, and how it chooses.

    Args:
        num_trials: configurations measured in a trial subprocess; candidates the memory model
            prunes without running them do not count.
        range_num_images_per_batch: `pipeline.num_images_per_batch` (per replica), inclusive.
        range_num_sw_batch_size: `validation.num_sw_batch_size`, inclusive.
        range_validation_data_device: placements tried for the whole validation volume
            (`accelerator`, `cpu`); on a machine without an accelerator only `cpu` is searched.
        search_recompute: also try `model.recompute` true and false (else the config's value).
        range_model_parallel: model-parallel settings tried (`runtime.model_parallel`): `none` (one
            device) and `mode:devices` entries such as `spatial:2`, `spatial:4`, `pipeline:2`; a pipeline
            keeps the config's `micro_batches` (default 2), and `axis` and `data` are the config's too.
            On GPUs an entry needing more GPUs than are visible is skipped with its reason; on a CPU it
            runs on logical CPU devices (one memory, so its peak is the whole process's). Default
            (null): the config's own setting only (`none` unless the config sets one).
        sampling: `linear` (every integer in the ranges) or `log` (powers of two from the lower
            bound: 1, 2, 4, ...): a grid over log ranges stays small enough to run exhaustively.
        memory_margin: the chosen configuration's measured peak must be at most this fraction of
            the memory budget (headroom for fragmentation and the largest cases).
        prune: skip candidates the memory model predicts clearly over the budget.
        prune_tolerance: "clearly": predicted peak > budget × (1 + prune_tolerance).
        warmup_steps, timed_steps: training steps per trial before / while timing.
        trial_timeout_s: a trial running longer fails ("timed out").
        num_initial_points: Bayesian optimisation: random trials before the Gaussian process
            (default: a third of num_trials, at least 3).
        seed: the tuner's random seed.
    """

    num_trials: int = 20
    range_num_images_per_batch: tuple[int, int] = (1, 20)
    range_num_sw_batch_size: tuple[int, int] = (1, 40)
    range_validation_data_device: tuple[Literal["accelerator", "cpu"], ...] = ("accelerator", "cpu")
    search_recompute: bool = False
    range_model_parallel: Optional[tuple[str, ...]] = None
    sampling: Literal["linear", "log"] = "linear"
    memory_margin: float = 0.9
    prune: bool = True
    prune_tolerance: float = 0.1
    warmup_steps: int = 2
    timed_steps: int = 3
    trial_timeout_s: float = 600.0
    num_initial_points: Optional[int] = None
    seed: int = 0

    def __post_init__(self):
        if self.num_trials < 1:
            raise ValueError(f"num_trials must be >= 1, got {self.num_trials}")
        for name in ("range_num_images_per_batch", "range_num_sw_batch_size"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be [low, high] with 1 <= low <= high, got [{lo}, {hi}]")
        if not self.range_validation_data_device:
            raise ValueError("range_validation_data_device must name at least one placement (accelerator, cpu)")
        if not 0 < self.memory_margin <= 1:
            raise ValueError(f"memory_margin must be in (0, 1], got {self.memory_margin}")
        if self.prune_tolerance < 0:
            raise ValueError(f"prune_tolerance must be >= 0, got {self.prune_tolerance}")
        if self.warmup_steps < 0 or self.timed_steps < 1:
            raise ValueError("warmup_steps must be >= 0 and timed_steps >= 1")
        if self.trial_timeout_s <= 0:
            raise ValueError(f"trial_timeout_s must be > 0, got {self.trial_timeout_s}")
        if self.range_model_parallel is not None:
            if not self.range_model_parallel:
                raise ValueError(
                    f"{MODEL_PARALLEL_KEY} must name at least one setting, e.g. [none, spatial:2]; "
                    "leave it out to keep the config's runtime.model_parallel"
                )
            settings = [model_parallel_setting(*parse_model_parallel(e)) for e in self.range_model_parallel]
            object.__setattr__(self, "range_model_parallel", tuple(dict.fromkeys(settings)))  # canonical, no repeats


def parse_model_parallel(entry: str) -> tuple[str, int]:
    """(mode, devices) of a `range_model_parallel` entry: `none` (one device) or `mode:devices`.

    Raises:
        ValueError: an entry that is neither, naming the key and what to write.

    Example:
        >>> parse_model_parallel("none"), parse_model_parallel(" Spatial:4 ")
        (('none', 1), ('spatial', 4))
    """
    text = str(entry).strip().lower()
    if text == "none":
        return "none", 1
    mode, sep, count = text.partition(":")
    mode = mode.strip()
    fix = "write none, or mode:devices with mode pipeline or spatial and 2 or more devices, e.g. spatial:2"
    if mode not in MODEL_PARALLEL_MODES:
        close = difflib.get_close_matches(mode, ["none", *MODEL_PARALLEL_MODES], n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{MODEL_PARALLEL_KEY}: {entry!r} is not a model-parallel setting{hint}: {fix}")
    if not sep:
        raise ValueError(f"{MODEL_PARALLEL_KEY}: {entry!r} names no device count: write {mode}:2 (mode:devices)")
    try:
        devices = int(count.strip())
    except ValueError:
        devices = 0
    if devices < 2:
        raise ValueError(
            f"{MODEL_PARALLEL_KEY}: {entry!r}: the device count must be an integer >= 2 (one device is `none`): {fix}"
        )
    return mode, devices


def model_parallel_setting(mode: str, devices: int) -> str:
    """The canonical entry: `none` or `mode:devices` (the search's value and its report's column)."""
    return "none" if mode == "none" else f"{mode}:{devices}"


class SpecsError(ConfigError):
    """A specs file that cannot be read, or a bad section, key or value in it (exit 2)."""

    label = "specs error"


def load_specs(source: str | Path | dict | None = None, **overrides) -> FitSpecs:
    """Reads specs from a YAML/JSON file or dict (None = defaults); `overrides` replace single keys.

    Raises:
        SpecsError: an unreadable file, an unknown section or key, or a bad value, named with its section.
    """
    try:
        return _load_specs(source, **overrides)
    except SpecsError:
        raise
    except ConfigError as e:
        raise SpecsError(str(e)) from e


def _load_specs(source: str | Path | dict | None = None, **overrides) -> FitSpecs:
    data = {}
    where = "specs"
    if isinstance(source, dict):
        data = source
    elif source is not None:
        where = str(source)
        data = read_yaml(source, "specs") or {}  # YAML reads JSON too
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected sections such as 'universal:', got {type(data).__name__}")
    for key in data:
        if key in ("universal", MODEL_NAME):
            continue
        if key in AUTO3DSEG_ALGOS:
            print(
                f"{where}: section '{key}' is for MONAI Auto3DSeg's {key}; tfmis trains '{MODEL_NAME}', ignoring it",
                file=sys.stderr,
            )
            continue
        close = difflib.get_close_matches(str(key), ["universal", MODEL_NAME], n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else f"; valid sections: universal, {MODEL_NAME}"
        raise ConfigError(f"{where}: unknown section '{key}'{hint}")
    for section in ("universal", MODEL_NAME):
        if data.get(section) is not None and not isinstance(data[section], dict):
            raise ConfigError(f"{where}: section '{section}' must be a mapping of keys")
    merged = {**(data.get("universal") or {}), **(data.get(MODEL_NAME) or {})}
    merged.update({k: v for k, v in overrides.items() if v is not None})
    for entry in merged.get(MODEL_PARALLEL_KEY) or []:
        if isinstance(entry, dict):  # YAML reads `spatial: 2` (a space after the colon) as a mapping
            written = ", ".join(f"{k}: {v}" for k, v in entry.items())
            raise ConfigError(
                f"{where}: specs.{MODEL_PARALLEL_KEY}: {{{written}}} is a mapping; write the entry without a "
                f"space after the colon or quote it, e.g. {', '.join(f'{k}:{v}' for k, v in entry.items())}"
            )
    try:
        return from_dict(FitSpecs, merged, prefix="specs.")
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e


def specs_to_dict(specs: FitSpecs) -> dict:
    """Plain values (tuples as lists), in the Auto3DSeg shape `{universal: {...}}`."""
    return {"universal": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(specs).items()}}
