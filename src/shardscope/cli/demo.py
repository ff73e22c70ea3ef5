"""`shardscope demo` (what `make demo` runs): the main job on built-in scenarios, end to end.

1. Predict llama-3-8b on 8 x H100 under every strategy (torch-free, microseconds).
2. Train a tiny model for real on 4 gloo ranks under zero3 and print what rank 0 measured beside the prediction.
3. Write the HTML report for the first scenario and say where it is.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from shardscope.cli.estimate import render_estimates
from shardscope.cli.tables import render_table
from shardscope.core.memory import estimate_memory
from shardscope.core.result import CATEGORIES
from shardscope.mesh import comparable_strategies
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec

DEFAULT_MODEL = "llama-3-8b"
DEFAULT_GPU = "h100-80gb"
REAL_RUN_STEPS = 3


def real_run_case() -> Any:
    """tiny-llama under torch's FSDP2 (zero3) on 4 gloo ranks, in float64 so parity with one process is exact."""
    from shardscope.validate.cases import ValidationCase

    return ValidationCase(model="tiny-llama", strategy="zero3", engine="pytorch", world_size=4, precision="fp64")


def add_parser(subparsers: Any) -> None:
    """Attach `demo` to the CLI."""
    parser = subparsers.add_parser(
        "demo",
        help="the main job on built-in scenarios (what `make demo` runs)",
        description=f"Predict {DEFAULT_MODEL} on 8 x {DEFAULT_GPU} under every strategy, train a tiny model for "
        "real on 4 gloo ranks beside its prediction, and write the HTML report.",
    )
    parser.add_argument(
        "--report", default="out/report.html", metavar="PATH", help="where the report goes (default %(default)s)"
    )
    parser.add_argument("--no-run", action="store_true", help="skip the real run (needs torch)")


def default_scenarios() -> list[Scenario]:
    """llama-3-8b, 8 x H100 80GB, bf16-mixed AdamW, 4096-token sequences: every strategy under torch's engines."""
    cluster = ClusterSpec(gpu=gpu_preset(DEFAULT_GPU), world_size=8, gpus_per_node=8)
    training = TrainingSpec(micro_batch_size=1, sequence_length=4096, checkpointing="none")
    return [
        Scenario(model=model_preset(DEFAULT_MODEL), cluster=cluster, training=training, strategy=Strategy(name=name))
        for name in comparable_strategies(grouped=False)
    ]


def real_run_beside_prediction() -> str:
    """Train the real-run case on gloo and lay rank 0's measured bytes beside the core's prediction for it."""
    from shardscope.runtime.api import run_training

    case = real_run_case()
    predicted = estimate_memory(case.scenario(), rank=0).per_rank
    result = run_training(
        model=case.model,
        strategy=case.strategy,
        engine=case.engine,
        world_size=case.world_size,
        steps=REAL_RUN_STEPS,
        precision=case.precision,
        micro_batch_size=case.micro_batch_size,
        sequence_length=case.sequence_length,
        progress=lambda text: print(f"  {text}", file=sys.stderr, flush=True),
    )
    measured = result.per_rank[0]
    rows = []
    for label, key in [(c.replace("_", " "), f"{c}_bytes") for c in CATEGORIES if c != "overhead"] + [
        ("peak", "peak_bytes")
    ]:
        want, got = predicted.to_json()[key], measured.to_json()[key]
        error = f"{(want - got) / got:+.1%}" if got else "-"
        rows.append([label, f"{want:,}", f"{got:,}", error])
    payload = sum(row.total_payload_bytes for row in result.ledger if row.phase != "setup")
    lines = [
        render_table(["rank 0 (bytes)", "predicted", "measured", "error"], rows),
        "",
        f"collectives per step: {payload:,} bytes of payload; step time {result.step_time_s * 1e3:.1f} ms; "
        f"parity with one process: max |diff| {result.parity.max_abs_diff:.1e} "
        f"({'ok' if result.parity.ok else 'NOT ok'})",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Predict, run, report."""
    from shardscope.cli.report import check_report_path, write_report_or_fail

    check_report_path(args.report)
    scenarios = default_scenarios()
    estimates = [estimate_memory(scenario) for scenario in scenarios]
    print("1. Predicted per-rank memory (shardscope estimate; torch is not imported)\n")
    print(render_estimates(estimates, "GiB"))
    if not args.no_run:
        print(
            f"\n2. A real run on gloo ({real_run_case().label}), rank 0 beside the prediction (shardscope run)\n",
            flush=True,
        )
        print(real_run_beside_prediction())
    path = write_report_or_fail(scenarios, args.report)
    print(f"\n3. Report written: {path.resolve()} (open it in a browser; it needs no network)")
    return 0
