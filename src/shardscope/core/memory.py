"""Per-rank memory by category and the peak, for one scenario: model states plus activations plus overhead.

The peak is the largest of the moments that matter, not the plain sum of the categories:
- end of forward: weights, optimizer state, every saved activation, the gathered units and the loss spike;
- start of backward: the same with the gradients of the log-softmax instead of the forward spike;
- top block's backward: the head's activations freed, its gradients and the top block's in flight;
- between the top two blocks: the top block's activations freed, two blocks gathered, their gradients in flight;
- bottom block's backward (engines that say so): the blocks above freed and their gradient shards landed, the block's
  own backward (recomputed tensors, MLP gradients) and the block above's communication buffers still in flight;
- optimizer step: weights, gradients, optimizer state and the step's workspace.
FSDP2 adds the output head's forward (zero2: the last all-gather's output still held), the top block's MLP backward
and its reduce-scatter; under gloo also the bottom block's and the root's reduce-scatters, where gloo holds a clone
of the reduce-scatter input (the backend is the cluster's: what a collective allocates depends on the library).
Under checkpointing the top block's backward also holds its recomputed activations. Overhead (framework context,
allocator headroom) is added on top as a stated assumption.
"""

from __future__ import annotations

from shardscope.core.activations import ActivationEstimate, estimate_activations
from shardscope.core.deepspeed_states import deepspeed_states
from shardscope.core.model_states import ModelStates, offload
from shardscope.core.paper_states import paper_states
from shardscope.core.params import param_layout
from shardscope.core.result import MemoryBreakdown, MemoryEstimate
from shardscope.core.sharding import whole_tensor_shards
from shardscope.core.torch_states import torch_states
from shardscope.specs import Scenario
from shardscope.units import MIB

_NO_ACTIVATIONS = ActivationEstimate(
    saved_bytes=0,
    block_bytes=0,
    stored_block_bytes=0,
    recompute_bytes=0,
    logits_bytes=0,
    loss_forward_spike_bytes=0,
    loss_backward_spike_bytes=0,
    head_bytes=0,
    head_gradient_bytes=0,
    hidden_bytes=0,
)
LOSS_GRAD_BYTES = 4  # the scalar gradient of the loss


def model_states(scenario: Scenario, rank: int) -> ModelStates:
    """Model states of one rank under the scenario's strategy and engine."""
    engine = scenario.strategy.engine
    if engine == "paper":
        return offload(scenario, paper_states(scenario))
    if engine == "deepspeed":
        return deepspeed_states(scenario)
    return offload(scenario, torch_states(scenario, rank))


def busiest_rank(scenario: Scenario) -> int:
    """The rank that holds the most: rank 0, except under ZeroRedundancyOptimizer's uneven assignment."""
    strategy = scenario.strategy
    if strategy.engine == "pytorch" and strategy.name == "zero1" and scenario.model.has_shape:
        sizes = whole_tensor_shards(param_layout(scenario.model), scenario.cluster.world_size).numel_per_rank
        return sizes.index(max(sizes))
    return 0


