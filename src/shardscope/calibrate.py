"""Measure this machine and write a hardware profile: collectives over a payload sweep fitted to latency and
bandwidth, matmul throughput, per-kernel overhead and memory bandwidth.

Collectives run on real process groups: gloo across `world_size` local processes on CPU, or nccl on GPUs when started
under torchrun. The fit is the alpha-beta model of core.network: t = call latency + steps x step latency +
wire bytes / bandwidth, least squares over every op and payload (ring steps and wire bytes from "Bandwidth Optimal
All-reduce Algorithms for Clusters of Workstations"). Needs torch; the core never imports this module.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import socket
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardscope.presets.hardware import HardwareProfile, InterconnectSpec

OPS = ("all_reduce", "all_gather", "reduce_scatter")
DEFAULT_PAYLOADS = tuple(2**power for power in range(12, 25, 2))  # 4 KiB .. 16 MiB
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One measured collective: op, unsharded payload, ranks and median seconds per call."""

    op: str
    payload_bytes: int
    world_size: int
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """What calibrate measured, and the profile fitted from it."""

    samples: tuple[Sample, ...]
    """Every collective timing."""
    profile: HardwareProfile
    """The fitted profile."""
    fit_error: float
    """Largest relative error of the fitted model over the samples."""


def _ring(op: str, ranks: int) -> tuple[float, int]:
    """(wire bytes per unit of payload, steps) of a ring, as in core.network."""
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks, 2 * (ranks - 1)
    return (ranks - 1) / ranks, ranks - 1


