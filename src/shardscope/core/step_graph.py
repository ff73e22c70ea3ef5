"""The task graph of one step, before the timeline runs it (`core.timeline`): the compute tasks, then a task per call
in `core.comm.comm_events`' order (the engine's data-parallel calls, the tensor, context and expert parallel calls,
optimizer offload's copies), what each compute task waits for, and the part of ring attention's exchange hidden
behind its attention (`core.ring_overlap`).

The model-parallel calls are most of a step's tasks (a 405B pipeline rank's step of 16 micro-batches has thousands,
its data-parallel calls a few hundred) and the same for every data-parallel strategy, offload and GPU count of a
shape (`core.model_parallel_comm.model_parallel_shape`), while the planner simulates hundreds of steps that share a
few dozen shapes. So their costs, tasks, waits and hidden exchange are built once per shape and moved to their
position among the step's tasks (`model_parallel_tasks`), equal to the tasks building them again gives
(tests/core/test_step_graph.py).
No engine issues them asynchronously (DTensor's calls, ring attention's exchange and the expert all-to-alls block:
every engine's `is_async` holds only for data-parallel groups), so what the calls before them leave to them is the
place of the last one: a call at the same place waits for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import chain, compress, count, repeat
from operator import attrgetter, itemgetter, lt
from typing import NamedTuple, get_args

from shardscope.choices import CommGroup, Trigger
from shardscope.core.comm import comm_event_parts
from shardscope.core.comm_events import CommEvent, Place, new_event
from shardscope.core.compute import ComputeModel, compute_model
from shardscope.core.engines import rules_for
from shardscope.core.kept import kept
from shardscope.core.model_parallel_comm import CACHED_SHAPES, model_parallel_shape
from shardscope.core.network import CollectiveCost, network_model
from shardscope.core.result import CollectiveRow
from shardscope.core.ring_overlap import hidden_exchange
from shardscope.core.timeline_tasks import (
    Task,
    build_comm_tasks,
    build_compute_tasks,
    event_costs,
    slow_beside_async,
)
from shardscope.presets.hardware import HardwareProfile
from shardscope.specs import Scenario


class StepGraph(NamedTuple):
    """One step's tasks and what orders them."""

    events: tuple[CommEvent, ...]
    """The step's calls (`comm_events`)."""
    costs: tuple[CollectiveCost, ...]
    """The cost of each call."""
    compute: ComputeModel
    """The compute model the compute tasks were priced with."""
    tasks: list[Task]
    """The compute tasks, then a task per call."""
    computes: int
    """tasks[:computes] are compute tasks."""
    waits: dict[int, list[int]]
    """The calls each compute task waits for (the optimizer step every call issued before it)."""
    hidden: dict[int, float]
    """Seconds of each ring-attention call hidden behind its attention, by task index."""
    runs: dict[int, tuple[float, ...]]
    """Of a merged graph (`merged_runs`), the durations of the calls each task that stands for a run of calls runs,
    in order, by task index; empty otherwise."""
    call_seconds: tuple[float, ...]
    """Of a graph with `runs`, every call's duration in the order of the graph of every call (what the step's
    communication time sums, in that order); empty otherwise (every task is one call)."""


EventPlacement = Callable[[Scenario, tuple[CommEvent, ...]], tuple[CommEvent, ...]]
"""What a pipeline rank makes of the data-parallel calls of its model without a pipeline (`core.pipeline_time`)."""


def step_graph(
    scenario: Scenario, profile: HardwareProfile, placement: EventPlacement | None = None, merged: bool = False
) -> StepGraph:
    """The scenario's step as tasks for the timeline, its data-parallel calls as `placement` places them; `merged`:
    each run of model-parallel calls at one place as one task (`merged_runs`: the same step in exact
    arithmetic, from a graph of half the tasks, so its events and costs no longer match its tasks one to one)."""
    data_parallel, model_parallel, offload = comm_event_parts(scenario)  # refuses a model without a shape first
    if placement is not None:
        data_parallel = placement(scenario, data_parallel)
    compute = compute_model(scenario, profile)
    compute_tasks, where = build_compute_tasks(scenario, compute, profile)
    own = data_parallel + offload
    own_costs = event_costs(scenario, own, network_model(profile))
    asynchronous = asynchronous_calls(scenario, own)
    slowdown = profile.host_terms.async_compute_slowdown
    if slowdown:
        slow_beside_async(asynchronous, own, own_costs, compute_tasks, where, slowdown)
    computes, split, sync_wait_s = len(compute_tasks), len(data_parallel), profile.host_terms.sync_wait_s
    waits: dict[int, list[int]] = {}
    before = build_comm_tasks(
        data_parallel, own_costs[:split], where, sync_wait_s, asynchronous[:split], waits, computes
    )
    shared = model_parallel_tasks(
        scenario, profile, compute, model_parallel, where, computes + split, before.previous, merged
    )
    for consumer, positions in shared.waits:
        waits.setdefault(consumer, []).extend(positions)
    offload_first = computes + split + len(shared.tasks)
    after = build_comm_tasks(
        offload,
        own_costs[split:],
        where,
        sync_wait_s,
        asynchronous[split:],
        waits,
        offload_first,
        shared.previous,
        before.waited_async,
    )
    optimizer = where[("optimizer", 0, -1)]
    waits[optimizer] = [
        *_issued_before(optimizer, before.tasks, computes),
        *shared.before_optimizer,
        *_issued_before(optimizer, after.tasks, offload_first),
    ]
    return StepGraph(
        events=data_parallel + model_parallel + offload,
        costs=own_costs[:split] + shared.costs + own_costs[split:],
        compute=compute,
        tasks=compute_tasks + before.tasks + list(shared.tasks) + after.tasks,
        computes=computes,
        waits=waits,
        hidden=shared.hidden,
        runs=shared.runs,
        call_seconds=tuple(chain(map(_DURATION, before.tasks), shared.call_seconds, map(_DURATION, after.tasks)))
        if shared.runs
        else (),
    )


