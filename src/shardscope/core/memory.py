"""Per-rank memory by category and the peak, for one scenario: model states plus activations plus overhead.

The peak is the largest of the moments of the step the scenario's engine names (`core.engines`), not the plain sum
of the categories. Overhead (the framework context) is added on top as a stated assumption. What the caching allocator
reserves for the step (MemoryEstimate.reserved_peak_bytes, which `fits` is judged on) is derived on demand by
core.allocation_stream: it costs a replay of the step's allocations, which a planner asks only near the limit.
"""

from __future__ import annotations

from shardscope.core.engines import rules_for
from shardscope.core.engines.base import peak_of
from shardscope.core.result import MemoryBreakdown, MemoryEstimate
from shardscope.specs import Scenario
from shardscope.units import MIB


def busiest_rank(scenario: Scenario) -> int:
    """The rank that holds the most (rank 0 unless the engine assigns ranks unevenly)."""
    return rules_for(scenario).busiest_rank(scenario)


def estimate_memory(scenario: Scenario, rank: int | None = None) -> MemoryEstimate:
    """Memory of one rank (the busiest when rank is None) under the scenario."""
    world = scenario.cluster.world_size
    if scenario.strategy.pp > 1:
        from shardscope.core.pipeline_memory import estimate_pipeline_memory  # it builds on this module's imports

        return estimate_pipeline_memory(scenario, rank)
    rules = rules_for(scenario)
    if rank is None:
        rank = rules.busiest_rank(scenario)
    elif not 0 <= rank < world:
        raise ValueError(f"rank={rank} must be between 0 and world_size-1={world - 1}")
    memory = rules.rank_memory(scenario, rank)
    states, acts, model = memory.states, memory.activations, scenario.model
    peak_moment, live = peak_of(memory.moments)
    tensor_peak = live.total
    overhead = scenario.overheads.context_bytes
    per_rank = MemoryBreakdown(
        parameters_bytes=states.parameters_bytes,
        gradients_bytes=states.gradients_bytes,
        optimizer_state_bytes=states.optimizer_state_bytes,
        activations_bytes=acts.saved_bytes,
        buffers_bytes=states.persistent_buffers_bytes
        + max(states.forward_buffers_bytes, states.backward_buffers_bytes, states.boundary_buffers_bytes),
        temporary_bytes=max(
            states.forward_temporary_bytes + acts.loss_forward_spike_bytes,
            acts.loss_backward_spike_bytes + acts.recompute_bytes + states.backward_grads_bytes,
            states.boundary_grads_bytes,
            states.optimizer_temporary_bytes,
        ),
        overhead_bytes=overhead,
        peak_bytes=tensor_peak + overhead,
    )
    return MemoryEstimate(
        scenario=scenario,
        per_rank=per_rank,
        host_bytes_per_node=states.host_bytes * scenario.cluster.ranks_per_node,
        peak_moment=peak_moment,
        activations_estimated=model.has_shape,
        rank=rank,
    )


def describe_assumptions(estimate: MemoryEstimate) -> tuple[str, ...]:
    """Plain-English statements of what an estimate assumed."""
    scenario, rank = estimate.scenario, estimate.rank
    overheads, strategy, training = scenario.overheads, scenario.strategy, scenario.training
    notes = [
        f"engine {strategy.engine}: {rules_for(scenario).summary}",
        f"framework context {overheads.context_bytes / MIB:.0f} MiB per GPU (override with --context-memory)",
        _reserved_note(overheads.allocator_headroom),
        f"rank {rank} shown (the busiest)",
    ]
    if not scenario.model.has_shape:
        notes.append("only a parameter count is known: activations and gathered-unit buffers are not estimated")
    else:
        notes.append(
            f"activations for micro-batch {training.micro_batch_size} x {training.sequence_length} tokens, "
            f"{training.attention} attention, checkpointing {training.checkpointing}, no dropout"
        )
    if training.grad_accum_steps > 1:
        notes.append(f"{training.grad_accum_steps} micro-batches accumulate gradients, which stay live in forward")
    if strategy.pp > 1:
        notes.append(
            f"pipeline {strategy.pp_schedule} over {strategy.pipeline_stages} stages with {training.grad_accum_steps} "
            f"micro-batches: the pipeline rank with the highest peak is shown (the others in per_stage)"
        )
    return tuple(notes)


def _reserved_note(allocator_headroom: float | None) -> str:
    if allocator_headroom is None:
        return (
            "fits: the reserved peak (the step's allocations replayed through a model of PyTorch's caching allocator) "
            "plus the context within GPU memory"
        )
    return (
        f"fits: the reserved peak taken as the allocated peak plus {allocator_headroom:.0%} (--allocator-headroom, "
        "instead of the caching allocator model) plus the context within GPU memory"
    )
