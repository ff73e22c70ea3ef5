"""The full validation matrix (issue 6): predicted, traced and measured for every case; writes docs/accuracy.md.

Run: .venv/bin/python benchmarks/bench_validate.py [--out docs/accuracy.md] [--hardware profile.toml]
It takes minutes on a 2-core machine (every case really trains on gloo, and each torch-engine case is traced).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

from shardscope.validate.cases import full_matrix
from shardscope.validate.compare import TARGETS
from shardscope.validate.runner import CaseResult, validate_cases


def _fmt(value: float | None, quantity: str) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.1f} ms" if quantity == "step_time_s" else f"{int(value):,}"


def _err(value: float | None) -> str:
    return "-" if value is None else f"{value:.2%}"


def summary(results: list[CaseResult]) -> list[str]:
    """Per quantity, the prediction and the trace apart: rows within target and the largest error."""
    by_quantity: dict[str, list] = defaultdict(list)
    for result in results:
        for row in result.rows:
            by_quantity[row.quantity].append(row)
    lines = [
        "| quantity | target (predicted / traced) | predicted within target | largest predicted error | "
        "traced within target | largest traced error |",
        "|---|---|---|---|---|---|",
    ]
    for quantity, rows in by_quantity.items():
        target = TARGETS.get(quantity, (float("inf"), float("inf")))
        target_text = f"{target[0]:.0%} / {target[1]:.0%}" if quantity in TARGETS else "reported only"
        predicted_ok = sum(row.error <= target[0] + 1e-12 for row in rows)
        traced = [row.traced_error for row in rows if row.traced_error is not None]
        traced_ok = sum(error <= target[1] + 1e-12 for error in traced)
        lines.append(
            f"| {quantity} | {target_text} | {predicted_ok} of {len(rows)} | "
            f"{_err(max(row.error for row in rows))} | {traced_ok} of {len(traced)} | "
            f"{_err(max(traced) if traced else None)} |"
        )
    return lines


def write(results: list[CaseResult], out: Path, seconds: float, command: str, device: str) -> None:
    import torch

    rows = [row for result in results for row in result.rows]
    failing = [row for row in rows if not row.ok]
    lines = [
        "# Accuracy: predicted and traced against measured",
        "",
        f"Written by `{command}` on {datetime.date.today().isoformat()}, in {seconds / 60:.1f} minutes.",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {'nccl on CUDA' if device == 'cuda' else 'gloo on CPU'}. "
        f"Every case really trains ({len(results)} cases, rank 0 compared).",
        "",
        "Targets: parameters, gradients, optimizer state and the step's collective payload agree to the byte; the "
        "prediction's activations and peak within 5% of the measurement; the trace's peak within 1%. The trace "
        "replays torch's engines only (teaching strategies have no trace column) and cannot run the MoE router's "
        "data-dependent `nonzero` on fake tensors. Runs on CPU use gloo, whose reduce-scatter clones its input; "
        "the prediction and the trace are asked for a gloo cluster and count that clone.",
        "",
        f"**{len(rows) - len(failing)} of {len(rows)} rows within target.**",
        "",
        *summary(results),
        "",
        "## Every row",
        "",
        "| case | quantity | predicted | traced | measured | predicted error | traced error | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.case.label} | {row.quantity} | {_fmt(row.predicted, row.quantity)} | "
            f"{_fmt(row.traced, row.quantity)} | {_fmt(row.measured, row.quantity)} | {_err(row.error)} | "
            f"{_err(row.traced_error)} | {'yes' if row.ok else 'NO'} |"
        )
    notes = sorted({note for result in results for note in result.notes})
    lines += ["", "## Notes", ""] + [f"- {note}" for note in notes]
    out.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/accuracy.md"))
    parser.add_argument("--hardware", help="hardware profile for step-time predictions")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="gloo on CPU or nccl on GPUs")
    args = parser.parse_args()
    hardware = None
    if args.hardware:
        from shardscope.presets.profile_toml import load_profile

        hardware = load_profile(args.hardware)
    cases = full_matrix(args.device)
    started = time.monotonic()
    results = validate_cases(cases, hardware=hardware, progress=lambda text: print(text, file=sys.stderr))
    seconds = time.monotonic() - started
    command = "python benchmarks/bench_validate.py" + (f" --hardware {args.hardware}" if args.hardware else "")
    command += " --device cuda" if args.device == "cuda" else ""
    write(results, args.out, seconds, command, args.device)
    rows = [row for result in results for row in result.rows]
    print(f"{sum(row.ok for row in rows)} of {len(rows)} rows within target; wrote {args.out}")
    print("\n".join(summary(results)))


if __name__ == "__main__":
    main()
