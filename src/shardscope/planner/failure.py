"""The failure mode a plan runs into next, computed from its own numbers.

Each check looks at one way a run goes wrong, measures how close the plan is to it as a fraction (of the peak, of the
step, of an even split), and words it with the numbers. The plan's failure mode is the check with the largest
fraction; the rest are kept as risks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from shardscope.choices import Checkpointing, checkpoint_every
from shardscope.core.activations import estimate_activations
from shardscope.core.engines import rules_for
from shardscope.core.rank_share import rank_share
from shardscope.core.result import MemoryEstimate
from shardscope.planner.request import PlanRequest
from shardscope.planner.timing import PlanTiming
from shardscope.specs import Scenario, SpecError
from shardscope.units import format_bytes

# Thresholds: below these fractions a risk is too small to name.
ACTIVATIONS_SHARE = 0.4  # of the peak
LOGITS_SHARE = 0.08  # of the peak
EXPOSED_SHARE = 0.05  # of the step, for ZeRO-3 across nodes
COMM_BOUND_SHARE = 0.15  # of the step, any other strategy
UNEVEN_EXCESS = 0.02  # busiest rank over an even split
NEAR_CAPACITY = 0.92  # of the budget

MemoryOf = Callable[[Scenario], MemoryEstimate]
TimingOf = Callable[[Scenario], PlanTiming]


@dataclass(frozen=True, slots=True, kw_only=True)
class FailureMode:
    """One way the plan goes wrong, how close it is, and what to do about it."""

    kind: str
    """'activations-dominate', 'zero3-cross-node', 'logits-spike', 'offload-host', 'zero1-uneven-shard',
    'communication-bound', 'near-capacity' or 'compute-bound' (nothing close)."""
    severity: float
    """How close, as a fraction (of the peak, the step or an even split); the largest is the plan's failure mode."""
    message: str
    """The failure in plain English, with the numbers."""

    def to_json(self) -> dict[str, object]:
        """The `failure_mode` object of `shardscope.plan/v1`."""
        return {"kind": self.kind, "severity": round(self.severity, 4), "message": self.message}


def _gib(num_bytes: float) -> str:
    return format_bytes(num_bytes, "GiB")


def _with(
    scenario: Scenario, *, sequence_length: int | None = None, checkpointing: Checkpointing | None = None
) -> Scenario:
    training = scenario.training
    training = dataclasses.replace(
        training,
        sequence_length=sequence_length or training.sequence_length,
        checkpointing=checkpointing or training.checkpointing,
    )
    return dataclasses.replace(scenario, training=training)


def _longest_sequence(scenario: Scenario, budget: int, memory_of: MemoryOf) -> int:
    """The longest sequence (a multiple of 256) that still fits at this micro-batch, by bisection."""
    low, high = scenario.training.sequence_length, scenario.training.sequence_length * 64
    while high - low > 256:
        middle = (low + high) // 2 // 256 * 256
        if middle <= low:
            break
        if memory_of(_with(scenario, sequence_length=middle)).per_rank.peak_bytes <= budget:
            low = middle
        else:
            high = middle
    return low


def _activations(scenario: Scenario, memory: MemoryEstimate, budget: int, memory_of: MemoryOf) -> FailureMode | None:
    per_rank = memory.per_rank
    share = per_rank.activations_bytes / per_rank.peak_bytes
    if share < ACTIVATIONS_SHARE:
        return None
    training = scenario.training
    if per_rank.parameters_bytes:
        ratio = per_rank.activations_bytes / per_rank.parameters_bytes
        size = f"{ratio:.1f}x the rank's parameter memory"
    else:
        size = "all of the rank's model memory (its parameters live on the host)"
    head = (
        f"activations are {size} ({_gib(per_rank.activations_bytes)} of the {_gib(per_rank.peak_bytes)} peak) at "
        f"sequence length {training.sequence_length}"
    )
    if checkpoint_every(training.checkpointing) != 1:  # 'every:1' is 'full'
        full = memory_of(_with(scenario, checkpointing="full")).per_rank
        advice = f"; --checkpointing full keeps {_gib(full.activations_bytes)}"
    else:
        longest = _longest_sequence(scenario, budget, memory_of)
        advice = f" even with full checkpointing; sequences longer than about {longest} tokens no longer fit"
    return FailureMode(kind="activations-dominate", severity=share, message=head + advice)


def _logits(scenario: Scenario, memory: MemoryEstimate) -> FailureMode | None:
    if memory.peak_moment not in ("end of forward", "start of backward"):
        return None
    acts = estimate_activations(
        scenario.model, scenario.training, gpu_kernels=scenario.cluster.gpu_kernels, share=rank_share(scenario)
    )
    spike = max(acts.loss_forward_spike_bytes, acts.loss_backward_spike_bytes)
    share = spike / memory.per_rank.peak_bytes
    if share < LOGITS_SHARE:
        return None
    training = scenario.training
    return FailureMode(
        kind="logits-spike",
        severity=share,
        message=f"the loss materialises {training.micro_batch_size} x {training.sequence_length} x "
        f"{scenario.model.vocab_size} logits: {_gib(spike)} extra at the {memory.peak_moment} ({share:.0%} of the "
        f"peak); a chunked cross-entropy or a smaller micro-batch avoids it",
    )


