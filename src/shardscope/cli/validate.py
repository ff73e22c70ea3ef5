"""`shardscope validate`: predicted, traced and measured side by side, with the error of every number."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from shardscope.cli.arg_types import positive_int
from shardscope.cli.errors import CliError
from shardscope.cli.tables import render_table
from shardscope.validate.runner import VALIDATE_SCHEMA


def add_parser(subparsers: Any) -> None:
    """Attach `validate` to the CLI."""
    parser = subparsers.add_parser(
        "validate",
        help="predict, trace and really run a matrix of cases, and compare every number",
        description="For each case: the core's prediction, the fake-tensor trace and a real gloo run, side by side. "
        "Exits 1 when any row is outside its target (model states and ledger: exact; peak and activations: 5%% "
        "for the prediction, peak 1%% for the trace).",
    )
    parser.add_argument("--quick", action="store_true", help="a few cases covering every strategy (CI)")
    parser.add_argument("--models", help="comma list of model presets to keep from the full matrix")
    parser.add_argument("--strategies", help="comma list of strategies to keep")
    parser.add_argument("--engines", help="comma list of engines to keep (teaching, pytorch)")
    parser.add_argument("--world-sizes", help="comma list of world sizes to keep (2, 4, 8)")
    parser.add_argument("--precisions", help="comma list of precisions to keep (fp32, bf16-mixed)")
    parser.add_argument(
        "--tp",
        type=positive_int,
        help="keep the cases of this tensor-parallel degree (1: data parallelism only; the matrix has 1 and 2)",
    )
    parser.add_argument(
        "--cp", type=positive_int, help="keep the cases of this context-parallel degree (the matrix has 1 and 2)"
    )
    parser.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the cases with (or --no-sequence-parallel: without) sequence parallelism between the tp ranks",
    )
    parser.add_argument("--no-trace", action="store_true", help="skip the trace column")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo processes (default); cuda: nccl, one GPU per rank, max_memory_allocated as the peak",
    )
    parser.add_argument(
        "--hardware",
        metavar="PROFILE",
        help="hardware profile (from `shardscope calibrate`) to predict step times with",
    )
    parser.add_argument("--json", action="store_true", help=f"print JSON ({VALIDATE_SCHEMA})")


def _keep(values: str | None, option: str, allowed: list[str]) -> set[str] | None:
    """A filter's values; an empty list or a value no case has is an error naming it and the allowed ones."""
    if values is None:
        return None
    words = {value.strip() for value in values.split(",") if value.strip()}
    if not words:
        raise CliError(f"{option} {values!r} is empty; give a comma list of {', '.join(allowed)}")
    unknown = sorted(words - set(allowed))
    if unknown:
        raise CliError(f"{option} {', '.join(map(repr, unknown))} is not in the matrix; allowed: {', '.join(allowed)}")
    return words


def _degrees_match(case: Any, args: argparse.Namespace) -> bool:
    """--sequence-parallel / --no-sequence-parallel, where given, keep the cases with (or without) it."""
    return args.sequence_parallel is None or case.sequence_parallel == args.sequence_parallel


def _require_gpus(world_size: int) -> None:
    """nccl needs a GPU of its own per rank."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < world_size:
        raise CliError(
            f"--device cuda needs {world_size} GPUs (one per rank) and this machine has {count}; "
            "filter with --world-sizes or run on CPU"
        )


def run(args: argparse.Namespace) -> int:
    """Run the matrix and print the comparison."""
    from shardscope.presets.hardware import HardwareError
    from shardscope.presets.profile_toml import load_profile
    from shardscope.validate.cases import every_case, quick_matrix

    cases = quick_matrix(args.device) if args.quick else every_case(args.device)
    options = {
        "model": "--models",
        "strategy": "--strategies",
        "engine": "--engines",
        "world_size": "--world-sizes",
        "precision": "--precisions",
        "tp": "--tp",
        "cp": "--cp",
    }
    filters = {
        name: _keep(
            None if (value := getattr(args, option[2:].replace("-", "_"))) is None else str(value),
            option,
            list(dict.fromkeys(str(getattr(case, name)) for case in cases)),
        )
        for name, option in options.items()
    }
    cases = tuple(
        case
        for case in cases
        if all(keep is None or str(getattr(case, name)) in keep for name, keep in filters.items())
        and _degrees_match(case, args)
    )
    if not cases:
        raise CliError(
            "no validation case is left after the filters; check --models, --strategies, --engines, --tp, --cp, "
            "--sequence-parallel"
        )
    if args.device == "cuda":
        _require_gpus(max(case.world_size for case in cases))
    hardware = None
    if args.hardware:
        try:
            hardware = load_profile(args.hardware)
        except HardwareError as error:
            raise CliError(str(error)) from None
    from shardscope.runtime.config import RunError
    from shardscope.validate.runner import validate_cases, validation_document

    def progress(text: str) -> None:
        print(f"  {text}", file=sys.stderr, flush=True)

    print(f"validating {len(cases)} cases", file=sys.stderr, flush=True)
    try:
        results = validate_cases(cases, hardware=hardware, with_trace=not args.no_trace, progress=progress)
    except RunError as error:
        raise CliError(f"a real run failed: {error}", exit_code=1) from None
    if args.json:
        print(json.dumps(validation_document(results), indent=2))
    else:
        print(render_results(results))
    return 0 if all(result.ok for result in results) else 1


def _value(quantity: str, value: float | None) -> str:
    if value is None:
        return "-"
    if quantity == "step_time_s":
        return f"{value * 1e3:.1f} ms"
    return f"{int(value):,}"


def _error(value: float | None) -> str:
    return "-" if value is None else f"{value:.2%}"


def render_results(results: list[Any]) -> str:
    """One table: a row per case and quantity."""
    header = ["case", "quantity", "predicted", "traced", "measured", "pred err", "trace err", "ok"]
    rows = []
    for result in results:
        for row in result.rows:
            rows.append(
                [
                    row.case.label,
                    row.quantity,
                    _value(row.quantity, row.predicted),
                    _value(row.quantity, row.traced),
                    _value(row.quantity, row.measured),
                    _error(row.error),
                    _error(row.traced_error),
                    "yes" if row.ok else "NO",
                ]
            )
    failing = sum(1 for result in results for row in result.rows if not row.ok)
    total = sum(len(result.rows) for result in results)
    notes = sorted({note for result in results for note in result.notes})
    lines = [render_table(header, rows), "", f"{total - failing} of {total} rows within target"]
    lines += [f"  - {note}" for note in notes]
    lines += [f"  - {r.case.label}: ledger differs: {line}" for r in results for line in r.ledger_mismatches]
    not_run = [result for result in results if result.not_run]
    if not_run:
        lines += ["", f"{len(not_run)} cases not run (no run engine implements them yet):"]
        lines += [f"  - {result.case.label}: {result.not_run}" for result in not_run]
    return "\n".join(lines)
