"""A plan as values with reasons, written as a commented tfmis config (`Plan`), and its number formats."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import numpy as np
import yaml

from tfmis.planning.rules import fmt_mm

SECTIONS = (
    "data",
    "pipeline",
    "model",
    "loss",
    "optimizer",
    "training",
    "validation",
    "runtime",
    "output",
    "cascade",
    "planning",
)


@dataclasses.dataclass
class Plan:
    """Planned config values with their reasons.

    Attributes:
        values: dotted config key (e.g. `model.strides`) -> value, in writing order.
        reasons: dotted config key -> why that value.
        notes: section (e.g. `data.conversion`) -> comment lines written above the section's keys.
        header: comment lines at the top of the file.
        summary: the numbers behind the plan (fingerprint and hardware), for the table and tests.
    """

    values: dict = dataclasses.field(default_factory=dict)
    reasons: dict = dataclasses.field(default_factory=dict)
    notes: dict = dataclasses.field(default_factory=dict)
    header: list = dataclasses.field(default_factory=list)
    summary: dict = dataclasses.field(default_factory=dict)

    def set(self, key: str, value, reason: str) -> None:
        self.values[key] = value
        self.reasons[key] = reason

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The plan as YAML text: sections in config order, a comment with the reason on every key."""
        lines = [f"# {line}" if line else "#" for line in self.header]
        if path is not None:
            lines += ["#", "# Edit any value and train with:", f"#   python -m tfmis.train --config {path}"]
        tree: dict = {}
        for key in self.values:
            node = tree
            parts = key.split(".")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = key
        for section in sorted(tree, key=lambda s: SECTIONS.index(s) if s in SECTIONS else len(SECTIONS)):
            lines.append("")
            self._render(lines, section, tree[section], 0, section)
        return "\n".join(lines) + "\n"

    def _render(self, lines: list, name: str, node, depth: int, prefix: str) -> None:
        indent = "  " * depth
        if isinstance(node, str):  # a leaf: the dotted key
            text = f"{indent}{name}: {format_value(self.values[node])}"
            reason = self.reasons[node]
            if len(text) + len(reason) + 4 <= 118:
                lines.append(f"{text}  # {reason}")
            else:
                lines += [f"{indent}# {w}" for w in textwrap.wrap(reason, 116 - len(indent))]
                lines.append(text)
            return
        for note in self.notes.get(prefix, []):
            lines += [f"{indent}# {w}" for w in textwrap.wrap(note, 116 - len(indent))]
        lines.append(f"{indent}{name}:")
        for key, child in node.items():
            self._render(lines, key, child, depth + 1, f"{prefix}.{key}")

    def config(self, overrides=()):
        """The plan as a validated `tfmis.config.Config` (with `key=value` overrides applied: a bad one is named)."""
        from tfmis.config import parse_config

        return parse_config(yaml.safe_load(self.to_yaml()), overrides, "plan")

    def write(self, path: str | Path) -> Path:
        """Writes the commented YAML atomically and reads it back with `load_config` (a plan that does not
        load is a bug here, not the user's)."""
        from tfmis.config import load_config
        from tfmis.utils.io import atomic_writer

        path = Path(path)
        with atomic_writer(path) as f:
            f.write(self.to_yaml(path))
        load_config(path)
        return path

    def table(self) -> str:
        """A short table of the main choices."""
        v = self.values
        s = self.summary
        rows = [
            ("dataset", f"{s['name']}: {s['num_cases']} cases, {', '.join(s['modalities'])}"),
            ("hardware", s["hardware"]),
            ("planned for", s.get("planned_for_text", "this machine")),
            ("target spacing (mm)", fmt_mm(v["data.conversion.spacing"])),
            ("median shape", fmt_shape(s["median_shape"])),
            ("patch", fmt_shape(v["pipeline.patch_size"])),
            ("strides", ", ".join(fmt_stride(x) for x in v["model.strides"])),
            ("filters", ", ".join(str(f) for f in v["model.filters"])),
            ("batch / crops per volume", f"{v['pipeline.num_images_per_batch']} / {v['pipeline.num_crops_per_image']}"),
            ("class ratios", str(v.get("pipeline.class_ratios"))),
            ("normalisation", "; ".join(s["normalisation"])),
            ("precision / XLA", f"{v['training.precision']} / {str(v['training.jit_compile']).lower()}"),
            ("optimizer", f"{v['optimizer.name']} lr {v['optimizer.learning_rate']:g} {v['optimizer.schedule']}"),
            ("training", f"{v['training.epochs']} epochs x {s['steps_per_epoch']} steps"),
            (
                "validation",
                f"roi {fmt_shape(v['validation.roi_size'])}, sw batch {v['validation.num_sw_batch_size']}, "
                f"overlap {v['validation.overlap']}, every {v['validation.val_interval']} epochs",
            ),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {val}" for k, val in rows)


def format_value(value) -> str:
    """A value as YAML flow text: [1, [2, 2, 1], 2], 0.003, true, null; a mapping in its own order (regions are
    painted in theirs).

    >>> format_value({"whole": [1, 2], "core": [2]})
    '{whole: [1, 2], core: [2]}'
    """
    value = _plain(value)
    text = yaml.safe_dump([value], default_flow_style=True, width=10_000, sort_keys=False).strip()
    return text[1:-1]


def _plain(value):
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def fmt_shape(shape) -> str:
    return "x".join(str(int(round(s))) for s in shape)


def fmt_stride(stride) -> str:
    return str(stride) if isinstance(stride, int) else "(" + ",".join(str(s) for s in stride) + ")"
