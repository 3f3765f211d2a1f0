"""What a hyperparameter search varies and how it scores a trial: the space file and the objective.

The space file maps dotted config keys to choices (`{values: [...]}`, or a bare list) or ranges
(`{min, max}` with optional `step` and `sampling: linear|log`; integer keys give integer ranges).
Every key and every value is checked against the config dataclasses before anything runs.

The objective is `best_mean_dice` (the best validation mean Dice, maximised) or `time_to_dice:T`
(training seconds until the validation mean Dice first reached T, from `thresholds_reached`,
minimised; a run that never reached it scores `NOT_REACHED_SECONDS`).

Example:
```python
space = load_space("configs/hpo_space.yaml", load_config("configs/demo.yaml"))
print(space.grid(), Objective.parse("time_to_dice:0.9").direction)
```
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

from tfmis.config import Config, ConfigError, from_dict, read_yaml, set_key, to_dict, validate

NOT_REACHED_SECONDS = 1.0e6  # time_to_dice of a run that never reached the target
SET_PER_TRIAL = ("output.dir",)  # keys the search sets itself


@dataclasses.dataclass
class Param:
    """One searched config key.

    Args:
        key: the dotted config key, e.g. `optimizer.learning_rate`.
        kind: "choice" (a list of values), "int" or "float" (a range).
        values: the choices, as the config holds them (choice only).
        min, max, step, sampling: the range (int/float); `step` is a multiplier under log sampling,
            as in Keras Tuner.
        encoded: the choices are not scalars of one type (lists, null): Keras Tuner sees their JSON text.
    """

    key: str
    kind: str
    values: list | None = None
    min: float | None = None
    max: float | None = None
    step: float | None = None
    sampling: str = "linear"
    encoded: bool = False

    def grid_values(self) -> list | None:
        """Every value of a finite parameter (choices, integer ranges, ranges with a step); None otherwise."""
        if self.kind == "choice":
            return list(self.values)
        if self.step is None and self.kind == "float":
            return None
        step, log = (self.step, self.sampling == "log") if self.step is not None else (1, False)
        values, v, i = [], self.min, 0
        while v <= self.max * (1 + 1e-12) + 1e-12:
            values.append(int(round(v)) if self.kind == "int" else float(f"{v:.12g}"))
            i += 1
            v = self.min * step**i if log else self.min + step * i
        return values

    def add_to(self, hp) -> None:
        """Declares this parameter in a `keras_tuner.HyperParameters`."""
        if self.kind == "choice":
            hp.Choice(self.key, [json.dumps(v) for v in self.values] if self.encoded else list(self.values))
        elif self.kind == "int":
            hp.Int(
                self.key,
                int(self.min),
                int(self.max),
                step=int(self.step) if self.step else None,
                sampling=self.sampling,
            )
        else:
            hp.Float(self.key, self.min, self.max, step=self.step, sampling=self.sampling)

    def decode(self, value):
        """The config value of a value Keras Tuner hands over."""
        if self.encoded:
            return json.loads(value)
        if self.kind == "int":
            return int(round(value))
        if self.kind == "float":
            return float(value)
        return value

    def describe(self) -> str:
        if self.kind == "choice":
            return json.dumps(self.values)
        step = f", step {self.step:g}" if self.step else ""
        return f"[{self.min:g}, {self.max:g}] {self.sampling}{step}" + (" (integers)" if self.kind == "int" else "")

    def to_dict(self) -> dict:
        if self.kind == "choice":
            return {"values": self.values}
        d = {"min": self.min, "max": self.max, "sampling": self.sampling}
        if self.step is not None:
            d["step"] = self.step
        return d


@dataclasses.dataclass
class SearchSpace:
    """The searched config keys, in the space file's order (the grid's first key varies slowest)."""

    params: list[Param]
    source: str = "space"

    @property
    def keys(self) -> list[str]:
        return [p.key for p in self.params]

    def finite(self) -> bool:
        return all(p.grid_values() is not None for p in self.params)

    def grid(self) -> list[dict]:
        """Every combination, first key slowest (as nested loops over the file's keys)."""
        columns = []
        for p in self.params:
            values = p.grid_values()
            if values is None:
                raise ConfigError(
                    f"{self.source}: {p.key} is a continuous range {p.describe()}: a grid needs "
                    f"`values` or a `step`; or search it with --strategy random or bayesian"
                )
            columns.append(values)
        return [dict(zip(self.keys, combo)) for combo in itertools.product(*columns)]

    def hyperparameters(self):
        """The Keras Tuner search space."""
        import keras_tuner

        hp = keras_tuner.HyperParameters()
        for p in self.params:
            p.add_to(hp)
        return hp

    def to_tuner(self, values: dict) -> dict:
        """Config values → the values Keras Tuner records (JSON text for encoded choices)."""
        return {p.key: json.dumps(values[p.key]) if p.encoded else values[p.key] for p in self.params}

    def decode(self, values: dict) -> dict:
        """Keras Tuner's values → config values, in the space's order."""
        by_key = {p.key: p for p in self.params}
        return {key: by_key[key].decode(values[key]) for key in self.keys if key in values}

    def to_dict(self) -> dict:
        return {p.key: p.to_dict() for p in self.params}


def overrides_for(values: dict) -> list[str]:
    """`key=value` overrides (as `tfmis.train --set` takes them) for a trial's values."""
    return [f"{key}={json.dumps(value)}" for key, value in values.items()]


def _config_value(data: dict, key: str, value, source: str):
    """`value` as the config holds it at `key` (checked by `from_dict` and `validate`), or a ConfigError
    naming the key."""
    tree = json.loads(json.dumps(data))
    try:
        set_key(tree, key, value)
        config = from_dict(Config, tree)
        validate(config)
    except ConfigError as e:
        text = str(e)
        raise ConfigError(
            f"{source}: {key}: {text}"
            if "unknown config key" in text or "not a config section" in text
            else f"{source}: {key}={value!r} is not valid: {text}"
        ) from e
    result = to_dict(config)
    for part in key.split("."):
        if not isinstance(result, dict) or part not in result:
            raise ConfigError(f"{source}: {key}: not a config value")
        result = result[part]
    if isinstance(result, dict):
        raise ConfigError(
            f"{source}: {key} is a config section, not a value: name one of its keys, e.g. "
            f"{key}.{next(iter(result), '...')}"
        )
    return result


def parse_space(data, config: Config, source: str = "space") -> SearchSpace:
    """Checks a space mapping against `config`'s dataclasses and returns the `SearchSpace`.

    Args:
        data: {dotted key: {values: [...]} | [...] | {min, max, step?, sampling?}}.
        config: the base config; every key must be one of its values, every choice and both ends of
            every range must be valid there.
        source: the file name errors start with.

    Raises:
        ConfigError: naming the key (unknown keys suggest the closest valid one).

    Example:
        >>> from tfmis.config import Config
        >>> space = parse_space({"loss.name": {"values": ["dice", "dice_ce"]}}, Config())
        >>> space.grid()
        [{'loss.name': 'dice'}, {'loss.name': 'dice_ce'}]
    """
    if not isinstance(data, dict) or not data:
        raise ConfigError(
            f"{source}: expected a mapping of dotted config keys to choices, e.g. "
            "'optimizer.learning_rate: {values: [0.001, 0.0003]}'"
        )
    base = to_dict(config)
    params = []
    for key, spec in data.items():
        key = str(key)
        if key in SET_PER_TRIAL:
            raise ConfigError(
                f"{source}: {key} is set by the search for each trial (<output>/trials/<id>); remove it from the space"
            )
        if isinstance(spec, list):
            spec = {"values": spec}
        if not isinstance(spec, dict):
            raise ConfigError(f"{source}: {key}: expected {{values: [...]}} or {{min: ..., max: ...}}, got {spec!r}")
        unknown = set(spec) - {"values", "min", "max", "step", "sampling"}
        if unknown:
            raise ConfigError(
                f"{source}: {key}: unknown field(s) {sorted(unknown)}; use values, or min, max, step and sampling"
            )
        if "values" in spec:
            if set(spec) != {"values"}:
                raise ConfigError(f"{source}: {key}: give either values or a range (min, max), not both")
            raw = spec["values"]
            if not isinstance(raw, list) or not raw:
                raise ConfigError(f"{source}: {key}: values must be a non-empty list, got {raw!r}")
            values = [_config_value(base, key, v, source) for v in raw]
            if len({json.dumps(v) for v in values}) != len(values):
                raise ConfigError(f"{source}: {key}: values repeat: {values}")
            scalar_types = {type(v) for v in values}
            encoded = not (len(scalar_types) == 1 and scalar_types <= {int, float, str, bool})
            params.append(Param(key, "choice", values=values, encoded=encoded))
            continue
        if "min" not in spec or "max" not in spec:
            raise ConfigError(
                f"{source}: {key}: a range needs min and max (and optionally step, sampling), or give values: [...]"
            )
        lo = _config_value(base, key, spec["min"], source)
        hi = _config_value(base, key, spec["max"], source)
        if isinstance(lo, bool) or not isinstance(lo, (int, float)):
            raise ConfigError(
                f"{source}: {key} holds {type(lo).__name__} values: a range needs a numeric key; "
                "give values: [...] instead"
            )
        kind = "int" if isinstance(lo, int) else "float"
        sampling = spec.get("sampling", "linear")
        if sampling not in ("linear", "log"):
            raise ConfigError(f"{source}: {key}: sampling must be linear or log, got {sampling!r}")
        if not lo < hi:
            raise ConfigError(f"{source}: {key}: min ({lo}) must be below max ({hi})")
        if sampling == "log" and lo <= 0:
            raise ConfigError(f"{source}: {key}: log sampling needs min > 0, got {lo}")
        step = spec.get("step")
        if step is not None:
            if isinstance(step, str):
                try:
                    step = float(step)
                except ValueError:
                    pass
            if (
                isinstance(step, bool)
                or not isinstance(step, (int, float))
                or step <= 0
                or (sampling == "log" and step <= 1)
                or (kind == "int" and step != int(step))
            ):
                need = (
                    "a multiplier > 1 under log sampling"
                    if sampling == "log"
                    else "a positive integer"
                    if kind == "int"
                    else "a positive number"
                )
                raise ConfigError(f"{source}: {key}: step must be {need}, got {spec['step']!r}")
        params.append(Param(key, kind, min=lo, max=hi, step=step, sampling=sampling))
        for value in params[-1].grid_values() or ():  # every grid value of a range is valid too
            _config_value(base, key, value, source)
    return SearchSpace(params, source)


def load_space(path, config: Config) -> SearchSpace:
    """Reads and checks a space file (YAML or JSON); see `parse_space`.

    Example:
    ```python
    space = load_space("configs/hpo_space.yaml", load_config("configs/demo.yaml"))
    print(space.grid())
    ```
    """
    return parse_space(read_yaml(path, "space"), config, str(path))


# ---------------------------------------------------------------------------------------------- the objective


@dataclasses.dataclass(frozen=True)
class Objective:
    """What a trial scores: `best_mean_dice` (maximised) or `time_to_dice` with a target (minimised).

    Example:
        >>> Objective.parse("time_to_dice:0.9").name
        'time_to_dice_0.90'
        >>> Objective.parse("best_mean_dice").value({"best_mean_dice": 0.8})
        0.8
    """

    kind: str
    target: float | None = None

    @classmethod
    def parse(cls, text: str) -> Objective:
        text = str(text).strip()
        if text == "best_mean_dice":
            return cls("best_mean_dice")
        if text.startswith("time_to_dice:"):
            raw = text.split(":", 1)[1]
            try:
                target = float(raw)
            except ValueError:
                target = math.nan
            if not 0 < target <= 1:
                raise ConfigError(
                    f"--objective {text}: the target must be a mean Dice in (0, 1], e.g. time_to_dice:0.9"
                )
            if abs(round(target, 2) - target) > 1e-9:
                raise ConfigError(
                    f"--objective {text}: summary.json records thresholds to 2 decimals; give the "
                    f"target as {round(target, 2)}"
                )
            return cls("time_to_dice", round(target, 2))
        raise ConfigError(
            f"--objective {text!r}: expected best_mean_dice or time_to_dice:<target>, e.g. time_to_dice:0.9"
        )

    @property
    def name(self) -> str:
        """The metric name Keras Tuner records."""
        return self.kind if self.target is None else f"{self.kind}_{self.target:.2f}"

    @property
    def direction(self) -> str:
        return "max" if self.kind == "best_mean_dice" else "min"

    def __str__(self) -> str:
        return self.kind if self.target is None else f"{self.kind}:{self.target:g}"

    def better(self, a: float, b: float) -> bool:
        return a > b if self.direction == "max" else a < b

    def trial_overrides(self, config: Config) -> list[str]:
        """time_to_dice: adds the target to `training.dice_thresholds` when it is not there."""
        if self.target is None:
            return []
        thresholds = [float(t) for t in config.training.dice_thresholds]
        if any(f"{t:.2f}" == f"{self.target:.2f}" for t in thresholds):
            return []
        return [f"training.dice_thresholds={json.dumps(sorted(thresholds + [self.target]))}"]

    def value(self, summary: dict) -> float:
        """The objective of a finished run's `summary.json`.

        Raises:
            ValueError: best_mean_dice of a run that never validated.
        """
        if self.kind == "best_mean_dice":
            if summary.get("best_mean_dice") is None:
                raise ConfigError(
                    "the run never validated (best_mean_dice is null): make validation.val_interval <= training.epochs"
                )
            return float(summary["best_mean_dice"])
        reached = (summary.get("thresholds_reached") or {}).get(f"{self.target:.2f}")
        return float(reached["elapsed_seconds"]) if reached else NOT_REACHED_SECONDS

    def display(self, value) -> str:
        if value is None:
            return "-"
        if self.kind == "best_mean_dice":
            return f"{value:.4f}"
        return "not reached" if value >= NOT_REACHED_SECONDS else f"{value:.1f} s"