def _time_calls(call: Any, repeats: int, device: torch.device) -> float:
    """Median seconds of `call` after a warm-up, each call fenced by a barrier."""
    for _ in range(2):
        call()
    durations = []
    for _ in range(repeats):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        durations.append(time.perf_counter() - start)
    durations.sort()
    return durations[len(durations) // 2]


def _measure_collectives(payloads: tuple[int, ...], repeats: int, device: torch.device) -> list[Sample]:
    world = dist.get_world_size()
    samples = []
    for payload in payloads:
        numel = max(world, payload // 4 // world * world)
        full = torch.ones(numel, device=device)
        shard = torch.ones(numel // world, device=device)
        calls = {
            "all_reduce": functools.partial(dist.all_reduce, full),
            "all_gather": functools.partial(dist.all_gather_into_tensor, full, shard),
            "reduce_scatter": functools.partial(dist.reduce_scatter_tensor, shard, full),
        }
        for op in OPS:
            seconds = _time_calls(calls[op], repeats, device)
            samples.append(Sample(op=op, payload_bytes=numel * 4, world_size=world, seconds=seconds))
    return samples


def _median_seconds(work: Any, repeats: int, device: torch.device) -> float:
    work()
    durations = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize()
        durations.append(time.perf_counter() - start)
    durations.sort()
    return durations[len(durations) // 2]


def measure_compute(device: torch.device, dtype: torch.dtype, size: int = 512) -> dict[str, float]:
    """Matmul FLOP/s, seconds per small autograd op, and copy bandwidth on this device."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    matmul = _median_seconds(lambda: torch.mm(a, b), 10, device)
    # A tiny op with autograd, forward and backward: what one kernel of a small model costs beyond its FLOPs.
    x = torch.randn(8, 8, device=device, dtype=dtype, requires_grad=True)

    def tiny() -> None:
        for _ in range(50):
            (x * 1.5).sum().backward()

    # per iteration: mul and sum forward, their two backward kernels and the accumulation into x.grad
    overhead = _median_seconds(tiny, 5, device) / (50 * 5)
    big = torch.empty(16 * 2**20, device=device, dtype=torch.float32)
    source = torch.ones_like(big)
    copy = _median_seconds(lambda: big.copy_(source), 5, device)
    return {
        "matmul_flops_per_s": 2.0 * size**3 / matmul,
        "kernel_overhead_s": overhead,
        "memory_bandwidth_bytes_per_s": 2.0 * big.numel() * 4 / copy,
    }


def _worker(rank: int, world: int, port: int, payloads: tuple[int, ...], repeats: int, queue: Any) -> None:
    """One local gloo rank: measure, hand rank 0's numbers back, leave cleanly (DESIGN.md's rules)."""
    ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renames of the *_tensor collectives
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device("cpu")
    samples = _measure_collectives(payloads, repeats, device)
    dist.barrier()
    compute = measure_compute(device, torch.float32)  # every rank at once, as in training
    if rank == 0:
        queue.put((samples, compute))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_local(
    world_size: int, payloads: tuple[int, ...], repeats: int, timeout_s: float
) -> tuple[list[Sample], dict[str, float]]:
    """Launch world_size gloo processes on this host; kill them all if the deadline passes."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    workers = [
        context.Process(target=_worker, args=(rank, world_size, port, payloads, repeats, queue), daemon=True)
        for rank in range(world_size)
    ]
    for worker in workers:
        worker.start()
    try:
        samples, compute = queue.get(timeout=timeout_s)
        deadline = time.monotonic() + 30
        for worker in workers:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
    except Exception as error:
        raise TimeoutError(f"calibration ranks did not finish within {timeout_s:.0f} s") from error
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join()
    return samples, compute


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


def calibrate(
    world_size: int = 2, payloads: tuple[int, ...] = DEFAULT_PAYLOADS, repeats: int = 10, timeout_s: float = 300.0
) -> Calibration:
    """Measure this host with world_size gloo ranks and fit a profile."""
    samples, compute = run_local(world_size, payloads, repeats, timeout_s)
    call, step, bandwidth, error = fit_samples(samples)
    host = socket.gethostname()
    link = InterconnectSpec(
        id="measured",
        name=f"gloo on {host}",
        bandwidth_bytes_per_s=bandwidth,
        latency_s=step,
        source=f"shardscope calibrate: {len(samples)} gloo timings, world size {world_size}",
    )
    memory = InterconnectSpec(
        id="measured-memory",
        name=f"memory copy on {host}",
        bandwidth_bytes_per_s=compute["memory_bandwidth_bytes_per_s"],
        latency_s=0.0,
        source="shardscope calibrate: 64 MiB copy",
    )
    profile = HardwareProfile(
        name=f"calibrated: {host}, gloo, {world_size} ranks",
        intra_node=link,
        inter_node=link,
        host=memory,
        call_latency_s=call,
        algorithm="ring",
        overlap=False,
        matmul_flops_per_s=compute["matmul_flops_per_s"],
        efficiency=1.0,
        kernel_overhead_s=compute["kernel_overhead_s"],
        memory_bandwidth_bytes_per_s=compute["memory_bandwidth_bytes_per_s"],
        source=f"shardscope calibrate on {host} at {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, "
        f"1 thread per rank; fit max relative error {error:.0%}",
    )
    return Calibration(samples=tuple(samples), profile=profile, fit_error=error)


def calibrate_torchrun(payloads: tuple[int, ...] = DEFAULT_PAYLOADS, repeats: int = 10) -> Calibration | None:
    """Under torchrun: nccl on GPUs (gloo without), every rank measures, rank 0 gets the Calibration."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    world = dist.get_world_size()
    samples = _measure_collectives(payloads, repeats, device) if world > 1 else []
    compute = measure_compute(device, torch.bfloat16 if cuda else torch.float32, size=8192 if cuda else 512)
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    call, step, bandwidth, error = fit_samples(samples) if samples else (0.0, 0.0, 1.0, 0.0)
    where = "intra-node" if per_node == world else "whole job (inter-node bound)"
    link = InterconnectSpec(
        id="measured",
        name=f"{'nccl' if cuda else 'gloo'} {where}",
        bandwidth_bytes_per_s=bandwidth,
        latency_s=step,
        source=f"shardscope calibrate under torchrun, world size {world}",
    )
    profile = HardwareProfile(
        name=f"calibrated: torchrun, {world} ranks",
        intra_node=link,
        inter_node=link,
        host=link,
        call_latency_s=call,
        algorithm="ring",
        overlap=cuda,
        matmul_flops_per_s=compute["matmul_flops_per_s"],
        efficiency=1.0,
        kernel_overhead_s=compute["kernel_overhead_s"],
        memory_bandwidth_bytes_per_s=compute["memory_bandwidth_bytes_per_s"],
        source=f"shardscope calibrate under torchrun, torch {torch.__version__}; fit max relative error {error:.0%}",
    )
    return Calibration(samples=tuple(samples), profile=profile, fit_error=error)
