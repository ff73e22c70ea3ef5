"""Plain-text tables and bars for the terminal."""

from __future__ import annotations

from collections.abc import Sequence


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell; the first column left-aligned, the rest right-aligned."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        parts = [str(cells[0]).ljust(widths[0])]
        parts += [str(cell).rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


def bar(value: float, capacity: float, width: int = 40) -> str:
    """A bar of `width` cells against a capacity line; past the capacity it is drawn up to the line and marked '>'."""
    if capacity <= 0:
        return ""
    filled = round(min(value / capacity, 1.0) * width)
    overflow = ">" if value > capacity else "|"
    return "[" + "#" * filled + "." * (width - filled) + "]" + overflow
