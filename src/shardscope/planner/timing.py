"""Step time of a plan from the time model, fast enough to rank thousands of them.

A step of k micro-batches repeats the same work k times, so the simulated step time grows linearly in k after the
first: the planner simulates one and two micro-batches and extends the line (T(k) = T(2) + (k - 2)(T(2) - T(1))),
instead of simulating k x (blocks + 2) stages. A test holds the extension to the full simulation. Where every
micro-batch repeats the same schedule (ZeRO-3, FSDP, HSDP, DDP and ZeRO-1 on a GPU), T(2) - T(1) is what the run of
two's first micro-batch adds, so one run serves (`plan_timing`).

A lower bound comes first and costs almost nothing: the compute stream's busy time. No step is shorter than its
compute, so a plan whose bound is already worse than the plans kept is never simulated. A plan that passes it meets
the compute chain with the optimizer step (`optimizer_floor_s`, no call built), then a tighter bound before it is
simulated (`communication_floor`): the data-parallel collectives and host copies,
which the compute bound ignores and which decide the cost ranking, where every GPU count computes about the same, and
the optimizer step after them (CPU-Adam under offload, often the longest task of an offloaded step).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from itertools import compress, repeat
from operator import and_, attrgetter, eq, sub

from shardscope.core.comm_events import CallKey, CommEvent, call_keys, optimizer_offload_events
from shardscope.core.compute import compute_model, model_flops_per_step
from shardscope.core.engines import rules_for
from shardscope.core.kernels import stage_seconds
from shardscope.core.model_parallel_comm import model_parallel_calls
from shardscope.core.network import NetworkModel, event_cost, network_model
from shardscope.core.result import CollectiveRow
from shardscope.core.step_totals import StepTotals, step_totals, step_totals_and_increment
from shardscope.core.timeline import INSIDE_STAGE, STREAM_OF_GROUP
from shardscope.core.timeline_tasks import optimizer_task_s
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
    ledger: tuple[CollectiveRow, ...] | None = None
    """A pipeline's collectives and messages, of the pipeline rank that finishes last (as `estimate --time` shows
    it); None otherwise (`core.comm.collective_ledger` of the scenario)."""


def _with_micro_batches(scenario: Scenario, count: int) -> Scenario:
    return dataclasses.replace(scenario, training=dataclasses.replace(scenario.training, grad_accum_steps=count))


def plan_timing(scenario: Scenario, hardware: HardwareProfile) -> PlanTiming:
    """Simulate at most two micro-batches and extend the line to the plan's count: from one run of two by what its
    first micro-batch adds, where every micro-batch repeats the same schedule
    (`core.step_totals.step_totals_and_increment` says where), else from runs of one and two."""
    steps = scenario.training.grad_accum_steps
    model_flops = model_flops_per_step(scenario)
    tokens = scenario.tokens_per_step
    if steps <= SIMULATED_MICRO_BATCHES:
        exact = step_totals(scenario, hardware)
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
    two, added = step_totals_and_increment(_with_micro_batches(scenario, 2), hardware)
    if added is None:
        added = StepTotals._make(map(sub, two, step_totals(_with_micro_batches(scenario, 1), hardware)))
    extra = steps - 2
    step = two.step_time_s + extra * added.step_time_s
    compute = two.compute_time_s + extra * added.compute_time_s
    return PlanTiming(
        step_time_s=step,
        compute_time_s=compute,
        comm_time_s=two.comm_time_s + extra * added.comm_time_s,
        exposed_comm_s=max(0.0, step - compute),
        host_copy_s=two.host_copy_s + extra * added.host_copy_s,
        wire_bytes_per_rank=round(two.wire_bytes_per_rank + extra * added.wire_bytes_per_rank),
        tokens_per_s=tokens / step,
        mfu=model_flops / (step * two.peak_flops_per_s),
        simulated_micro_batches=SIMULATED_MICRO_BATCHES,
    )


def compute_lower_bound_s(scenario: Scenario, hardware: HardwareProfile) -> float:
    """The compute stream's forward, recompute and backward time as the time model prices it (core.kernels): no
    step of this scenario is shorter."""
    return micro_batch_compute_s(scenario, hardware) * scenario.training.grad_accum_steps


def micro_batch_compute_s(scenario: Scenario, hardware: HardwareProfile) -> float:
    """One micro-batch's forward, recompute and backward time: the same for every micro-batch count (core.kernels
    prices a micro-batch from its tokens, checkpointing and rank share), so one value serves them all."""
    forward, recompute, backward = stage_seconds(scenario, compute_model(scenario, hardware))
    return sum(forward) + sum(recompute) + sum(backward)


def tensor_parallel_floor_s(scenario: Scenario, hardware: HardwareProfile, micro_batch_size: int = 1) -> float:
    """A floor under one micro-batch's tensor-parallel calls inside its stages: the time model puts each on the
    critical path (a stage waits for it), so they add to the compute stream's time. Priced at `micro_batch_size`
    sequences per micro-batch: at one (the default) the floor holds for every micro-batch size (a call's time grows
    with its payload) and one value serves them all; at the scenario's own size it is the exact sum. Every block
    makes the same calls, so a model of three blocks or more sums those of the model cut to one block plus n - 1
    times what a second block adds (tests/planner/test_tensor_parallel_floor.py holds it to the whole model's sum)."""
    if scenario.strategy.tp == 1:
        return 0.0
    once = dataclasses.replace(
        scenario,
        training=dataclasses.replace(scenario.training, micro_batch_size=micro_batch_size, grad_accum_steps=1),
    )
    net = network_model(hardware)
    layers = once.model.num_layers
    if layers < 3:
        return _tensor_parallel_sum(once, net)
    one, two = (
        _tensor_parallel_sum(dataclasses.replace(once, model=dataclasses.replace(once.model, num_layers=blocks)), net)
        for blocks in (1, 2)
    )
    return one + (layers - 1) * (two - one)


def _tensor_parallel_sum(scenario: Scenario, net: NetworkModel) -> float:
    """Seconds of the tensor-parallel calls inside the stages of one micro-batch of `scenario`, each distinct call
    priced once."""
    # the weights' element size reaches only the gradient all-reduces after backward, which the floor leaves out
    events = model_parallel_calls(scenario, rules_for(scenario).param_comm_bytes(scenario))
    in_tp_group = map(eq, map(_GROUP, events), repeat("tp"))
    inside = map(and_, in_tp_group, map(INSIDE_STAGE.__contains__, map(_TRIGGER, events)))
    chosen = list(compress(events, inside))  # filtered and counted at C speed
    rows = list(map(_ROW, chosen))
    keys = list(zip(map(_OP, rows), map(_PAYLOAD, rows), strict=True))
    counts = Counter(keys)
    # each distinct call priced once: its last call, counted where the first came, as a dict filled call by call
    calls = {key: (event, counts[key]) for key, event in dict(zip(keys, chosen, strict=True)).items()}
    return sum(event_cost(event, scenario, net).time_s * count for event, count in calls.values())


ROUNDING_MARGIN = 1e-9
"""Relative slack under the communication floor: it sums the same durations as the simulation in another order, and
extends two micro-batches to k as plan_timing does, so it may land a few units in the last place above a tight step."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CommunicationFloor:
    """What the data-parallel collectives, host copies and the optimizer step add under a step, whatever the schedule.

    Valid because of how `core.timeline.simulate` schedules (streams run their work one piece at a time):
    - edges_s: the first forward waits for its gathers (trigger 'before_forward' of micro-batch 0, stage 0), which
      start at 0, and the optimizer waits for the reductions the last backward issues (trigger 'after_backward' of
      the last micro-batch, stage 0), which start when it ends; in between the compute stream runs every forward,
      recompute and backward, each after the tensor-parallel calls that block it. So the optimizer step starts at
      least the first gathers + (compute + the tensor-parallel floor) + the last reductions after 0, each edge
      counted on one stream (the longest stream's sum of them).
    - before_step_s: the optimizer step waits for every call issued before it (`core.step_graph`), so it starts no
      earlier than the busiest 'comm' or 'host' stream's calls before it (each at least its priced time; a wait for
      the later rank only lengthens it).
    - tail_s: the optimizer step is one compute task (CPU-Adam over the host's bandwidth under offload, often the
      longest task of an offloaded step: `core.compute.optimizer_step_s`), and the calls after it ('after_step':
      optimizer offload's copy of the updated parameters, ZeRO-1/2's broadcasts) start when it ends.
    The step is then at least max(chain + edges_s, before_step_s) + tail_s, where chain is the compute bound plus the
    tp floor. Without overlap every stream is one: every call is an edge and the optimizer step the tail."""

    edges_s: float
    """Communication before the first forward plus after the last backward, on the critical path."""
    before_step_s: float
    """The busiest of the data-parallel ('comm') and host streams, over the calls the optimizer step waits for."""
    tail_s: float
    """The optimizer step, then the longest stream's calls after it."""

    def bound_s(self, chain_s: float) -> float:
        """The step's lower bound given the compute stream's chain (compute bound plus tensor-parallel floor)."""
        return (max(chain_s + self.edges_s, self.before_step_s) + self.tail_s) * (1.0 - ROUNDING_MARGIN)


StreamSums = tuple[dict[str, float], dict[str, float], dict[str, float], dict[str, float], dict[str, float]]
"""Seconds per 'comm' and 'host' stream of a step's data-parallel calls and host copies: all of them, those before
the first forward, those after the last backward, those after the optimizer step, those of micro-batch 0."""


def _stream_sums(scenario: Scenario, seconds: Callable[[CommEvent], float], host_only: bool) -> StreamSums:
    """The step's `StreamSums`. A ZeRO-3, FSDP or HSDP step without a pipeline makes the same calls for every block
    (one unit each, `core.sharded_calls`), so its calls are those of the model cut to one block plus n - 1 times
    what a second block adds, and its edges (the root's calls) are the one-block model's; optimizer offload's copies
    hold the whole shard, so they are the scenario's own. tests/planner/test_communication_floor.py holds this to the
    whole step's sums."""
    layers = scenario.model.num_layers
    if scenario.strategy.stage != 3 or scenario.strategy.pp > 1 or layers < 3:
        return _tallied_sums(_data_parallel_events(scenario), scenario, seconds, host_only)
    short = [
        dataclasses.replace(scenario, model=dataclasses.replace(scenario.model, num_layers=blocks)) for blocks in (1, 2)
    ]
    (one, first, last, after, one_first), (two, _, _, _, two_first) = (
        _tallied_sums(rules_for(cut).step_events(cut), cut, seconds, host_only) for cut in short
    )
    busy, first_micro_batch = (
        {stream: low.get(stream, 0.0) + (layers - 1) * (high[stream] - low.get(stream, 0.0)) for stream in high}
        for low, high in ((one, two), (one_first, two_first))
    )
    if scenario.strategy.offload != "optimizer":
        return busy, first, last, after, first_micro_batch
    copies = _tallied_sums(_offload_events(scenario), scenario, seconds, host_only)
    return (
        _added(busy, copies[0]),
        _added(first, copies[1]),
        _added(last, copies[2]),
        _added(after, copies[3]),
        _added(first_micro_batch, copies[4]),
    )


def _tallied_sums(
    events: list[CommEvent], scenario: Scenario, seconds: Callable[[CommEvent], float], host_only: bool
) -> StreamSums:
    """`StreamSums` of `events`, a step of the scenario's micro-batches."""
    tally = _CallTally.of(events, scenario.training.grad_accum_steps - 1)
    busy, first, last, after, first_micro_batch = (
        tally.stream_seconds(counts, seconds, host_only)
        for counts in (tally.every, tally.first, tally.last, tally.after_step, tally.first_micro_batch)
    )
    return busy, first, last, after, first_micro_batch


def _added(sums: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    """Per stream, the two sums added (in a fixed order of streams: the floor without overlap sums them)."""
    return {stream: sums.get(stream, 0.0) + more.get(stream, 0.0) for stream in dict.fromkeys([*sums, *more])}


def _offload_events(scenario: Scenario) -> list[CommEvent]:
    rules = rules_for(scenario)
    return optimizer_offload_events(scenario, rules.grad_comm_bytes(scenario), rules.param_comm_bytes(scenario))


def _data_parallel_events(scenario: Scenario) -> list[CommEvent]:
    """The events of `core.comm.comm_events` that the floor may count, without building the tensor-parallel calls
    (the costly part, and priced by the tp floor instead); `_CallTally.stream_seconds` keeps those of the 'comm'
    and 'host' streams."""
    events = rules_for(scenario).step_events(scenario)
    return events + _offload_events(scenario) if scenario.strategy.offload == "optimizer" else events


_STAGE, _MICRO_BATCH = attrgetter("stage"), attrgetter("micro_batch")
_GROUP, _TRIGGER, _ROW = attrgetter("group"), attrgetter("trigger"), attrgetter("row")
_OP, _PAYLOAD = attrgetter("op"), attrgetter("payload_bytes")
_AT_STAGE_ZERO_OR_STEP = (1).__gt__  # stage 0 or -1 (the optimizer step's: 'after_step')
_FLOOR_STREAMS = ("comm", "host")


@dataclass(frozen=True, slots=True)
class _CallTally:
    """A step's calls counted by what they send, so each distinct call is priced once: a 70B step repeats the same
    few calls (one per unit kind and op) on every unit and micro-batch. Counted by the identity of the call's row
    (`core.comm_events.call_keys`)."""

    calls: dict[CallKey, CommEvent]
    """One call of each distinct (row, group)."""
    every: dict[CallKey, int]
    """How many calls of each the step makes."""
    first: dict[CallKey, int]
    """Of them, before the first forward: micro-batch 0, stage 0, 'before_forward'."""
    last: dict[CallKey, int]
    """Of them, after the last backward: the last micro-batch, stage 0, 'after_backward'."""
    after_step: dict[CallKey, int]
    """Of them, after the optimizer step: the last micro-batch, stage -1, 'after_step'."""
    first_micro_batch: dict[CallKey, int]
    """Of them, micro-batch 0's."""

    @classmethod
    def of(cls, events: list[CommEvent], last_micro_batch: int) -> _CallTally:
        """The tally of a step of `last_micro_batch` + 1 micro-batches."""
        keys = call_keys(events)
        first: Counter[CallKey] = Counter()
        last: Counter[CallKey] = Counter()
        after_step: Counter[CallKey] = Counter()
        # the calls at stage 0 and -1 are few (the root's, the last gradient buckets', the step's): looked at one
        # by one
        at_edges = map(_AT_STAGE_ZERO_OR_STEP, map(_STAGE, events))  # stage >= -1
        for key, event in compress(zip(keys, events, strict=True), at_edges):
            if event.micro_batch == 0 and event.trigger == "before_forward":
                first[key] += 1
            elif event.micro_batch == last_micro_batch and event.trigger == "after_backward":
                last[key] += 1
            elif event.trigger == "after_step":
                after_step[key] += 1
        return cls(
            calls=dict(zip(keys, events, strict=True)),
            every=Counter(keys),
            first=first,
            last=last,
            after_step=after_step,
            first_micro_batch=Counter(compress(keys, map(eq, map(_MICRO_BATCH, events), repeat(0)))),
        )

    def stream_seconds(
        self, counts: dict[CallKey, int], seconds: Callable[[CommEvent], float], host_only: bool
    ) -> dict[str, float]:
        """Seconds of the counted calls on each of the 'comm' and 'host' streams (only 'host' when `host_only`:
        data-parallel groups of one rank send nothing)."""
        sums: dict[str, float] = {}
        for key, count in counts.items():
            stream = STREAM_OF_GROUP.get(key[1], "comm")
            if stream in _FLOOR_STREAMS and not (host_only and stream != "host"):
                sums[stream] = sums.get(stream, 0.0) + seconds(self.calls[key]) * count
        return sums


def optimizer_floor_s(scenario: Scenario, hardware: HardwareProfile) -> float:
    """The optimizer step's task as the simulation prices it (`core.timeline_tasks.optimizer_task_s`, of the step
    of at most two micro-batches that plan_timing simulates): the part of `CommunicationFloor.tail_s` that needs no
    communication event, so it bounds a step cheaply on its own (`Evaluator.optimizer_bound_s`)."""
    asked = _with_micro_batches(scenario, min(scenario.training.grad_accum_steps, SIMULATED_MICRO_BATCHES))
    rules = rules_for(asked)
    return optimizer_task_s(asked, compute_model(asked, hardware), hardware, rules.framework_s(asked, hardware))


def communication_floor(
    scenario: Scenario, hardware: HardwareProfile, optimizer_s: float | None = None
) -> CommunicationFloor:
    """The floor for the scenario's micro-batch count, from a step of two micro-batches extended as plan_timing does
    (each further micro-batch issues micro-batch 0's calls; the last micro-batch's own and the calls after the
    optimizer step come once a step: tests/planner/test_communication_floor.py holds it to steps of one and two
    summed call by call). `optimizer_s`: the scenario's `optimizer_floor_s` where the caller has it."""
    net = network_model(hardware)
    steps = scenario.training.grad_accum_steps
    priced: dict[tuple[str, str, int, int], float] = {}
    host_only = scenario.state_ranks == 1  # as comm_events: data-parallel groups of one rank send nothing

    def seconds(event: CommEvent) -> float:
        key = (event.group, event.row.op, event.row.group_size, event.row.payload_bytes)
        found = priced.get(key)
        if found is None:
            found = priced[key] = event_cost(event, scenario, net).time_s
        return found

    simulated = min(steps, SIMULATED_MICRO_BATCHES)
    # Each stream's whole step and its edges: the gathers before the first forward (micro-batch 0, stage 0,
    # 'before_forward'), the reductions after the last backward (the last micro-batch, stage 0, 'after_backward')
    # and the calls after the optimizer step ('after_step').
    # A step of k micro-batches makes those of two plus k - 2 times micro-batch 0's (a step of one makes those of two
    # less micro-batch 0's: the calls of the last micro-batch and after the step come once).
    busy, first, last, after, first_micro_batch = _stream_sums(
        _with_micro_batches(scenario, simulated), seconds, host_only
    )
    if steps > simulated:
        busy = {stream: total + (steps - 2) * first_micro_batch.get(stream, 0.0) for stream, total in busy.items()}
    optimizer = optimizer_s if optimizer_s is not None else optimizer_floor_s(scenario, hardware)
    if not hardware.overlap:
        return CommunicationFloor(edges_s=sum(busy.values()), before_step_s=0.0, tail_s=optimizer)
    before = (total - after.get(stream, 0.0) for stream, total in busy.items())
    return CommunicationFloor(
        edges_s=max(first.values(), default=0.0) + max(last.values(), default=0.0),
        before_step_s=max(before, default=0.0),
        tail_s=optimizer + max(after.values(), default=0.0),
    )
