"""The collective ledger: every collective call and host transfer one rank makes in one training step, and before
the first.

The calls come from the scenario's engine (`core.engines`), built from `core.comm_events`; the ledger
(`collective_ledger`) is these events merged into rows of the shared schema, so a predicted ledger and one measured by
`shardscope run` line up row for row. Communication volumes follow "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models" (Rajbhandari et al.): DDP and ZeRO-1/2 move 2 x parameters per step, ZeRO-3 3 x
(Section 7).
"""

from __future__ import annotations

from shardscope.core.comm_events import DDP_FIRST_BUCKET_BYTES, CommEvent, optimizer_offload_events
from shardscope.core.engines import rules_for
from shardscope.core.result import CollectiveRow, merge_ledger
from shardscope.specs import Scenario, SpecError

__all__ = [
    "DDP_FIRST_BUCKET_BYTES",
    "CommEvent",
    "collective_ledger",
    "comm_events",
    "gradient_buckets",
    "run_ledger",
    "setup_ledger",
]


def gradient_buckets(scenario: Scenario) -> tuple[tuple[int, int], ...]:
    """Gradient buckets in the order they fill in backward: (bytes, stage whose backward completes the bucket)."""
    return rules_for(scenario).gradient_buckets(scenario)


def comm_events(scenario: Scenario) -> tuple[CommEvent, ...]:
    """Every collective and host copy of one step, in the order rank 0 issues them."""
    if not scenario.model.has_shape:
        raise SpecError(
            f"model {scenario.model.name!r} has only a parameter count; the ledger and the time model need its shape "
            f"(give --model or --config)"
        )
    rules = rules_for(scenario)
    events = rules.step_events(scenario)
    if scenario.strategy.offload == "optimizer":
        events += optimizer_offload_events(scenario, rules.grad_comm_bytes(scenario), rules.param_comm_bytes(scenario))
    if scenario.cluster.world_size == 1:  # a single rank sends nothing; host copies remain
        events = [event for event in events if event.group == "host"]
    return tuple(events)


def collective_ledger(scenario: Scenario) -> tuple[CollectiveRow, ...]:
    """The step's ledger in the shared row schema (phase, op, group size, payload bytes, count)."""
    return merge_ledger([event.row for event in comm_events(scenario)])


def setup_ledger(scenario: Scenario) -> tuple[CollectiveRow, ...]:
    """Collectives made once, before the first step, so that every rank starts from rank 0's weights."""
    if scenario.cluster.world_size == 1 or not scenario.model.has_shape:
        return ()
    return merge_ledger(rules_for(scenario).setup_rows(scenario))


def run_ledger(scenario: Scenario) -> tuple[CollectiveRow, ...]:
    """What `shardscope run` records for rank 0: the setup collectives, then one step's."""
    return merge_ledger([*setup_ledger(scenario), *collective_ledger(scenario)])
