"""What an engine's pipeline rules are handed about one pipeline rank: its stages, its schedule's shape and order,
and what its step holds besides the moments' own terms (core.pipeline_memory and core.pipeline_time build them).

A rank's order of actions depends only on its schedule's shape (`RankSchedule`), so what is computed from the order
alone (the most micro-batches in flight, the states an action starts in) is kept per shape: a planner sweep asks
thousands of scenarios that share a few shapes, and a key of five numbers costs the same for 16 micro-batches as for
128.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from shardscope.choices import PipelineSchedule
from shardscope.core.activations import ActivationEstimate
from shardscope.core.kept import kept
from shardscope.core.model_states import ModelStates
from shardscope.core.pipeline import PipelineStage
from shardscope.core.pipeline_schedule import Action, rank_actions
from shardscope.core.result import CollectiveRow


class RankSchedule(NamedTuple):
    """The shape one pipeline rank's order of forwards and backwards depends on (core.pipeline_schedule)."""

    schedule: PipelineSchedule
    pp: int
    virtual: int
    """Virtual stages per rank (1 outside interleaved 1F1B)."""
    micro_batches: int
    rank: int

    @property
    def actions(self) -> tuple[Action, ...]:
        """The rank's forwards and backwards in its schedule's order (kept per shape)."""
        return kept(_orders, self, lambda: tuple(rank_actions(*self)), CACHED_ORDERS)


CACHED_ORDERS = 1024
_orders: dict[RankSchedule, tuple[Action, ...]] = {}


class PipelineLoad(NamedTuple):
    """What one pipeline rank's step holds besides the moments' own terms (core.pipeline_memory builds it)."""

    stages: tuple[PipelineStage, ...]
    """The rank's stages."""
    states: ModelStates
    """The engine's states of the model the rank holds (its rank proxy)."""
    activations: ActivationEstimate
    """One micro-batch's activations of the whole model on one rank."""
    schedule: RankSchedule
    """The shape of the rank's order of forwards and backwards (`schedule.actions`)."""
    weights: tuple[tuple[int, int], ...]
    """(stage index, activations one micro-batch keeps on that stage while in flight) for each of the rank's stages,
    in order."""
    in_flight_bytes: int
    """The most activations the schedule keeps in flight at once."""
    in_flight: int
    """Micro-batches in flight at that moment, every stage of the rank together."""
    step_activations: int
    """Activations held for the whole step (the schedule's token ids and targets)."""
    receive_bytes: int
    """The stages' point-to-point receive buffers, kept for the step."""
    working_bytes: int
    """The larger of the loss's forward spike (head stage) and one block's backward working set."""
    shard_degree: int
    """Ranks the data-parallel strategy shards each stage over."""


class PipelineCalls(NamedTuple):
    """A pipeline rank's stages and the order its schedule runs them in."""

    stages: tuple[PipelineStage, ...]
    actions: tuple[Action, ...]


StageRows = Callable[[tuple[PipelineStage, ...]], list[CollectiveRow]]
"""The data-parallel collectives of a step of a model of these stages without a pipeline, every micro-batch's."""
