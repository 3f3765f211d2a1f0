"""Plain-text tables for the terminal: the searches' trial tables, prediction results."""

from __future__ import annotations


def text_table(rows: list[tuple], align: str = "right") -> list[str]:
    """Lines of `rows` (tuples of strings, the header first) with aligned columns; the last column, free text
    such as a status, is neither padded nor aligned.

    Args:
        align: `right` (numbers) or `left` (names) for every aligned column.

    Example:
        >>> text_table([("trial", "img/s", "status"), ("1", "12.5", "ok")])
        ['trial  img/s  status', '    1   12.5  ok']
    """
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    pad = str.rjust if align == "right" else str.ljust
    return ["  ".join(pad(c, w) for c, w in zip(row[:-1], widths)) + "  " + row[-1] for row in rows]
