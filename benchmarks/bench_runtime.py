"""Real-run benchmarks (not a test): teaching strategies against torch's engines, and gloo bus bandwidth.

    .venv/bin/python benchmarks/bench_runtime.py [--world-size 2] [--model tiny-gpt2] [--steps 6]

Step times come from one launch per engine pair on the same model, world size and batch, so the ratio compares
like with like (goal: teaching at most 1.5x torch). Bus bandwidth follows nccl-tests' convention: algorithm
bandwidth (bytes / time) times 2(n-1)/n for all-reduce and (n-1)/n for all-gather and reduce-scatter.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist

from shardscope.cli.tables import render_table
from shardscope.procs.functions import run_function
from shardscope.runtime import RunConfig, run_suite
from shardscope.runtime.collectives import all_gather_single, reduce_scatter_single
from shardscope.runtime.lesson_impl import init_process_group

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
PAYLOADS = (2**12, 2**16, 2**20, 2**23)  # bytes of the full (unsharded) buffer
REPEATS = 5


def _bandwidth_rank(rank: int, world: int, port: int, options: dict[str, Any]) -> dict[str, Any]:
    init_process_group(rank, world, port=port, timeout=120)
    rows: dict[str, Any] = {}
    for payload in options["payloads"]:
        full = torch.zeros(payload // 4, dtype=torch.float32)
        shard = torch.zeros(full.numel() // world, dtype=torch.float32)
        calls = {
            "all_reduce": lambda full=full: dist.all_reduce(full),
            "all_gather": lambda full=full, shard=shard: all_gather_single(full, shard),
            "reduce_scatter": lambda full=full, shard=shard: reduce_scatter_single(shard, full),
        }
        for op, call in calls.items():
            call()  # warm-up
            dist.barrier()
            started = time.perf_counter()
            for _ in range(REPEATS):
                call()
            rows[f"{op}:{payload}"] = (time.perf_counter() - started) / REPEATS
    dist.barrier()
    dist.destroy_process_group()
    return rows


def bus_bandwidth(world: int) -> list[list[str]]:
    reports = run_function(_bandwidth_rank, world, {"payloads": PAYLOADS}, timeout_s=300)
    factor = {
        "all_reduce": 2 * (world - 1) / world,
        "all_gather": (world - 1) / world,
        "reduce_scatter": (world - 1) / world,
    }
    rows = []
    for payload in PAYLOADS:
        for op in factor:
            seconds = max(report[f"{op}:{payload}"] for report in reports.values())
            rows.append(
                [op, f"{payload / 2**20:.3f}", f"{seconds * 1e3:.3f}", f"{payload / seconds * factor[op] / 1e9:.3f}"]
            )
    return rows


def step_times(model: str, world: int, steps: int) -> list[list[str]]:
    configs = [
        RunConfig.from_options(
            model=model,
            strategy=s,
            engine=e,
            world_size=world,
            steps=steps,
            precision="fp32",
            micro_batch_size=4,
            sequence_length=64,
            timeout_s=300,
        )
        for s in STRATEGIES
        for e in ("teaching", "pytorch")
    ]
    results = run_suite(configs)
    rows = []
    for index, strategy in enumerate(STRATEGIES):
        teaching, torch_run = results[2 * index], results[2 * index + 1]
        rows.append(
            [
                strategy,
                f"{teaching.step_time_s * 1e3:.1f}",
                f"{torch_run.step_time_s * 1e3:.1f}",
                f"{teaching.step_time_s / torch_run.step_time_s:.2f}",
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", default="tiny-gpt2")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    print(f"step time, {args.model}, {args.world_size} gloo ranks, fp32, median of unmeasured steps")
    print(
        render_table(
            ["strategy", "teaching ms", "torch ms", "teaching/torch"],
            step_times(args.model, args.world_size, args.steps),
        )
    )
    print(f"\ngloo bus bandwidth, {args.world_size} ranks on this machine (GB = 1e9 bytes)")
    print(render_table(["op", "payload MiB", "time ms", "bus GB/s"], bus_bandwidth(args.world_size)))


if __name__ == "__main__":
    main()
