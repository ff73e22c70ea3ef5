"""Audit the core's predicted peak against the measured peaks in docs/accuracy.md, without running anything.

Usage: python benchmarks/audit_peak.py [--all] [--doc docs/accuracy.md]

Prints the predicted and doc-measured peak of every case of the full matrix, with the activations' error and the
peak's error against the trace's (which replays torch's engines on fake tensors, without gloo's transient buffers),
and exits 1 when a peak is off by more than the 5% target of `shardscope validate`. Rows within target are left out
unless --all is given.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from shardscope.core.memory import estimate_memory
from shardscope.validate.cases import full_matrix

PEAK_TARGET = 0.05  # docs/accuracy.md: the prediction's peak within 5% of the measurement
ROOT = Path(__file__).resolve().parent.parent
_ROW = re.compile(
    r"^\| (?P<case>[^|]+) \| (?P<quantity>[a-z_]+) \| (?P<predicted>[^|]+) "
    r"\| (?P<traced>[^|]+) \| (?P<measured>[^|]+) \|"
)


def _bytes(cell: str) -> int | None:
    digits = cell.strip().replace(",", "")
    return int(digits) if digits.isdigit() else None


def doc_rows(doc: Path, column: str) -> dict[tuple[str, str], int]:
    """(case label, quantity) -> the bytes in one column ('measured' or 'traced') of the accuracy table."""
    rows = {}
    for line in doc.read_text().splitlines():
        match = _ROW.match(line)
        if match and (value := _bytes(match[column])) is not None:
            rows[(match["case"].strip(), match["quantity"])] = value
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "accuracy.md")
    parser.add_argument("--all", action="store_true", help="print every case, not only the misses")
    args = parser.parse_args(argv)
    measured, traced = doc_rows(args.doc, "measured"), doc_rows(args.doc, "traced")
    header = (
        f"{'case':<46} {'moment':<24} {'predicted':>11} {'measured':>11} {'error':>8} {'act err':>8} {'vs trace':>8}"
    )
    print(header)
    print("-" * len(header))
    misses = total = 0
    for case in full_matrix():
        peak = measured.get((case.label, "peak"))
        if peak is None:
            continue
        total += 1
        estimate = estimate_memory(case.scenario(), rank=0)
        predicted = estimate.per_rank.peak_bytes
        error = (predicted - peak) / peak
        acts = measured.get((case.label, "activations"), 0)
        act_error = (estimate.per_rank.activations_bytes - acts) / acts if acts else 0.0
        trace = traced.get((case.label, "peak"))
        trace_error = f"{(predicted - trace) / trace:+.2%}" if trace else "-"
        miss = abs(error) > PEAK_TARGET
        misses += miss
        if miss or args.all:
            print(
                f"{case.label:<46} {estimate.peak_moment:<24} {predicted:>11,} {peak:>11,} "
                f"{error:>+8.2%} {act_error:>+8.2%} {trace_error:>8}{'  MISS' if miss else ''}"
            )
    print(f"\n{total - misses} of {total} peaks within {PEAK_TARGET:.0%}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
