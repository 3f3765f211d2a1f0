"""From nested dicts (a YAML document) and `--set key=value` overrides to a checked `Config`.

`from_dict` builds a section from its dict, checking every key (an unknown one is named, with the closest valid one)
and every value against the field's type (`_coerce`); `apply_override` applies one `--set`; `parse_config` does both
and then the cross-field checks (`tfmis.config.checks.validate`).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Literal, Union

import yaml

from tfmis.config.checks import validate
from tfmis.config.schema import Config
from tfmis.errors import ConfigError

MOVED_KEYS = {"training.distribution": "runtime.distribution", "training.devices": "runtime.devices"}


def from_dict(cls, data, prefix: str = ""):
    """Builds dataclass `cls` from nested dicts, checking every key and type."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            full = f"{prefix}{key}"
            if full in MOVED_KEYS:
                raise ConfigError(
                    f"config key '{full}' has moved to '{MOVED_KEYS[full]}' (the runtime: section): "
                    f"write it there, e.g. --set {MOVED_KEYS[full]}=..."
                )
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys here: {', '.join(names)}"
            raise ConfigError(f"unknown config key '{full}'{hint}")
    kwargs = {key: _coerce(hints[key], value, f"{prefix}{key}") for key, value in data.items()}
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section's own cross-field checks (e.g. UNetArchitecture, ConversionOptions)
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {e}") from e


def _coerce(tp, value, key: str):
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key + ".")
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            if len(args) < len(typing.get_args(tp)):
                return None
            raise ConfigError(f"{key}: expected {_describe(tp)}, got null")
        errors = []
        for arg in args:  # the first alternative that takes the value, e.g. int | tuple[int, int, int]
            try:
                return _coerce(arg, value, key)
            except ConfigError as e:
                errors.append(e)
        if len(args) == 1:
            raise errors[0]
        raise ConfigError(f"{key}: expected {_describe(tp)}, got {type(value).__name__} {value!r}")
    if origin is tuple:
        items = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list of {_describe(items[0])}, got {type(value).__name__} {value!r}")
        if items[-1] is Ellipsis:
            return tuple(_coerce(items[0], v, f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(items):
            raise ConfigError(f"{key}: expected {len(items)} values, got {len(value)} in {list(value)}")
        return tuple(_coerce(t, v, f"{key}[{i}]") for i, (t, v) in enumerate(zip(items, value)))
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            same_but_case = [str(c) for c in choices if str(c).lower() == str(value).lower()]
            close = same_but_case or difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key}: {value!r} is not one of {list(choices)}{hint}")
        return value
    if origin is dict:
        key_type, item = typing.get_args(tp)
        if value is None:  # `regions:` with nothing under it
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of name: value, got {type(value).__name__} {value!r}")
        return {
            _coerce(key_type, k, f"{key} (the key {k!r})"): _coerce(item, v, f"{key}.{k}") for k, v in value.items()
        }
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list of {item.__name__}, got {type(value).__name__} {value!r}")
        return [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if value is None:
        raise ConfigError(f"{key}: expected {tp.__name__}, got null")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")  # a bug in the schema, not in the file


def _describe(tp) -> str:
    """A type as a reader says it: int, a number, 3 values, an integer or 3 values..."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is tuple:
        items = typing.get_args(tp)
        return f"a list of {_describe(items[0])}" if items[-1] is Ellipsis else f"{len(items)} values"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(tp, str(tp))


def set_key(data: dict, key: str, value) -> None:
    """Sets dotted `key` (e.g. `training.epochs`) in nested config dicts `data`, creating sections on the way."""
    node = data
    *path, leaf = key.strip().split(".")
    for part in path:
        if node.get(part) is None:  # absent, or null in the file (e.g. data.split: null)
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: '{part}' is not a config section")
    node[leaf] = value


def apply_override(data: dict, override: str) -> None:
    """Applies `a.b.c=value` (value parsed as YAML) to nested dict `data` in place."""
    if "=" not in override:
        raise ConfigError(f"--set {override!r}: expected key=value, e.g. training.epochs=3")
    key, raw = override.split("=", 1)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key}: cannot parse value {raw!r} ({e})") from e
    try:
        set_key(data, key, value)
    except ConfigError as e:
        raise ConfigError(f"--set {e}") from None


def parse_config(data, overrides=(), source: str = "config") -> Config:
    """A validated `Config` from the nested dicts of a YAML document (None = the defaults) and `key=value`
    overrides; `source` (a file name) starts the error when the document is not a mapping."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: expected a mapping of config sections (data:, pipeline:, model:, ...), got "
            f"{type(data).__name__}"
        )
    for override in overrides:
        apply_override(data, override)
    config = from_dict(Config, data)
    validate(config)
    return config