def asynchronous_calls(scenario: Scenario, events: tuple[CommEvent, ...]) -> tuple[bool, ...]:
    """The engine's `is_async` of every event. All an engine's rule reads of a call is its trigger and group
    (`EngineRules.is_async`): when it holds for no pair at all (only DDP's and ZeRO-1's bucket reductions are
    asynchronous, so every sharded step), none is asked alone; else each distinct pair of the step is asked once
    (a step of a thousand calls has a handful). tests/core/test_asynchronous_calls.py holds it to asking each call."""
    rules = rules_for(scenario)
    if not any(rules.is_async(scenario, probe) for probe in _PROBES):
        return (False,) * len(events)
    sorts = list(map(_TRIGGER_GROUP, events))
    decided = {sort: rules.is_async(scenario, event) for sort, event in dict(zip(sorts, events, strict=True)).items()}
    return tuple(map(decided.__getitem__, sorts))


_PROBES = tuple(
    new_event(
        CollectiveRow(phase="backward", op="all_reduce", group_size=2, payload_bytes=0, count=1),
        group,
        0,
        0,
        trigger,
        "",
    )
    for trigger in get_args(Trigger)
    for group in get_args(CommGroup)
)
"""A call of every trigger and group, to ask an engine whether any call of a step can be asynchronous."""
_TRIGGER_GROUP = attrgetter("trigger", "group")


def _issued_before(key: float, tasks: list[Task], first: int) -> Iterator[int]:
    """The indices (`first` that of tasks[0]) of the tasks issued before `key`, filtered without a Python-level loop:
    a step has hundreds of calls and the planner builds hundreds of steps."""
    return compress(count(first), map(lt, map(_KEY, tasks), repeat(key)))


_KEY = itemgetter(0)  # Task.key
_DURATION, _PAYLOAD = itemgetter(4), itemgetter(5)  # Task.duration_s, Task.payload_bytes


class ModelParallelTasks(NamedTuple):
    """A step's model-parallel calls placed at their index among its tasks."""

    costs: tuple[CollectiveCost, ...]
    tasks: tuple[Task, ...]
    waits: tuple[tuple[int, tuple[int, ...]], ...]
    """(compute task, the calls it waits for)."""
    before_optimizer: tuple[int, ...]
    """The calls issued before the optimizer step (it waits for them)."""
    hidden: dict[int, float]
    """Seconds of each ring-attention call hidden behind its attention, by task index."""
    previous: Place | None
    """The place of the last call."""
    runs: dict[int, tuple[float, ...]]
    """The durations of the calls of each task that stands for a run of them (`merged_runs`), by task index."""
    call_seconds: tuple[float, ...]
    """Every call's duration, in order, once merged (`merged_runs`); empty before."""


_built: dict[tuple[object, ...], dict[int, ModelParallelTasks]] = {}
"""Per shape (everything but the first task's index), the tasks placed at each first index asked."""


def model_parallel_tasks(
    scenario: Scenario,
    profile: HardwareProfile,
    compute: ComputeModel,
    events: tuple[CommEvent, ...],
    where: dict[tuple[str, int, int], int],
    first: int,
    previous: Place | None,
    merged: bool = False,
) -> ModelParallelTasks:
    """The tasks of `events` (the scenario's `model_parallel_calls`), the first at index `first`, after a call at
    `previous`; `where` places the step's compute tasks (`build_compute_tasks`). Kept per shape: the key holds
    everything they read of the scenario (the shape of the calls, which fixes the compute tasks' places, and what
    prices them: the GPU, the backend, the ranks on a node and the hardware profile); a shape placed at another
    index is moved there (`_moved`), not built again. `merged`: each run of calls at one place as one task
    (`merged_runs`), kept apart from the tasks of every call."""
    if not events:
        return ModelParallelTasks((), (), (), (), {}, previous, {}, ())
    opening = events[0]
    rules = rules_for(scenario)
    cluster = scenario.cluster
    key = (
        model_parallel_shape(scenario, rules.param_comm_bytes(scenario), rules.megatron_tensor_parallel),
        cluster.gpu,
        cluster.backend,
        cluster.ranks_per_node,
        profile,
        previous == (opening.micro_batch, opening.stage, opening.trigger),
        merged,
    )
    placed = kept(_built, key, dict, CACHED_SHAPES)
    found = placed.get(first)
    if found is None:
        if placed:
            known, block = next(iter(placed.items()))
            found = _moved(block, first - known, where[("optimizer", 0, -1)] + 1)
        else:
            found = _build(scenario, profile, compute, events, where, first, previous)
            if merged:
                found = merged_runs(found, first)
        placed[first] = found
    return found


