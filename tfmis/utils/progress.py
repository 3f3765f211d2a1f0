"""Progress of long work: a tqdm bar on a terminal, plain lines in a log file.

A tqdm bar written to a file (a SLURM log, `> convert.log`) leaves one carriage-return frame per update;
`progress_bar` gives the bar only when its stream is a terminal and otherwise prints a readable line every
`interval_seconds` and one at the end.
"""

from __future__ import annotations

import sys
import time


class LineProgress:
    """The part of tqdm's interface tfmis uses (`update`, `write`, `set_postfix`, `close`), as plain lines.

    Args:
        total: how many units the work has.
        desc: what is being done, e.g. "Converting Task09_Spleen".
        unit: the unit's name, e.g. "case".
        disable: print nothing but `write` messages.
        file: the stream (default: standard error).
        interval_seconds: seconds between lines (0 = a line per update); the last update always gets one.
        initial: units already done (a resumed run).
    """

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str,
        disable: bool = False,
        file=None,
        interval_seconds: float = 30.0,
        initial: int = 0,
    ):
        self.total, self.desc, self.unit, self.disable = total, desc, unit, disable
        self.file = file or sys.stderr
        self.interval = float(interval_seconds)
        self.n = self.initial = initial
        self.postfix = ""
        self.start = self.last_line = time.perf_counter()
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if not self.disable and (now - self.last_line >= self.interval or self.n >= self.total):
            self.last_line = now
            self._line(now)

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def write(self, message: str, file=None) -> None:
        print(message, file=file or self.file, flush=True)

    def close(self) -> None:
        if not self.closed and not self.disable and self.n > self.initial and self.n < self.total:
            self._line(time.perf_counter())  # stopped early: say how far it got
        self.closed = True

    def _line(self, now: float) -> None:
        share = f" ({self.n / self.total:.0%})" if self.total else ""
        extra = f"  {self.postfix}" if self.postfix else ""
        plural = self.unit + ("es" if self.unit.endswith(("s", "sh", "ch", "x")) else "s")
        print(
            f"{self.desc}: {self.n}/{self.total} {plural}{share}  {now - self.start:.0f}s{extra}",
            file=self.file,
            flush=True,
        )


def progress_bar(
    total: int, desc: str, unit: str, disable: bool = False, file=None, interval_seconds: float = 30.0, initial: int = 0
):
    """A tqdm bar when `file` (default standard error) is a terminal, else a `LineProgress`.

    Example:
        bar = progress_bar(len(cases), "Converting Task09_Spleen", "case")
        for case in cases:
            ...
            bar.update(1)
        bar.close()
    """
    file = file or sys.stderr
    if file.isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, disable=disable, file=file, initial=initial)
    return LineProgress(
        total, desc, unit, disable=disable, file=file, interval_seconds=interval_seconds, initial=initial
    )
