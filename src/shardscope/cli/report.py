"""`shardscope report`: write one self-contained HTML page (charts as inline SVG) for a comparison or a plan."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from shardscope.cli.errors import CliError
from shardscope.cli.scenario_args import (
    add_cluster_arguments,
    add_model_arguments,
    add_strategy_arguments,
    add_training_arguments,
    gpu_from_args,
    model_from_args,
    overheads_from_args,
    scenarios_from_args,
    step_from_args,
)
from shardscope.cli.timeline import add_hardware_arguments, hardware_from_args
from shardscope.planner import PlanRequest, plan
from shardscope.planner.unsearched import default_expert_degrees
from shardscope.specs import Strategy
from shardscope.strategy import DEFAULT_VIRTUAL_STAGES
from shardscope.units import parse_count

EXAMPLES = """examples:
  shardscope report --model llama-3-8b --gpus 8 --seq-len 4096 -o report.html
  shardscope report --model llama-3-8b --gpus 16 --strategy fsdp --pp 4 --grad-accum 8 -o pipeline.html
  shardscope report --model llama-3-70b --gpus 1024 --seq-len 4096 --global-batch-tokens 4M -o plan.html --png charts/
"""


def add_parser(subparsers: Any) -> None:
    """Attach `report` to the CLI."""
    parser = subparsers.add_parser(
        "report",
        help="write an HTML page: strategy comparison, memory and communication charts, timeline, observations",
        description="Compare strategies for one scenario, or plan the run (--global-batch-tokens, with --gpus as "
        "the cap), and write one self-contained HTML page that opens without a network.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser)
    add_cluster_arguments(parser)
    add_training_arguments(parser)
    add_strategy_arguments(parser)
    add_hardware_arguments(parser)
    parser.add_argument("-o", "--output", metavar="PATH", default="report.html", help="the page (default %(default)s)")
    parser.add_argument("--png", metavar="DIR", help="also write every chart as a PNG file into DIR")
    parser.add_argument("--global-batch-tokens", metavar="N", help="plan the run for this batch, up to --gpus GPUs")
    parser.add_argument("--price-per-gpu-hour", type=float, metavar="X", help="with a plan: rank by cost")


def check_report_path(output: str) -> None:
    """Refuse an empty path or a directory as the page's path before any work is done."""
    if not output.strip():
        raise CliError(f"the report's path {output!r} is empty; give a file name such as report.html")
    if Path(output).is_dir():
        raise CliError(f"cannot write the report to {output!r}: it is a directory; give a file name such as r.html")


def write_report_or_fail(subject: Any, output: str, **options: Any) -> Path:
    """Write the page; a path that cannot be written (a directory, /proc, a full disk) is one line naming it."""
    from shardscope.report import write_report

    check_report_path(output)
    try:
        return write_report(subject, output, **options)
    except OSError as error:
        where = error.filename if error.filename is not None else output
        raise CliError(f"cannot write the report to {str(where)!r}: {error.strerror or error}") from None


def run(args: argparse.Namespace) -> int:
    """Build the page and say where it is."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError("the report needs matplotlib: pip install 'shardscope[report]'") from None
    check_report_path(args.output)
    if args.price_per_gpu_hour is not None and not args.global_batch_tokens:
        raise CliError(
            f"--price-per-gpu-hour {args.price_per_gpu_hour} ranks plans by cost; give --global-batch-tokens to plan"
        )
    if args.global_batch_tokens:
        if args.params:
            raise CliError("--params gives only a parameter count; planning needs the model's shape")
        if args.capacity_factor:
            raise CliError(
                f"--capacity-factor {args.capacity_factor:g}: plans are searched for dropless routing only; "
                "leave --global-batch-tokens out to report this scenario"
            )
        gpu = gpu_from_args(args)
        price = args.price_per_gpu_hour
        model = model_from_args(args)
        training = step_from_args(args, model)
        request = PlanRequest(
            model=model,
            gpu=gpu,
            training=training,
            strategy=Strategy(name="ddp", engine=args.engine),
            global_batch_tokens=parse_count(args.global_batch_tokens),
            gpus_per_node=args.gpus_per_node,
            max_gpus=args.gpus,
            pipeline_parallel=(args.pp,),  # --pp N plans pipelines of N stages (the schedule --pp-schedule's)
            pipeline_schedules=(args.pp_schedule,),
            virtual_stages=(args.pp_virtual_stages or DEFAULT_VIRTUAL_STAGES,),
            # --ep N plans experts split N ways; without it, the degrees `plan` searches by default
            expert_parallel=(args.ep,) if args.ep > 1 else default_expert_degrees(model, args.gpus_per_node),
            overheads=overheads_from_args(args),
            rank_by="cost" if price is not None else "step-time",
            price_per_gpu_hour=price,
            hardware=hardware_from_args(args, gpu),
        )
        result = plan(request)
        if not result.plans:
            raise CliError(f"nothing fits on up to {args.gpus} x {gpu.name}; see `shardscope plan` for why", 1)
        subject: Any = result
        hardware = request.hardware
    else:
        subject = scenarios_from_args(args)
        hardware = hardware_from_args(args, subject[0].cluster.gpu) if subject[0].model.has_shape else None
    path = write_report_or_fail(subject, args.output, png_dir=args.png, hardware=hardware)
    print(f"shardscope report: wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")
    if args.png:
        print(f"shardscope report: charts as PNG in {args.png}")
    return 0
