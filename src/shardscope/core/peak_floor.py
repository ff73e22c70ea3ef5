"""A lower bound under a rank's peak (`core.memory.estimate_memory`), at a fraction of its cost, for a rank without a
pipeline: the planner asks it before it estimates a point, and a point whose floor already breaks the budget cannot
fit.

Every engine's moments are built on `core.engines.base.shared_moments`, which hold two that bound the peak from below:
- the end of forward holds the weights, the optimizer state, the persistent buffers and every saved activation
  (besides gradients kept from earlier micro-batches, the forward's buffers and temporaries);
- the optimizer step holds the weights, every gradient, the optimizer state and the persistent buffers (besides the
  optimizer's temporaries).
The framework context comes on top of each. So the peak is at least context + weights + optimizer state + persistent
buffers + the larger of the saved activations and the gradients. tests/core/test_peak_floor.py holds the floor under
the peak of every engine, family, offload, checkpointing and model-parallel cut.

The floor comes in two parts, so a search over many points can keep each: `held_floor` reads the rank's states (no
micro-batch, micro-batch count or checkpointing changes them), `saved_activations_bytes` one micro-batch's
activations (no data-parallel family, shard group or offload changes them beyond what `HeldFloor` carries).
`batch_floor_bytes` is the floor of a batch alone, whatever the family: the context and the saved activations."""

from __future__ import annotations

from dataclasses import dataclass

from shardscope.core.engines import rules_for
from shardscope.core.engines.base import activations_for
from shardscope.specs import Scenario


@dataclass(frozen=True, slots=True)
class HeldFloor:
    """What a rank holds through its whole step, from its states alone."""

    held_bytes: int
    """The weights, the optimizer state, the persistent buffers and the framework context: live at every moment."""
    gradients_bytes: int
    """Every gradient: live at the optimizer step."""
    autocast: bool
    """The states' autocast, which the saved activations read (`core.engines.base.activations_for`)."""
    megatron: bool
    """The engine runs tensor parallelism as Megatron-LM does, which the saved activations read."""

    @property
    def states_bytes(self) -> int:
        """The floor whatever the micro-batch: the optimizer step's part of it."""
        return self.held_bytes + self.gradients_bytes

    def peak_floor_bytes(self, saved_activations: int) -> int:
        """The floor under the peak of a micro-batch that saves `saved_activations` bytes."""
        return self.held_bytes + max(saved_activations, self.gradients_bytes)


def held_floor(scenario: Scenario, rank: int | None = None) -> HeldFloor:
    """The part of the floor of `rank` its states give; when None, of the busiest rank (as `estimate_memory`), from
    its engine's `floor_states` (no larger than its own)."""
    rules = rules_for(scenario)
    states = rules.floor_states(scenario) if rank is None else rules.rank_states(scenario, rank)
    held = states.parameters_bytes + states.optimizer_state_bytes + states.persistent_buffers_bytes
    return HeldFloor(
        held_bytes=held + scenario.overheads.context_bytes,
        gradients_bytes=states.gradients_bytes,
        autocast=states.autocast,
        megatron=rules.megatron_tensor_parallel,
    )


def saved_activations_bytes(scenario: Scenario, floor: HeldFloor) -> int:
    """One micro-batch's saved activations on the rank, as its engine counts them."""
    return activations_for(scenario, floor.autocast, floor.megatron).saved_bytes


def batch_floor_bytes(scenario: Scenario) -> int:
    """A floor under the peak of every point that shares the scenario's batch, cut and engine, whatever its
    data-parallel family, shard group and offload: the framework context and the fewer saved activations of the two
    ways to save them (under autocast or not, the one thing families differ in)."""
    megatron = rules_for(scenario).megatron_tensor_parallel
    saved = min(activations_for(scenario, autocast, megatron).saved_bytes for autocast in (False, True))
    return scenario.overheads.context_bytes + saved


def peak_floor_bytes(scenario: Scenario, rank: int | None = None) -> int:
    """The floor under `estimate_memory(scenario, rank).per_rank.peak_bytes` (no pipeline)."""
    floor = held_floor(scenario, rank)
    return floor.peak_floor_bytes(saved_activations_bytes(scenario, floor))
