"""Is calibrate's rank wait (framework.sync_wait_s) noisy because of how it is timed, or because the wait itself drifts?

Usage: python benchmarks/bench_rank_wait.py [--blocks 8] [--pairs 180] [--segments 15,30,60,120,240]
Two local gloo ranks, one thread each. Each block times `pairs` pairs as calibrate does (a barrier, a ~2 ms segment of
compute on both ranks, a 4-byte all_reduce timed from the end of the rank's own segment, a barrier, the same
all_reduce alone; the trimmed mean of the differences) and, from the same iterations, the wait read off the clock:
both ranks share this host's monotonic clock, so after the block the ranks exchange their segment end times and each
takes the trimmed mean of (the later rank's end - its own end). Prints both per block and rank: if they agree while
the blocks differ, the wait drifts and more samples cannot steady it. Then the clock's figure after segments of
other lengths (`--segments`: iterations of calibrate's compute segment, 60 being calibrate's), interleaved in rounds
so that the drift hits every length alike: whether the wait grows with the compute before the collective.
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

from shardscope.calibrate.collectives import compute_segment, trimmed_mean
from shardscope.procs.functions import run_function


def _clock_wait(ends: list[float], rank: int, world: int) -> float:
    """Trimmed mean of (the later rank's segment end - this rank's), the ranks' end times exchanged once."""
    every = [torch.zeros(len(ends), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, torch.tensor(ends, dtype=torch.float64))
    latest = torch.stack(every).max(dim=0).values
    return trimmed_mean((latest - every[rank]).tolist())


def _rank(rank: int, world: int, port: int, options: dict[str, Any]) -> dict[str, Any]:
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    flag = torch.ones(1)

    def timed_all_reduce() -> float:
        start = time.perf_counter()
        dist.all_reduce(flag)
        return time.perf_counter() - start

    blocks = []
    for _ in range(options["blocks"]):
        differences, ends = [], []
        for _ in range(options["pairs"]):
            dist.barrier()
            compute_segment()
            ends.append(time.perf_counter())
            after_compute = timed_all_reduce()
            dist.barrier()
            differences.append(after_compute - timed_all_reduce())
        blocks.append((trimmed_mean(differences), _clock_wait(ends, rank, world)))
    by_length: dict[int, list[float]] = {length: [] for length in options["segments"]}
    durations: dict[int, list[float]] = {length: [] for length in options["segments"]}
    for _ in range(options["blocks"]):
        for length in options["segments"]:
            starts, ends = [], []
            for _ in range(options["pairs"] // 4):
                dist.barrier()
                starts.append(time.perf_counter())
                compute_segment(length)
                ends.append(time.perf_counter())
                dist.all_reduce(flag)
            by_length[length].append(_clock_wait(ends, rank, world))
            durations[length].append(trimmed_mean([end - start for start, end in zip(starts, ends, strict=True)]))
    dist.barrier()
    dist.destroy_process_group()
    sweep = [(statistics.median(durations[n]), statistics.median(by_length[n])) for n in options["segments"]]
    return {"blocks": blocks, "sweep": sweep}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=180)
    parser.add_argument("--segments", default="15,30,60,120,240")
    args = parser.parse_args()
    try:
        segments = [int(length) for length in args.segments.split(",")]
    except ValueError:
        segments = []
    if args.blocks < 1 or args.pairs < 40 or not segments or min(segments) < 1:
        print("error: --blocks must be 1 or more, --pairs 40 or more, --segments positive integers", file=sys.stderr)
        return 2
    options = {"blocks": args.blocks, "pairs": args.pairs, "segments": segments}
    reports = run_function(_rank, 2, options, timeout_s=300)
    print(f"{'rank':>4} {'block':>5} {'as calibrate, ms':>16} {'from the clock, ms':>18}")
    for rank, report in sorted(reports.items()):
        for index, (difference, skew) in enumerate(report["blocks"]):
            print(f"{rank:>4} {index + 1:>5} {difference * 1e3:16.2f} {skew * 1e3:18.2f}")
    print(f"\n{'rank':>4} {'segment ms':>10} {'wait ms (median of blocks)':>27}")
    for rank, report in sorted(reports.items()):
        for duration, wait in report["sweep"]:
            print(f"{rank:>4} {duration * 1e3:10.2f} {wait * 1e3:27.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
