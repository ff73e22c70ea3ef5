"""Step time of a plan from the time model, fast enough to rank thousands of them.

A step of k micro-batches repeats the same work k times, so the simulated step time grows linearly in k after the
first: the planner simulates one and two micro-batches and extends the line (T(k) = T(2) + (k - 2)(T(2) - T(1))),
instead of simulating k x (blocks + 2) stages. A test holds the extension to the full simulation.

A lower bound comes first and costs almost nothing: the compute stream's busy time. No step is shorter than its
compute, so a plan whose bound is already worse than the plans kept is never simulated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardscope.core.comm_events import CommEvent
from shardscope.core.compute import compute_model, model_flops_per_step
from shardscope.core.kernels import stage_seconds
from shardscope.core.model_parallel_comm import model_parallel_events
from shardscope.core.network import event_cost, network_model
from shardscope.core.timeline import INSIDE_STAGE, estimate_time
from shardscope.presets.hardware import HardwareProfile
from shardscope.specs import Scenario

SIMULATED_MICRO_BATCHES = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanTiming:
    """Time of one plan's step, and what it yields."""

    step_time_s: float
    """One optimizer step, every micro-batch."""
    compute_time_s: float
    """Busy time of the compute stream."""
    comm_time_s: float
    """Sum of the durations of every collective and host copy."""
    exposed_comm_s: float
    """Step time beyond compute: communication not hidden behind it."""
    host_copy_s: float
    """Part of comm_time_s spent copying to and from the host (offload)."""
    wire_bytes_per_rank: int
    """Bytes one rank sends over links in one step."""
    tokens_per_s: float
    """Tokens the whole job trains per second."""
    mfu: float
    """Model FLOPs utilisation (PaLM, Appendix B)."""
    simulated_micro_batches: int
    """Micro-batches the simulation ran; fewer than the plan's means the rest were extended linearly."""


def _with_micro_batches(scenario: Scenario, count: int) -> Scenario:
    return dataclasses.replace(scenario, training=dataclasses.replace(scenario.training, grad_accum_steps=count))


def plan_timing(scenario: Scenario, hardware: HardwareProfile) -> PlanTiming:
    """Simulate at most two micro-batches and extend the line to the plan's count."""
    steps = scenario.training.grad_accum_steps
    model_flops = model_flops_per_step(scenario)
    tokens = scenario.tokens_per_step
    if steps <= SIMULATED_MICRO_BATCHES:
        exact = estimate_time(scenario, hardware)
        return PlanTiming(
            step_time_s=exact.step_time_s,
            compute_time_s=exact.compute_time_s,
            comm_time_s=exact.comm_time_s,
            exposed_comm_s=exact.exposed_comm_s,
            host_copy_s=exact.host_copy_s,
            wire_bytes_per_rank=exact.wire_bytes_per_rank,
            tokens_per_s=tokens / exact.step_time_s,
            mfu=model_flops / (exact.step_time_s * exact.peak_flops_per_s),
            simulated_micro_batches=steps,
        )
    one = estimate_time(_with_micro_batches(scenario, 1), hardware)
    two = estimate_time(_with_micro_batches(scenario, 2), hardware)
    extra = steps - 2

    def extend(first: float, second: float) -> float:
        return second + extra * (second - first)

    step = extend(one.step_time_s, two.step_time_s)
    compute = extend(one.compute_time_s, two.compute_time_s)
    return PlanTiming(
        step_time_s=step,
        compute_time_s=compute,
        comm_time_s=extend(one.comm_time_s, two.comm_time_s),
        exposed_comm_s=max(0.0, step - compute),
        host_copy_s=extend(one.host_copy_s, two.host_copy_s),
        wire_bytes_per_rank=round(extend(one.wire_bytes_per_rank, two.wire_bytes_per_rank)),
        tokens_per_s=tokens / step,
        mfu=model_flops / (step * two.peak_flops_per_s),
        simulated_micro_batches=SIMULATED_MICRO_BATCHES,
    )


def compute_lower_bound_s(scenario: Scenario, hardware: HardwareProfile) -> float:
    """The compute stream's forward, recompute and backward time as the time model prices it (core.kernels): no
    step of this scenario is shorter."""
    forward, recompute, backward = stage_seconds(scenario, compute_model(scenario, hardware))
    return (sum(forward) + sum(recompute) + sum(backward)) * scenario.training.grad_accum_steps


def tensor_parallel_floor_s(scenario: Scenario, hardware: HardwareProfile) -> float:
    """A floor under one micro-batch's tensor-parallel calls inside its stages: the time model puts each on the
    critical path (a stage waits for it), so they add to the compute stream's time. Priced at one sequence per
    micro-batch, so the floor holds for every micro-batch size (a call's time grows with its payload) and one value
    serves them all."""
    if scenario.strategy.tp == 1:
        return 0.0
    once = dataclasses.replace(
        scenario, training=dataclasses.replace(scenario.training, micro_batch_size=1, grad_accum_steps=1)
    )
    net = network_model(hardware)
    calls: dict[tuple[str, int], tuple[CommEvent, int]] = {}  # each distinct call priced once
    for event in model_parallel_events(once, weight_bytes=1):
        if event.group == "tp" and event.trigger in INSIDE_STAGE:
            key = (event.row.op, event.row.payload_bytes)
            calls[key] = (event, calls[key][1] + 1 if key in calls else 1)
    return sum(event_cost(event, once, net).time_s * count for event, count in calls.values())
