"""Measure this machine and write a hardware profile: collectives over a payload sweep fitted to latency and
bandwidth, matmul throughput, per-kernel overhead and memory bandwidth.

Collectives run on real process groups: gloo across `world_size` local processes on CPU, or nccl on GPUs when started
under torchrun. The fit is the alpha-beta model of core.network: t = call latency + steps x step latency +
wire bytes / bandwidth, least squares over every op and payload (ring steps and wire bytes from "Bandwidth Optimal
All-reduce Algorithms for Clusters of Workstations"). Needs torch; the core never imports this module.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardscope.calibrate.collectives import (
    DEFAULT_PAYLOADS,
    OPS,
    Sample,
    _measure_collectives,
    fit_op,
    fit_samples,
)
from shardscope.calibrate.hooks import measure_async_slowdown, measure_hook_s
from shardscope.calibrate.overheads import (
    FRAMEWORK_REPEATS,
    FRAMEWORK_UNITS,
    FRAMEWORK_WIDTH,
    framework_overheads,
    measure_compute,
    measure_framework,
    measure_sync_wait,
)
from shardscope.presets.hardware import HOST_FIELDS, OVERHEAD_FIELDS, HardwareProfile, HostOverheads, InterconnectSpec
from shardscope.procs.functions import run_function
from shardscope.runtime.teaching.op_counts import TEACHING_PYTHON_OPS


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """What calibrate measured, and the profile fitted from it."""

    samples: tuple[Sample, ...]
    """Every collective timing."""
    profile: HardwareProfile
    """The fitted profile."""
    fit_error: float
    """Largest relative error of the fitted model over the samples."""


def calibrate_rank(rank: int, world: int, port: int, options: dict[str, Any]) -> dict[str, Any]:
    """One local gloo rank (run by shardscope.procs): measure; rank 0 reports the samples and compute terms."""
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(float(os.environ.get("SHARDSCOPE_CALIBRATE_STACKS_AFTER_S", "600")))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device("cpu")
    samples = _measure_collectives(tuple(options["payloads"]), options["repeats"], device)
    dist.barrier()
    compute = measure_compute(device, torch.float32)  # every rank at once, as in training
    dist.barrier()
    compute.update(measure_framework(compute["matmul_flops_per_s"], options["framework_repeats"]))
    dist.barrier()
    compute["sync_wait_s"] = measure_sync_wait()
    dist.barrier()
    compute["hook_s"] = measure_hook_s()
    dist.barrier()
    compute["async_slowdown"] = measure_async_slowdown()
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    if rank != 0:
        return {}
    return {"samples": [dataclasses.asdict(sample) for sample in samples], "compute": compute}


def run_local(
    world_size: int,
    payloads: tuple[int, ...],
    repeats: int,
    timeout_s: float,
    framework_repeats: int = FRAMEWORK_REPEATS,
) -> tuple[list[Sample], dict[str, float]]:
    """Measure on world_size local gloo ranks; RunError naming the rank when one fails or the deadline passes."""
    options = {"payloads": list(payloads), "repeats": repeats, "framework_repeats": framework_repeats}
    report = run_function(calibrate_rank, world_size, options, timeout_s)[0]
    return [Sample(**sample) for sample in report["samples"]], report["compute"]


def calibrate(
    world_size: int = 2,
    payloads: tuple[int, ...] = DEFAULT_PAYLOADS,
    repeats: int = 20,
    timeout_s: float = 300.0,
    framework_repeats: int = FRAMEWORK_REPEATS,
) -> Calibration:
    """Measure this host with world_size gloo ranks and fit a profile. repeats: timing windows per collective and
    payload; framework_repeats: per framework micro-benchmark (measure_framework; fewer is quicker and noisier)."""
    samples, compute = run_local(world_size, payloads, repeats, timeout_s, framework_repeats)
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
        **{name: overheads[name] for name in OVERHEAD_FIELDS},
        host_overheads=HostOverheads(
            **{name: overheads[name] for name in (*HOST_FIELDS, "family_op_costs")}, python_ops=TEACHING_PYTHON_OPS
        ),
        source=f"shardscope calibrate on {host} at {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, "
        f"1 thread per rank; fit max relative error {error:.0%}",
    )
    return Calibration(samples=tuple(samples), profile=profile, fit_error=error)


def calibrate_torchrun(payloads: tuple[int, ...] = DEFAULT_PAYLOADS, repeats: int = 20) -> Calibration | None:
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


__all__ = [
    "DEFAULT_PAYLOADS",
    "FRAMEWORK_UNITS",
    "FRAMEWORK_WIDTH",
    "OPS",
    "Calibration",
    "Sample",
    "calibrate",
    "calibrate_rank",
    "calibrate_torchrun",
    "fit_op",
    "fit_samples",
    "framework_overheads",
    "run_local",
]
