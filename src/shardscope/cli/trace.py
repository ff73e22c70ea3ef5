"""`shardscope trace`: replay a training step of rank 0 on fake tensors over N fake ranks, one subprocess each."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from shardscope.choices import Attention
from shardscope.cli.errors import CliError
from shardscope.cli.scenario_args import (
    add_cluster_arguments,
    add_model_arguments,
    add_strategy_arguments,
    add_training_arguments,
    scenarios_from_args,
)
from shardscope.cli.tables import render_table
from shardscope.configs.args import with_source
from shardscope.core.engines import ENGINE_RULES
from shardscope.core.result import CATEGORIES
from shardscope.presets.hf_config import UnsupportedModelType, read_hf_config
from shardscope.specs import ModelSpec, Scenario
from shardscope.trace.request import ATTN_IMPLEMENTATIONS, IMPLEMENTATIONS
from shardscope.units import format_bytes

EXAMPLES = """examples:
  shardscope trace --model llama-3-8b --gpus 8 --strategy zero3 --seq-len 4096 --checkpointing full
  shardscope trace --model tiny-llama --gpus 64 --strategy hsdp --shard-group 8 --json
  shardscope trace --config path/to/config.json --gpus 16 --strategy zero2
  shardscope trace --model mistral-7b --implementation hf --attn-implementation eager --gpus 8 --seq-len 4096
  shardscope trace --module mypackage.models:make --gpus 8 --strategy fsdp
  shardscope trace --model tiny-llama --gpus 4 --strategy fsdp --cp 2 --seq-len 32
  shardscope trace --model tiny-llama --gpus 4 --pp 2 --pp-schedule 1f1b --grad-accum 4 --strategy fsdp
