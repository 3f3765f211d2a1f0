"""Config files: reading YAML (named errors), loading a config, saving one, and plans of several stages.

- `read_yaml`: a file's YAML document, or a `ConfigError` naming the file;
- `load_config` / `save_config` (`to_dict`: the config as the plain dicts YAML writes);
- `write_stages` / `load_stages`: a stages file, the stage configs a plan trains in order (`STAGES_KEY`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from tfmis.config.parse import parse_config
from tfmis.config.schema import Config
from tfmis.errors import ConfigError


def read_yaml(path: str | Path, kind: str = "config"):
    """The document of a YAML (or JSON) file; a `ConfigError` naming the file when it is missing or not YAML.

    Args:
        kind: what the file is, for the message ("config", "space", "specs").
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{kind} file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {e.object[e.start : e.start + 1]!r} at offset {e.start}): save the "
            f"{kind} file as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the {kind} file ({e.strerror or e})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        detail = " ".join(str(e).split())  # one line: PyYAML's message spans several
        raise ConfigError(f"{path}: not valid YAML ({detail})") from e


def load_config(path: str | Path | None = None, overrides=()) -> Config:
    """Reads a YAML config (or the defaults when `path` is None) and applies `key=value` overrides."""
    data = read_yaml(path) if path is not None else {}
    if isinstance(data, dict) and STAGES_KEY in data:
        stages = ", ".join(f"{s.get('name')}: {s.get('config')}" for s in data[STAGES_KEY] if isinstance(s, dict))
        raise ConfigError(
            f"{path} is a plan of several stages ({stages}): python -m tfmis.train --config {path} trains them in "
            f"order; give one stage's config file to use that stage alone"
        )
    return parse_config(data, overrides, str(path) if path is not None else "config")


# ---------------------------------------------------------------- plans of several stages

STAGES_KEY = "stages"


def write_stages(path: str | Path, stages, comments=()) -> Path:
    """Writes a stages file: the stage configs (name, path) to train in order, with comment lines on top."""
    from tfmis.utils.io import atomic_writer

    path = Path(path)
    body = yaml.safe_dump({STAGES_KEY: [{"name": n, "config": str(p)} for n, p in stages]}, sort_keys=False)
    header = "".join(f"# {line}\n" for line in comments)
    with atomic_writer(path) as f:
        f.write(
            f"# tfmis plan of {len(stages)} stages, trained in order by: python -m tfmis.train --config {path}\n"
            + header
            + body
        )
    return path


def load_stages(path: str | Path) -> list[tuple[str, Path]] | None:
    """The (name, config path) list of a stages file; None when `path` is a plain config.

    Raises:
        ConfigError: the file is missing, not YAML, or a stage is malformed or missing (named).
    """
    data = read_yaml(path)
    if not isinstance(data, dict) or STAGES_KEY not in data:
        return None
    stages = data[STAGES_KEY]
    if not isinstance(stages, list) or not stages:
        raise ConfigError(f"{path}: '{STAGES_KEY}' must be a list of {{name, config}} entries")
    result = []
    for i, stage in enumerate(stages):
        if not isinstance(stage, dict) or not {"name", "config"} <= set(stage):
            raise ConfigError(f"{path}: {STAGES_KEY}[{i}] needs a name and a config (a stage's config file)")
        if not Path(stage["config"]).is_file():
            raise ConfigError(f"{path}: stage {stage['name']}: config file {stage['config']} does not exist")
        result.append((str(stage["name"]), Path(stage["config"])))
    return result


# ---------------------------------------------------------------- saving


def to_dict(config) -> dict:
    """Plain nested dicts and lists (tuples become lists), as YAML writes them."""

    def plain(value):
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return plain(dataclasses.asdict(config))


def save_config(config: Config, path: str | Path) -> None:
    from tfmis.utils.io import atomic_writer

    with atomic_writer(path) as f:
        yaml.safe_dump(to_dict(config), f, sort_keys=False)
