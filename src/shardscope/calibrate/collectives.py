"""Collective timings over a payload sweep, and their alpha-beta fits (the ring model of core.network: "Bandwidth
Optimal All-reduce Algorithms for Clusters of Workstations")."""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardscope.presets.hardware import OpCost
from shardscope.runtime.collectives import all_gather_single, reduce_scatter_single

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
DEFAULT_PAYLOADS = tuple(2**power for power in range(12, 25, 2))  # 4 KiB .. 16 MiB
CALLS_PER_WINDOW = 4  # collectives issued back to back per window after compute, as a step issues them


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One measured collective: op, unsharded payload, ranks and mean seconds per call."""

    op: str
    payload_bytes: int
    world_size: int
    seconds: float


def _ring(op: str, ranks: int) -> tuple[float, int]:
    """(wire bytes per unit of payload, steps) of a ring, as in core.network."""
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks, 2 * (ranks - 1)
    if op == "broadcast":
        return 1.0, ranks - 1
    return (ranks - 1) / ranks, ranks - 1


def trimmed_mean(values: list[float]) -> float:
    """Mean without the slowest and fastest tenth."""
    ordered = sorted(values)
    trim = len(ordered) // 10
    return statistics.fmean(ordered[trim : len(ordered) - trim])


def compute_segment(iterations: int = 60) -> None:
    """About one small block's forward and backward of work on this rank (~2 ms on one shared CPU core): what a step
    runs before its collectives. Both ranks run the same segment, so neither waits long for the other."""
    y = torch.full((64, 64), 0.5)
    for _ in range(iterations):
        y = torch.tanh(y * 1.01 + 0.1)


def _time_calls(call: Any, repeats: int, device: torch.device) -> float:
    """Seconds per call as a step pays it: after a warm-up, `repeats` windows of CALLS_PER_WINDOW calls issued back
    to back after a segment of compute (a barrier before it); the trimmed mean of the windows' per-call time over the
    calls after the first (the first waits for the later rank: core.timeline charges that as sync_wait_s, measured
    apart by measure_sync_wait).

    A step pays its collectives' mean cost, stalls included, and gloo on a shared CPU has a long tail (the median of
    single barrier-fenced calls prices a step's calls too low), so the figure is a mean over windows. A step issues
    its collectives after compute, not after a barrier, and calls after compute cost more here
    (benchmarks/bench_gloo_tail.py); timed so, the teaching ZeRO rows of benchmarks/bench_time.py came closer to
    their measured step times (docs/time-model.md quotes runs before and after)."""
    for _ in range(2):
        call()
    windows = []
    for _ in range(repeats):
        dist.barrier()
        compute_segment()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(CALLS_PER_WINDOW - 1):
            call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        windows.append((time.perf_counter() - start) / (CALLS_PER_WINDOW - 1))
    return trimmed_mean(windows)


def _measure_collectives(payloads: tuple[int, ...], repeats: int, device: torch.device) -> list[Sample]:
    world = dist.get_world_size()
    samples = []
    for payload in payloads:
        numel = max(world, payload // 4 // world * world)
        full = torch.ones(numel, device=device)
        shard = torch.ones(numel // world, device=device)
        calls = {
            "all_reduce": functools.partial(dist.all_reduce, full),
            "all_gather": functools.partial(all_gather_single, full, shard),
            "reduce_scatter": functools.partial(reduce_scatter_single, shard, full),
            "broadcast": functools.partial(dist.broadcast, full, 0),
        }
        for op in OPS:
            seconds = _time_calls(calls[op], repeats, device)
            samples.append(Sample(op=op, payload_bytes=numel * 4, world_size=world, seconds=seconds))
    return samples


def fit_samples(samples: list[Sample]) -> tuple[float, float, float, float]:
    """Least squares of t = call + steps x step + wire / bandwidth: (call s, step s, bandwidth B/s, max rel. error)."""
    rows, times = [], []
    for sample in samples:
        fraction, steps = _ring(sample.op, sample.world_size)
        rows.append([1.0, float(steps), fraction * sample.payload_bytes])
        times.append(sample.seconds)
    design = torch.tensor(rows, dtype=torch.float64)
    target = torch.tensor(times, dtype=torch.float64).unsqueeze(1)
    # weight by 1/t so small and large payloads count alike (relative error)
    weights = 1.0 / target
    solution = torch.linalg.lstsq(design * weights, target * weights).solution.squeeze(1).tolist()
    call, step, per_byte = (max(value, 0.0) for value in solution)
    per_byte = max(per_byte, 1e-15)
    predicted = design @ torch.tensor([call, step, per_byte], dtype=torch.float64)
    error = float(((predicted - target.squeeze(1)).abs() / target.squeeze(1)).max())
    return call, step, 1.0 / per_byte, error


def fit_op(samples: list[Sample], op: str) -> OpCost:
    """One op's own t = call + wire / bandwidth (least squares in relative error, as fit_samples)."""
    mine = [sample for sample in samples if sample.op == op]
    design = torch.tensor([[1.0, _ring(op, s.world_size)[0] * s.payload_bytes] for s in mine], dtype=torch.float64)
    target = torch.tensor([s.seconds for s in mine], dtype=torch.float64).unsqueeze(1)
    solution = torch.linalg.lstsq(design / target, target / target).solution.squeeze(1).tolist()
    return OpCost(op=op, call_latency_s=max(solution[0], 0.0), bandwidth_bytes_per_s=1.0 / max(solution[1], 1e-15))


def _op_seconds(cost: OpCost, payload_bytes: int, world_size: int) -> float:
    return cost.call_latency_s + _ring(cost.op, world_size)[0] * payload_bytes / cost.bandwidth_bytes_per_s
