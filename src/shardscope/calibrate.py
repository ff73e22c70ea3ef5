"""Measure this machine and write a hardware profile: collectives over a payload sweep fitted to latency and
bandwidth, matmul throughput, per-kernel overhead and memory bandwidth.

Collectives run on real process groups: gloo across `world_size` local processes on CPU, or nccl on GPUs when started
under torchrun. The fit is the alpha-beta model of core.network: t = call latency + steps x step latency +
wire bytes / bandwidth, least squares over every op and payload (ring steps and wire bytes from "Bandwidth Optimal
All-reduce Algorithms for Clusters of Workstations"). Needs torch; the core never imports this module.
"""

from __future__ import annotations

import ctypes
import faulthandler
import functools
import math
import os
import signal
import socket
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from shardscope.presets.hardware import HardwareProfile, InterconnectSpec, OpCost

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
DEFAULT_PAYLOADS = tuple(2**power for power in range(12, 25, 2))  # 4 KiB .. 16 MiB
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One measured collective: op, unsharded payload, ranks and mean seconds per call."""

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
    if op == "broadcast":
        return 1.0, ranks - 1
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
    return statistics.median(durations)


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
            "broadcast": functools.partial(dist.broadcast, full, 0),
        }
        for op in OPS:
            seconds = _time_calls(calls[op], repeats, device)
            samples.append(Sample(op=op, payload_bytes=numel * 4, world_size=world, seconds=seconds))
    return samples


# A timing window about as long as a small model's step. Per-op costs are trimmed means over such windows (the
# slowest and fastest tenth dropped): a step is a sum of many pieces, so its expected time is the sum of their
# expected times, stalls of a shared machine included; trimming keeps one rare long stall from swinging the figure.
WINDOW_S = 5e-3


def _typical_seconds(work: Any, repeats: int, device: torch.device, collective: bool = False) -> float:
    """Seconds per call of `work`: the trimmed mean over `repeats` windows of about WINDOW_S, each running it n times.
    Work that communicates runs once per window, so that every rank makes the same number of calls."""

    def timed(count: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(count):
            work()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    first = timed(1)
    count = 1 if collective else max(1, math.ceil(WINDOW_S / max(first, 1e-9)))
    return _trimmed_mean([timed(count) / count for _ in range(repeats)])


def _trimmed_mean(values: list[float]) -> float:
    """Mean without the slowest and fastest tenth."""
    ordered = sorted(values)
    trim = len(ordered) // 10
    return statistics.fmean(ordered[trim : len(ordered) - trim])


def measure_compute(device: torch.device, dtype: torch.dtype, size: int = 512) -> dict[str, float]:
    """Matmul FLOP/s, seconds per small autograd op, and copy bandwidth on this device."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    matmul = _typical_seconds(lambda: torch.mm(a, b), 10, device)
    # A tiny op with autograd, forward and backward: what one kernel of a small model costs beyond its FLOPs.
    x = torch.randn(8, 8, device=device, dtype=dtype, requires_grad=True)

    def tiny() -> None:
        for _ in range(50):
            (x * 1.5).sum().backward()  # type: ignore[no-untyped-call]

    # per iteration: mul and sum forward, their two backward kernels and the accumulation into x.grad
    overhead = _typical_seconds(tiny, 5, device) / (50 * 5)
    big = torch.empty(16 * 2**20, device=device, dtype=torch.float32)
    source = torch.ones_like(big)
    copy = _typical_seconds(lambda: big.copy_(source), 5, device)
    return {
        "matmul_flops_per_s": 2.0 * size**3 / matmul,
        "kernel_overhead_s": overhead,
        "memory_bandwidth_bytes_per_s": 2.0 * big.numel() * 4 / copy,
    }


class _OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts aten ops, the unit of the core's per-op costs (core.compute's op counts are counted the same way)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _counted(work: Any) -> int:
    counter = _OpCounter()
    with counter:
        work()
    return counter.ops


# Framework micro-benchmarks: a stack of FRAMEWORK_UNITS tiny Linear(FRAMEWORK_WIDTH, FRAMEWORK_WIDTH) units on a
# (FRAMEWORK_WIDTH, FRAMEWORK_WIDTH) input, small enough that FLOPs are negligible and what is timed is the
# framework's own work: eager dispatch, autograd, hooks, DDP's reducer, FSDP2's per-unit bookkeeping.
FRAMEWORK_UNITS = 4
FRAMEWORK_WIDTH = 64


def _stack() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(FRAMEWORK_WIDTH, FRAMEWORK_WIDTH) for _ in range(FRAMEWORK_UNITS)))


