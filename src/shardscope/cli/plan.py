"""`shardscope plan`: what fits on a GPU type and is fastest (or cheapest), and what each plan runs into next."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from shardscope.choices import OFFLOADS, PIPELINE_SCHEDULES, Word, parse_choice
from shardscope.cli.arg_types import positive_int
from shardscope.cli.errors import CliError
from shardscope.cli.scenario_args import (
    add_capacity_argument,
    add_gpu_arguments,
    add_model_arguments,
    add_rules_arguments,
    add_step_arguments,
    gpu_from_args,
    model_from_args,
    overheads_from_args,
    step_from_args,
)
from shardscope.cli.tables import bar, render_table
from shardscope.cli.timeline import add_hardware_arguments, hardware_from_args
from shardscope.configs.args import with_source
from shardscope.core.params import count_parameters
from shardscope.mesh import STRATEGY_ALIASES
from shardscope.planner import FAMILIES, RANKINGS, PlanRequest, PlanResult, plan
from shardscope.planner.request import CHECKPOINTING_ORDER
from shardscope.planner.result import PLAN_SCHEMA
from shardscope.planner.unsearched import default_expert_degrees, nothing_to_search, skipped_degrees
from shardscope.specs import SpecError, Strategy
from shardscope.units import format_bytes, format_count, parse_bytes, parse_count

DEFAULT_TP = "1,2,4,8"
"""Tensor parallel degrees searched when --tp is not given (and the model routes dropless)."""

EXAMPLES = """examples:
  shardscope plan --model llama-3-70b --gpu h100-80gb --seq-len 4096 --global-batch-tokens 4M
  shardscope plan --model llama-3-70b --gpu h100-80gb --seq-len 4096 --global-batch-tokens 4M \\
      --price-per-gpu-hour 2.5 --max-gpus 512 --json
  shardscope plan --model llama-3-8b --gpu a100-40gb --seq-len 8192 --min-gpus
  shardscope plan --model llama-3.1-405b --gpu h100-80gb --seq-len 8192 --global-batch-tokens 16M \
      --max-gpus 1024 --pp 1,4,8,16
  shardscope plan --model mixtral-8x7b --gpu h100-80gb --seq-len 4096 --global-batch-tokens 4M --ep 1,8 \
      --capacity-factor 1.25

