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
from operator import itemgetter
from typing import NamedTuple

from shardscope.core.comm import CommEvent, collective_ledger, comm_events, with_micro_batches
from shardscope.core.compute import (
    ComputeModel,
    compute_model,
    model_flops_per_step,
    optimizer_step_s,
    rank_stage_flops,
)
from shardscope.core.engines import rules_for
from shardscope.core.kernels import stage_seconds
from shardscope.core.network import CollectiveCost, NetworkModel, event_cost, network_model
from shardscope.core.overheads import async_slowdown_s
from shardscope.core.params import rank_layout
from shardscope.core.result import CollectiveRow, merge_ledger
from shardscope.core.ring_overlap import hidden_exchange
from shardscope.core.sharding import flat_shard_numel
from shardscope.presets.hardware import HardwareProfile, default_profile
from shardscope.specs import Scenario

STREAMS = ("compute", "comm", "host", "model_parallel")
STREAM_OF_GROUP = {"host": "host", "tp": "model_parallel", "cp": "model_parallel"}
"""Streams other than 'comm' (the data-parallel collectives): tp and cp run on process groups, so NCCL streams, of
their own."""
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


class _Task(NamedTuple):
    """One piece of work before it is scheduled (a tuple: a 70B step has thousands and the planner simulates
    hundreds of steps)."""

    key: float
    name: str
    stream: str
    category: str
    duration_s: float
    payload_bytes: int
    after: tuple[int, ...]  # indices (into the task list) that must finish first


def _compute_tasks(
    scenario: Scenario, compute: ComputeModel, profile: HardwareProfile
) -> tuple[list[_Task], dict[tuple[str, int, int], int]]:
    """Compute tasks in issue order, and where each (kind, micro-batch, stage) sits among them."""
    stages = rank_stage_flops(scenario)
    rules = rules_for(scenario)
    framework = rules.framework_s(scenario, profile)
    tasks: list[_Task] = []
    where: dict[tuple[str, int, int], int] = {}

    # Every micro-batch repeats the same stages: each stage's forward, recompute and backward time computed once.
    forward, recompute, backward = stage_seconds(scenario, compute)

    def add(kind: str, micro_batch: int, stage: int, seconds: float) -> None:
        where[(kind, micro_batch, stage)] = len(tasks)
        name = f"{kind} {stages[stage].name}" + (f" (micro-batch {micro_batch})" if micro_batch else "")
        seconds += framework.get((kind, stage), 0.0)
        tasks.append(_Task(len(tasks), name, "compute", kind, seconds, 0, ()))

    for micro_batch in range(scenario.training.grad_accum_steps):
        for index in range(len(stages)):
            add("forward", micro_batch, index, forward[index])
        for index in reversed(range(len(stages))):
            if stages[index].recompute_flops:
                add("recompute", micro_batch, index, recompute[index])
            add("backward", micro_batch, index, backward[index])
    layout = rank_layout(scenario)
    degree = scenario.parallelism.dp_shard
    shard_tensors = rules.optimizer_tensors(scenario)
    seconds = optimizer_step_s(scenario, compute, flat_shard_numel(layout.total_numel, degree), shard_tensors)
    seconds += profile.host_terms.optimizer_step_overhead_s + framework.get(("optimizer", -1), 0.0)
    seconds += rules.optimizer_overhead_s(scenario, profile, shard_tensors)
    where[("optimizer", 0, -1)] = len(tasks)
    tasks.append(_Task(len(tasks), "optimizer step", "compute", "optimizer", seconds, 0, ()))
    return tasks, where


def _consumer(event: CommEvent, where: dict[tuple[str, int, int], int]) -> int:
    """The compute task a gather must precede (the recompute when there is one), or the one a call made inside a
    stage's compute blocks (a re-forward's call with the backward when the stage has no recompute task)."""
    trigger = event.trigger
    kind = "forward" if trigger in ("before_forward", "during_forward") else "backward"
    recompute = where.get(("recompute", event.micro_batch, event.stage))
    if recompute is not None and trigger in ("before_backward", "during_recompute"):
        return recompute
    return where[(kind, event.micro_batch, event.stage)]


