"""Audit the core's predicted peak against measured peaks, without running anything.

Usage: python benchmarks/audit_peak.py [--all] [--doc docs/accuracy.md] [--measured RUN.json ...] [--only-measured]

Measured and traced figures come from the accuracy table (docs/accuracy.md), overridden case by case by the JSON of
fresh runs (`shardscope validate --json ... > RUN.json`, shardscope.validate/v1; several files may be given). Prints
the predicted and measured peak of every case of the full matrix (predicted for the case's backend, gloo), the
activations' error, and the NCCL prediction's error against the trace's peak (the trace replays torch's engines on
fake tensors with NCCL's semantics: no gloo clone), and exits 1 when a peak is off by more than the 5% target of
`shardscope validate`. Rows within target are left out unless --all is given; --only-measured audits only the cases
the JSON files hold.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

from shardscope.core.memory import estimate_memory
from shardscope.validate.cases import ValidationCase, full_matrix

PEAK_TARGET = 0.05  # docs/accuracy.md: the prediction's peak within 5% of the measurement
ROOT = Path(__file__).resolve().parent.parent
_ROW = re.compile(
    r"^\| (?P<case>[^|]+) \| (?P<quantity>[a-z_]+) \| (?P<predicted>[^|]+) "
    r"\| (?P<traced>[^|]+) \| (?P<measured>[^|]+) \|"
)
Figures = dict[tuple[str, str], int]


def _bytes(cell: str) -> int | None:
    digits = cell.strip().replace(",", "")
    return int(digits) if digits.isdigit() else None


def doc_rows(doc: Path, column: str) -> Figures:
    """(case label, quantity) -> the bytes in one column ('measured' or 'traced') of the accuracy table."""
    rows = {}
    for line in doc.read_text().splitlines():
        match = _ROW.match(line)
        if match and (value := _bytes(match[column])) is not None:
            rows[(match["case"].strip(), match["quantity"])] = value
    return rows


def json_rows(path: Path, column: str, cases: tuple[ValidationCase, ...]) -> Figures:
    """The same from a `shardscope validate --json` document ('measured' or 'traced'; a missing trace is left out)."""
    labels = {_key(case.to_json()): case.label for case in cases}
    rows = {}
    for row in json.loads(path.read_text())["rows"]:
        value = row.get(f"{column}_bytes")
        if value is not None:
            rows[(labels[_key(row["case"])], row["category"])] = int(value)
    return rows


def _key(case: dict[str, object]) -> tuple[object, ...]:
    """The fields that name a case of the full matrix (a newer JSON may carry more)."""
    return tuple(case.get(field) for field in _CASE_FIELDS)


_CASE_FIELDS = ("model", "strategy", "engine", "world_size", "precision", "checkpointing")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "accuracy.md")
    parser.add_argument("--measured", type=Path, nargs="*", default=[], help="validate --json files (override doc)")
    parser.add_argument("--only-measured", action="store_true", help="audit only the cases of the JSON files")
    parser.add_argument("--all", action="store_true", help="print every case, not only the misses")
    args = parser.parse_args(argv)
    cases = full_matrix()
    measured, traced = doc_rows(args.doc, "measured"), doc_rows(args.doc, "traced")
    fresh: set[str] = set()
    for path in args.measured:
        if not path.read_text().strip():
            print(f"skipping {path}: empty (a run that did not finish?)", file=sys.stderr)
            continue
        runs = json_rows(path, "measured", cases)
        measured.update(runs)
        traced.update(json_rows(path, "traced", cases))
        fresh.update(label for label, _ in runs)
    header = (
        f"{'case':<46} {'moment':<30} {'predicted':>11} {'measured':>11} {'error':>8} {'act err':>8} {'nccl/tr':>8}"
    )
    print(header)
    print("-" * len(header))
    misses = total = 0
    for case in cases:
        peak = measured.get((case.label, "peak"))
        if peak is None or (args.only_measured and case.label not in fresh):
            continue
        total += 1
        scenario = case.scenario()
        estimate = estimate_memory(scenario, rank=0)
        predicted = estimate.per_rank.peak_bytes
        error = (predicted - peak) / peak
        acts = measured.get((case.label, "activations"), 0)
        act_error = (estimate.per_rank.activations_bytes - acts) / acts if acts else 0.0
        trace = traced.get((case.label, "peak"))
        nccl = replace(scenario, cluster=replace(scenario.cluster, backend="nccl"))
        nccl_peak = estimate_memory(nccl, rank=0).per_rank.peak_bytes
        trace_error = f"{(nccl_peak - trace) / trace:+.2%}" if trace else "-"
        miss = abs(error) > PEAK_TARGET
        misses += miss
        if miss or args.all:
            print(
                f"{case.label:<46} {estimate.peak_moment:<30} {predicted:>11,} {peak:>11,} "
                f"{error:>+8.2%} {act_error:>+8.2%} {trace_error:>8}{'  MISS' if miss else ''}"
            )
    print(f"\n{total - misses} of {total} peaks within {PEAK_TARGET:.0%}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