"""


def add_parser(subparsers: Any) -> None:
    """Attach `trace` to the CLI."""
    parser = subparsers.add_parser(
        "trace",
        help="replay a real training step on fake tensors over N fake ranks (needs torch)",
        description="Run rank 0 of a training step on fake tensors over a fake process group of --gpus ranks, with "
        "torch's own engines, and report what it allocates (by category, and its peak) and sends.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser, required=False)
    parser.add_argument(
        "--module",
        metavar="PACKAGE.MODULE:FUNCTION",
        help="a factory returning (torch.nn.Module, sample batch), built on the meta device",
    )
    parser.add_argument(
        "--implementation",
        choices=IMPLEMENTATIONS,
        help="whose modeling code runs: reference (shardscope's modules, built to the model's shape; the default "
        "with --model) or hf (transformers' own, built from the preset's or --config's config.json on the meta "
        "device, offline; the default with --config)",
    )
    parser.add_argument(
        "--attn-implementation",
        choices=ATTN_IMPLEMENTATIONS,
        help="--implementation hf: transformers' attention kernel (default: --attention's); eager counts as "
        "--attention eager, the others as sdpa",
    )
    add_cluster_arguments(parser)
    add_training_arguments(parser)
    parser.set_defaults(attention=None)  # unset, so --attn-implementation can tell a conflicting --attention
    add_strategy_arguments(parser, many=False)
    parser.add_argument(
        "--time-limit",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="stop the trace after this long (default %(default)s)",
    )
    parser.add_argument(
        "--traced-blocks",
        type=int,
        default=6,
        metavar="N",
        help="trace a deeper model cut to N-1 and N blocks and extrapolate exactly; 0 traces every block "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--memory-snapshot",
        metavar="FILE",
        help="also write the step's allocations, replayed through the CUDA caching allocator model, as a memory "
        "snapshot (torch.cuda.memory._snapshot's pickle; open it at https://pytorch.org/memory_viz); "
        "traces every block",
    )
    parser.add_argument("--units", choices=("GiB", "GB", "MiB", "MB"), default="GiB", help="printed units")
    parser.add_argument("--json", action="store_true", help="print JSON (shardscope.trace/v1)")


def implementation_of(args: argparse.Namespace) -> str:
    """--implementation, or its default: hf for a --config file, reference otherwise; checked against the rest.
    `--config FILE --implementation reference` traces shardscope's modules built to that config's shape."""
    implementation: str = args.implementation or ("hf" if args.config else "reference")
    if args.module and args.implementation:
        raise CliError(f"--implementation {args.implementation}: a --module factory runs its own modeling code")
    if args.attn_implementation and implementation != "hf":
        raise CliError(
            f"--attn-implementation {args.attn_implementation} chooses transformers' attention (--implementation hf); "
            "the reference modules take --attention eager or sdpa"
        )
    if args.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise CliError(
            "--attn-implementation flash_attention_2 needs the flash-attn package (a CUDA build), which is not "
            "installed here; use sdpa or eager"
        )
    return implementation


def _traced_only_model(args: argparse.Namespace) -> ModelSpec | None:
    """For a --config whose model_type the core has no family for: a spec that only names it (the trace measures
    its model states and activations alone); None for every other model."""
    if not args.config or implementation_of(args) != "hf":
        return None
    try:
        read_hf_config(args.config)
    except UnsupportedModelType as error:
        return ModelSpec(
            name=f"{error.model_type} ({args.config})",
            family="count",
            declared_parameters=1,
            source=f"{args.config}: model_type {error.model_type}, outside the core's families; traced only",
        )
    return None


def _scenario(args: argparse.Namespace) -> Scenario:
    chosen = [flag for flag in ("model", "config", "params", "module") if getattr(args, flag, None)]
    if len(chosen) != 1:
        raise CliError("give exactly one of --model, --config or --module")
    if args.params:
        raise CliError(
            "--params gives no shape to replay; use --model, --config or --module, or `shardscope estimate --params`"
        )
    if not ENGINE_RULES[args.engine].torch_engines:
        raise CliError(
            f"--engine {args.engine}: the trace runs torch's own engines (--engine pytorch); use "
            "`shardscope estimate` for the paper or deepspeed accounting"
        )
    if args.offload != "none":
        raise CliError(
            f"--offload {args.offload} is not traced (fake tensors have no host/device split); use "
            "`shardscope estimate`"
        )
    _resolve_attention(args)
    traced_only = _traced_only_model(args)
    if args.module:
        args.params = "1"  # the factory's module is the model; the spec only carries the name
    if traced_only is not None:  # the core cannot read it: build the rest of the scenario around a named count
        scenario = scenarios_from_args(
            argparse.Namespace(**{**vars(args), "config": None, "params": "1"}), [args.strategy]
        )[0]
        scenario = dataclasses.replace(scenario, model=traced_only)
    else:
        scenario = scenarios_from_args(args, [args.strategy])[0]
    if args.module:
        model = ModelSpec(name=args.module, family="count", declared_parameters=1, source="--module factory")
        scenario = dataclasses.replace(scenario, model=model)
    return scenario


def _resolve_attention(args: argparse.Namespace) -> None:
    """--attention as the scenario counts it: --attn-implementation's (eager materialises the scores, the other
    kernels fuse them) when that is given, and a --attention that says otherwise is refused; sdpa when neither is."""
    if not args.attn_implementation:
        args.attention = args.attention or "sdpa"
        return
    counted: Attention = "eager" if args.attn_implementation == "eager" else "sdpa"
    if args.attention not in (None, counted):
        raise CliError(
            f"--attention {args.attention} and --attn-implementation {args.attn_implementation} disagree: "
            f"{args.attn_implementation} is counted as --attention {counted}; give one of them"
        )
    args.attention = counted


def render(result: Any, units: str) -> str:
    """The human-readable report of one trace."""
    per_rank = result.per_rank
    shown = "rank 0"
    if result.per_stage:
        busiest = next(entry for entry in result.per_stage if entry.per_rank == per_rank)
        shown = f"pipeline rank {busiest.pipeline_rank} (the busiest; each traced as its first rank)"
    lines = [
        f"trace of {shown} of {result.world_size}, {result.strategy} on {result.engine} ({result.elapsed_s:.1f} s)",
        "",
    ]
    fallback = dict(result.fallbacks)
    rows = [
        [name, format_bytes(per_rank.category_bytes(name), units), "core's figure" if name in fallback else "traced"]
        for name in CATEGORIES
        if name != "overhead"
    ]
    rows.append(["peak", format_bytes(per_rank.peak_bytes, units), result.peak_moment])
    if result.reserved_peak_bytes is not None:
        rows.append(["reserved", format_bytes(result.reserved_peak_bytes, units), "CUDA caching allocator, replayed"])
    lines += [render_table(["category", "bytes per rank", "source"], rows), ""]
    if result.per_stage:
        stages = [
            [
                str(entry.pipeline_rank),
                ", ".join(entry.stages),
                format_bytes(entry.per_rank.activations_bytes, units),
                format_bytes(entry.per_rank.peak_bytes, units),
                entry.peak_moment,
            ]
            for entry in result.per_stage
        ]
        lines += [render_table(["pipeline rank", "stages", "activations", "peak", "when"], stages), ""]
    if result.ledger:
        # the group by its mesh axis (dp, tp, cp), as the JSON ledger names it, beside its size
        ledger = [
            [row.phase, row.op, row.group, str(row.group_size), format_bytes(row.payload_bytes, "MiB"), str(row.count)]
            for row in result.ledger
        ]
        lines += [render_table(["phase", "collective", "group", "ranks", "payload", "count"], ledger), ""]
    flops = result.flops
    lines.append(
        f"FLOPs per step on this rank: {flops.total_flops:.3e} (forward {flops.forward_flops:.3e}, "
        f"backward {flops.backward_flops:.3e}; attention by formula {flops.attention_formula_flops:.3e})"
    )
    lines += [f"fallback: {category}: {why}" for category, why in result.fallbacks]
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Trace the scenario in a subprocess and print it."""
    implementation = implementation_of(args)
    scenario = _scenario(args)
    from shardscope.trace.request import TraceRequest, pipeline_refusal
    from shardscope.trace.runner import TraceError, run_in_subprocess, stderr_progress

    if args.time_limit <= 0:
        raise CliError(f"--time-limit {args.time_limit} must be more than 0 seconds")
    if args.traced_blocks != 0 and args.traced_blocks < 6:
        raise CliError(f"--traced-blocks {args.traced_blocks} must be 0 (every block) or at least 6")
    snapshot = ""
    if args.memory_snapshot:
        target = Path(args.memory_snapshot).expanduser().resolve()
        if not target.parent.is_dir():
            raise CliError(f"--memory-snapshot {args.memory_snapshot}: folder {target.parent} does not exist")
        snapshot = str(target)
    request = TraceRequest(
        scenario=scenario,
        implementation=implementation,
        config_path=args.config if implementation == "hf" else "",
        attn_implementation=args.attn_implementation or "",
        factory=args.module or "",
        time_limit_s=args.time_limit,
        traced_blocks=args.traced_blocks,
        memory_snapshot=snapshot,
    )
    refusal = pipeline_refusal(request) if scenario.strategy.pp > 1 else ""
    if refusal:
        raise CliError(refusal)
    try:
        result = run_in_subprocess(request, stderr_progress("trace"))
    except TraceError as error:
        raise CliError(str(error)) from None
    finally:
        if sys.stderr.isatty():
            sys.stderr.write("\r\x1b[K")
    if args.json:
        print(json.dumps(with_source(result.to_json(scenario), args), indent=1))
    else:
        print(render(result, args.units))
    if snapshot:
        print(f"memory snapshot written to {snapshot} (open it at https://pytorch.org/memory_viz)", file=sys.stderr)
    return 0
