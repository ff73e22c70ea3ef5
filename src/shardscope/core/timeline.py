"""One training step of one rank, simulated event by event on a compute stream, a communication stream, a host copy
stream and a model-parallel stream (tp and cp calls, on process groups of their own), so overlap (FSDP prefetch, DDP
buckets reduced during backward, ring attention's exchange behind its attention) is counted, not assumed.

Streams run their work in issue order, as CUDA streams do. Every piece of work starts when its stream is free and the
work it depends on has finished: a gather finishes before the stage that uses it, a gradient reduction starts after
the backward that produced it, the optimizer waits for every reduction. Prefetch is FSDP2's: a unit's all-gather is
issued while the previous unit computes, at most one ahead ("PyTorch FSDP: Experiences on Scaling Fully Sharded
Data Parallel", Section 3.3: backward and forward prefetching). A tensor-parallel call sits between two matmuls of
its stage, so it blocks that stage's compute (on the critical path); ring attention's exchange overlaps the attention
of the chunk in hand (`core.ring_overlap`). Without overlap (CPU gloo, where torch runs every collective on the
caller's thread) all the streams are one.

Outputs: step time, exposed communication (the step's time beyond its compute), tokens per second, MFU as PaLM
defines it ("PaLM: Scaling Language Modeling with Pathways", Appendix B: model FLOPs / (time x peak)), and the spans
that `core.chrome_trace` turns into a Chrome trace.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import NamedTuple

from shardscope.core.comm import CommEvent, collective_ledger, with_micro_batches
from shardscope.core.compute import ComputeModel, compute_model, model_flops_per_step
from shardscope.core.network import CollectiveCost, network_model
from shardscope.core.result import CollectiveRow, merge_ledger
from shardscope.core.step_graph import EventPlacement, step_graph
from shardscope.core.timeline_tasks import (
    INSIDE_STAGE,
    STREAM_OF_GROUP,
    Task,
)
from shardscope.presets.hardware import HardwareProfile, default_profile
from shardscope.specs import Scenario

STREAMS = ("compute", "comm", "host", "model_parallel")
EXACT_MICRO_BATCHES = 16
"""Steps of up to this many micro-batches are simulated whole; longer ones are extended from it (`estimate_time`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    """One piece of work on one stream."""

    name: str
    """What it is, e.g. 'forward block 3' or 'all_gather block 3'."""
    stream: str
    """'compute', 'comm' (data-parallel collectives), 'host' or 'model_parallel' (tp and cp calls)."""
    category: str
    """'forward', 'backward', 'recompute', 'optimizer', or the collective's op."""
    start_s: float
    """Start, from the beginning of the step."""
    duration_s: float
    """How long it runs."""
    payload_bytes: int = 0
    """Bytes moved (communication only)."""

    @property
    def end_s(self) -> float:
        """When it finishes."""
        return self.start_s + self.duration_s


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeEstimate:
    """The time model's answer for one scenario on one piece of hardware."""

    scenario: Scenario
    """The question."""
    hardware: HardwareProfile
    """The hardware it was answered for."""
    ledger: tuple[CollectiveRow, ...]
    """Collectives and host copies of one step, merged rows."""
    wire_bytes_per_rank: int
    """Bytes one rank sends over links in one step, by the algorithm model."""
    comm_time_s: float
    """Sum of the durations of every collective and host copy."""
    exposed_comm_s: float
    """Step time beyond the compute stream's busy time: communication not hidden behind compute."""
    compute_time_s: float
    """Busy time of the compute stream (forward, backward, recompute, optimizer)."""
    step_time_s: float
    """One optimizer step, all micro-batches."""
    model_flops: float
    """FLOPs per rank per step without recomputation."""
    peak_flops_per_s: float
    """The peak MFU is measured against (datasheet, or measured matmul throughput)."""
    schedule: tuple[tuple[str, str, str, float, float, int], ...]
    """Every piece of work as (name, stream, category, start_s, duration_s, payload_bytes), in start order. Plain
    tuples, because the planner simulates hundreds of steps of a thousand pieces each and reads none of them;
    `spans` gives them as Span objects."""
    simulated_micro_batches: int
    """Micro-batches the schedule holds: all of the step's, or EXACT_MICRO_BATCHES when the step has more and its
    totals were extended linearly (see `estimate_time`)."""

    @property
    def spans(self) -> tuple[Span, ...]:
        """Every piece of work, for the trace."""
        return tuple(
            Span(name=name, stream=stream, category=category, start_s=start, duration_s=duration, payload_bytes=size)
            for name, stream, category, start, duration, size in self.schedule
        )

    @property
    def host_copy_s(self) -> float:
        """Time spent copying between GPU and host (offload), in the step's order."""
        return sum(duration for _, stream, _, _, duration, _ in self.schedule if stream == "host")

    @property
    def tokens_per_s(self) -> float:
        """Tokens the whole job trains per second."""
        return self.scenario.tokens_per_step / self.step_time_s

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs per second per rank over the peak."""
        return self.model_flops / (self.step_time_s * self.peak_flops_per_s)

    def to_json(self) -> dict[str, object]:
        """The time part of `estimate --time` for one strategy."""
        return {
            "communication": {
                "ledger": [row.to_json() for row in self.ledger],
                "wire_bytes_per_rank": self.wire_bytes_per_rank,
                "time_s": self.comm_time_s,
                "exposed_time_s": self.exposed_comm_s,
            },
            "compute_time_s": self.compute_time_s,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "simulated_micro_batches": self.simulated_micro_batches,
            "hardware": self.hardware.name,
        }


class StepRun(NamedTuple):
    """A step's tasks run through the streams: what `simulate` and `core.step_totals` read."""

    events: tuple[CommEvent, ...]
    costs: tuple[CollectiveCost, ...]
    compute: ComputeModel
    tasks: list[Task]
    computes: int  # tasks[:computes] are compute tasks, the rest communication
    order: list[int]  # issue order
    starts: list[float]  # start of each task, by index
    finish: list[float]  # end of each task, by index
    call_seconds: tuple[float, ...]  # `StepGraph.call_seconds`


def run_step(
    scenario: Scenario, profile: HardwareProfile, placement: EventPlacement | None = None, merged: bool = False
) -> StepRun:
    """Run the step's tasks through the streams (`merged`: its graph with runs of calls as one task, `step_graph`)."""
    graph = step_graph(scenario, profile, placement, merged)
    tasks, computes, waits, hidden, runs = graph.tasks, graph.computes, graph.waits, graph.hidden, graph.runs
    # Issue order: by key, then by index (the sort is stable), so compute, listed first, before communication
    # issued at the same key. The keys as floats (compute tasks' are ints, exact as floats): a sort of one type
    # compares floats directly, one of ints and floats goes through the generic comparison, a third slower.
    keys = list(map(float, map(_KEY, tasks)))
    order = sorted(range(len(tasks)), key=keys.__getitem__)
    free = dict.fromkeys(STREAMS, 0.0)
    finish = [0.0] * len(tasks)
    starts = [0.0] * len(tasks)
    overlap = profile.overlap
    for index in order:
        _, _, stream, _, duration, _, after = tasks[index]
        if not overlap:
            stream = "compute"
        start = free[stream]
        for dep in after:
            end = finish[dep]
            if end > start:  # max(start, end), without the call
                start = end
        # Only compute tasks wait for calls (`StepGraph.waits`); the index test is cheaper than the dict's.
        if index < computes and index in waits:
            for dep in waits[index]:
                # Most steps hide nothing (no ring attention): `hidden and` spares a lookup per waited call.
                ready = finish[dep] - hidden[dep] if hidden and dep in hidden else finish[dep]
                if ready > start:
                    start = ready
        starts[index] = start
        if runs and index in runs:  # a run of calls: each call's duration added in turn, as its own task would
            for duration in runs[index]:
                start += duration
            finish[index] = free[stream] = start
        else:
            finish[index] = free[stream] = start + duration
    return StepRun(graph.events, graph.costs, graph.compute, tasks, computes, order, starts, finish, graph.call_seconds)


def run_totals(run: StepRun) -> tuple[float, float, float, int]:
    """(step time, compute stream's busy time, communication time, wire bytes per rank) of a run."""
    tasks, computes = run.tasks, run.computes
    step = max(run.finish, default=0.0)
    compute_busy = sum(map(_DURATION, tasks[:computes]))  # summed in task order, as every total of the step
    comm = sum(run.call_seconds or map(_DURATION, tasks[computes:]))  # every call's own, as `simulate` sums them
    return step, compute_busy, comm, round(sum(map(_WIRE_BYTES, run.costs)))


_KEY = itemgetter(0)  # Task.key
_DURATION = attrgetter("duration_s")
_WIRE_BYTES = attrgetter("wire_bytes")


def simulate(scenario: Scenario, profile: HardwareProfile) -> TimeEstimate:
    """Run the step's tasks through the streams and measure what comes out."""
    return _measured(scenario, profile, run_step(scenario, profile))


def _measured(scenario: Scenario, profile: HardwareProfile, run: StepRun) -> TimeEstimate:
    """`simulate`'s answer from its run."""
    tasks, starts = run.tasks, run.starts
    step, compute_busy, comm, wire = run_totals(run)
    schedule = [
        (task.name, task.stream, task.category, starts[index], task.duration_s, task.payload_bytes)
        for index in run.order
        for task in (tasks[index],)
    ]
    return TimeEstimate(
        scenario=scenario,
        hardware=profile,
        ledger=merge_ledger([event.row for event in run.events]),
        wire_bytes_per_rank=wire,
        comm_time_s=comm,
        exposed_comm_s=max(0.0, step - compute_busy),
        compute_time_s=compute_busy,
        step_time_s=step,
        model_flops=model_flops_per_step(scenario),
        peak_flops_per_s=run.compute.peak_flops_per_s,
        schedule=tuple(sorted(schedule, key=itemgetter(3))),
        simulated_micro_batches=scenario.training.grad_accum_steps,
    )


def estimate_time(scenario: Scenario, hardware: HardwareProfile | None = None) -> TimeEstimate:
    """Step time, communication and throughput of a scenario; the GPU preset's datasheet profile by default.

    A step of up to EXACT_MICRO_BATCHES micro-batches is simulated whole. Past that every further micro-batch repeats
    the same work, so the step's totals are those of EXACT_MICRO_BATCHES micro-batches extended by the difference
    the last one made (O(1) in the count, in time and memory), and the schedule is the simulated part."""
    profile = hardware or default_profile(scenario.cluster.gpu)
    if scenario.strategy.pp > 1:  # a pipeline's schedule is simulated by core.pipeline_time, which calls back here
        from shardscope.core.pipeline_time import estimate_pipeline_time

        return estimate_pipeline_time(scenario, profile)
    return estimate_from_runs(scenario, profile, step_runs(scenario, profile))


class StepRuns(NamedTuple):
    """The runs `estimate_time` measures a step without a pipeline from: the whole step (`last`, `before` None), or
    EXACT_MICRO_BATCHES - 1 and EXACT_MICRO_BATCHES micro-batches of a longer one."""

    before: StepRun | None
    last: StepRun


def run_micro_batches(micro_batches: int) -> tuple[int, ...]:
    """The micro-batches of each run `step_runs` makes of a step of `micro_batches`: the whole step's, or
    EXACT_MICRO_BATCHES - 1 and EXACT_MICRO_BATCHES of a longer one."""
    if micro_batches <= EXACT_MICRO_BATCHES:
        return (micro_batches,)
    return (EXACT_MICRO_BATCHES - 1, EXACT_MICRO_BATCHES)


def step_runs(scenario: Scenario, profile: HardwareProfile, placement: EventPlacement | None = None) -> StepRuns:
    """Run the step (a step without a pipeline) as `estimate_time` does, before measuring it; a pipeline rank's
    proxy with its data-parallel calls as `placement` places them."""
    counts = run_micro_batches(scenario.training.grad_accum_steps)
    if len(counts) == 1:
        return StepRuns(None, run_step(scenario, profile, placement))
    before, last = (run_step(with_micro_batches(scenario, count), profile, placement) for count in counts)
    return StepRuns(before, last)


def _extend(scenario: Scenario, earlier: float, later: float) -> float:
    """A total of EXACT_MICRO_BATCHES micro-batches extended to the step's by the difference the last one made."""
    return later + (scenario.training.grad_accum_steps - EXACT_MICRO_BATCHES) * (later - earlier)


def estimate_from_runs(scenario: Scenario, profile: HardwareProfile, runs: StepRuns) -> TimeEstimate:
    """`estimate_time`'s answer from `step_runs`."""
    if runs.before is None:
        return _measured(scenario, profile, runs.last)
    before = _measured(with_micro_batches(scenario, EXACT_MICRO_BATCHES - 1), profile, runs.before)
    last = _measured(with_micro_batches(scenario, EXACT_MICRO_BATCHES), profile, runs.last)

    def extend(earlier: float, later: float) -> float:
        return _extend(scenario, earlier, later)

    step, compute = extend(before.step_time_s, last.step_time_s), extend(before.compute_time_s, last.compute_time_s)
    return dataclasses.replace(
        last,
        scenario=scenario,
        ledger=collective_ledger(scenario),
        wire_bytes_per_rank=round(extend(before.wire_bytes_per_rank, last.wire_bytes_per_rank)),
        comm_time_s=extend(before.comm_time_s, last.comm_time_s),
        exposed_comm_s=max(0.0, step - compute),
        compute_time_s=compute,
        step_time_s=step,
        model_flops=model_flops_per_step(scenario),
    )


def exposed_and_optimizer_s(scenario: Scenario, runs: StepRuns) -> tuple[float, float]:
    """`estimate_from_runs(...)`'s exposed_comm_s and its optimizer step's duration, equal to the last bit
    (tests/core/test_pipeline_speed.py), without its ledger and schedule: what a pipeline rank does after its last
    backward (`core.pipeline_time`), asked of every pipeline rank."""
    step, compute, _, _ = run_totals(runs.last)
    if runs.before is not None:
        earlier_step, earlier_compute, _, _ = run_totals(runs.before)
        step, compute = _extend(scenario, earlier_step, step), _extend(scenario, earlier_compute, compute)
    optimizer = runs.last.tasks[runs.last.computes - 1]  # the last compute task (build_compute_tasks)
    return max(0.0, step - compute), optimizer.duration_s


class StepCalls(NamedTuple):
    """`estimate_from_runs(...)`'s ledger, wire bytes, communication time and peak, equal to the last bit
    (tests/core/test_pipeline_speed.py), without its schedule: the calls of the pipeline rank `core.pipeline_time`
    shows."""

    ledger: tuple[CollectiveRow, ...]
    wire_bytes_per_rank: int
    comm_time_s: float
    peak_flops_per_s: float


def step_calls(scenario: Scenario, runs: StepRuns) -> StepCalls:
    """The calls of a step without a pipeline, measured from `step_runs`."""
    _, _, comm, wire = run_totals(runs.last)
    peak = runs.last.compute.peak_flops_per_s
    if runs.before is None:
        return StepCalls(merge_ledger([event.row for event in runs.last.events]), wire, comm, peak)
    _, _, earlier_comm, earlier_wire = run_totals(runs.before)
    extended_wire = round(_extend(scenario, earlier_wire, wire))
    return StepCalls(collective_ledger(scenario), extended_wire, _extend(scenario, earlier_comm, comm), peak)


# compute_model and network_model moved to core.compute and core.network; they stay importable from here, where callers
# found them.
__all__ = [
    "INSIDE_STAGE",
    "STREAMS",
    "STREAM_OF_GROUP",
    "Span",
    "StepCalls",
    "StepRun",
    "StepRuns",
    "TimeEstimate",
    "compute_model",
    "estimate_from_runs",
    "estimate_time",
    "exposed_and_optimizer_s",
    "network_model",
    "run_micro_batches",
    "run_step",
    "run_totals",
    "simulate",
    "step_calls",
    "step_runs",
]
