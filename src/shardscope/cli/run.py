"""`shardscope run`: train for real on N local processes and print what every rank measured.

shardscope run --model tiny-gpt2 --strategy zero3 --engine paper --world-size 4 --steps 3 --dtype float64
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from shardscope.cli.errors import CliError
from shardscope.cli.scenario_args import add_model_parallel_arguments
from shardscope.cli.tables import render_table

DTYPES = {"float64": "fp64", "fp64": "fp64", "float32": "fp32", "fp32": "fp32"}
COLUMNS = ("parameters", "gradients", "optimizer_state", "activations", "buffers", "temporary")


def add_parser(subparsers: Any) -> None:
    """Attach `run` and its options."""
    parser = subparsers.add_parser(
        "run",
        help="train for real on torch.distributed and measure every byte",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="tiny-gpt2", help="model preset (default tiny-gpt2)")
    parser.add_argument("--strategy", default="zero3", help="ddp, zero1, zero2, zero3, fsdp or hsdp")
    parser.add_argument(
        "--engine",
        default="paper",
        help="paper: shardscope's teaching strategies, written from collectives ('teaching' is another word for it); "
        "pytorch: DDP, ZeroRedundancyOptimizer, FSDP2 (default paper)",
    )
    parser.add_argument("--world-size", type=int, default=2, help="processes (1 to 8 here)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps; the last is measured")
    parser.add_argument("--dtype", default=None, help="float64 or float32 (sets --precision)")
    parser.add_argument("--precision", default=None, help="fp64, fp32 or bf16-mixed (default fp64)")
    parser.add_argument("--shard-group", type=int, default=0, help="hsdp: ranks per shard group")
    add_model_parallel_arguments(parser)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per micro-batch")
    parser.add_argument(
        "--grad-accum", type=int, default=1, help="micro-batches per step: more than 1 only with --pp (default 1)"
    )
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--checkpointing", default="none", help="none, full, selective, op or every:N")
    parser.add_argument("--attention", default="sdpa", help="eager or sdpa")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before the whole run is ended")
    parser.add_argument("--json", action="store_true", help="print the shardscope.run/v1 document")
    parser.add_argument("--inject-fault", default="", help=argparse.SUPPRESS)


def _precision(args: argparse.Namespace) -> str:
    if args.dtype is not None and args.dtype not in DTYPES:
        raise CliError(f"--dtype {args.dtype!r} is not known; allowed: float64, float32")
    from_dtype = DTYPES.get(args.dtype) if args.dtype else None
    if from_dtype and args.precision and args.precision != from_dtype:
        raise CliError(f"--dtype {args.dtype} and --precision {args.precision} disagree; give one")
    return args.precision or from_dtype or "fp64"


def _kib(value: int) -> str:
    return f"{value / 1024:,.1f}"


def render(result: Any) -> str:
    """Per-rank bytes by category and peak, the ledger, parity and step time."""
    rows = [
        [f"rank {rank}", *(_kib(b.category_bytes(c)) for c in COLUMNS), _kib(b.peak_bytes)]
        for rank, b in enumerate(result.per_rank)
    ]
    memory = render_table(["KiB", *COLUMNS, "peak"], rows)
    ledger = render_table(
        ["phase", "op", "group", "payload KiB", "count"],
        [[r.phase, r.op, str(r.group_size), _kib(r.payload_bytes), str(r.count)] for r in result.ledger],
    )
    parity = result.parity
    config = result.config
    return "\n".join(
        [
            f"{config.model} {config.strategy.name} ({config.strategy.engine}) on {config.world_size} ranks, "
            f"{config.training.precision}, "
            f"measured step {config.steps} (KiB = 1024 bytes)",
            memory,
            "",
            "collectives of rank 0 (setup and the measured step):",
            ledger,
            "",
            f"parity vs {parity.reference}: max |diff| = {parity.max_abs_diff:.3g} "
            f"({'ok' if parity.ok else 'FAILED'}, tolerance {parity.tolerance:g})",
            f"step time: {result.step_time_s * 1000:.1f} ms (median, slowest rank)",
        ]
    )


def run(args: argparse.Namespace) -> int:
    """Validate, launch, print; exit 0 when parity holds, 1 when it does not, 2 on bad input or a failed rank."""
    from shardscope.procs.launcher import MAX_LOCAL_WORLD_SIZE, check_timeout
    from shardscope.runtime import RunConfig, RunError, run_training
    from shardscope.specs import SpecError

    try:
        check_timeout(args.timeout, "--timeout")
    except RunError as error:
        raise CliError(str(error)) from None
    if not 1 <= args.world_size <= MAX_LOCAL_WORLD_SIZE:
        raise CliError(
            f"--world-size {args.world_size} must be between 1 and {MAX_LOCAL_WORLD_SIZE} local processes; "
            "for more ranks run the worker under torchrun (docs/cluster.md)"
        )
    try:
        config = RunConfig.from_options(
            model=args.model,
            strategy=args.strategy,
            engine=args.engine,
            world_size=args.world_size,
            steps=args.steps,
            precision=_precision(args),
            micro_batch_size=args.micro_batch,
            grad_accum=args.grad_accum,
            sequence_length=args.seq_len,
            checkpointing=args.checkpointing,
            attention=args.attention,
            shard_group=args.shard_group,
            tp=args.tp,
            cp=args.cp,
            sequence_parallel=args.sequence_parallel,
            pp=args.pp,
            pp_schedule=args.pp_schedule,
            pp_virtual_stages=args.pp_virtual_stages,
            pp_layers=args.pp_layers,
            ep=args.ep,
            capacity_factor=args.capacity_factor,
            timeout_s=args.timeout,
            fault=args.inject_fault,
        )
    except SpecError as error:
        raise CliError(str(error)) from error

    def progress(stage: str) -> None:
        print(f"shardscope run: rank 0 {stage}", file=sys.stderr, flush=True)

    try:
        result = run_training(config, progress=progress)
    except RunError as error:
        raise CliError(f"run failed: {error}", exit_code=1) from error
    print(json.dumps(result.to_json(), indent=1) if args.json else render(result))
    return 0 if result.parity.ok else 1
