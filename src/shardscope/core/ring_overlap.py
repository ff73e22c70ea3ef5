"""How much of ring attention's K/V exchange hides behind the attention it feeds (context parallelism's overlap).

Ring attention computes on the K/V chunk in hand while the next one travels, so every step but the last overlaps one
chunk's attention ("Ring Attention with Blockwise Transformers for Near-Infinite Context", Liu et al., Section 3).
"""

from __future__ import annotations

import dataclasses

from shardscope.core.comm_events import CommEvent
from shardscope.core.compute import ComputeModel
from shardscope.core.kernels import stage_seconds
from shardscope.core.network import CollectiveCost
from shardscope.specs import Scenario


def _attention_forward_s(scenario: Scenario, compute: ComputeModel) -> float:
    """One block's attention core in forward on one rank, read off the compute model as the re-forward of selective
    checkpointing, which recomputes exactly the attention core (core.compute, core.kernels)."""
    training = dataclasses.replace(scenario.training, checkpointing="selective")
    return stage_seconds(dataclasses.replace(scenario, training=training), compute)[1][1]


def hidden_exchange(
    scenario: Scenario, compute: ComputeModel, events: tuple[CommEvent, ...], costs: tuple[CollectiveCost, ...]
) -> dict[int, float]:
    """Seconds of each stage's ring-attention exchange hidden behind its attention, by event index.

    Ring attention computes on the K/V chunk in hand while the next one travels, so every step but the last overlaps
    one chunk's attention ("Ring Attention with Blockwise Transformers for Near-Infinite Context", Section 3): of a
    stage's exchange, min(exchange, (cp - 1) / cp x the stage's attention core) is hidden (backward's attention taken
    as twice forward's, as its FLOPs are); the rest delays the stage's compute like a tensor-parallel call."""
    cp = scenario.strategy.cp
    if cp == 1:
        return {}
    forward = _attention_forward_s(scenario, compute)
    window = {"during_forward": forward, "during_recompute": forward, "during_backward": 2 * forward}
    stages: dict[tuple[int, int, str], list[int]] = {}
    for index, event in enumerate(events):
        if event.group == "cp":
            stages.setdefault((event.micro_batch, event.stage, event.trigger), []).append(index)
    hidden: dict[int, float] = {}
    for (_, _, trigger), members in stages.items():
        exchange = sum(costs[index].time_s for index in members)
        allowance = min(exchange, window[trigger] * (cp - 1) / cp)
        hidden.update(dict.fromkeys(members, allowance))
    return hidden
