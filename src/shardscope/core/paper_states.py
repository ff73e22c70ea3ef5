"""The 'paper' engine: "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (Rajbhandari et al.),
Section 3 and Figure 1, as shardscope's teaching strategies allocate it.

Mixed-precision Adam holds 2 + 2 + K bytes per parameter with K = 12 (fp32 master, momentum, variance); stage 1
shards the K bytes over N ranks, stage 2 also the gradients, stage 3 also the parameters. The teaching strategies
keep one flat buffer per unit (the root: embeddings, final norm and head; then each block), padded to a multiple of
the shard degree D, so a rank holds ceil(P_u / D) elements of unit u, and Adam keeps one 4-byte step per buffer.
Without a shape (--params) the model is one flat buffer, which is the paper's own accounting.
"""

from __future__ import annotations

from shardscope.core.model_states import ModelStates, dtype_bytes, optimizer_moments, step_tensor_bytes
from shardscope.core.params import ParamLayout, model_facts
from shardscope.core.sharding import flat_units
from shardscope.core.torch_states import head_numel
from shardscope.specs import Scenario

ADAM_TEMPORARIES = 3


def paper_states(scenario: Scenario) -> ModelStates:
    """Model states, gathered units and in-flight gradients of one rank (every rank holds the same)."""
    training, stage = scenario.training, scenario.strategy.stage
    total, layout = model_facts(scenario.model)
    degree = scenario.shard_degree if stage else 1
    units = flat_units(layout if layout is not None else total, degree)
    weight = dtype_bytes(training.precision)
    master = 4 if training.is_mixed else 0
    moment = 4 if training.is_mixed else weight
    moments = optimizer_moments(training.optimizer)
    optimizer_numel = units.shard_numel if stage >= 1 else units.padded_numel
    in_flight = _in_flight(layout, units.root_padded_numel, units.block_padded_numel, weight, stage)
    # Stage 1 reduce-scatters each unit's flat gradients after backward into a new shard-sized buffer; gloo's
    # reduce-scatter (ProcessGroupGloo::reduce_scatter_tensor_coalesced) also clones its whole input meanwhile.
    largest_unit = max(units.root_padded_numel, units.block_padded_numel)
    clone = largest_unit if scenario.cluster.backend == "gloo" else 0
    after_backward = (units.largest_shard_numel + clone) * weight if stage == 1 else 0
    return ModelStates(
        parameters_bytes=(units.shard_numel if stage >= 3 else units.padded_numel) * weight,
        gradients_bytes=(units.shard_numel if stage >= 2 else units.padded_numel) * weight,
        optimizer_state_bytes=optimizer_numel * (master + moments * moment)
        + units.count * step_tensor_bytes(training.optimizer),
        # torch's single-tensor Adam works one flat buffer at a time with up to three temporaries of its size (the
        # square root, the denominator, the update; measured); under mixed precision every buffer's gradient is
        # first copied to fp32.
        optimizer_temporary_bytes=(ADAM_TEMPORARIES * units.largest_shard_numel * moment + optimizer_numel * master)
        if moments
        else 0,
        gradients_persist=True,
        after_backward_buffers_bytes=after_backward,
        forward_buffers_bytes=in_flight[0],
        backward_buffers_bytes=in_flight[1],
        boundary_buffers_bytes=in_flight[2],
        backward_grads_bytes=in_flight[3],
        boundary_grads_bytes=in_flight[4],
    )


def _in_flight(
    layout: ParamLayout | None, root_padded: int, block_padded: int, weight: int, stage: int
) -> tuple[int, int, int, int, int]:
    """(gathered when forward ends, gathered in the top block's backward, gathered between blocks, gradients in
    flight in the top block's backward, and between blocks).

    Stages 0 and 1 keep whole flat gradient buffers: nothing else is in flight. Stages 2 and 3: a unit's
    per-parameter gradients live until its last one lands and is reduce-scattered; the root's land last, so they are
    in flight through all of backward, but while the blocks run only the head's (final norm, output head) exist: an
    untied embedding's gradient is made after the bottom block (measured: `shardscope validate` case
    tiny-llama zero3 teaching w4 fp32 ckpt peaks at 1,387,284 B in the top block's backward). Stage 3 also keeps the
    root gathered from forward to the end of backward, a block while it runs, and the next block gathered at the
    boundary."""
    if layout is None or stage < 2:
        return 0, 0, 0, 0, 0
    head, block = head_numel(layout) * weight, layout.block_numel * weight
    if stage < 3:
        return 0, 0, 0, head, head + block + block_padded * weight
    gathered_root, gathered_block = root_padded * weight, block_padded * weight
    return (gathered_root, gathered_root + gathered_block, gathered_root + 2 * gathered_block, head, head + block)
