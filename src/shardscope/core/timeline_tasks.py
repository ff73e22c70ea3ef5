"""The tasks of one step before the timeline schedules them (`core.timeline`): the compute stages of every
micro-batch and the optimizer, each communication event placed against the compute it waits for or blocks, and the
compute slowed beside asynchronous collectives."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from itertools import repeat
from operator import add, attrgetter
from typing import NamedTuple

from shardscope.core.comm import CommEvent
from shardscope.core.comm_events import CallKey, Place, call_keys
from shardscope.core.compute import ComputeModel, optimizer_step_s, rank_stage_flops
from shardscope.core.engines import rules_for
from shardscope.core.engines.base import TimePlace
from shardscope.core.kept import kept
from shardscope.core.kernels import stage_seconds
from shardscope.core.model_parallel_comm import CACHED_SHAPES
from shardscope.core.network import CollectiveCost, NetworkModel, event_cost
from shardscope.core.overheads import async_slowdown_s
from shardscope.core.params import rank_layout
from shardscope.core.rank_share import rank_share
from shardscope.core.sharding import flat_shard_numel
from shardscope.presets.hardware import HardwareProfile
from shardscope.specs import Scenario

STREAM_OF_GROUP = {"host": "host", "tp": "model_parallel", "cp": "model_parallel", "ep": "model_parallel"}
"""Streams other than 'comm' (the data-parallel collectives): tp, cp and ep run on process groups, so NCCL streams,
of their own (ep's all-to-alls, like tp's calls, block the stage that waits for them)."""


class Task(NamedTuple):
    """One piece of work before it is scheduled (a tuple: a 70B step has thousands and the planner simulates
    hundreds of steps)."""

    key: float
    name: str
    stream: str
    category: str
    duration_s: float
    payload_bytes: int
    after: tuple[int, ...]  # indices (into the task list) that must finish first


def build_compute_tasks(
    scenario: Scenario, compute: ComputeModel, profile: HardwareProfile
) -> tuple[list[Task], dict[tuple[str, int, int], int]]:
    """Compute tasks in issue order, and where each (kind, micro-batch, stage) sits among them (shared by the
    steps of a shape: read only)."""
    rules = rules_for(scenario)
    framework = rules.framework_s(scenario, profile)
    key = (scenario.model, scenario.training, rank_share(scenario), compute, tuple(framework.items()))
    found = kept(_stage_tasks, key, lambda: _stage_tasks_of(scenario, compute, framework), CACHED_SHAPES)
    tasks, where = list(found[0]), found[1]
    seconds = optimizer_task_s(scenario, compute, profile, framework)
    tasks.append(Task(len(tasks), "optimizer step", "compute", "optimizer", seconds, 0, ()))
    return tasks, where


def optimizer_task_s(
    scenario: Scenario, compute: ComputeModel, profile: HardwareProfile, framework: dict[TimePlace, float]
) -> float:
    """The optimizer step's task, before compute beside asynchronous calls is slowed (`slow_beside_async`):
    `framework` is the engine's `framework_s`."""
    rules = rules_for(scenario)
    layout = rank_layout(scenario)
    degree = scenario.parallelism.dp_shard
    shard_tensors = rules.optimizer_tensors(scenario)
    seconds = optimizer_step_s(scenario, compute, flat_shard_numel(layout.total_numel, degree), shard_tensors)
    seconds += profile.host_terms.optimizer_step_overhead_s + framework.get(("optimizer", -1), 0.0)
    seconds += rules.optimizer_overhead_s(scenario, profile, shard_tensors)
    return seconds


_stage_tasks: dict[tuple[object, ...], tuple[tuple[Task, ...], dict[tuple[str, int, int], int]]] = {}


def _stage_tasks_of(
    scenario: Scenario, compute: ComputeModel, framework: dict[TimePlace, float]
) -> tuple[tuple[Task, ...], dict[tuple[str, int, int], int]]:
    """Every micro-batch's forward, recompute and backward tasks of the stages, and where they and the optimizer
    step (after them) sit: all they read of the scenario is its model, its training and its rank's share
    (`core.compute.rank_stage_flops`, `core.kernels.stage_seconds`), so the planner's steps of a shape share them."""
    stages = rank_stage_flops(scenario)
    tasks: list[Task] = []
    where: dict[tuple[str, int, int], int] = {}

    # Every micro-batch repeats the same stages: each stage's forward, recompute and backward time computed once.
    forward, recompute, backward = stage_seconds(scenario, compute)

    def add(kind: str, micro_batch: int, stage: int, seconds: float) -> None:
        where[(kind, micro_batch, stage)] = len(tasks)
        name = f"{kind} {stages[stage].name}" + (f" (micro-batch {micro_batch})" if micro_batch else "")
        seconds += framework.get((kind, stage), 0.0)
        tasks.append(Task(len(tasks), name, "compute", kind, seconds, 0, ()))

    for micro_batch in range(scenario.training.grad_accum_steps):
        for index in range(len(stages)):
            add("forward", micro_batch, index, forward[index])
        for index in reversed(range(len(stages))):
            if stages[index].recompute_flops:
                add("recompute", micro_batch, index, recompute[index])
            add("backward", micro_batch, index, backward[index])
    where[("optimizer", 0, -1)] = len(tasks)
    return tuple(tasks), where