exit status: 0 when the search ran, also when nothing fits (that is an answer: the families that do not fit are
listed with what breaks the budget and by how much); 2 on bad input, and where the degrees asked for leave nothing to
search (each degree the model, a node or the sequence rules out is named, under the answer when others remain).
"""


def _choices(text: str, allowed: tuple[Word, ...], option: str) -> tuple[Word, ...]:
    """A comma list of allowed values, or 'all'."""
    if text == "all":
        return allowed
    words = tuple(value.strip() for value in text.split(",") if value.strip())
    words = tuple(STRATEGY_ALIASES.get(value, value) for value in words)
    if not words:
        raise CliError(f"{option} is empty; give a comma list of {', '.join(allowed)}, or all")
    values = []
    for word in words:
        try:
            values.append(parse_choice(option, word, allowed))
        except SpecError:
            raise CliError(
                f"{option} {word!r} is not known; give a comma list of {', '.join(allowed)}, or all"
            ) from None
    return tuple(values)


def _degrees(text: str, option: str) -> tuple[int, ...]:
    """A comma list of whole numbers of at least 1."""
    words = [word.strip() for word in text.split(",") if word.strip()]
    if not words or not all(word.isdigit() and 1 <= int(word) <= 1024 for word in words):
        raise CliError(f"{option} {text!r} must be a comma list of whole numbers between 1 and 1024, e.g. 1,2,4,8")
    return tuple(sorted({int(word) for word in words}))


def _virtual_stages(text: str) -> tuple[int, ...]:
    """--pp-virtual-stages: a comma list of whole numbers of at least 2."""
    values = _degrees(text, "--pp-virtual-stages")
    if min(values) < 2:
        raise CliError(f"--pp-virtual-stages {text!r}: interleaved-1f1b needs at least 2 stages per pipeline rank")
    return values


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The planning question and the space to search (shared with `report --plan`)."""
    add_model_arguments(parser)
    add_gpu_arguments(parser)
    add_step_arguments(parser)
    add_rules_arguments(parser)
    parser.add_argument("--max-gpus", type=positive_int, default=1024, help="most GPUs a plan may use (default 1024)")
    parser.add_argument("--global-batch-tokens", metavar="N", help="tokens per optimizer step, e.g. 4M")
    parser.add_argument("--batch-tolerance", type=float, default=0.05, help="allowed batch error (default 0.05)")
    parser.add_argument("--headroom", type=float, default=0.05, help="fraction of GPU memory kept free (default 0.05)")
    parser.add_argument("--host-memory", metavar="SIZE", help="host memory per node, checked under offload")
    parser.add_argument("--price-per-gpu-hour", type=float, metavar="X", help="rank by cost per million tokens")
    parser.add_argument("--rank-by", choices=RANKINGS, help="default: cost with a price, else step-time")
    parser.add_argument("--strategy", default="all", help=f"families to search: {', '.join(FAMILIES)}, or all")
    parser.add_argument("--offload", default="all", help=f"offloads to search: {', '.join(OFFLOADS)}, or all")
    parser.add_argument("--checkpointing", default="all", help=f"to search: {', '.join(CHECKPOINTING_ORDER)}, or all")
    parser.add_argument(
        "--tp",
        default=None,
        help=f"tensor parallel degrees to search, a comma list (default {DEFAULT_TP}, or 1 under --capacity-factor; "
        "those above a node or not dividing the model's heads, KV heads, FFN width or vocabulary are skipped)",
    )
    parser.add_argument(
        "--cp",
        default="1",
        help="context parallel degrees to search, a comma list, e.g. 1,2,4,8 for long sequences (default 1; those "
        "not splitting the sequence into 2 x cp chunks are skipped)",
    )
    parser.add_argument(
        "--pp",
        default="1",
        help="pipeline parallel degrees to search, a comma list, e.g. 1,2,4,8,16 (default 1: no pipeline; those with "
        "more stages than the model has layers are skipped; a pipeline runs at least pp micro-batches a step)",
    )
    parser.add_argument(
        "--pp-schedule",
        default="1f1b,interleaved-1f1b",
        help=f"pipeline schedules to search where pp > 1: {', '.join(PIPELINE_SCHEDULES)}, or all (default "
        "%(default)s)",
    )
    parser.add_argument(
        "--pp-virtual-stages",
        default="2",
        help="stages per pipeline rank to search under interleaved-1f1b, a comma list of at least 2 (default 2)",
    )
    parser.add_argument(
        "--ep",
        default=None,
        help="expert parallel degrees to search on a mixture-of-experts model, a comma list, e.g. 1,2,4,8 (default: 1 "
        "and the powers of 2 up to a node's GPUs that divide the experts, 1,2,4,8 for mixtral-8x7b; 1 for a model "
        "without experts; those not dividing the data-parallel shard x cp are skipped)",
    )
    add_capacity_argument(parser)
    parser.add_argument("--max-micro-batch", type=positive_int, default=32, help="largest micro-batch (default 32)")
    parser.add_argument("--min-gpus", action="store_true", help="find the fewest GPUs that can train the model")
    parser.add_argument("--top", type=positive_int, default=5, help="plans to show (default 5)")
    add_hardware_arguments(parser)