def _moved(block: ModelParallelTasks, by: int, computes: int) -> ModelParallelTasks:
    """`block` placed `by` tasks later: the indices of calls (from `computes` on) move, those of compute tasks stay
    (a call waits for the call before it at its place, always the last of its `after`)."""
    return block._replace(
        tasks=tuple(
            Task(*task[:-1], (*task.after[:-1], task.after[-1] + by))
            if task.after and task.after[-1] >= computes
            else task
            for task in block.tasks
        ),
        waits=tuple((consumer, tuple(position + by for position in positions)) for consumer, positions in block.waits),
        before_optimizer=tuple(position + by for position in block.before_optimizer),
        hidden={index + by: seconds for index, seconds in block.hidden.items()},
        runs={index + by: durations for index, durations in block.runs.items()},
    )


def _build(
    scenario: Scenario,
    profile: HardwareProfile,
    compute: ComputeModel,
    events: tuple[CommEvent, ...],
    where: dict[tuple[str, int, int], int],
    first: int,
    previous: Place | None,
) -> ModelParallelTasks:
    costs = event_costs(scenario, events, network_model(profile))
    waits: dict[int, list[int]] = {}
    synchronous = (False,) * len(events)
    built = build_comm_tasks(events, costs, where, profile.host_terms.sync_wait_s, synchronous, waits, first, previous)
    optimizer = where[("optimizer", 0, -1)]
    return ModelParallelTasks(
        costs=costs,
        tasks=tuple(built.tasks),
        waits=tuple((consumer, tuple(positions)) for consumer, positions in waits.items()),
        before_optimizer=tuple(first + index for index, task in enumerate(built.tasks) if task.key < optimizer),
        hidden={first + index: s for index, s in hidden_exchange(scenario, compute, events, costs).items()},
        previous=built.previous,
        runs={},
        call_seconds=(),
    )


def merged_runs(block: ModelParallelTasks, first: int) -> ModelParallelTasks:
    """`block` (its first task at index `first`) with each run of calls at one place (a stage's tensor-parallel
    calls, a dozen per block) as one task, its calls' durations kept in `runs`: the timeline adds them to the run's
    start one by one, so the step comes out the same to the last bit from a graph of half the tasks. A call made at
    the place of the call before it starts after it (`timeline_tasks._comm_order` chains them), and shares its issue
    key, its stream ('model_parallel', every model-parallel group's), the compute task that waits for it and the
    tasks it starts after (`timeline_tasks._placement`): so it comes next in issue order and starts when the one
    before it ends, and the run ends at its first call's start plus their durations. Calls with a part hidden (ring
    attention's, which a waiting stage subtracts from each call's end) stay apart. Its costs stay one per call."""
    tasks, hidden = block.tasks, block.hidden
    starts = [  # where each run starts: a call not chained to the one before it, or either with a part hidden
        index
        for index, task in enumerate(tasks)
        if not (index and task.after and task.after[-1] == first + index - 1)
        or (hidden and (first + index - 1 in hidden or first + index in hidden))
    ]
    bounds = list(zip(starts, [*starts[1:], len(tasks)], strict=True))
    merged_at = {first + index: first + run for run, (start, end) in enumerate(bounds) for index in range(start, end)}
    durations = [tuple(map(_DURATION, tasks[start:end])) for start, end in bounds]
    merged = []
    for (start, end), seconds in zip(bounds, durations, strict=True):
        task = tasks[start]
        after = task.after  # compute tasks, then the call it is chained to (hidden, or the data-parallel ones')
        if after and after[-1] >= first:
            after = (*after[:-1], merged_at[after[-1]])
        payload = sum(map(_PAYLOAD, tasks[start:end]))
        merged.append(Task(task.key, task.name, task.stream, task.category, sum(seconds), payload, after))

    def moved(positions: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(dict.fromkeys(map(merged_at.__getitem__, positions)))

    return block._replace(
        tasks=tuple(merged),
        waits=tuple((consumer, moved(positions)) for consumer, positions in block.waits),
        before_optimizer=moved(block.before_optimizer),
        hidden={merged_at[index]: seconds for index, seconds in hidden.items()},
        runs={first + run: seconds for run, seconds in enumerate(durations) if len(seconds) > 1},
        call_seconds=tuple(map(_DURATION, tasks)),
    )
