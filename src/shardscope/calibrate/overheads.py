"""Framework overheads measured by micro-benchmarks: matmul throughput, per-op dispatch, per-tensor optimizer work,
DDP and FSDP2 bookkeeping, and the wait at a synchronisation point; then the profile terms fitted from them."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch
import torch.distributed as dist

from shardscope.calibrate.collectives import _op_seconds, compute_segment, trimmed_mean
from shardscope.presets.hardware import FamilyOpCost, OpCost
from shardscope.specs import ModelSpec, TrainingSpec

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
    return trimmed_mean([timed(count) / count for _ in range(repeats)])


def measure_compute(device: torch.device, dtype: torch.dtype, size: int = 512) -> dict[str, float]:
    """Matmul FLOP/s, seconds per small autograd op, and copy bandwidth on this device."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    matmul = _typical_seconds(lambda: torch.mm(a, b), 30, device)
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


# Framework micro-benchmarks: a stack of FRAMEWORK_UNITS tiny Linear(FRAMEWORK_WIDTH, FRAMEWORK_WIDTH) units on a
# (FRAMEWORK_WIDTH, FRAMEWORK_WIDTH) input, small enough that FLOPs are negligible and what is timed is the
# framework's own work: eager dispatch, autograd, hooks, DDP's reducer, FSDP2's per-unit bookkeeping.
FRAMEWORK_UNITS = 4
FRAMEWORK_WIDTH = 64


def _stack() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(FRAMEWORK_WIDTH, FRAMEWORK_WIDTH) for _ in range(FRAMEWORK_UNITS)))


def measure_sync_wait(repeats: int = 60) -> float:
    """Extra wait at a blocking collective that follows compute, over the compute and the collective alone.

    Two ranks that compute the same work do not finish it at the same moment on a shared CPU; the collective waits
    for the later one, so a step pays E[max of the ranks' compute] rather than E[compute] at every synchronisation.
    Measured in pairs: after a barrier both ranks compute the same segment (about one block's forward and backward
    on a small model, ~2 ms) and each times its 4-byte all_reduce from the end of its own segment; then, after another
    barrier, the same all_reduce alone. The figure is the trimmed mean of the differences over 3 x repeats pairs.
    (Differencing three separately timed means, as this did before, swung it between 0 and 3 ms from one calibration
    to the next.)"""
    flag = torch.ones(1)

    def timed_all_reduce() -> float:
        start = time.perf_counter()
        dist.all_reduce(flag)
        return time.perf_counter() - start

    differences = []
    for _ in range(3 * repeats):
        dist.barrier()
        compute_segment()
        after_compute = timed_all_reduce()
        dist.barrier()
        differences.append(after_compute - timed_all_reduce())
    return max(0.0, trimmed_mean(differences))


# The transformer the per-op costs are fitted on: gpt2-style like the presets but of its own shape. A real model's
# ops (layer norms, softmax, views, the loss, each inside a module call) cost more than a micro-benchmark's
# elementwise ops, and two ranks sharing the machine slow them further; timing a model, on every rank at once,
# prices the op the way core.compute counts it.
REFERENCE_MODEL = ModelSpec(
    name="calibration-gpt2",
    family="gpt2",
    hidden_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    head_dim=24,
    ffn_hidden_size=384,
    vocab_size=320,
    max_positions=64,
    tie_embeddings=True,
)
# llama's ops (RMSNorm's pieces, rotary embeddings, SwiGLU) are more and smaller than gpt2's: its own reference, of
# its own shape, prices them for the llama family (the profile's [compute.families.llama]).
LLAMA_REFERENCE_MODEL = dataclasses.replace(
    REFERENCE_MODEL, name="calibration-llama", family="llama", num_kv_heads=2, ffn_hidden_size=256, tie_embeddings=False
)
REFERENCE_TRAINING = TrainingSpec(micro_batch_size=2, sequence_length=32, precision="fp32")
STEP_PAYLOAD_BYTES = 64 * 1024  # the all_reduce between the reference model's iterations: about one unit's gradients


