"""A step's tensor, context and expert parallel calls as tasks of the timeline, built once per shape of step.

They are most of a step's tasks (a 405B pipeline rank's step of 16 micro-batches has thousands, its data-parallel
calls a few hundred) and the same for every data-parallel strategy, offload and GPU count of a shape
(`core.model_parallel_comm.model_parallel_shape`), while the planner simulates hundreds of steps that share a few
dozen shapes. So their costs, tasks, waits and hidden exchange are built once per shape and position among the
step's tasks, and `core.timeline` places them between the data-parallel calls and offload's copies, as building
them again would (tests/core/test_task_graph_reuse.py).

No engine issues them asynchronously (DTensor's calls, ring attention's exchange and the expert all-to-alls block:
`is_async` of every engine holds only for data-parallel groups), so what the calls before them leave to them is the
place of the last one: a call at the same place waits for it.
"""

from __future__ import annotations

from typing import NamedTuple

from shardscope.core.comm_events import CommEvent, Place
from shardscope.core.compute import ComputeModel
from shardscope.core.engines import rules_for
from shardscope.core.model_parallel_comm import CACHED_SHAPES, model_parallel_shape
from shardscope.core.network import CollectiveCost, network_model
from shardscope.core.ring_overlap import hidden_exchange
from shardscope.core.timeline_tasks import Task, build_comm_tasks, event_costs
from shardscope.presets.hardware import HardwareProfile
from shardscope.specs import Scenario


class ModelParallelTasks(NamedTuple):
    """The model-parallel calls of a step placed at their index among its tasks."""

    costs: tuple[CollectiveCost, ...]
    tasks: tuple[Task, ...]
    waits: tuple[tuple[int, tuple[int, ...]], ...]
    """(compute task, the calls it waits for)."""
    before_optimizer: tuple[int, ...]
    """The calls issued before the optimizer step (it waits for them)."""
    hidden: dict[int, float]
    """Seconds of each ring-attention call hidden behind its attention (`core.ring_overlap`), by task index."""
    previous: Place | None
    """The place of the last call."""


_built: dict[tuple[object, ...], ModelParallelTasks] = {}


def model_parallel_tasks(
    scenario: Scenario,
    profile: HardwareProfile,
    compute: ComputeModel,
    events: tuple[CommEvent, ...],
    where: dict[tuple[str, int, int], int],
    first: int,
    previous: Place | None,
) -> ModelParallelTasks:
    """The tasks of `events` (the scenario's `model_parallel_calls`), the first at index `first`, after a call at
    `previous`; `where` places the step's compute tasks (`build_compute_tasks`). Kept per shape: everything they
    read of the scenario is in the key."""
    if not events:
        return ModelParallelTasks((), (), (), (), {}, previous)
    opening = events[0]
    rules = rules_for(scenario)
    cluster = scenario.cluster
    key = (
        model_parallel_shape(scenario, rules.param_comm_bytes(scenario), rules.megatron_tensor_parallel),
        cluster.gpu,
        cluster.backend,
        cluster.ranks_per_node,
        profile,
        first,
        previous == (opening.micro_batch, opening.stage, opening.trigger),
    )
    found = _built.get(key)
    if found is None:
        if len(_built) >= CACHED_SHAPES:
            _built.clear()
        found = _built[key] = _build(scenario, profile, compute, events, where, first, previous)
    return found


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
    )
