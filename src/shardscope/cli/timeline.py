"""`shardscope timeline`: simulate one step of one strategy, print where the time goes, write a Chrome trace; with
--pp, every pipeline rank's schedule, stages by time (cli.pipeline_view).

Also home of the hardware options every time-aware command shares (`estimate --time`, `timeline`, later `plan`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from shardscope.cli.errors import CliError
from shardscope.cli.pipeline_view import pipeline_json, render_pipeline
from shardscope.cli.scenario_args import (
    add_cluster_arguments,
    add_model_arguments,
    add_strategy_arguments,
    add_training_arguments,
    scenarios_from_args,
)
from shardscope.cli.tables import render_table
from shardscope.configs.args import with_source
from shardscope.core.chrome_trace import chrome_trace, pipeline_chrome_trace
from shardscope.core.memory import estimate_memory
from shardscope.core.network import ledger_costs
from shardscope.core.pipeline_time import pipeline_step
from shardscope.core.timeline import TimeEstimate, estimate_time, network_model
from shardscope.presets.hardware import (
    HardwareProfile,
    InterconnectSpec,
    default_profile,
    interconnect_preset,
    interconnect_preset_names,
)
from shardscope.presets.profile_toml import load_profile
from shardscope.specs import GpuSpec, Scenario
from shardscope.units import format_bytes, parse_bytes

EXAMPLES = """examples:
  shardscope timeline --model llama-3-8b --gpus 16 --strategy zero3 --trace step.json
  shardscope timeline --model gpt2-xl --seq-len 1024 --gpus 64 --strategy ddp --inter-node ethernet-100g
  shardscope timeline --model llama-3-8b --gpus 16 --strategy fsdp --pp 4 --grad-accum 8 --trace pipeline.json
  shardscope timeline --model tiny-gpt2 --seq-len 64 --gpus 2 --gpus-per-node 2 --strategy ddp --hardware profile.toml
"""


def add_hardware_arguments(parser: argparse.ArgumentParser) -> None:
    """--hardware and the link, algorithm and efficiency overrides."""
    group = parser.add_argument_group("hardware (time model)")
    group.add_argument("--hardware", metavar="PROFILE.toml", help="a hardware profile (from shardscope calibrate)")
    known = ", ".join(interconnect_preset_names())
    group.add_argument("--intra-node", metavar="LINK", help=f"interconnect inside a node: {known}")
    group.add_argument("--inter-node", metavar="LINK", help="interconnect between nodes, per GPU (same ids)")
    group.add_argument("--intra-node-bandwidth", metavar="SIZE", help="bytes per second per direction, e.g. 450GB")
    group.add_argument("--inter-node-bandwidth", metavar="SIZE", help="bytes per second per direction, e.g. 50GB")
    group.add_argument("--algorithm", choices=("ring", "tree", "hierarchical", "auto"), help="collective algorithm")
    group.add_argument(
        "--efficiency",
        type=float,
        help="fraction of peak FLOP/s a step reaches: FLOPs / (peak x this) replaces the per-op kernel model "
        "of GPUs that have one (default for the others: 0.5)",
    )
    group.add_argument("--no-overlap", action="store_true", help="run communication and compute on one stream")


def _bandwidth(text: str, option: str) -> float:
    value = parse_bytes(text)
    if value <= 0:
        raise CliError(f"{option} {text} must be more than 0 bytes per second")
    return float(value)


def _with_bandwidth(link: InterconnectSpec, text: str | None, option: str) -> InterconnectSpec:
    if text is None:
        return link
    bandwidth = _bandwidth(text, option)
    return dataclasses.replace(link, id="custom", name=f"{link.name}, {option} {text}", bandwidth_bytes_per_s=bandwidth)


def hardware_from_args(args: argparse.Namespace, gpu: GpuSpec) -> HardwareProfile:
    """The profile file, or the GPU's datasheet profile, with the command line's overrides applied."""
    profile = load_profile(args.hardware) if args.hardware else default_profile(gpu)
    intra = interconnect_preset(args.intra_node) if args.intra_node else profile.intra_node
    inter = interconnect_preset(args.inter_node) if args.inter_node else profile.inter_node
    intra = _with_bandwidth(intra, args.intra_node_bandwidth, "--intra-node-bandwidth")
    inter = _with_bandwidth(inter, args.inter_node_bandwidth, "--inter-node-bandwidth")
    changes: dict[str, Any] = {"intra_node": intra, "inter_node": inter}
    if args.algorithm:
        changes["algorithm"] = args.algorithm
    if args.efficiency is not None:
        if not 0 < args.efficiency <= 1:
            raise CliError(f"--efficiency {args.efficiency} must be more than 0 and at most 1")
        changes["efficiency"] = args.efficiency
        changes["per_op_kernels"] = False
    if args.no_overlap:
        changes["overlap"] = False
    return dataclasses.replace(profile, **changes)


def add_parser(subparsers: Any) -> None:
    """Attach `timeline` to the CLI."""
    parser = subparsers.add_parser(
        "timeline",
        help="simulate one training step: compute and communication streams, overlap, Chrome trace",
        description="Simulate one step of one strategy on a compute and a communication stream and show where "
        "the time goes.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser)
    add_cluster_arguments(parser)
    add_training_arguments(parser)
    add_strategy_arguments(parser, many=False)
    add_hardware_arguments(parser)
    parser.add_argument("--trace", metavar="OUT.json", help="write the Chrome trace (chrome://tracing, Perfetto)")
    parser.add_argument("--json", action="store_true", help="print the time estimate as JSON")


def render_summary(estimate: TimeEstimate) -> str:
    """Where the time goes, and the ledger with each row's wire bytes and time."""
    scenario = estimate.scenario
    net = network_model(estimate.hardware)
    rows = [
        [
            phase,
            op,
            f"{group} {size}",
            format_bytes(payload, "MiB"),
            str(int(count)),
            format_bytes(wire, "MiB"),
            f"{seconds * 1e3:.3f}",
        ]
        for (phase, op, group, size, payload), (count, wire, seconds) in ledger_costs(scenario, net).items()
    ]
    header = (
        f"{scenario.model.name}, {scenario.strategy.label} ({scenario.strategy.engine}) on "
        f"{scenario.cluster.world_size} ranks, {scenario.cluster.ranks_per_node} per node; hardware: "
        f"{estimate.hardware.name}"
    )
    lines = [
        header,
        "",
        f"step time           {estimate.step_time_s * 1e3:10.3f} ms",
        f"compute             {estimate.compute_time_s * 1e3:10.3f} ms",
        f"communication       {estimate.comm_time_s * 1e3:10.3f} ms (sum of calls)",
        f"exposed comm        {estimate.exposed_comm_s * 1e3:10.3f} ms (not hidden behind compute)",
        f"tokens per second   {estimate.tokens_per_s:10.1f} (whole job)",
        f"MFU                 {estimate.mfu:10.1%}",
        f"wire bytes per rank {format_bytes(estimate.wire_bytes_per_rank, 'MiB'):>13}",
        "",
        render_table(["phase", "op", "group", "payload", "calls", "wire", "time ms"], rows) if rows else "no calls",
    ]
    return "\n".join(lines)


