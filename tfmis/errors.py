"""The errors a user can cause, each with the exit code every command gives it.

A command (`tfmis.utils.cli.run_command`) prints such an error as one line (`<label>: <message>`, the message
naming the file, case or key and the fix) and exits with its class's `exit_code`; any other exception is a bug
and keeps its traceback. `TFMIS_DEBUG=1` shows the traceback of these too.

    TfmisError                       1  error
    ├── UsageError                   2  error        bad arguments: fix the command line
    │   └── ConfigError              2  config error  an unreadable config or a bad value: fix the key
    ├── DataError                    1  error        a dataset, case, checkpoint or input that cannot be used
    │   └── MissingInput             1  error        a file or folder the work needs does not exist
    ├── RunStateError                1  error        a run folder, lock or conversion in a state that stops the work
    ├── ResourceError                1  error        out of memory, nothing fits the budget
    ├── TrainingFailed               1  error        training or a search stopped (divergence, a lost worker)
    └── PartialFailure               3  error        finished, but some cases or folds failed (named)

An OS error (a missing file, permissions, a file in the way, a full disk) is exit 1 in every command; argparse's
usage errors are exit 2. The classes also derive from the builtin a caller would expect (ConfigError and
DataError are ValueErrors), so library code that catches those keeps working.
"""

from __future__ import annotations


class TfmisError(Exception):
    """An error the user can fix; `line()` is what the command prints, `exit_code` what it exits with."""

    exit_code = 1
    label = "error"

    def __str__(self) -> str:  # the message as given, also for a class that is a KeyError too (no quotes)
        return str(self.args[0]) if len(self.args) == 1 else Exception.__str__(self)

    def line(self) -> str:
        """`<label>: <the message's first line>` (a library's multi-line message stays one line)."""
        text = str(self).strip()
        return f"{self.label}: {text.splitlines()[0] if text else type(self).__name__}"


class UsageError(TfmisError, ValueError):
    """Bad arguments: the command line needs fixing (exit 2, as argparse's own errors)."""

    exit_code = 2


class ConfigError(UsageError):
    """An unreadable config, specs or space file, or a bad value in one; the message names the key and the fix."""

    label = "config error"


class DataError(TfmisError, ValueError):
    """A dataset, case, split, checkpoint or input file that cannot be used as it is."""


class MissingInput(DataError, FileNotFoundError):
    """A file or folder the work needs does not exist; the message names it and how to make it."""


class RunStateError(TfmisError, RuntimeError):
    """A run folder, lock or conversion whose state stops the work (an existing run, a live holder, changed
    parameters); the message says how to go on (--resume, another folder, wait)."""


class ResourceError(TfmisError):
    """Not enough memory (or no configuration fits the budget) for what was asked."""


class TrainingFailed(TfmisError, RuntimeError):
    """Training or a search stopped: divergence, a lost worker, no trial finished."""


class PartialFailure(TfmisError):
    """The command finished, but some cases or folds failed; they are named, the others are written."""

    exit_code = 3


def exit_codes() -> dict[str, int]:
    """{class name: exit code} of every error class here (docs/exit-codes.md is tested against it)."""
    found, todo = {}, [TfmisError]
    while todo:
        cls = todo.pop()
        if cls.__module__ == __name__:  # not the library's own subclasses (RunExists, FolderLocked ...)
            found[cls.__name__] = cls.exit_code
        todo.extend(cls.__subclasses__())
    return found
