"""The errors of the dataset layer: a dataset unusable as a whole (`DatasetError`; `DatasetNotFound` when the folder
holds no dataset.json), one unusable case (`CaseError`, which a conversion records and goes past), and an image file
that cannot be read (`UnreadableImage`)."""

from __future__ import annotations

from tfmis.errors import DataError, UsageError


class DatasetError(DataError):
    """The dataset as a whole is unusable (dataset.json missing or malformed)."""


class DatasetNotFound(UsageError, DatasetError):
    """The folder given as a dataset holds no dataset.json: the argument or `data.source_dir` needs fixing
    (exit 2, as any usage error; still a DatasetError for library callers)."""


class CaseError(DataError):
    """One case is unusable; the message says why. Conversion records it and goes on."""

    def __init__(self, case_id: str, reason: str):
        super().__init__(f"case {case_id}: {reason}")
        self.case_id = case_id
        self.reason = reason


class UnreadableImage(DataError):
    """An image file that cannot be read: missing, truncated, corrupt, or of a format whose reader is not
    installed. The message names the file and the reason."""
