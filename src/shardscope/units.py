"""Units: parsing counts and sizes from the command line, and printing bytes with the unit named.

Bytes are plain ints everywhere inside shardscope; these helpers are the only place GiB and GB appear.
"""

from __future__ import annotations

import math
import re

KIB = 1024
MIB = 1024**2
GIB = 1024**3
TIB = 1024**4
KB = 1000
MB = 1000**2
GB = 1000**3
TB = 1000**4

_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_BYTE_SUFFIXES = {
    "": 1,
    "b": 1,
    "kb": KB,
    "mb": MB,
    "gb": GB,
    "tb": TB,
    "kib": KIB,
    "mib": MIB,
    "gib": GIB,
    "tib": TIB,
}
_NUMBER = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class UnitError(ValueError):
    """A count or size that cannot be read."""


def _split(text: str, what: str, allowed: str) -> tuple[float, str]:
    match = _NUMBER.match(text)
    if not match:
        raise UnitError(f"{what} {text!r} is not a number; use {allowed}")
    value = float(match.group(1))
    if not math.isfinite(value):
        raise UnitError(f"{what} {text!r} is not finite")
    if value < 0:
        raise UnitError(f"{what} {text!r} must be positive")
    return value, match.group(2).lower()


def parse_count(text: str) -> int:
    """Read a count such as '7.5B', '70e9', '6738415616' or '125M' into an int."""
    allowed = "a number with an optional K, M, B or T suffix (7.5B, 70e9, 6738415616)"
    value, suffix = _split(text, "count", allowed)
    if suffix not in _COUNT_SUFFIXES:
        raise UnitError(f"count {text!r} has unknown suffix {suffix!r}; use {allowed}")
    count = value * _COUNT_SUFFIXES[suffix]
    if count != int(count) and abs(count - round(count)) > 1e-6 * max(1.0, count):
        raise UnitError(f"count {text!r} is not a whole number")
    return round(count)


def parse_bytes(text: str) -> int:
    """Read a size such as '80GiB', '80GB', '1.5TiB' or '4096' (bytes) into an int."""
    allowed = "a number with B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
    value, suffix = _split(text, "size", allowed)
    if suffix not in _BYTE_SUFFIXES:
        raise UnitError(f"size {text!r} has unknown unit {suffix!r}; use {allowed}")
    return round(value * _BYTE_SUFFIXES[suffix])


def format_bytes(num_bytes: int | float, units: str = "GiB", digits: int = 2) -> str:
    """Print bytes in GiB (powers of 1024) or GB (powers of 1000), the unit always named."""
    if units == "GiB":
        return f"{num_bytes / GIB:,.{digits}f} GiB"
    if units == "GB":
        return f"{num_bytes / GB:,.{digits}f} GB"
    if units == "MiB":
        return f"{num_bytes / MIB:,.{digits}f} MiB"
    if units == "MB":
        return f"{num_bytes / MB:,.{digits}f} MB"
    raise UnitError(f"units {units!r} is not known; use GiB, GB, MiB or MB")


def format_count(count: int) -> str:
    """Print a parameter count the way papers do: 6.74B, 124.4M."""
    for scale, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if count >= scale:
            return f"{count / scale:.2f}{suffix}"
    return str(count)