def write_trace(trace: dict[str, object], path: str) -> None:
    """Write a Chrome trace; a path that cannot be written is one line naming it."""
    try:
        Path(path).write_text(json.dumps(trace), encoding="utf-8")
    except OSError as error:
        raise CliError(f"cannot write trace {path!r}: {error.strerror}") from None


def run_pipeline(scenario: Scenario, hardware: HardwareProfile, args: argparse.Namespace) -> int:
    """A pipeline's step: every pipeline rank simulated (core.pipeline_time), drawn stage by stage."""
    step = pipeline_step(scenario, hardware)
    estimate = estimate_time(scenario, hardware)  # the numbers of `estimate --time`, for the rank that ends last
    if args.trace:
        write_trace(pipeline_chrome_trace(step), args.trace)
    if args.json:
        print(json.dumps(with_source({**estimate.to_json(), "pipeline": pipeline_json(step)}, args), indent=2))
        return 0
    print(render_pipeline(step, estimate))
    if args.trace:
        print(
            f"\nChrome trace written to {args.trace}: a process per pipeline rank, a thread per stage, micro-batches "
            "in flight (open in https://ui.perfetto.dev or chrome://tracing)"
        )
    return 0


def run(args: argparse.Namespace) -> int:
    """Simulate, print, and write the trace."""
    (scenario,) = scenarios_from_args(args, [args.strategy])
    hardware = hardware_from_args(args, scenario.cluster.gpu)
    if scenario.strategy.pp > 1:
        return run_pipeline(scenario, hardware, args)
    estimate = estimate_time(scenario, hardware)
    if args.trace:
        write_trace(chrome_trace(estimate, estimate_memory(scenario)), args.trace)
    if args.json:
        print(json.dumps(with_source(estimate.to_json(), args), indent=2))
    else:
        print(render_summary(estimate))
        if args.trace:
            print(
                f"\nChrome trace written to {args.trace}: both streams, communication in flight and memory by category"
                " (open in https://ui.perfetto.dev or chrome://tracing)"
            )
            steps = scenario.training.grad_accum_steps
            if estimate.simulated_micro_batches < steps:
                print(
                    f"the trace draws the first {estimate.simulated_micro_batches} of the {steps} micro-batches; the "
                    "totals above cover all of them (each further micro-batch repeats the last one's work)"
                )
    return 0
