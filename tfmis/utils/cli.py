"""What the commands share at their edge: `OPTIONS -- COMMAND` arguments, and one line for an OS error."""

from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path


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


# ---------------------------------------------------------------- one line for an OS error at a command's edge

DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
# how a full disk reads when the errno is lost on the way (TensorFlow's ResourceExhaustedError, h5py's RuntimeError)
DISK_FULL_TEXTS = ("no space left on device", "file too large", "disk quota exceeded", "errno = 28", "errno = 27")


def is_disk_full(error: BaseException) -> bool:
    """True when `error` (an OSError, or a library's error wrapping one) says the disk or a file size limit is full."""
    if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
        return True
    text = str(error).lower()
    return any(t in text for t in DISK_FULL_TEXTS)


def remove_temp_files(*folders, patterns=("*.tmp", "*.tmp.*")) -> list[Path]:
    """Deletes the temporary files (`x.tmp`, `x.tmp.weights.h5`) directly in `folders`; returns them, sorted.

    A temporary of another live writer on this host (`tfmis.utils.io.temp_path` names hold the writer's pid) is
    kept: this process's and dead writers' are removed."""
    from tfmis.utils.io import writer_alive

    removed = []
    for folder in folders:
        folder = Path(folder)
        if not folder.is_dir():
            continue
        for pattern in patterns:
            for path in folder.glob(pattern):
                if writer_alive(path, including_self=False):
                    continue
                if path.is_file() or path.is_symlink():
                    path.unlink(missing_ok=True)
                    removed.append(path)
    return sorted(set(removed))


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


def error_line(error: BaseException) -> str:
    """The first line of an exception's message (a library's multi-line message stays one line)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