def _consumer(trigger: str, micro_batch: int, stage: int, where: dict[tuple[str, int, int], int]) -> int:
    """The compute task a gather must precede (the recompute when there is one), or the one a call made inside a
    stage's compute blocks (a re-forward's call with the backward when the stage has no recompute task)."""
    kind = "forward" if trigger in ("before_forward", "during_forward") else "backward"
    recompute = where.get(("recompute", micro_batch, stage))
    if recompute is not None and trigger in ("before_backward", "during_recompute"):
        return recompute
    return where[(kind, micro_batch, stage)]


def _placement(
    place: Place, where: dict[tuple[str, int, int], int], optimizer: int
) -> tuple[float, tuple[int, ...], int | None]:
    """Where a call at `place` goes: its issue key, the tasks it starts after, and the compute task that waits for
    it (None when none does).

    A call inside a stage (tensor and context parallelism's) starts once the compute before it finishes and blocks
    the stage's compute: its time is on the critical path, as the matmul after a tp collective needs its result."""
    micro_batch, stage, trigger = place
    if trigger in INSIDE_STAGE:
        consumer = _consumer(trigger, micro_batch, stage, where)
        # issued once the compute before it is, and blocking that stage's compute
        return consumer - 0.5, (consumer - 1,) if consumer >= 1 else (), consumer
    if trigger == "before_forward" or trigger == "before_backward":
        consumer = _consumer(trigger, micro_batch, stage, where)
        # issued while the previous stage computes: one unit of prefetch
        return consumer - 1.0, (consumer - 2,) if consumer >= 2 else (), consumer
    if trigger == "after_backward":
        producer = where[("backward", micro_batch, stage)]
        return producer + 0.5, (producer,), None
    return optimizer + 0.5, (optimizer,), None


_Placed = tuple[float, tuple[int, ...], int | None]
_placements: dict[int, tuple[dict[tuple[str, int, int], int], dict[Place, _Placed]]] = {}


def _placements_of(where: dict[tuple[str, int, int], int]) -> dict[Place, _Placed]:
    """`_placement` of every place asked so far among the compute tasks `where` places (a step's calls share a few
    hundred places, and the steps of a shape share `where`: `build_compute_tasks`). Kept by the id of `where`, which
    the entry holds, so no other dict can take that id while the entry lasts."""
    return kept(_placements, id(where), lambda: (where, {}), CACHED_SHAPES)[1]


def event_costs(scenario: Scenario, events: tuple[CommEvent, ...], net: NetworkModel) -> tuple[CollectiveCost, ...]:
    """The cost of every event, each distinct call priced once: a step repeats the same few calls (one per unit
    kind and op) hundreds of times (`call_keys`)."""
    priced: dict[tuple[str, str, int, int], CollectiveCost] = {}
    cost_of: dict[CallKey, CollectiveCost] = {}
    keys = call_keys(events)
    for key, event in dict(zip(keys, events, strict=True)).items():
        row = event.row
        shape = (event.group, row.op, row.group_size, row.payload_bytes)
        cost = priced.get(shape)
        if cost is None:
            cost = priced[shape] = event_cost(event, scenario, net)
        cost_of[key] = cost
    return tuple(map(cost_of.__getitem__, keys))


INSIDE_STAGE = ("during_forward", "during_recompute", "during_backward")
_PLACE = attrgetter("micro_batch", "stage", "trigger")
_GROUP = attrgetter("group")
_new_task = partial(tuple.__new__, Task)
"""`Task(...)` from a tuple of its fields, at half the cost of its Python-level `__new__`: a step has a thousand calls
and the planner simulates hundreds of steps."""


class CommTasks(NamedTuple):
    """Communication tasks built from a run of events, and what the next run of events carries on from."""

    tasks: list[Task]
    previous: Place | None
    """The place of the last event: a call at the same place next waits for it."""
    waited_async: bool
    """An asynchronous call has paid the wait for the later rank."""


