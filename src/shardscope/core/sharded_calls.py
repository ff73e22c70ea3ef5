"""The collective calls of a ZeRO-3, FSDP or HSDP step (`sharded_events`): per-unit gathers before use, per-unit
reduce-scatters after backward, made once per step shape and kept, because the planner asks a plan's bound and its
simulation for the same steps. The calls are `core.comm_events.CommEvent`s, made column by column."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from itertools import repeat
from typing import NamedTuple

from shardscope.choices import CommGroup, Trigger
from shardscope.core.comm_events import (
    LEDGER_GROUP,
    CommEvent,
    Unit,
    call_row,
    every_micro_batch,
    fsdp_units,
    new_events,
)
from shardscope.core.params import ParamLayout, rank_layout
from shardscope.core.result import CollectiveRow
from shardscope.specs import Scenario


def sharded_events(
    scenario: Scenario,
    gathered_numels: tuple[int, int],
    param_bytes: int,
    grad_bytes: int,
    regather_root: bool,
    root_once: bool = False,
) -> list[CommEvent]:
    """ZeRO-3, FSDP and HSDP: per-unit all-gathers before use, per-unit reduce-scatters after backward (hsdp: then an
    all-reduce of the shard across replica groups); `gathered_numels` is (root, one block) once gathered, padding
    included; `regather_root`: the root is gathered again for backward (else kept from forward); `root_once`: the
    root is gathered for the first micro-batch only and kept whole through the step."""
    strategy = scenario.strategy
    group: CommGroup = "shard" if strategy.preset.groups_replicate else "world"
    offload_params = strategy.offload == "optimizer+params"
    reshard = strategy.reshard_after_forward and strategy.stage == 3
    shape = _ShardedShape(
        rank_layout(scenario),
        scenario.shard_degree,
        scenario.replica_degree,
        group,
        offload_params,
        reshard,
        gathered_numels,
        param_bytes,
        grad_bytes,
        regather_root,
    )
    steps = scenario.training.grad_accum_steps
    make = _sharded_step if steps <= KEPT_STEPS_UP_TO else _sharded_step.__wrapped__
    return list(make(shape, root_once, steps))


class _ShardedShape(NamedTuple):
    """What a sharded step's first micro-batch reads (`sharded_events`' arguments and the scenario's)."""

    layout: ParamLayout
    degree: int
    replicas: int
    group: CommGroup
    offload_params: bool
    reshard: bool
    gathered_numels: tuple[int, int]
    param_bytes: int
    grad_bytes: int
    regather_root: bool


KEPT_STEPS_UP_TO = 16
"""Steps of at most this many micro-batches have their calls kept (the planner's bounds and simulations ask steps of
one and two micro-batches, the time model's runs at most 16), so a kept step holds at most 16 micro-batches' calls
and 512 of them stay small; a longer step's calls are made anew."""


@lru_cache(maxsize=512)  # the planner asks for a plan's bound long before its simulation, hundreds of steps apart
def _sharded_step(shape: _ShardedShape, root_once: bool, steps: int) -> tuple[CommEvent, ...]:
    """`sharded_events` from what it reads, kept: the planner's bound of a plan and its simulation ask for the same
    steps (of one and two micro-batches), made from the same kept first micro-batch."""
    first = _sharded_micro_batch(shape)
    if steps == 1:
        return first
    events = every_micro_batch(first, steps)
    if not root_once:
        return tuple(events)
    root_gathers = ("all_gather root", "h2d root")  # the later micro-batches use micro-batch 0's gathered root
    return tuple(
        call
        for call in events
        if not (call.micro_batch and call.trigger == "before_forward" and call.label in root_gathers)
    )


@lru_cache(maxsize=512)
def _sharded_micro_batch(shape: _ShardedShape) -> tuple[CommEvent, ...]:
    """Micro-batch 0's calls of a sharded step: every micro-batch makes the same. Every block's unit sends the same
    rows, so they are made once per unit size and place ('forward' and 'backward' gathers, 'reduce'), and the calls
    made column by column (`new_events`), the blocks' columns one block's repeated."""
    degree, replicas, group, offload_params = shape.degree, shape.replicas, shape.group, shape.offload_params
    param_bytes, grad_bytes = shape.param_bytes, shape.grad_bytes
    root_numel, block_numel = shape.gathered_numels
    made: dict[tuple[str, int], tuple[tuple[str, CollectiveRow, CommGroup], ...]] = {}

    def calls(kind: str, numel: int) -> tuple[tuple[str, CollectiveRow, CommGroup], ...]:
        """(label, row, group) of the calls of a unit of `numel` gathered elements at one place."""
        found = made.get((kind, numel))
        if found is not None:
            return found
        shard = numel // degree * grad_bytes
        ledger_group = LEDGER_GROUP[group]
        if kind != "reduce":  # a gather, after its host copy under parameter offload
            gather = [("all_gather", call_row(kind, "all_gather", ledger_group, degree, numel * param_bytes), group)]
            copy = call_row(kind, "host_to_device", "host", 1, numel // degree * param_bytes)
            found = made[(kind, numel)] = (("h2d", copy, "host"), *gather) if offload_params else tuple(gather)
            return found
        reduce: list[tuple[str, CollectiveRow, CommGroup]] = [
            ("reduce_scatter", call_row("backward", "reduce_scatter", ledger_group, degree, numel * grad_bytes), group)
        ]
        if replicas > 1:  # hsdp: the reduced shard is averaged across the replica groups
            reduce.append(
                ("all_reduce", call_row("backward", "all_reduce", LEDGER_GROUP["replica"], replicas, shard), "replica")
            )
        if offload_params:
            reduce.append(("d2h gradients", call_row("backward", "device_to_host", "host", 1, shard), "host"))
        found = made[(kind, numel)] = tuple(reduce)
        return found

    rows: list[CollectiveRow] = []
    groups: list[CommGroup] = []
    stages: list[int] = []
    triggers: list[Trigger] = []
    labels: list[str] = []

    def add(places: Sequence[tuple[str, Trigger]], units: Sequence[Unit]) -> None:
        """The calls of each unit of `units` (all of one size) at each of `places` (kind, trigger) in turn, a
        column at a time: the blocks repeat the same calls, so their rows, groups and triggers are one unit's
        repeated."""
        numel = root_numel if units[0].name == "root" else block_numel
        pattern = [(prefix, row, on, trigger) for kind, trigger in places for prefix, row, on in calls(kind, numel)]
        rows.extend([row for _, row, _, _ in pattern] * len(units))
        groups.extend([on for _, _, on, _ in pattern] * len(units))
        triggers.extend([trigger for _, _, _, trigger in pattern] * len(units))
        stages.extend(
            [
                unit.last_stage if trigger == "before_backward" else unit.first_stage
                for unit in units
                for _, _, _, trigger in pattern
            ]
        )
        labels.extend([f"{prefix} {unit.name}" for unit in units for prefix, _, _, _ in pattern])

    root, *blocks = fsdp_units(shape.layout)
    gather: tuple[str, Trigger] = ("backward", "before_backward")
    reduce: tuple[str, Trigger] = ("reduce", "after_backward")
    add([("forward", "before_forward")], [root])
    if blocks:
        add([("forward", "before_forward")], blocks)
        add([gather, reduce] if shape.reshard else [reduce], blocks[::-1])
    add([gather, reduce] if shape.reshard and shape.regather_root else [reduce], [root])
    return tuple(new_events(rows, groups, repeat(0), stages, triggers, labels))