def _event_costs(scenario: Scenario, events: tuple[CommEvent, ...], net: NetworkModel) -> tuple[CollectiveCost, ...]:
    """The cost of every event, each distinct call priced once: a step repeats the same few calls (one per unit
    kind and op) hundreds of times."""
    priced: dict[tuple[str, str, int, int], CollectiveCost] = {}
    costs = []
    for event in events:
        key = (event.group, event.row.op, event.row.group_size, event.row.payload_bytes)
        cost = priced.get(key)
        if cost is None:
            cost = priced[key] = event_cost(event, scenario, net)
        costs.append(cost)
    return tuple(costs)


INSIDE_STAGE = ("during_forward", "during_recompute", "during_backward")


def _comm_tasks(
    events: tuple[CommEvent, ...],
    costs: tuple[CollectiveCost, ...],
    compute_tasks: list[_Task],
    where: dict[tuple[str, int, int], int],
    sync_wait_s: float,
    asynchronous: tuple[bool, ...],
) -> tuple[list[_Task], dict[int, list[int]]]:
    """Communication tasks with their issue keys, and the gathers each compute task waits for.

    A call inside a stage (tensor and context parallelism's) starts once the compute before it finishes and blocks
    the stage's compute: its time is on the critical path, as the matmul after a tp collective needs its result.

    The wait for the later rank is paid by the first blocking collective after compute, and once per step by the
    async ones (asynchronous[i]: event i is issued with async_op=True): the rank goes on computing while they wait,
    and the skew between the ranks is absorbed once, by the first."""
    optimizer = where[("optimizer", 0, -1)]
    first = len(compute_tasks)  # the index the first communication task will have
    tasks: list[_Task] = []
    waits: dict[int, list[int]] = {}
    previous: tuple[int, int, str] | None = None
    waited_async = False
    for position, (event, cost) in enumerate(zip(events, costs, strict=True), start=first):
        duration = cost.time_s
        stream = STREAM_OF_GROUP.get(event.group, "comm")
        trigger = event.trigger
        after: list[int]
        if trigger in INSIDE_STAGE:
            consumer = _consumer(event, where)
            key = consumer - 0.5  # issued once the compute before it is, and blocking that stage's compute
            after = [consumer - 1] if consumer >= 1 else []
            waits.setdefault(consumer, []).append(position)
        elif trigger == "before_forward" or trigger == "before_backward":
            consumer = _consumer(event, where)
            key = consumer - 1.0  # issued while the previous stage computes: one unit of prefetch
            after = [consumer - 2] if consumer >= 2 else []
            waits.setdefault(consumer, []).append(position)
        elif trigger == "after_backward":
            producer = where[("backward", event.micro_batch, event.stage)]
            key, after = producer + 0.5, [producer]
        else:
            key, after = optimizer + 0.5, [optimizer]
        place = (event.micro_batch, event.stage, trigger)
        if place == previous:  # a copy then its gather, a reduce-scatter then its all-reduce and offload copy
            after.append(position - 1)
        elif stream != "host" and not (waited_async and asynchronous[position - first]):
            duration += sync_wait_s  # the first collective after compute waits for the later rank
            waited_async = waited_async or asynchronous[position - first]
        row = event.row
        tasks.append(_Task(key, event.label, stream, row.op, duration, row.payload_bytes, tuple(after)))
        previous = place
    return tasks, waits


