"""`shardscope estimate`: per-rank memory by category for one or more strategies, in microseconds, without torch."""

from __future__ import annotations

import argparse
import json
from typing import Any

from shardscope.cli.scenario_args import (
    add_cluster_arguments,
    add_model_arguments,
    add_strategy_arguments,
    add_training_arguments,
    scenarios_from_args,
)
from shardscope.cli.tables import bar, render_table
from shardscope.cli.timeline import add_hardware_arguments, hardware_from_args
from shardscope.configs.args import with_source
from shardscope.core.memory import describe_assumptions, estimate_memory
from shardscope.core.params import count_parameters
from shardscope.core.result import CATEGORIES, ESTIMATE_SCHEMA, MemoryEstimate, estimate_document
from shardscope.core.timeline import TimeEstimate, estimate_time
from shardscope.units import format_bytes, format_count

EXAMPLES = """examples:
  shardscope estimate --model llama-3-8b --gpus 8 --strategy all
  shardscope estimate --model llama-3-70b --gpus 64 --gpu h100-80gb --seq-len 4096 --checkpointing full
  shardscope estimate --params 7.5B --gpus 64 --engine paper --strategy ddp,zero1,zero2,zero3 --units GB
  shardscope estimate --config path/to/config.json --gpus 16 --strategy hsdp --shard-group 8 --json
"""


def add_parser(subparsers: Any) -> None:
    """Attach `estimate` to the CLI."""
    parser = subparsers.add_parser(
        "estimate",
        help="predict per-rank memory by category for DDP, ZeRO-1/2/3, FSDP and HSDP",
        description="Predict what each GPU holds, category by category, and whether it fits.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser)
    add_cluster_arguments(parser)
    add_training_arguments(parser)
    add_strategy_arguments(parser)
    parser.add_argument("--units", choices=("GiB", "GB"), default="GiB", help="printed units (default GiB)")
    parser.add_argument("--json", action="store_true", help=f"print JSON ({ESTIMATE_SCHEMA})")
    parser.add_argument("--time", action="store_true", help="add communication, step time, tokens/s and MFU")
    add_hardware_arguments(parser)


def render_estimates(estimates: list[MemoryEstimate], units: str) -> str:
    """The human table: strategies as columns, categories as rows, then peak, fit and assumptions."""
    first = estimates[0].scenario
    model, cluster, training = first.model, first.cluster, first.training
    header = (
        f"{model.name}: {format_count(count_parameters(model))} parameters on {cluster.world_size} x "
        f"{cluster.gpu.name} ({format_bytes(cluster.gpu.memory_bytes, units, 0)}), {training.precision}, "
        f"{training.optimizer}, micro-batch {training.micro_batch_size} x {training.sequence_length}"
    )
    columns = [e.scenario.strategy.label for e in estimates]
    rows: list[list[str]] = []
    for category in CATEGORIES:
        label = category.replace("_", " ")
        if category == "activations" and not estimates[0].activations_estimated:
            rows.append([label] + ["not estimated"] * len(estimates))
            continue
        rows.append([label] + [format_bytes(e.per_rank.category_bytes(category), units) for e in estimates])
    rows.append(["sum of categories"] + [format_bytes(e.per_rank.total_bytes, units) for e in estimates])
    rows.append(["peak"] + [format_bytes(e.per_rank.peak_bytes, units) for e in estimates])
    rows.append(["reserved peak"] + [format_bytes(held_bytes(e), units) for e in estimates])
    rows.append(["peak moment"] + [e.peak_moment for e in estimates])
    if any(e.host_bytes_per_node for e in estimates):
        rows.append(["host per node"] + [format_bytes(e.host_bytes_per_node, units) for e in estimates])
    rows.append(["fits"] + ["yes" if e.fits else "NO" for e in estimates])
    if any(e.scenario.parallelism.splits_model for e in estimates):
        rows.append(["mesh"] + [e.scenario.parallelism.described for e in estimates])
    lines = [header, "", render_table(["per rank", *columns], rows), ""]
    capacity = cluster.gpu.memory_bytes
    for column, estimate in zip(columns, estimates, strict=True):
        lines.append(
            f"{column:>10} {bar(held_bytes(estimate), capacity)} "
            f"{held_bytes(estimate) / capacity:.0%} of GPU memory reserved"
        )
    lines += [
        stage_line(column, estimate, units)
        for column, estimate in zip(columns, estimates, strict=True)
        if estimate.per_stage
    ]
    lines += ["", "assumptions:"] + [f"  - {note}" for note in describe_assumptions(estimates[0])]
    return "\n".join(lines)


def held_bytes(estimate: MemoryEstimate) -> int:
    """What the GPU holds at the step's worst: the caching allocator's reserved peak plus the framework context (the
    peak row's overhead), what `fits` is judged on."""
    return estimate.reserved_peak_bytes + estimate.per_rank.overhead_bytes


def stage_line(column: str, estimate: MemoryEstimate, units: str) -> str:
    """A pipeline's layout in one line: each pipeline rank's stages and its peak, the busiest marked."""
    busiest = estimate.per_stage.index(max(estimate.per_stage, key=lambda entry: entry.per_rank.peak_bytes))
    parts = [
        f"{entry.pipeline_rank}: {' & '.join(entry.stages)} {format_bytes(entry.per_rank.peak_bytes, units)}"
        + (" (busiest)" if entry.pipeline_rank == busiest else "")
        for entry in estimate.per_stage
    ]
    return f"{column:>10} stages by pipeline rank: " + "; ".join(parts)


def render_times(times: list[TimeEstimate]) -> str:
    """The --time table: one row per strategy."""
    rows = [
        [
            t.scenario.strategy.label,
            f"{t.step_time_s * 1e3:.2f}",
            f"{t.comm_time_s * 1e3:.2f}",
            f"{t.exposed_comm_s * 1e3:.2f}",
            format_bytes(t.wire_bytes_per_rank, "GB"),
            f"{t.tokens_per_s:,.0f}",
            f"{t.mfu:.1%}",
        ]
        for t in times
    ]
    header = ["time", "step ms", "comm ms", "exposed ms", "wire/rank", "tokens/s", "MFU"]
    return f"\nhardware: {times[0].hardware.name}\n" + render_table(header, rows)


def run(args: argparse.Namespace) -> int:
    """Estimate and print."""
    scenarios = scenarios_from_args(args)
    estimates = [estimate_memory(scenario) for scenario in scenarios]
    times: list[TimeEstimate] = []
    if args.time:
        hardware = hardware_from_args(args, scenarios[0].cluster.gpu)
        times = [estimate_time(scenario, hardware) for scenario in scenarios]
    if args.json:
        print(json.dumps(with_source(estimate_document(estimates, times), args), indent=2))
    else:
        print(render_estimates(estimates, args.units))
        if times:
            print(render_times(times))
    return 0