def build_comm_tasks(
    events: Sequence[CommEvent],
    costs: Sequence[CollectiveCost],
    where: dict[tuple[str, int, int], int],
    sync_wait_s: float,
    asynchronous: Sequence[bool],
    waits: dict[int, list[int]],
    first: int,
    previous: Place | None = None,
    waited_async: bool = False,
) -> CommTasks:
    """Communication tasks with their issue keys (`_placement`), the first at index `first` of the step's tasks
    (after the compute tasks and the events before these, which left `previous` and `waited_async`); the gathers
    each compute task waits for are added to `waits`.

    The wait for the later rank is paid by the first blocking collective after compute, and once per step by the
    async ones (asynchronous[i]: event i is issued with async_op=True): the rank goes on computing while they wait,
    and the skew between the ranks is absorbed once, by the first.

    Everything but the durations, labels, ops and payloads follows from where the events sit (`_CommOrder`), which
    the planner's steps of a shape share whatever their group sizes and payloads: it is kept by those places, and
    only the calls' own values are read per step."""
    places = tuple(map(_PLACE, events))
    streams = tuple(map(STREAM_OF_GROUP.get, map(_GROUP, events), repeat("comm")))
    key = (places, streams, tuple(asynchronous), id(where), first, previous, waited_async, sync_wait_s)

    def make() -> _CommOrder:
        return _comm_order(places, streams, asynchronous, where, first, previous, waited_async, sync_wait_s)

    order = kept(_comm_orders, key, make, CACHED_SHAPES)
    if order.where is not where:  # a `where` since freed left its id to this one
        order = _comm_orders[key] = make()
    for consumer, positions in order.waits:
        waits.setdefault(consumer, []).extend(positions)
    rows = list(map(_ROW, events))
    durations = map(add, map(_TIME, costs), order.sync_waits_s)
    fields = zip(
        order.keys,
        map(_LABEL, events),
        streams,
        map(_OP, rows),
        durations,
        map(_PAYLOAD, rows),
        order.after,
        strict=True,
    )
    return CommTasks(list(map(_new_task, fields)), order.previous, order.waited_async)


class _CommOrder(NamedTuple):
    """What `build_comm_tasks` makes of a run of events' places: every task's issue key, the tasks it starts after and
    the wait for the later rank it pays, and the calls each compute task waits for."""

    where: dict[tuple[str, int, int], int]
    """The compute tasks' places it was made for (held, so no other dict takes its id while it is kept)."""
    keys: tuple[float, ...]
    after: tuple[tuple[int, ...], ...]
    sync_waits_s: tuple[float, ...]
    """The wait each call pays for the later rank: sync_wait_s or 0.0."""
    waits: tuple[tuple[int, tuple[int, ...]], ...]
    """(compute task, the calls it waits for), in the order the consumers first appear."""
    previous: Place | None
    waited_async: bool


_comm_orders: dict[tuple[object, ...], _CommOrder] = {}


def _comm_order(
    places: tuple[Place, ...],
    streams: tuple[str, ...],
    asynchronous: Sequence[bool],
    where: dict[tuple[str, int, int], int],
    first: int,
    previous: Place | None,
    waited_async: bool,
    sync_wait_s: float,
) -> _CommOrder:
    optimizer = where[("optimizer", 0, -1)]
    placed = _placements_of(where)
    for place in set(places).difference(placed):
        placed[place] = _placement(place, where, optimizer)
    keys: list[float] = []
    afters: list[tuple[int, ...]] = []
    sync_waits: list[float] = []
    waits: dict[int, list[int]] = {}
    for position, (place, stream, issued_async) in enumerate(zip(places, streams, asynchronous, strict=True), first):
        key, after, consumer = placed[place]
        if consumer is not None:
            waits.setdefault(consumer, []).append(position)
        wait = 0.0
        if place == previous:  # a copy then its gather, a reduce-scatter then its all-reduce and offload copy
            after += (position - 1,)
        elif stream != "host" and not (waited_async and issued_async):
            wait = sync_wait_s  # the first collective after compute waits for the later rank
            waited_async = waited_async or issued_async
        keys.append(key)
        afters.append(after)
        sync_waits.append(wait)
        previous = place
    return _CommOrder(
        where=where,
        keys=tuple(keys),
        after=tuple(afters),
        sync_waits_s=tuple(sync_waits),
        waits=tuple((consumer, tuple(positions)) for consumer, positions in waits.items()),
        previous=previous,
        waited_async=waited_async,
    )


_ROW = attrgetter("row")
_TIME = attrgetter("time_s")
_LABEL = attrgetter("label")
_OP = attrgetter("op")
_PAYLOAD = attrgetter("payload_bytes")


def slow_beside_async(
    asynchronous: tuple[bool, ...],
    events: tuple[CommEvent, ...],
    costs: tuple[CollectiveCost, ...],
    compute_tasks: list[Task],
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
