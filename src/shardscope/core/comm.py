"""The collective ledger: every collective call and host transfer one rank makes in one training step, and before
the first.

The calls come from the scenario's engine (`core.engines`), built from `core.comm_events`; the ledger
(`collective_ledger`) is these events merged into rows of the shared schema, so a predicted ledger and one measured by
`shardscope run` line up row for row. Communication volumes follow "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models" (Rajbhandari et al.): DDP and ZeRO-1/2 move 2 x parameters per step, ZeRO-3 3 x
(Section 7).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import TypeVar

from shardscope.core.comm_events import DDP_FIRST_BUCKET_BYTES, CommEvent, optimizer_offload_events
from shardscope.core.engines import rules_for
from shardscope.core.model_parallel_comm import model_parallel_calls
from shardscope.core.result import CollectiveRow, LedgerKey, ledger_row, merge_ledger
from shardscope.specs import Scenario, SpecError

__all__ = [
    "DDP_FIRST_BUCKET_BYTES",
    "CommEvent",
    "collective_ledger",
    "comm_event_parts",
    "comm_events",
    "gradient_buckets",
    "repeated_totals",
    "run_ledger",
    "setup_ledger",
]


def gradient_buckets(scenario: Scenario) -> tuple[tuple[int, int], ...]:
    """Gradient buckets in the order they fill in backward: (bytes, stage whose backward completes the bucket)."""
    return rules_for(scenario).gradient_buckets(scenario)


def comm_events(scenario: Scenario) -> tuple[CommEvent, ...]:
    """Every collective and host copy of one step: the engine's data-parallel calls, tensor and context
    parallelism's (the same under every engine: DTensor's plan and ring attention), then optimizer offload's copies."""
    data_parallel, model_parallel, offload = comm_event_parts(scenario)
    return data_parallel + model_parallel + offload


def comm_event_parts(
    scenario: Scenario,
) -> tuple[tuple[CommEvent, ...], tuple[CommEvent, ...], tuple[CommEvent, ...]]:
    """`comm_events` in its three runs: the engine's data-parallel calls, the tensor, context and expert parallel
    calls (`model_parallel_calls`, kept per shape), optimizer offload's copies."""
    if not scenario.model.has_shape:
        raise SpecError(
            f"model {scenario.model.name!r} has only a parameter count; the ledger and the time model need its shape "
            f"(give --model or --config)"
        )
    rules = rules_for(scenario)
    model_parallel = model_parallel_calls(scenario, rules.param_comm_bytes(scenario), rules.megatron_tensor_parallel)
    data_parallel = rules.step_events(scenario)
    offload = []
    if scenario.strategy.offload == "optimizer":
        offload = optimizer_offload_events(scenario, rules.grad_comm_bytes(scenario), rules.param_comm_bytes(scenario))
    if scenario.state_ranks == 1:  # data-parallel groups of one rank send nothing; host copies and tp calls remain
        data_parallel = [event for event in data_parallel if event.group in ("host", "tp", "cp", "ep")]
        offload = [event for event in offload if event.group in ("host", "tp", "cp", "ep")]
    return tuple(data_parallel), model_parallel, tuple(offload)


Key = TypeVar("Key", bound=Hashable)


def with_micro_batches(scenario: Scenario, count: int) -> Scenario:
    """The scenario with `count` micro-batches per step."""
    return dataclasses.replace(scenario, training=dataclasses.replace(scenario.training, grad_accum_steps=count))


def repeated_totals(
    scenario: Scenario, tally: Callable[[Scenario], dict[Key, tuple[float, ...]]]
) -> dict[Key, tuple[float, ...]]:
    """`tally` (totals by key of a step's calls) for k micro-batches, from the tallies of one and two: every
    micro-batch after the first issues the same calls, the rest (the last micro-batch's reductions, the step's
    gathers) come once, so each total grows by the same amount per micro-batch. O(1) in k."""
    steps = scenario.training.grad_accum_steps
    if steps <= 2:
        return tally(scenario)
    one, two = tally(with_micro_batches(scenario, 1)), tally(with_micro_batches(scenario, 2))
    return {
        key: tuple(a + (steps - 1) * (b - a) for a, b in zip(one.get(key, (0,) * len(values)), values, strict=True))
        for key, values in two.items()
    }


def _call_counts(scenario: Scenario) -> dict[LedgerKey, tuple[float, ...]]:
    return {row.key: (row.count,) for row in merge_ledger([event.row for event in comm_events(scenario)])}


def collective_ledger(scenario: Scenario) -> tuple[CollectiveRow, ...]:
    """The step's ledger in the shared row schema (phase, op, group, group size, payload bytes, count); O(1) in the
    number of micro-batches."""
    rows = [ledger_row(key, int(count)) for key, (count,) in repeated_totals(scenario, _call_counts).items()]
    return merge_ledger(rows)


def setup_ledger(scenario: Scenario) -> tuple[CollectiveRow, ...]:
    """Collectives made once, before the first step, so that every rank starts from rank 0's weights."""
    if scenario.cluster.world_size == 1 or not scenario.model.has_shape:
        return ()
    return merge_ledger([row for row in rules_for(scenario).setup_rows(scenario) if row.group_size > 1])


def run_ledger(scenario: Scenario) -> tuple[CollectiveRow, ...]:
    """What `shardscope run` records for rank 0: the setup collectives, then one step's."""
    return merge_ledger([*setup_ledger(scenario), *collective_ledger(scenario)])