def _slow_beside_async(
    asynchronous: tuple[bool, ...],
    events: tuple[CommEvent, ...],
    costs: tuple[CollectiveCost, ...],
    compute_tasks: list[_Task],
    where: dict[tuple[str, int, int], int],
    slowdown: float,
) -> None:
    """Lengthen the compute tasks that run while an async collective is in flight (core.overheads)."""
    issued = [
        (where[("backward", event.micro_batch, event.stage)], cost.time_s)
        for event, cost, issued_async in zip(events, costs, asynchronous, strict=True)
        if issued_async
    ]
    if not issued:
        return
    durations = [task.duration_s for task in compute_tasks]
    extra = async_slowdown_s(durations, issued, where[("optimizer", 0, -1)], slowdown)
    for index, seconds in enumerate(extra):
        if seconds:
            compute_tasks[index] = compute_tasks[index]._replace(duration_s=durations[index] + seconds)


def simulate(scenario: Scenario, profile: HardwareProfile) -> TimeEstimate:
    """Run the step's tasks through the streams and measure what comes out."""
    events = comm_events(scenario)  # built once per call (refuses a model without a shape before anything else)
    compute = compute_model(scenario, profile)
    costs = _event_costs(scenario, events, network_model(profile))
    compute_tasks, where = _compute_tasks(scenario, compute, profile)
    rules = rules_for(scenario)
    asynchronous = tuple(rules.is_async(scenario, event) for event in events)
    if profile.host_terms.async_compute_slowdown:
        _slow_beside_async(asynchronous, events, costs, compute_tasks, where, profile.host_terms.async_compute_slowdown)
    comm_tasks, waits = _comm_tasks(events, costs, compute_tasks, where, profile.host_terms.sync_wait_s, asynchronous)
    tasks = compute_tasks + comm_tasks
    optimizer = where[("optimizer", 0, -1)]
    computes = len(compute_tasks)
    hidden = {computes + index: s for index, s in hidden_exchange(scenario, compute, events, costs).items()}
    waits[optimizer] = [computes + index for index, task in enumerate(comm_tasks) if task.key < optimizer]
    # Issue order: by key; compute before communication issued at the same key; stable otherwise.
    keys = [(task.key, index >= computes, index) for index, task in enumerate(tasks)]
    order = [index for _, _, index in sorted(keys)]
    free = dict.fromkeys(STREAMS, 0.0)
    finish = [0.0] * len(tasks)
    schedule: list[tuple[str, str, str, float, float, int]] = []
    for index in order:
        task = tasks[index]
        stream = task.stream if profile.overlap else "compute"
        start = free[stream]
        for dep in task.after:
            start = max(start, finish[dep])
        for dep in waits.get(index, ()):
            start = max(start, finish[dep] - hidden.get(dep, 0.0))
        finish[index] = free[stream] = start + task.duration_s
        schedule.append((task.name, task.stream, task.category, start, task.duration_s, task.payload_bytes))
    step = max(finish, default=0.0)
    compute_busy = sum(task.duration_s for task in compute_tasks)
    wire = sum(cost.wire_bytes for cost in costs)
    return TimeEstimate(
        scenario=scenario,
        hardware=profile,
        ledger=merge_ledger([event.row for event in events]),
        wire_bytes_per_rank=round(wire),
        comm_time_s=sum(task.duration_s for task in comm_tasks),
        exposed_comm_s=max(0.0, step - compute_busy),
        compute_time_s=compute_busy,
        step_time_s=step,
        model_flops=model_flops_per_step(scenario),
        peak_flops_per_s=compute.peak_flops_per_s,
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
    steps = scenario.training.grad_accum_steps
    if steps <= EXACT_MICRO_BATCHES:
        return simulate(scenario, profile)
    before = simulate(with_micro_batches(scenario, EXACT_MICRO_BATCHES - 1), profile)
    last = simulate(with_micro_batches(scenario, EXACT_MICRO_BATCHES), profile)
    more = steps - EXACT_MICRO_BATCHES

    def extend(earlier: float, later: float) -> float:
        return later + more * (later - earlier)

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


# compute_model and network_model moved to core.compute and core.network; they stay importable from here, where callers
# found them.
__all__ = [
    "STREAMS",
    "Span",
    "TimeEstimate",
    "compute_model",
    "estimate_time",
    "network_model",
    "simulate",
]