def _backward_seconds(make_loss: Any, repeats: int, per_window: int) -> float:
    """Seconds of one backward alone (the graphs built untimed), trimmed mean over windows of per_window backwards:
    timing forward + backward and subtracting forward can come out negative on a noisy machine."""
    windows = []
    for _ in range(repeats):
        losses = [make_loss() for _ in range(per_window)]
        start = time.perf_counter()
        for loss in losses:
            loss.backward()
        windows.append((time.perf_counter() - start) / per_window)
    return _trimmed_mean(windows)


def measure_sync_wait(repeats: int = 15) -> float:
    """Extra wait at a blocking collective that follows compute, over the compute and the collective alone.

    Two ranks that compute the same work do not finish it at the same moment on a shared CPU; the collective waits
    for the later one, so a step pays E[max of the ranks' compute] rather than E[compute] at every synchronisation.
    Measured as (compute segment + 4-byte all_reduce) - segment - the all_reduce fenced by a barrier, with a segment
    of about one block's forward and backward on a small model (~2 ms)."""
    cpu = torch.device("cpu")
    x = torch.randn(FRAMEWORK_WIDTH, FRAMEWORK_WIDTH)
    flag = torch.ones(1)

    def segment() -> None:
        y = x
        for _ in range(60):
            y = torch.tanh(y * 1.01 + 0.1)

    def fenced() -> float:
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flag)
        return time.perf_counter() - start

    def segment_then_sync() -> None:
        segment()
        dist.all_reduce(flag)

    alone = _typical_seconds(segment, repeats, cpu, collective=True)
    call = statistics.median(fenced() for _ in range(repeats))
    both = _typical_seconds(segment_then_sync, repeats, cpu, collective=True)
    return max(0.0, both - alone - call)


def measure_framework(repeats: int = 15) -> dict[str, float]:
    """Per-op, per-tensor and per-unit framework costs on this machine (gloo, CPU; every rank runs it at once).

    Returned raw: seconds per forward and backward aten op, per optimizer tensor (plain and FSDP2's DTensors), and
    step times of the same tiny stack plain, under DDP and under FSDP2, for calibrate() to subtract the modelled
    collectives from.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    cpu = torch.device("cpu")
    x = torch.randn(FRAMEWORK_WIDTH, FRAMEWORK_WIDTH, requires_grad=True)

    def chain() -> torch.Tensor:
        y = x
        for _ in range(16):
            y = torch.tanh(y * 1.01 + 0.1)
        return y.sum()

    forward_ops = _counted(chain)
    loss = chain()
    backward_ops = _counted(loss.backward)
    forward_s = _typical_seconds(chain, repeats, cpu)
    backward_s = _backward_seconds(chain, repeats, max(1, math.ceil(WINDOW_S / max(forward_s, 1e-9))))
    tensors = [torch.zeros(FRAMEWORK_WIDTH, requires_grad=True) for _ in range(32)]
    for tensor in tensors:
        tensor.grad = torch.ones_like(tensor)
    adam = torch.optim.AdamW(tensors, lr=1e-3, foreach=False)
    optimizer_tensor_s = _typical_seconds(adam.step, repeats, cpu) / len(tensors)
    inputs = torch.randn(FRAMEWORK_WIDTH, FRAMEWORK_WIDTH)

    def train_step(module: torch.nn.Module) -> None:
        module(inputs).sum().backward()

    plain = _stack()
    plain_s = _typical_seconds(lambda: train_step(plain), repeats, cpu)
    ddp = DistributedDataParallel(_stack())
    for _ in range(3):  # DDP rebuilds its buckets after the first iteration
        train_step(ddp)
    ddp_s = _typical_seconds(lambda: train_step(ddp), repeats, cpu, collective=True)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    zero_stack = _stack()
    train_step(zero_stack)
    zero = ZeroRedundancyOptimizer(list(zero_stack.parameters()), torch.optim.AdamW, lr=1e-3, foreach=False)
    zero.step()
    zero_s = _typical_seconds(zero.step, repeats, cpu, collective=True)
    sharded = _stack()
    for unit in sharded:
        fully_shard(unit, reshard_after_forward=True)
    fully_shard(sharded)
    fsdp_s = _typical_seconds(lambda: train_step(sharded), repeats, cpu, collective=True)
    train_step(sharded)
    dtensor_adam = torch.optim.AdamW(sharded.parameters(), lr=1e-3, foreach=False)
    dtensor_adam.step()
    fsdp_optimizer_tensor_s = _typical_seconds(dtensor_adam.step, repeats, cpu, collective=True) / (2 * FRAMEWORK_UNITS)
    return {
        "forward_op_s": forward_s / forward_ops,
        "backward_op_s": backward_s / backward_ops,
        "optimizer_tensor_s": optimizer_tensor_s,
        "fsdp_optimizer_tensor_s": fsdp_optimizer_tensor_s,
        "plain_step_s": plain_s,
        "ddp_step_s": ddp_s,
        "fsdp_step_s": fsdp_s,
        "zero_step_s": zero_s,
    }


def _worker(rank: int, world: int, port: int, payloads: tuple[int, ...], repeats: int, queue: Any) -> None:
    """One local gloo rank: measure, hand rank 0's numbers back, leave cleanly (DESIGN.md's rules)."""
    ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renames of the *_tensor collectives
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(float(os.environ.get("SHARDSCOPE_CALIBRATE_STACKS_AFTER_S", "600")))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device("cpu")
    samples = _measure_collectives(payloads, repeats, device)
    dist.barrier()
    compute = measure_compute(device, torch.float32)  # every rank at once, as in training
    dist.barrier()
    compute.update(measure_framework())
    dist.barrier()
    compute["sync_wait_s"] = measure_sync_wait()
    if rank == 0:
        queue.put((samples, compute))
        # put() hands the data to a feeder thread; os._exit below would kill it before the pipe has the data
        queue.close()
        queue.join_thread()
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


def fit_op(samples: list[Sample], op: str) -> OpCost:
    """One op's own t = call + wire / bandwidth (least squares in relative error, as fit_samples)."""
    mine = [sample for sample in samples if sample.op == op]
    design = torch.tensor([[1.0, _ring(op, s.world_size)[0] * s.payload_bytes] for s in mine], dtype=torch.float64)
    target = torch.tensor([s.seconds for s in mine], dtype=torch.float64).unsqueeze(1)
    solution = torch.linalg.lstsq(design / target, target / target).solution.squeeze(1).tolist()
    return OpCost(op=op, call_latency_s=max(solution[0], 0.0), bandwidth_bytes_per_s=1.0 / max(solution[1], 1e-15))


