"""What the commands share at their edge: `run_command` (an error as one line and its exit code),
`OPTIONS -- COMMAND` arguments, `--set` overrides, and one line for an OS error."""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib.abc
import inspect
import os
import shutil
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

from tfmis.errors import TfmisError
from tfmis.utils.io import is_disk_full

DEBUG_ENV = "TFMIS_DEBUG"  # "1": tracebacks for the handled errors too
EXIT_INTERRUPTED = 130  # as a shell reports a command ended by Ctrl-C


class Edge:
    """What a command is writing, for the one line of an OS error that names no file (a full disk)."""

    writing: str | Path | None = None
    rerun: str = "rerun the same command"


def writing(path: str | Path | None, rerun: str | None = None) -> None:
    """Names the output the command is writing now (and how to finish the job after a failure), for the line of
    a full disk or another OS error that carries no file name."""
    Edge.writing = path
    if rerun is not None:
        Edge.rerun = rerun


def print_error(line: str) -> None:
    """One line on stderr, written at once (several workers may share the stream)."""
    sys.stderr.write(line.rstrip("\n") + "\n")
    sys.stderr.flush()


def run_command(command: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Runs a command's body and returns its exit status; the one place errors become exit codes.

    A `tfmis.errors.TfmisError` prints its one line and exits with its `exit_code`; an OS error (a missing
    file, permissions, a file in the way) and a full disk (also when a library wraps it) print one line naming
    the file and exit 1; Ctrl-C exits 130. Anything else is a bug: its traceback is kept. With `TFMIS_DEBUG=1`
    the handled errors print their traceback before their line.
    """
    Edge.writing, Edge.rerun = None, "rerun the same command"
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        return command(argv)
    except TfmisError as e:
        return _handled(e, debug)
    except OSError as e:
        if debug:
            traceback.print_exc()
        print_error(f"error: {os_error_line(e, Edge.writing, Edge.rerun)}")
        return 1
    except KeyboardInterrupt:
        print_error("interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:  # a full disk as TensorFlow (ResourceExhaustedError) or h5py (RuntimeError) report it
        traced = traced_error(e)
        if traced is not None:
            return _handled(traced, debug)
        if not is_disk_full(e):
            raise
        if debug:
            traceback.print_exc()
        print_error(f"error: disk full writing {Edge.writing or 'the output'}: free space and {Edge.rerun}")
        return 1


def _handled(error: TfmisError, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    print_error(error.line())
    return error.exit_code


def traced_error(error: BaseException) -> TfmisError | None:
    """The `TfmisError` a function raised while TensorFlow traced it (a model-parallel setting found wrong when the
    step is built), which AutoGraph re-raises as its own error (a `StagingError`, with `ag_error_metadata`) whose
    context is the original; None for any other error."""
    while error is not None and hasattr(error, "ag_error_metadata"):
        if isinstance(error, TfmisError):
            return error
        error = error.__context__
    return error if isinstance(error, TfmisError) and error is not None else None


# threads a command's process does not wait for at its end (`start_unjoined`)
_UNJOINED: list[threading.Thread] = []


def start_unjoined(target: Callable[[], object], name: str) -> threading.Thread:
    """Runs `target` in a thread of its own (not a daemon) whose end a command's process need not wait for: when the
    command has returned and the thread still runs, the process ends at once (`end_command_process`). Called from a
    library or a test, the interpreter waits for it at exit as for any thread.

    Why not a daemon thread: the interpreter's finalization cuts a daemon thread off where it stands, and inside
    TensorFlow's C++ destructor that aborts the process ("FATAL: exception not rethrown", status -6)."""
    thread = threading.Thread(target=target, name=name)
    thread.start()
    _UNJOINED[:] = [t for t in _UNJOINED if t.is_alive()] + [thread]
    return thread


def end_command_process(code: int) -> None:
    """Ends the process now, with status `code`, when a `start_unjoined` thread still runs: the exit handlers run
    (`atexit`: Horovod's shutdown, logging's flush, ...), stdout and stderr are flushed, then `os._exit` skips the
    interpreter's finalization, which would wait for the thread (a training iterator's destructor took 27-32 s on a
    busy machine: docs/benchmarks.md). Returns when no such thread runs."""
    if not any(t.is_alive() for t in _UNJOINED):
        return
    atexit._run_exitfuncs()  # the handlers os._exit would skip (CPython's; tests/test_private_apis.py)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            pass
    os._exit(code)


class KerasWrappersWithoutSklearn(importlib.abc.MetaPathFinder):
    """An import finder under which Keras' scikit-learn wrappers (`keras.src.wrappers`, imported with TensorFlow)
    find no scikit-learn; every other importer, keras-tuner's Bayesian oracle among them, imports it as usual.

    scikit-learn is installed for that oracle (keras-tuner's `bayesian` extra), and Keras imports it at start only for
    its wrappers, which tfmis never uses: 1.3-1.7 s of the 7.7 s TensorFlow takes to import, paid by every command
    process (each fold, trial and test subprocess). Keras reads a missing scikit-learn as "not installed" and its
    wrappers then say so when used. Installed for a command run as its process's own only (`command`), never for
    Python code that imports tfmis."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] != "sklearn":
            return None
        frame = inspect.currentframe()
        while frame is not None:
            if frame.f_globals.get("__name__", "").startswith("keras.src.wrappers"):
                raise ModuleNotFoundError(f"No module named {name!r} (not for Keras' wrappers in tfmis)", name=name)
            frame = frame.f_back
        return None


def start_tensorflow_without_sklearn() -> None:
    """Called by a process's own entry point before TensorFlow is imported: Keras' wrappers will find no
    scikit-learn (`KerasWrappersWithoutSklearn`); once only, and not where Keras is already loaded."""
    if "keras" not in sys.modules and not any(isinstance(f, KerasWrappersWithoutSklearn) for f in sys.meta_path):
        sys.meta_path.insert(0, KerasWrappersWithoutSklearn())


def _is_process_command(body) -> bool:
    """The command runs as its process's own: `tfmis-<name>` (a `[project.scripts]` entry point), `python -m
    tfmis.<name>` (its module is then `__main__`) or a package's `__main__.py` calling it, not a call from Python (a
    notebook, a test)."""
    stem = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else ""
    return body.__module__ == "__main__" or stem.startswith("tfmis-") or stem == "__main__"


def command(body: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """Makes `body(argv) -> exit status` a command's `main` (a `[project.scripts]` entry point) that runs through
    `run_command`; as its process's own command (no `argv`), TensorFlow starts without scikit-learn
    (`KerasWrappersWithoutSklearn`) and the process ends when the command has returned (`end_command_process`)."""

    @functools.wraps(body)
    def main(argv: list[str] | None = None) -> int:
        own = argv is None and _is_process_command(body)
        if own:
            start_tensorflow_without_sklearn()
        code = run_command(body, argv)
        if own:
            end_command_process(code)
        return code

    return main


def add_set_argument(parser, help_example: str = "--set training.epochs=3") -> None:
    """The `--set KEY=VALUE` option (repeatable) every config-taking command has; parsed into `overrides`."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config value, e.g. {help_example}",
    )


def parse_with_command(
    parser: argparse.ArgumentParser, argv: list[str] | None, usage: str
) -> tuple[argparse.Namespace, list[str]]:
    """(parsed options, command) of `OPTIONS -- COMMAND ...` (`argv` default: sys.argv[1:]).

    `-h`/`--help` before any `--` prints the full help and exits 0. Without `--`, prints `usage` to stderr and exits
    with status 2 (as argparse does for bad options, or when no command follows `--`).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    options = argv[: argv.index("--")] if "--" in argv else argv
    if "-h" in options or "--help" in options:
        parser.print_help()
        raise SystemExit(0)
    if "--" not in argv:
        print(usage, file=sys.stderr)
        raise SystemExit(2)
    split = argv.index("--")
    args, command = parser.parse_args(argv[:split]), argv[split + 1 :]
    if not command:
        parser.error("no command after --")
    return args, command


def check_command(command: list[str]) -> str | None:
    """Why the wrapped `command` (after `--`) cannot be started (its program is not found or not executable), or
    None: `tfmis-launch` and `tfmis-monitor` both refuse it as a bad argument (exit 2)."""
    program = command[0]
    if shutil.which(program) is None:
        where = "is not an executable file" if os.path.exists(program) else "is not found (on PATH or as a path)"
        return f"program {program!r} after -- {where}: check the command"
    return None


# ---------------------------------------------------------------- one line for an OS error at a command's edge


def _file_in_the_way(path: Path) -> Path | None:
    """The first existing non-folder on the way to `path` (the cause of ENOTDIR/EEXIST on mkdir), or None."""
    for candidate in [*reversed(path.parents), path]:
        if candidate.exists() and not candidate.is_dir():
            return candidate
    return None


def os_error_line(error: OSError, writing: str | Path | None = None, rerun: str = "rerun the same command") -> str:
    """One line for an OSError at a command's edge: the file and the fix, no traceback.

    Args:
        writing: the file being written, named when the error does not carry one (a full disk).
        rerun: what finishes the job once the cause is fixed (e.g. "rerun with --resume").
    """
    name = error.filename if getattr(error, "filename", None) else writing
    if error.errno is None and str(error).strip() and not is_disk_full(error):  # raised with its own message
        return str(error).strip().splitlines()[0]
    if is_disk_full(error):
        return f"disk full writing {name or 'the output'}: free space and {rerun}"
    if isinstance(error, (NotADirectoryError, FileExistsError)) and name is not None:
        blocker = _file_in_the_way(Path(name))
        if blocker is not None:
            return f"{blocker} is a file, not a folder: remove it or give another folder"
    what = error.strerror or str(error) or type(error).__name__
    if isinstance(error, PermissionError):
        return f"{name}: permission denied: change its permissions or choose another path"
    if isinstance(error, FileNotFoundError):
        return f"{name}: not found: check the path"
    if isinstance(error, IsADirectoryError):
        return f"{name}: is a folder, expected a file"
    return f"{name}: {what}" if name else f"{type(error).__name__}: {what}"
