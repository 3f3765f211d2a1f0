"""What the commands share at their edge: `OPTIONS -- COMMAND` arguments."""

from __future__ import annotations

import argparse
import sys


def parse_with_command(
    parser: argparse.ArgumentParser, argv: list[str] | None, usage: str
) -> tuple[argparse.Namespace, list[str]] | None:
    """(parsed options, command) of `OPTIONS -- COMMAND ...` (`argv` default: sys.argv[1:]).

    None, after printing `usage` to stderr, when there is no `--`; argparse's error (exit status 2) when the
    options are bad or no command follows `--`.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print(usage, file=sys.stderr)
        return None
    split = argv.index("--")
    args, command = parser.parse_args(argv[:split]), argv[split + 1 :]
    if not command:
        parser.error("no command after --")
    return args, command