def _zero3_cross_node(
    scenario: Scenario, timing: PlanTiming, request: PlanRequest, memory_of: MemoryOf, timing_of: TimingOf
) -> FailureMode | None:
    cluster = scenario.cluster
    share = timing.exposed_comm_s / timing.step_time_s
    if not scenario.strategy.preset.full_shard or cluster.num_nodes < 2 or share < EXPOSED_SHARE:
        return None
    message = (
        f"ZeRO-3 gathers and reduce-scatters across {cluster.num_nodes} nodes: {timing.exposed_comm_s:.3f} s of the "
        f"{timing.step_time_s:.3f} s step is exposed communication ({timing.wire_bytes_per_rank / 1e9:.1f} GB per "
        f"rank per step)"
    )
    per_node = max(cluster.ranks_per_node // (scenario.strategy.tp * scenario.strategy.cp), 1)
    data_parallel = scenario.parallelism.data_parallel
    group = per_node  # data-parallel ranks per shard group: whole nodes of them
    while group < data_parallel:
        alternative = _hsdp(scenario, group) if data_parallel % group == 0 else None
        if alternative is not None and memory_of(alternative).per_rank.peak_bytes <= request.budget_bytes:
            other = timing_of(alternative)
            message += f"; hsdp with shard group {group} would take {other.step_time_s:.3f} s"
            break
        group += per_node
    else:
        message += "; no hsdp shard group smaller than the world fits"
    return FailureMode(kind="zero3-cross-node", severity=share, message=message)


def _hsdp(scenario: Scenario, group: int) -> Scenario | None:
    """The scenario under hsdp with shard groups of `group` data-parallel ranks, or None where its split does not fit
    such groups (expert parallelism borrows GPUs of the shard group)."""
    try:
        return dataclasses.replace(
            scenario, strategy=dataclasses.replace(scenario.strategy, name="hsdp", shard_group=group)
        )
    except SpecError:
        return None


def _offload(
    scenario: Scenario, memory: MemoryEstimate, timing: PlanTiming, request: PlanRequest
) -> FailureMode | None:
    if scenario.strategy.offload == "none":
        return None
    host = memory.host_bytes_per_node
    share = timing.host_copy_s / timing.step_time_s
    stated = ""
    if request.host_memory_bytes:
        share = max(share, host / request.host_memory_bytes)
        stated = f" of the {_gib(request.host_memory_bytes)} stated"
    return FailureMode(
        kind="offload-host",
        severity=share,
        message=f"offload '{scenario.strategy.offload}' keeps {_gib(host)} per node in pinned host memory{stated}, "
        f"and host copies take {timing.host_copy_s:.3f} s of the {timing.step_time_s:.3f} s step",
    )


def _zero1_uneven(scenario: Scenario) -> FailureMode | None:
    sizes = rules_for(scenario).optimizer_shard_numels(scenario)
    if sizes is None:
        return None
    even = sum(sizes) / len(sizes)
    busiest = max(sizes)
    excess = busiest / even - 1.0
    if excess < UNEVEN_EXCESS:
        return None
    idle = sum(1 for size in sizes if size == 0)
    return FailureMode(
        kind="zero1-uneven-shard",
        severity=min(1.0, excess),
        message=f"ZeroRedundancyOptimizer assigns whole tensors: rank {sizes.index(busiest)} holds the optimizer "
        f"state of {busiest:,} parameters, {excess:.0%} more than an even split ({even:,.0f})"
        + (f", and {idle} ranks hold none" if idle else ""),
    )


def _communication(scenario: Scenario, timing: PlanTiming) -> FailureMode | None:
    share = timing.exposed_comm_s / timing.step_time_s
    if share < COMM_BOUND_SHARE or scenario.strategy.preset.full_shard:
        return None
    return FailureMode(
        kind="communication-bound",
        severity=share,
        message=f"{share:.0%} of the step ({timing.exposed_comm_s:.3f} s) is communication not hidden behind "
        f"compute ({timing.wire_bytes_per_rank / 1e9:.1f} GB per rank per step)",
    )


def _near_capacity(memory: MemoryEstimate, budget: int) -> FailureMode | None:
    share = memory.per_rank.peak_bytes / budget
    if share < NEAR_CAPACITY:
        return None
    return FailureMode(
        kind="near-capacity",
        severity=share,
        message=f"the peak ({_gib(memory.per_rank.peak_bytes)}, at the {memory.peak_moment}) is {share:.0%} of the "
        f"{_gib(budget)} budget: fragmentation or a longer batch runs out of memory first",
    )


def diagnose(
    scenario: Scenario,
    memory: MemoryEstimate,
    timing: PlanTiming,
    request: PlanRequest,
    memory_of: MemoryOf,
    timing_of: TimingOf,
) -> tuple[FailureMode, ...]:
    """Every risk the plan's numbers show, the most pressing first; 'compute-bound' when none is close."""
    budget = request.budget_bytes
    found = [
        mode
        for mode in (
            _activations(scenario, memory, budget, memory_of),
            _logits(scenario, memory),
            _zero3_cross_node(scenario, timing, request, memory_of, timing_of),
            _offload(scenario, memory, timing, request),
            _zero1_uneven(scenario),
            _communication(scenario, timing),
            _near_capacity(memory, budget),
        )
        if mode is not None
    ]
    if not found:
        found.append(
            FailureMode(
                kind="compute-bound",
                severity=0.0,
                message=f"nothing close: the peak is {memory.per_rank.peak_bytes / budget:.0%} of the budget and "
                f"{timing.exposed_comm_s / timing.step_time_s:.0%} of the step is exposed communication; compute "
                f"sets the pace (MFU {timing.mfu:.0%})",
            )
        )
    return tuple(sorted(found, key=lambda mode: -mode.severity))
