"""Why calibrate takes means of steps' own patterns: gloo's long tail, calls back to back, compute after communication.

Usage: python benchmarks/bench_gloo_tail.py [--repeats 40]
Two local gloo ranks, one thread each, interleaved so that the machine's drift hits every variant alike. Prints, per
op at 64 KiB: the median and the mean of single calls after a barrier, the mean per call of three calls back to back
after a barrier, and of three calls back to back after a segment of compute and a first call (as calibrate times
them, and as a step issues them); then the gpt2-style calibration reference's forward, timed in a loop of forwards
and timed once right after a 64 KiB all_reduce (as a step runs it). docs/time-model.md quotes it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from shardscope.calibrate.collectives import compute_segment
from shardscope.calibrate.overheads import REFERENCE_MODEL, REFERENCE_TRAINING
from shardscope.procs.functions import run_function
from shardscope.reference_models import build_model, lm_loss, sample_batch
from shardscope.runtime.collectives import all_gather_single, reduce_scatter_single

PAYLOAD_BYTES = 64 * 1024


def _rank(rank: int, world: int, port: int, options: dict[str, Any]) -> dict[str, float]:
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    full = torch.ones(PAYLOAD_BYTES // 4)
    shard = torch.ones(PAYLOAD_BYTES // 4 // world)
    calls = {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: all_gather_single(full, shard),
        "reduce_scatter": lambda: reduce_scatter_single(shard, full),
    }
    single: dict[str, list[float]] = {op: [] for op in calls}
    chained: dict[str, list[float]] = {op: [] for op in calls}
    after_compute: dict[str, list[float]] = {op: [] for op in calls}
    for call in calls.values():
        call()
    for _ in range(options["repeats"]):
        for op, call in calls.items():
            dist.barrier()
            start = time.perf_counter()
            call()
            single[op].append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(3):
                call()
            chained[op].append((time.perf_counter() - start) / 3)
            dist.barrier()
            compute_segment()
            call()
            start = time.perf_counter()
            for _ in range(3):
                call()
            after_compute[op].append((time.perf_counter() - start) / 3)
    model = build_model(REFERENCE_MODEL, REFERENCE_TRAINING, seed=0)
    inputs, targets = sample_batch(REFERENCE_MODEL, REFERENCE_TRAINING, num_sequences=2)
    looped, after = [], []
    for _ in range(options["repeats"]):
        for _ in range(3):
            start = time.perf_counter()
            loss = lm_loss(model(inputs), targets)
            looped.append(time.perf_counter() - start)
        loss.backward()  # type: ignore[no-untyped-call]
        dist.all_reduce(full)
        start = time.perf_counter()
        loss = lm_loss(model(inputs), targets)
        after.append(time.perf_counter() - start)
        loss.backward()  # type: ignore[no-untyped-call]
    dist.destroy_process_group()
    out = {f"{op} median": statistics.median(single[op]) for op in calls}
    out |= {f"{op} mean": statistics.fmean(single[op]) for op in calls}
    out |= {f"{op} back to back": statistics.fmean(chained[op]) for op in calls}
    out |= {f"{op} back to back after compute": statistics.fmean(after_compute[op]) for op in calls}
    out |= {"forward in a loop": statistics.fmean(looped), "forward after a collective": statistics.fmean(after)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    reports = run_function(_rank, 2, {"repeats": args.repeats}, timeout_s=300)
    print(f"{'two gloo ranks, slower rank, ms':<40} {'value':>8}")
    for key in reports[0]:
        print(f"{key:<40} {max(report[key] for report in reports.values()) * 1e3:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
