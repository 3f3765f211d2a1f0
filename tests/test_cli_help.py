"""Every command tfmis installs (pyproject's `[project.scripts]`, read from the installed package's entry points)
answers `--help` with its full help and exit status 0, and the two commands that wrap another (`tfmis-launch`,
`tfmis-monitor`) still exit 2 with their usage line when no `-- COMMAND` follows."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

import pytest

SCRIPTS = {e.name: e.value for e in entry_points(group="console_scripts") if e.value.startswith("tfmis")}


def _main(entry: str):
    module, function = entry.split(":")
    return getattr(importlib.import_module(module), function)


def test_every_documented_command_is_installed():
    """The commands the docs name are all installed entry points (README's setup installs them)."""
    assert {"tfmis-train", "tfmis-predict", "tfmis-launch", "tfmis-monitor", "tfmis-auto"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_prints_the_full_help_and_exits_0(script, capsys):
    """`<script> --help`: exit 0, a usage line naming the command as it is installed (`tfmis-...`, not `python -m`),
    at least one option explained, and the exit statuses it ends with."""
    with pytest.raises(SystemExit) as exit_info:
        _main(SCRIPTS[script])(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code in (0, None), f"{script} --help exited {exit_info.value.code}"
    assert out.lower().startswith("usage:") and "options:" in out, out[:300]
    assert out.startswith(f"usage: {script}"), out.splitlines()[0]
    assert "Exit status" in " ".join(out.split()), f"{script} --help names no exit status"


@pytest.mark.parametrize("script", ["tfmis-launch", "tfmis-monitor"])
def test_wrappers_without_a_command_exit_2_with_their_usage(script, capsys):
    """Options without `-- COMMAND`: the usage line (naming every option the help lists) and exit 2."""
    with pytest.raises(SystemExit) as exit_info:
        _main(SCRIPTS[script])(["--interval", "1"] if script == "tfmis-monitor" else ["--nproc", "2"])
    assert exit_info.value.code == 2
    usage = capsys.readouterr().err.splitlines()[0]
    help_text = _main(SCRIPTS[script]).__module__
    parser = importlib.import_module(help_text).build_parser()
    for action in parser._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                assert flag in usage, f"{script}'s usage line leaves out {flag}: {usage}"