def measure_model_ops(
    matmul_flops_per_s: float, repeats: int = 15, models: tuple[ModelSpec, ...] = (REFERENCE_MODEL,)
) -> list[tuple[float, float]]:
    """Seconds per forward and per backward op of each reference model: its measured forward (with the loss) and
    backward, less their FLOPs at the measured matmul throughput, over the ops core.compute counts for it.

    Timed as a training step runs them: each iteration runs each model in turn, a blocking all_reduce of a unit-sized
    buffer (the communication a step has between its compute phases; skipped without a process group), then a
    forward and its backward, each timed once; trimmed means over 3 x repeats iterations. A forward that follows
    communication ran 7-21% slower here than one in a loop of forwards (benchmarks/bench_gloo_tail.py), and every
    forward of a step follows communication."""
    from shardscope.core.compute import stage_flops
    from shardscope.reference_models import build_model, lm_loss, sample_batch

    built = [build_model(spec, REFERENCE_TRAINING, seed=0) for spec in models]
    batches = [sample_batch(spec, REFERENCE_TRAINING, num_sequences=2) for spec in models]
    payload = torch.zeros(STEP_PAYLOAD_BYTES // 4)
    for model, (inputs, targets) in zip(built, batches, strict=True):  # warm-up
        lm_loss(model(inputs), targets).backward()  # type: ignore[no-untyped-call]
    forwards: list[list[float]] = [[] for _ in models]
    backwards: list[list[float]] = [[] for _ in models]
    for _ in range(3 * repeats):
        for index, (model, (inputs, targets)) in enumerate(zip(built, batches, strict=True)):
            if dist.is_initialized():
                dist.all_reduce(payload)
            start = time.perf_counter()
            loss = lm_loss(model(inputs), targets)
            middle = time.perf_counter()
            loss.backward()  # type: ignore[no-untyped-call]
            forwards[index].append(middle - start)
            backwards[index].append(time.perf_counter() - middle)
    costs = []
    for spec, forward_s, backward_s in zip(models, forwards, backwards, strict=True):
        stages = stage_flops(spec, REFERENCE_TRAINING)
        forward_flops = sum(stage.forward_flops for stage in stages) / matmul_flops_per_s
        backward_flops = sum(stage.backward_flops for stage in stages) / matmul_flops_per_s
        costs.append(
            (
                max(0.0, trimmed_mean(forward_s) - forward_flops) / sum(stage.forward_kernels for stage in stages),
                max(0.0, trimmed_mean(backward_s) - backward_flops) / sum(stage.backward_kernels for stage in stages),
            )
        )
    return costs


def _reference_training() -> tuple[torch.nn.Module, Any]:
    """The gpt2-style reference model and a function that runs one forward and backward of it (micro-batch 2)."""
    from shardscope.reference_models import build_model, lm_loss, sample_batch

    model = build_model(REFERENCE_MODEL, REFERENCE_TRAINING, seed=0)
    inputs, targets = sample_batch(REFERENCE_MODEL, REFERENCE_TRAINING, num_sequences=2)

    def forward_backward() -> None:
        lm_loss(model(inputs), targets).backward()  # type: ignore[no-untyped-call]

    return model, forward_backward


def measure_optimizer_step_overhead(repeats: int = 15) -> float:
    """What a step's optimizer step costs beyond the same step run again at once.

    A step's optimizer runs after its forward, backward and communication have pushed torch.optim's Python code and
    the optimizer's tensors out of the caches, and pays for it once per step, whatever the tensor count (0.15-0.37 ms
    here, in the profile lines of benchmarks/bench_time.py quoted in docs/time-model.md). Timed in pairs as a step
    runs it: each iteration makes a 64 KiB all_reduce (skipped without a process group), a forward and backward of
    the gpt2-style reference model, then its AdamW(foreach=False) step twice back to back; the trimmed mean of
    (first - second) over 3 x repeats."""
    model, forward_backward = _reference_training()
    adam = torch.optim.AdamW(model.parameters(), lr=1e-9, foreach=False)
    payload = torch.zeros(STEP_PAYLOAD_BYTES // 4)
    differences = []
    for iteration in range(3 * repeats + 2):
        if dist.is_initialized():
            dist.all_reduce(payload)
        forward_backward()
        start = time.perf_counter()
        adam.step()
        middle = time.perf_counter()
        adam.step()
        if iteration >= 2:  # the first two build the optimizer's state
            differences.append((middle - start) - (time.perf_counter() - middle))
        adam.zero_grad(set_to_none=True)
    return max(0.0, trimmed_mean(differences))


def measure_bookkeeping_op(repeats: int = 15) -> float:
    """Seconds per op the teaching strategies dispatch from Python around their collectives, timed as ZeRO-2 and
    ZeRO-3 run them: each iteration a forward and backward of the gpt2-style reference model, then every unit's
    gradients flattened into a zeroed padded buffer (runtime.teaching.flat.FlatLayout.flatten: a zeros, and a slice,
    detach, reshape and copy_ per tensor) and divided in place; the trimmed mean over 3 x repeats iterations of
    their time divided by the ops (runtime.teaching.op_counts declares the same ops per strategy)."""
    from shardscope.runtime.teaching.flat import FlatLayout, model_units
    from shardscope.runtime.teaching.op_counts import flatten_ops

    model, forward_backward = _reference_training()
    layouts = [FlatLayout(unit, shard_degree=2) for unit in model_units(model)]
    ops = sum(flatten_ops(len(layout.unit.params)) for layout in layouts)
    per_op = []
    for iteration in range(3 * repeats + 2):
        model.zero_grad(set_to_none=True)
        forward_backward()
        start = time.perf_counter()
        for layout in layouts:
            layout.flatten([p.grad for p in layout.unit.params]).div_(2)  # type: ignore[misc]
        if iteration >= 2:
            per_op.append((time.perf_counter() - start) / ops)
    return trimmed_mean(per_op)


def _paired_extra_s(plain: Any, variant: Any, repeats: int) -> float:
    """Seconds one call of `variant` takes beyond one of `plain`: the two timed back to back, 3 x repeats pairs, so
    that a shared machine's drift from one second to the next hits both halves of a pair alike; the trimmed mean of
    the differences, as a step pays the stalls of the collectives only the variant makes. (Timing each alone and
    subtracting, as this did before, swung torch DDP's figure between 0 and 3 ms from one calibration to the next.)
    `variant` may communicate: every rank makes the same calls."""
    plain()
    variant()
    differences = []
    for _ in range(3 * repeats):
        start = time.perf_counter()
        plain()
        middle = time.perf_counter()
        variant()
        differences.append(time.perf_counter() - middle - (middle - start))
    return trimmed_mean(differences)


FRAMEWORK_REPEATS = 30
"""Timing windows of each framework micro-benchmark (the optimizer step's and the bookkeeping op's: half as many)."""


def measure_framework(matmul_flops_per_s: float, repeats: int = FRAMEWORK_REPEATS) -> dict[str, float]:
    """Per-op, per-tensor and per-unit framework costs on this machine (gloo, CPU; every rank runs it at once).

    Returned raw: seconds per forward and backward op as the core counts them (measure_model_ops), per optimizer
    tensor (plain and FSDP2's DTensors), and what a step of the tiny stack takes beyond the same step plain under
    DDP and under FSDP2, and a ZeroRedundancyOptimizer step beyond AdamW over the rank's share of the tensors, for
    framework_overheads to subtract the modelled collectives from.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    cpu = torch.device("cpu")
    (forward_op_s, backward_op_s), (llama_forward_op_s, llama_backward_op_s) = measure_model_ops(
        matmul_flops_per_s, repeats, (REFERENCE_MODEL, LLAMA_REFERENCE_MODEL)
    )
    tensors = [torch.zeros(FRAMEWORK_WIDTH, requires_grad=True) for _ in range(32)]
    for tensor in tensors:
        tensor.grad = torch.ones_like(tensor)
    adam = torch.optim.AdamW(tensors, lr=1e-3, foreach=False)
    optimizer_tensor_s = _typical_seconds(adam.step, repeats, cpu) / len(tensors)
    # the slowest to time, and the least noisy in a prediction
    optimizer_step_s = measure_optimizer_step_overhead(max(1, repeats // 2))
    bookkeeping_op_s = measure_bookkeeping_op(max(1, repeats // 2))
    inputs = torch.randn(FRAMEWORK_WIDTH, FRAMEWORK_WIDTH)

    def train_step(module: torch.nn.Module) -> None:
        module(inputs).sum().backward()

    plain = _stack()
    ddp = DistributedDataParallel(_stack())
    for _ in range(3):  # DDP rebuilds its buckets after the first iteration
        train_step(ddp)
    ddp_extra_s = _paired_extra_s(lambda: train_step(plain), lambda: train_step(ddp), repeats)
    zero_stack, share_stack = _stack(), _stack()
    train_step(zero_stack)
    train_step(share_stack)
    zero = ZeroRedundancyOptimizer(list(zero_stack.parameters()), torch.optim.AdamW, lr=1e-3, foreach=False)
    zero.step()
    # the rank's share as ZeroRedundancyOptimizer partitions equal units: half the weights and half the biases
    share = list(share_stack.parameters())[: 2 * FRAMEWORK_UNITS // dist.get_world_size()]
    share_adam = torch.optim.AdamW(share, lr=1e-3, foreach=False)
    zero_extra_s = _paired_extra_s(share_adam.step, zero.step, repeats)
    sharded = _stack()
    for unit in sharded:
        fully_shard(unit, reshard_after_forward=True)
    fully_shard(sharded)
    fsdp_extra_s = _paired_extra_s(lambda: train_step(plain), lambda: train_step(sharded), repeats)
    train_step(sharded)
    dtensor_adam = torch.optim.AdamW(sharded.parameters(), lr=1e-3, foreach=False)
    dtensor_adam.step()
    fsdp_optimizer_tensor_s = _typical_seconds(dtensor_adam.step, repeats, cpu, collective=True) / (2 * FRAMEWORK_UNITS)
    return {
        "forward_op_s": forward_op_s,
        "backward_op_s": backward_op_s,
        "llama_forward_op_s": llama_forward_op_s,
        "llama_backward_op_s": llama_backward_op_s,
        "optimizer_tensor_s": optimizer_tensor_s,
        "optimizer_step_s": optimizer_step_s,
        "bookkeeping_op_s": bookkeeping_op_s,
        "fsdp_optimizer_tensor_s": fsdp_optimizer_tensor_s,
        "ddp_extra_s": ddp_extra_s,
        "fsdp_extra_s": fsdp_extra_s,
        "zero_extra_s": zero_extra_s,
    }


def framework_overheads(raw: dict[str, float], op_costs: dict[str, OpCost], world_size: int) -> dict[str, Any]:
    """The framework terms of the profile from measure_framework's timings: the per-op costs (gpt2's reference as the
    default, llama's for its family), and what each engine's step of the tiny stack takes beyond the plain one, less
    its collectives as the per-op fit prices them."""
    unit_bytes = (FRAMEWORK_WIDTH * FRAMEWORK_WIDTH + FRAMEWORK_WIDTH) * 4
    all_reduce = _op_seconds(op_costs["all_reduce"], FRAMEWORK_UNITS * unit_bytes, world_size)
    per_unit_comm = 2 * _op_seconds(op_costs["all_gather"], unit_bytes, world_size) + _op_seconds(
        op_costs["reduce_scatter"], unit_bytes, world_size
    )
    fsdp = raw["fsdp_extra_s"] - FRAMEWORK_UNITS * per_unit_comm
    # ZeroRedundancyOptimizer over the stack: beyond AdamW over the rank's share, one broadcast per tensor
    tensors = 2 * FRAMEWORK_UNITS
    zero = 0.0
    if "zero_extra_s" in raw:
        broadcasts = FRAMEWORK_UNITS * (
            _op_seconds(op_costs["broadcast"], FRAMEWORK_WIDTH * FRAMEWORK_WIDTH * 4, world_size)
            + _op_seconds(op_costs["broadcast"], FRAMEWORK_WIDTH * 4, world_size)
        )
        zero = raw["zero_extra_s"] - broadcasts
    return {
        "kernel_overhead_s": raw["forward_op_s"],
        "backward_op_overhead_s": raw["backward_op_s"],
        "optimizer_tensor_overhead_s": raw["optimizer_tensor_s"],
        "ddp_step_overhead_s": max(0.0, raw["ddp_extra_s"] - all_reduce),
        "fsdp_unit_overhead_s": max(0.0, fsdp / FRAMEWORK_UNITS),
        "fsdp_optimizer_tensor_overhead_s": max(0.0, raw["fsdp_optimizer_tensor_s"] - raw["optimizer_tensor_s"]),
        "sync_wait_s": raw.get("sync_wait_s", 0.0),
        "optimizer_step_overhead_s": raw.get("optimizer_step_s", 0.0),
        "zero_tensor_overhead_s": max(0.0, zero / tensors),
        "hook_overhead_s": raw.get("hook_s", 0.0),
        "bookkeeping_op_overhead_s": raw.get("bookkeeping_op_s", 0.0),
        "async_compute_slowdown": raw.get("async_slowdown", 0.0),
        "family_op_costs": (
            (
                FamilyOpCost(
                    family="llama",
                    kernel_overhead_s=raw["llama_forward_op_s"],
                    backward_op_overhead_s=raw["llama_backward_op_s"],
                ),
            )
            if "llama_forward_op_s" in raw
            else ()
        ),
    }