def _moments(states: ModelStates, acts: ActivationEstimate, accumulating: bool, blocks: int) -> dict[str, int]:
    """Bytes live at each moment of a step (without overhead)."""
    base = states.parameters_bytes + states.optimizer_state_bytes + states.persistent_buffers_bytes
    gradients_in_base = states.gradients_persist or accumulating
    base += states.gradients_bytes if gradients_in_base else 0
    after_head = acts.saved_bytes - acts.head_bytes
    recomputed_block_grads = states.recompute_grads_bytes if acts.recompute_bytes else 0
    moments = _coarse_moments(states, acts, base, after_head, recomputed_block_grads)
    if states.after_backward_buffers_bytes:
        moments["reduce-scatter after backward"] = (
            states.parameters_bytes
            + states.optimizer_state_bytes
            + states.persistent_buffers_bytes
            + states.gradients_bytes
            + states.after_backward_buffers_bytes
        )
    if states.forward_staging_bytes:
        # The output head's forward: the loss has not yet made its log-softmax, and the last all-gather's output is
        # still held (measured: `shardscope trace --model tiny-gpt2 --gpus 2 --gpus-per-node 2 --precision fp32
        # --strategy zero2 --engine pytorch --micro-batch 2 --seq-len 32` peaks at 'forward: lm_head').
        moments["output head's forward"] = (
            base
            + acts.saved_bytes
            - acts.log_softmax_bytes
            + acts.logits_bytes
            + states.forward_buffers_bytes
            + states.forward_staging_bytes
        )
    if states.first_block_buffers_bytes:
        # The first block's forward: what the embeddings and the block saved (or, checkpointed, its stored input)
        # and the block's output being made (measured: `shardscope validate` case tiny-moe zero2 pytorch w4 fp32
        # ckpt peaks in forward at 2,709,348 B with 887,808 B of flat all-gather outputs).
        first_block_saved = acts.saved_bytes - acts.head_bytes - (blocks - 1) * acts.stored_block_bytes
        moments["first block's forward"] = (
            base + first_block_saved + acts.hidden_bytes + states.first_block_buffers_bytes
        )
    if states.walks_block_backward:
        # The top block's backward seen at its two high points: in its MLP's backward (its saved tensors, the MLP's
        # gradients), and at its reduce-scatter (its saved tensors freed; the collective's buffers, per backend).
        top = base + after_head + acts.hidden_bytes + LOSS_GRAD_BYTES + states.backward_buffers_bytes
        moments["top block's backward"] = top + states.backward_grads_bytes + acts.block_backward_bytes
        moments["top block's reduce-scatter"] = (
            top - acts.stored_block_bytes + states.backward_grads_bytes + states.top_reduce_scatter_bytes
        )
    if states.bottom_block_moment:
        # The blocks above have freed what they stored and landed their gradients; the bottom block holds its own
        # stored tensors, what its backward makes, and the gradient flowing in from above.
        moments["bottom block's backward"] = (
            base
            + after_head
            - max(blocks - 1, 0) * acts.stored_block_bytes
            + acts.block_backward_bytes
            + acts.hidden_bytes
            + LOSS_GRAD_BYTES
            + states.bottom_buffers_bytes
            + states.bottom_grads_bytes
            + (0 if gradients_in_base else states.bottom_landed_grads_bytes)
        )
    if states.gloo_clone_moments:
        # gloo's reduce-scatter holds a clone of its input (torch_states): the bottom block's, with its backward's
        # tensors freed, and the root's, with every block's stored tensors freed and their gradient shards landed.
        after_blocks = base + after_head - blocks * acts.stored_block_bytes + LOSS_GRAD_BYTES
        moments["bottom block's reduce-scatter"] = (
            after_blocks
            + acts.hidden_bytes
            + states.bottom_grads_bytes
            + (0 if gradients_in_base else states.bottom_landed_grads_bytes)
            + states.bottom_reduce_scatter_bytes
        )
        moments["root's reduce-scatter"] = (
            after_blocks
            + (0 if gradients_in_base else states.root_landed_grads_bytes)
            + states.root_reduce_scatter_bytes
        )
    return moments


def _coarse_moments(
    states: ModelStates, acts: ActivationEstimate, base: int, after_head: int, recomputed_block_grads: int
) -> dict[str, int]:
    return {
        "end of forward": base
        + acts.saved_bytes
        + states.forward_buffers_bytes
        + states.forward_temporary_bytes
        + acts.loss_forward_spike_bytes,
        "start of backward": base
        + acts.saved_bytes
        + states.forward_buffers_bytes
        + acts.loss_backward_spike_bytes
        + LOSS_GRAD_BYTES,
        "top block's backward": base
        + after_head
        + acts.head_gradient_bytes
        + acts.hidden_bytes
        + LOSS_GRAD_BYTES
        + states.backward_buffers_bytes
        + states.backward_grads_bytes
        + acts.recompute_bytes
        + recomputed_block_grads,
        "between blocks in backward": base
        + after_head
        - acts.stored_block_bytes
        + states.boundary_buffers_bytes
        + states.boundary_grads_bytes,
        "optimizer step": states.parameters_bytes
        + states.optimizer_state_bytes
        + states.persistent_buffers_bytes
        + states.gradients_bytes
        + states.optimizer_temporary_bytes,
    }


def estimate_memory(scenario: Scenario, rank: int | None = None) -> MemoryEstimate:
    """Memory of one rank (the busiest when rank is None) under the scenario."""
    world = scenario.cluster.world_size
    if rank is None:
        rank = busiest_rank(scenario)
    elif not 0 <= rank < world:
        raise ValueError(f"rank={rank} must be between 0 and world_size-1={world - 1}")
    states = model_states(scenario, rank)
    model, training = scenario.model, scenario.training
    acts = estimate_activations(model, training, states.autocast) if model.has_shape else _NO_ACTIVATIONS
    moments = _moments(states, acts, training.grad_accum_steps > 1, model.num_layers)
    peak_moment = max(moments, key=lambda name: moments[name])
    tensor_peak = moments[peak_moment]
    overheads = scenario.overheads
    overhead = overheads.context_bytes + int(tensor_peak * overheads.allocator_headroom)
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
    engines = {
        "paper": "the ZeRO paper's accounting (16-bit weights and gradients, fp32 master and moments when mixed)",
        "pytorch": "what DDP, ZeroRedundancyOptimizer and FSDP2 fully_shard allocate (fp32 weights when mixed)",
        "deepspeed": "DeepSpeed's own estimators (largest layer gathered under ZeRO-3, 1.5x host buffers)",
    }
    notes = [
        f"engine {strategy.engine}: {engines[strategy.engine]}",
        f"framework context {overheads.context_bytes / MIB:.0f} MiB per GPU and allocator headroom "
        f"{overheads.allocator_headroom:.0%} of the tensor peak (override with --context-memory, --allocator-headroom)",
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
    return tuple(notes)