def add_parser(subparsers: Any) -> None:
    """Attach `plan` to the CLI."""
    parser = subparsers.add_parser(
        "plan",
        help="find the strategy, batch shape and GPU count that fit and are fastest (or cheapest)",
        description="Search strategies, offload, micro-batch, accumulation, checkpointing and GPU counts; rank what "
        "fits and say what each plan runs into next.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_plan_arguments(parser)
    parser.add_argument("--units", choices=("GiB", "GB"), default="GiB", help="printed units (default GiB)")
    parser.add_argument("--json", action="store_true", help=f"print JSON ({PLAN_SCHEMA})")


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    """The PlanRequest the command line describes."""
    if args.params:
        raise CliError("--params gives only a parameter count; planning needs the model's shape (--model or --config)")
    gpu = gpu_from_args(args)
    price = args.price_per_gpu_hour
    rank_by = args.rank_by or ("cost" if price is not None else "step-time")
    if rank_by == "cost" and price is None:
        raise CliError("--rank-by cost needs --price-per-gpu-hour (no prices are built in)")
    if args.global_batch_tokens is None and not args.min_gpus:
        raise CliError("--global-batch-tokens is needed to rank plans (e.g. 4M); only --min-gpus works without it")
    model = model_from_args(args)
    training = step_from_args(args, model)
    expert_parallel = _degrees(args.ep, "--ep") if args.ep else default_expert_degrees(model, args.gpus_per_node)
    if expert_parallel != (1,) and model.family != "moe":
        raise CliError(f"--ep {args.ep}: expert parallelism splits mixture-of-experts layers; {model.name} has none")
    tensor_parallel = _degrees(args.tp or ("1" if model.capacity_factor else DEFAULT_TP), "--tp")
    model_parallel = {"--tp": tensor_parallel, "--cp": _degrees(args.cp, "--cp"), "--pp": _degrees(args.pp, "--pp")}
    split = [f"{flag} {','.join(map(str, degrees))}" for flag, degrees in model_parallel.items() if degrees != (1,)]
    if model.capacity_factor and split:
        raise CliError(
            f"--capacity-factor {model.capacity_factor:g} with {' '.join(split)}: the capacity rule is modelled with "
            "data and expert parallelism only; search --tp 1 (the default under it), --cp 1 and --pp 1"
        )
    return PlanRequest(
        model=model,
        gpu=gpu,
        training=training,
        strategy=Strategy(name="ddp", engine=args.engine),
        global_batch_tokens=parse_count(args.global_batch_tokens) if args.global_batch_tokens else None,
        batch_tolerance=args.batch_tolerance,
        gpus_per_node=args.gpus_per_node,
        max_gpus=args.max_gpus,
        headroom=args.headroom,
        host_memory_bytes=parse_bytes(args.host_memory) if args.host_memory else 0,
        families=_choices(args.strategy, FAMILIES, "--strategy"),
        offloads=_choices(args.offload, OFFLOADS, "--offload"),
        checkpointing=_choices(args.checkpointing, CHECKPOINTING_ORDER, "--checkpointing"),
        max_micro_batch=args.max_micro_batch,
        tensor_parallel=tensor_parallel,
        context_parallel=model_parallel["--cp"],
        pipeline_parallel=model_parallel["--pp"],
        pipeline_schedules=_choices(args.pp_schedule, PIPELINE_SCHEDULES, "--pp-schedule"),
        virtual_stages=_virtual_stages(args.pp_virtual_stages),
        expert_parallel=expert_parallel,
        overheads=overheads_from_args(args),
        rank_by=rank_by,
        price_per_gpu_hour=price,
        top=args.top,
        min_gpus=args.min_gpus,
        hardware=hardware_from_args(args, gpu),
    )


def render_plan(result: PlanResult, units: str, elapsed_s: float) -> str:
    """The human answer: ranked plans, bars, failure modes, and the families that do not fit."""
    request, stats = result.request, result.stats
    batch = (
        f"global batch {format_count(request.global_batch_tokens)} tokens (within {request.batch_tolerance:.0%})"
        if request.global_batch_tokens
        else "one sequence per GPU"
    )
    routing = f", capacity factor {request.model.capacity_factor:g}" if request.model.capacity_factor else ""
    lines = [
        f"{request.model.name} ({format_count(count_parameters(request.model))} parameters{routing}) on "
        f"{request.gpu.name}, "
        f"sequence {request.sequence_length}, {batch}; budget {format_bytes(request.budget_bytes, units)} per GPU "
        f"({request.headroom:.0%} headroom), up to {request.max_gpus} GPUs",
        f"searched {stats.candidates} candidates: {stats.memory_evaluations} memory estimates, {stats.fitting} fit, "
        f"{stats.time_evaluations} simulated, in {elapsed_s:.2f} s; ranked by {request.rank_by}",
        "",
    ]
    if not result.plans:
        lines.append("nothing fits: no strategy, offload, checkpointing or GPU count in the space stays in budget")
    else:
        if request.min_gpus:
            lines += [f"fewest GPUs: {result.fewest_gpus} x {request.gpu.name}", ""]
        lines += [render_table(*_plan_table(result, units)), "", "memory per GPU against the budget, and step time:"]
        slowest = max(entry.timing.step_time_s for entry in result.plans)
        width = max(16, *(len(entry.label) for entry in result.plans))
        for index, entry in enumerate(result.plans, 1):
            peak = entry.memory.per_rank.peak_bytes
            lines.append(
                f"{index:>3} {entry.label:<{width}} {bar(peak, request.budget_bytes, 24)} "
                f"{peak / request.budget_bytes:4.0%}"
                f"  {bar(entry.timing.step_time_s, slowest, 24)} {entry.timing.step_time_s:.3f} s"
            )
        reasons = [(index, entry.mesh_reason) for index, entry in enumerate(result.plans, 1) if entry.mesh_reason]
        if reasons:
            lines += ["", "why the model is split:"] + [f"{index:>3} {reason}" for index, reason in reasons]
        lines += ["", "what each plan runs into next:"]
        lines += [f"{index:>3} {entry.failure_mode.message}" for index, entry in enumerate(result.plans, 1)]
    if result.rejected:
        lines += ["", "families that do not fit anywhere in the space:"]
        for rejection in result.rejected:
            closest = rejection.closest.scenario
            lines.append(
                f"  {rejection.family}: {rejection.category.replace('_', ' ')} break the budget; the closest attempt "
                f"is over by {format_bytes(rejection.over_by_bytes, units)} ({closest.strategy.label} on "
                f"{closest.cluster.world_size} GPUs, "
                f"offload {closest.strategy.offload}, checkpointing {closest.training.checkpointing}, micro-batch "
                f"{closest.training.micro_batch_size})"
            )
    skipped = skipped_degrees(request)
    if skipped:
        lines += ["", "not searched: " + "; ".join(why for _, why in skipped)]
    if request.pipeline_parallel == (1,):
        lines += ["", "pipelines were not searched: --pp 1,2,4,8 adds them (a slower search)"]
    return "\n".join(lines)


def _plan_table(result: PlanResult, units: str) -> tuple[list[str], list[list[str]]]:
    header = ["#", "strategy", "gpus", "micro", "accum", "ckpt", "offload", "peak", "step s", "tokens/s", "MFU"]
    priced = result.request.price_per_gpu_hour is not None
    if priced:
        header.append("cost/M tok")
    rows = []
    for index, entry in enumerate(result.plans, 1):
        training = entry.scenario.training
        row = [
            str(index),
            entry.label,
            str(entry.gpus),
            str(training.micro_batch_size),
            str(training.grad_accum_steps),
            training.checkpointing,
            entry.scenario.strategy.offload,
            format_bytes(entry.memory.per_rank.peak_bytes, units),
            f"{entry.timing.step_time_s:.3f}",
            f"{entry.timing.tokens_per_s:,.0f}",
            f"{entry.timing.mfu:.1%}",
        ]
        if priced:
            row.append(f"{entry.cost_per_million_tokens:.3f}")
        rows.append(row)
    return header, rows


def _progress(stage: str, done: int, total: int) -> None:
    """A one-line counter on stderr, only on a terminal."""
    if sys.stderr.isatty():
        end = "\n" if stage == "simulating" and done == total else ""
        print(f"\rshardscope plan: {stage} {done}/{total}", end=end, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Plan and print."""
    request = request_from_args(args)
    started = time.perf_counter()
    result = plan(request, progress=None if args.json else _progress)
    elapsed = time.perf_counter() - started
    if sys.stderr.isatty() and not args.json:
        print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    if not result.stats.candidates:  # the degrees asked for leave no plan to weigh: not the budget's doing
        raise CliError(nothing_to_search(request))
    if args.json:
        print(json.dumps(with_source(result.to_json(), args), indent=2))
    else:
        print(render_plan(result, args.units, elapsed))
    return 0  # "nothing fits" is an answer, printed with the rejections
