"""A sharded step's calls, made from a kept first micro-batch whose blocks share their rows, equal the calls made one
by one with `CommEvent(...)` (written out below as the reference), for every degree, replica count, offload,
resharding, root handling and micro-batch count; and `new_event` makes the same call as the constructor."""

from __future__ import annotations

import itertools

import pytest

from shardscope.choices import CommGroup, Trigger
from shardscope.core.comm_events import (
    LEDGER_GROUP,
    CommEvent,
    Place,
    fsdp_units,
    new_event,
    new_events,
)
from shardscope.core.params import rank_layout
from shardscope.core.result import CollectiveRow
from shardscope.core.sharded_calls import sharded_events
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec


def _call(phase: str, op: str, size: int, payload: int, group: CommGroup, at: Place, label: str) -> CommEvent:
    micro_batch, stage, trigger = at
    row = CollectiveRow(
        phase=phase,
        op=op,
        group=LEDGER_GROUP[group],
        group_size=size,
        payload_bytes=payload,
        count=1,
    )
    return CommEvent(row=row, group=group, micro_batch=micro_batch, stage=stage, trigger=trigger, label=label)


def _reference(
    scenario: Scenario, gathered: tuple[int, int], param: int, grad: int, regather_root: bool, root_once: bool
) -> list[CommEvent]:
    """Every call made one by one, in program order."""
    strategy = scenario.strategy
    group: CommGroup = "shard" if strategy.preset.groups_replicate else "world"
    offload = strategy.offload == "optimizer+params"
    reshard = strategy.reshard_after_forward and strategy.stage == 3
    degree, replicas = scenario.shard_degree, scenario.replica_degree
    units = fsdp_units(rank_layout(scenario))
    events: list[CommEvent] = []
    for micro_batch in range(scenario.training.grad_accum_steps):

        def gather(phase: str, numel: int, at: Place, name: str) -> None:
            if offload:
                events.append(_call(phase, "host_to_device", 1, numel // degree * param, "host", at, f"h2d {name}"))
            events.append(_call(phase, "all_gather", degree, numel * param, group, at, f"all_gather {name}"))

        for unit in units:
            numel = gathered[0] if unit.name == "root" else gathered[1]
            if not (root_once and micro_batch and unit.name == "root"):
                gather("forward", numel, (micro_batch, unit.first_stage, "before_forward"), unit.name)
        for unit in reversed(units):
            numel = gathered[0] if unit.name == "root" else gathered[1]
            if reshard and (unit.name != "root" or regather_root):
                gather("backward", numel, (micro_batch, unit.last_stage, "before_backward"), unit.name)
            at: Place = (micro_batch, unit.first_stage, "after_backward")
            shard = numel // degree * grad
            events.append(
                _call("backward", "reduce_scatter", degree, numel * grad, group, at, f"reduce_scatter {unit.name}")
            )
            if replicas > 1:
                events.append(
                    _call("backward", "all_reduce", replicas, shard, "replica", at, f"all_reduce {unit.name}")
                )
            if offload:
                events.append(_call("backward", "device_to_host", 1, shard, "host", at, f"d2h gradients {unit.name}"))
    return events


STRATEGIES = [
    Strategy(name="zero3"),
    Strategy(name="fsdp", reshard_after_forward=False),
    Strategy(name="fsdp", offload="optimizer+params"),
    Strategy(name="hsdp", shard_group=4),
    Strategy(name="hsdp", shard_group=8, offload="optimizer+params"),
    Strategy(name="zero2"),
]


@pytest.mark.parametrize(
    ("strategy", "micro_batches", "regather_root", "root_once"),
    list(itertools.product(STRATEGIES, (1, 2, 3), (True, False), (False, True))),
)
def test_sharded_calls_equal_the_calls_made_one_by_one(
    strategy: Strategy, micro_batches: int, regather_root: bool, root_once: bool
) -> None:
    scenario = Scenario(
        model=model_preset("llama-3-8b"),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=32, gpus_per_node=8),
        training=TrainingSpec(sequence_length=2048, grad_accum_steps=micro_batches, precision="bf16-mixed"),
        strategy=strategy,
    )
    gathered = (1_000_003 * 8, 7_000_001 * 8)
    made = sharded_events(scenario, gathered, 2, 4, regather_root=regather_root, root_once=root_once)
    reference = _reference(scenario, gathered, 2, 4, regather_root, root_once)
    assert len(reference) > 32 * micro_batches
    assert made == reference


def test_new_event_equals_the_constructor() -> None:
    row = CollectiveRow(phase="forward", op="all_gather", group="dp", group_size=8, payload_bytes=64, count=1)
    trigger: Trigger = "before_forward"
    made = new_event(row, "world", 2, 3, trigger, "all_gather block 2")
    built = CommEvent(row=row, group="world", micro_batch=2, stage=3, trigger=trigger, label="all_gather block 2")
    assert made == built and hash(made) == hash(built) and repr(made) == repr(built)
    with pytest.raises(AttributeError):
        made.stage = 4  # type: ignore[misc]


def test_new_events_equal_the_constructor_column_by_column() -> None:
    rows = [
        CollectiveRow(phase="forward", op="all_gather", group="dp", group_size=8, payload_bytes=64, count=1),
        CollectiveRow(phase="backward", op="device_to_host", group="host", group_size=1, payload_bytes=8, count=1),
        CollectiveRow(phase="backward", op="all_reduce", group="dp", group_size=2, payload_bytes=16, count=1),
    ]
    groups: list[CommGroup] = ["world", "host", "replica"]
    triggers: list[Trigger] = ["before_forward", "after_backward", "after_backward"]
    stages, labels = [1, 0, 5], ["all_gather block 0", "d2h gradients root", "all_reduce block 4"]
    made = new_events(rows, groups, itertools.repeat(3), stages, triggers, labels)
    built = [
        CommEvent(row=row, group=group, micro_batch=3, stage=stage, trigger=trigger, label=label)
        for row, group, stage, trigger, label in zip(rows, groups, stages, triggers, labels, strict=True)
    ]
    assert made == built and list(map(hash, made)) == list(map(hash, built))
    assert list(map(repr, made)) == list(map(repr, built))
    assert new_events([], [], itertools.repeat(0), [], [], []) == []