def _op_seconds(cost: OpCost, payload_bytes: int, world_size: int) -> float:
    return cost.call_latency_s + _ring(cost.op, world_size)[0] * payload_bytes / cost.bandwidth_bytes_per_s


def framework_overheads(raw: dict[str, float], op_costs: dict[str, OpCost], world_size: int) -> dict[str, float]:
    """The framework terms of the profile from measure_framework's timings: each engine's step of the tiny stack,
    less the plain step and less its collectives as the per-op fit prices them."""
    unit_bytes = (FRAMEWORK_WIDTH * FRAMEWORK_WIDTH + FRAMEWORK_WIDTH) * 4
    all_reduce = _op_seconds(op_costs["all_reduce"], FRAMEWORK_UNITS * unit_bytes, world_size)
    per_unit_comm = 2 * _op_seconds(op_costs["all_gather"], unit_bytes, world_size) + _op_seconds(
        op_costs["reduce_scatter"], unit_bytes, world_size
    )
    fsdp = raw["fsdp_step_s"] - raw["plain_step_s"] - FRAMEWORK_UNITS * per_unit_comm
    # ZeroRedundancyOptimizer over the stack: the rank's AdamW over half the tensors, one broadcast per tensor
    tensors = 2 * FRAMEWORK_UNITS
    zero = 0.0
    if "zero_step_s" in raw:
        broadcasts = FRAMEWORK_UNITS * (
            _op_seconds(op_costs["broadcast"], FRAMEWORK_WIDTH * FRAMEWORK_WIDTH * 4, world_size)
            + _op_seconds(op_costs["broadcast"], FRAMEWORK_WIDTH * 4, world_size)
        )
        zero = raw["zero_step_s"] - broadcasts - tensors / world_size * raw["optimizer_tensor_s"]
    return {
        "kernel_overhead_s": raw["forward_op_s"],
        "backward_op_overhead_s": raw["backward_op_s"],
        "optimizer_tensor_overhead_s": raw["optimizer_tensor_s"],
        "ddp_step_overhead_s": max(0.0, raw["ddp_step_s"] - raw["plain_step_s"] - all_reduce),
        "fsdp_unit_overhead_s": max(0.0, fsdp / FRAMEWORK_UNITS),
        "fsdp_optimizer_tensor_overhead_s": max(0.0, raw["fsdp_optimizer_tensor_s"] - raw["optimizer_tensor_s"]),
        "sync_wait_s": raw.get("sync_wait_s", 0.0),
        "zero_tensor_overhead_s": max(0.0, zero / tensors),
    }


def calibrate(
    world_size: int = 2, payloads: tuple[int, ...] = DEFAULT_PAYLOADS, repeats: int = 10, timeout_s: float = 300.0
) -> Calibration:
    """Measure this host with world_size gloo ranks and fit a profile."""
    samples, compute = run_local(world_size, payloads, repeats, timeout_s)
    call, step, bandwidth, error = fit_samples(samples)
    op_costs = {op: fit_op(samples, op) for op in OPS}
    overheads = framework_overheads(compute, op_costs, world_size)
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
        memory_bandwidth_bytes_per_s=compute["memory_bandwidth_bytes_per_s"],
        op_costs=tuple(op_costs.values()),
        **overheads,
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
