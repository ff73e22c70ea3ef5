"""`shardscope calibrate`: measure this machine and write a hardware profile for --hardware."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from shardscope.cli.arg_types import positive_int
from shardscope.cli.errors import CliError
from shardscope.cli.tables import render_table
from shardscope.presets.profile_toml import profile_to_toml
from shardscope.procs.launcher import MAX_LOCAL_WORLD_SIZE, RunError, check_timeout

EXAMPLES = """examples:
  shardscope calibrate --out profile.toml                 # 2 local gloo ranks on this machine
  torchrun --nproc-per-node 8 -m shardscope calibrate --out profile.toml   # nccl on 8 GPUs
"""


def add_parser(subparsers: Any) -> None:
    """Attach `calibrate` to the CLI."""
    parser = subparsers.add_parser(
        "calibrate",
        help="measure collectives, matmul throughput and kernel overhead; write a hardware profile",
        description="Time gloo (or, under torchrun, nccl) collectives over a payload sweep, fit latency and "
        "bandwidth, measure matmul throughput, and write a profile for --hardware.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="profile.toml", help="profile file to write (default %(default)s)")
    parser.add_argument(
        "--world-size", type=positive_int, default=2, help=f"local gloo ranks, 2 to {MAX_LOCAL_WORLD_SIZE} (default 2)"
    )
    parser.add_argument("--repeats", type=positive_int, default=20, help="timing windows per payload (default 20)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the ranks are killed")


def _check(args: argparse.Namespace) -> None:
    """Bad values end here, before any rank starts (exit 2, one line naming the value)."""
    try:
        check_timeout(args.timeout, "--timeout")
    except RunError as error:
        raise CliError(str(error)) from None
    if "TORCHELASTIC_RUN_ID" not in os.environ and not 2 <= args.world_size <= MAX_LOCAL_WORLD_SIZE:
        raise CliError(
            f"--world-size {args.world_size} must be between 2 (to time collectives) and {MAX_LOCAL_WORLD_SIZE} "
            "local ranks; for more, run calibrate under torchrun"
        )


def run(args: argparse.Namespace) -> int:
    """Measure, fit, print, write."""
    _check(args)
    try:
        from shardscope import calibrate as measure  # torch is needed here only
    except ImportError as error:
        raise CliError(f"calibrate needs torch ({error}); install shardscope[torch]") from None
    if "TORCHELASTIC_RUN_ID" in os.environ:
        result = measure.calibrate_torchrun(repeats=args.repeats)
        if result is None:
            return 0
    else:
        try:
            result = measure.calibrate(world_size=args.world_size, repeats=args.repeats, timeout_s=args.timeout)
        except RunError as error:
            raise CliError(f"calibrate failed: {error}", exit_code=1) from None
    rows = [[s.op, str(s.payload_bytes), f"{s.seconds * 1e6:.1f}"] for s in result.samples]
    profile = result.profile
    host = profile.host_terms
    print(render_table(["op", "payload bytes", "mean us"], rows))
    print(
        f"\nfit: call latency {profile.call_latency_s * 1e6:.1f} us, step latency "
        f"{profile.intra_node.latency_s * 1e6:.1f} us, bandwidth {profile.intra_node.bandwidth_bytes_per_s / 1e9:.2f}"
        f" GB/s (max relative error {result.fit_error:.0%})"
    )
    print(
        f"compute: matmul {profile.matmul_flops_per_s / 1e9:.1f} GFLOP/s, memory copy "
        f"{profile.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s; per op: forward "
        f"{profile.kernel_overhead_s * 1e6:.1f} us, backward {profile.backward_op_overhead_s * 1e6:.1f} us"
        + "".join(
            f" ({cost.family}: {cost.kernel_overhead_s * 1e6:.1f} us, {cost.backward_op_overhead_s * 1e6:.1f} us)"
            for cost in host.family_op_costs
        )
        + f"; optimizer {profile.optimizer_tensor_overhead_s * 1e6:.1f} us per tensor, "
        f"+{host.optimizer_step_overhead_s * 1e6:.0f} us per step (cold)"
    )
    print(
        f"framework: DDP {profile.ddp_step_overhead_s * 1e3:.2f} ms per step, FSDP2 "
        f"{profile.fsdp_unit_overhead_s * 1e3:.2f} ms per unit per step and "
        f"{host.fsdp_optimizer_tensor_overhead_s * 1e6:.0f} us per DTensor in the optimizer; wait for the later "
        f"rank {host.sync_wait_s * 1e3:.2f} ms per synchronisation; {host.hook_overhead_s * 1e6:.1f} us per "
        f"Python hook, {host.bookkeeping_op_overhead_s * 1e6:.1f} us per teaching bookkeeping op; compute "
        f"beside an async collective +{host.async_compute_slowdown:.2f} s per s in flight"
    )
    for cost in profile.op_costs:
        print(
            f"  {cost.op:<14} {cost.call_latency_s * 1e6:7.1f} us per call + ring wire bytes at "
            f"{cost.bandwidth_bytes_per_s / 1e9:.2f} GB/s"
        )
    try:
        Path(args.out).write_text(profile_to_toml(profile), encoding="utf-8")
    except OSError as error:
        raise CliError(f"cannot write {args.out!r}: {error.strerror}") from None
    print(f"profile written to {args.out}")
    return 0
