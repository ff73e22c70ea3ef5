"""The 'pytorch' engine: what DistributedDataParallel, ZeroRedundancyOptimizer and FSDP2 `fully_shard` allocate.

Mixed precision keeps fp32 parameters (autocast computes in 16 bits for DDP; a MixedPrecisionPolicy for FSDP2), Adam
keeps a 4-byte step per parameter tensor, DDP keeps one bucket copy of the gradients (unless gradient_as_bucket_view:
its reducer allocates it once, before the first backward, and reuses it); ZeroRedundancyOptimizer gives whole tensors
to ranks; FSDP2 pads every parameter's dim 0 to a multiple of the shard degree and gathers units in the compute
dtype, keeping the root gathered while forward ends and the head's gradients unsharded through backward.
"""

from __future__ import annotations

from functools import cache

from shardscope.core.model_states import ModelStates, dtype_bytes, optimizer_moments, step_tensor_bytes
from shardscope.core.params import ParamLayout, model_facts
from shardscope.core.sharding import dim0_shards, dim0_unit_sizes, flat_shard_numel, whole_tensor_shards
from shardscope.specs import Scenario


@cache
def head_numel(layout: ParamLayout) -> int:
    """Parameters whose gradients backward makes first: the final norm and the output head (the tied embedding)."""
    tail = sum(t.numel for t in layout.root if not t.name.startswith("embed"))
    tied = not any(t.name.startswith("lm_head") for t in layout.root)
    return tail + (layout.root[0].numel if tied else 0)


def torch_states(scenario: Scenario, rank: int) -> ModelStates:
    """Model states of one rank under torch's engine for the strategy."""
    if scenario.strategy.stage <= 1:
        return _replicated(scenario, rank)
    return _fully_sharded(scenario, rank)


def single_tensor_step_bytes(optimizer: str, largest_tensor_bytes: int) -> int:
    """Temporaries of a single-tensor (foreach=False) optimizer step, the torch engine's (runtime/trainer.py): Adam's
    `(exp_avg_sq.sqrt() / bias_correction2_sqrt)` holds two tensors the size of one parameter at once, one
    parameter at a time; SGD works in place (measured with runtime/tracker.py on torch 2.13: AdamW over tensors of
    1,000 and 300 fp32 elements peaks 8,000 B above its states, SGD with momentum 0 B)."""
    return 2 * largest_tensor_bytes if optimizer in ("adam", "adamw") else 0


def _replicated(scenario: Scenario, rank: int) -> ModelStates:
    """DistributedDataParallel, alone (ddp) or under ZeroRedundancyOptimizer (zero1)."""
    training, strategy = scenario.training, scenario.strategy
    total, layout = model_facts(scenario.model)
    stored = 4 if training.is_mixed else dtype_bytes(training.precision)  # mixed keeps fp32 weights
    moments = optimizer_moments(training.optimizer)
    if strategy.stage == 0:
        optimizer_numel, optimizer_tensors = total, layout.tensor_count if layout else 1
        largest = layout.largest_tensor_numel if layout else total
    elif layout is not None:
        shards = whole_tensor_shards(layout, scenario.cluster.world_size)
        optimizer_numel, optimizer_tensors = shards.numel_per_rank[rank], shards.tensors_per_rank[rank]
        largest = shards.largest_per_rank[rank]
    else:  # a bare parameter count: an even split is the best available assumption
        optimizer_numel = largest = flat_shard_numel(total, scenario.shard_degree)
        optimizer_tensors = 1
    bucket = 0 if strategy.gradient_as_bucket_view else total * stored
    head = head_numel(layout) * stored if layout else 0
    block = layout.block_numel * stored if layout else 0
    return ModelStates(
        parameters_bytes=total * stored,
        gradients_bytes=total * stored,
        optimizer_state_bytes=optimizer_numel * moments * stored
        + optimizer_tensors * step_tensor_bytes(training.optimizer),
        persistent_buffers_bytes=bucket,
        backward_grads_bytes=head,
        boundary_grads_bytes=head + block,
        recompute_grads_bytes=block,
        autocast=training.is_mixed,
        # Autocast's 16-bit weight copies are saved for backward: the activations count them (without a shape,
        # which has no activations, they are counted here).
        forward_temporary_bytes=total * dtype_bytes(training.precision) if training.is_mixed and not layout else 0,
        optimizer_temporary_bytes=single_tensor_step_bytes(training.optimizer, largest * stored),
    )


def _fully_sharded(scenario: Scenario, rank: int) -> ModelStates:
    """FSDP2 `fully_shard` on every block and the root: zero3 reshards after forward, zero2 keeps units gathered
    until backward, hsdp shards inside groups of the shard degree."""
    training, strategy = scenario.training, scenario.strategy
    total, layout = model_facts(scenario.model)
    stored = 4 if training.is_mixed else dtype_bytes(training.precision)
    compute = dtype_bytes(training.precision)
    degree = scenario.shard_degree
    if layout is None:  # a bare parameter count: one flat shard, no unit sizes to gather
        padded = local = largest = flat_shard_numel(total, degree)
        owned, root, block, blocks, head, block_numel = 1, 0, 0, 0, 0, 0
    else:
        shards = dim0_shards(layout, degree, rank)
        padded, local, owned = shards.padded_numel, shards.local_numel, shards.tensors_with_rows
        largest = shards.largest_local_numel
        root, block = dim0_unit_sizes(layout, degree)
        blocks, head, block_numel = layout.num_blocks, head_numel(layout), layout.block_numel
    # Unsharded gradients are made in the compute dtype; under mixed precision the reduce-scatter input is an fp32
    # copy of the unit's gradients.
    block_grads = block_numel * (compute + (4 if training.is_mixed else 0))
    in_flight_blocks, staging = 1, 0
    if strategy.name == "zero2" or not strategy.reshard_after_forward:
        # Measured (trace): the last block's flat all-gather output is held through the output head's forward and
        # freed when the loss runs; in backward the block's gradients add nothing beyond the gathered model.
        gathered_forward = gathered_backward = gathered_boundary = (root + blocks * block) * compute
        in_flight_blocks, staging = 0, block * compute
    else:
        gathered_forward = root * compute
        # measured (trace): FSDP2 prefetches the next block's all-gather while a block runs backward
        gathered_backward = (root + block + (block if blocks > 1 else 0)) * compute
        gathered_boundary = (root + block) * compute  # measured: FSDP2 frees a block before gathering the next
    moments = optimizer_moments(training.optimizer)
    # The bottom block's backward (measured: `shardscope trace --model tiny-llama --gpus 2 --gpus-per-node 2
    # --precision bf16-mixed --checkpointing full --strategy zero2 --engine pytorch --micro-batch 2 --seq-len 32
    # --context-memory 0 --allocator-headroom 0` peaks at 'backward: layers.0' with 1,506,012 B, as the gloo run):
    # every block above has resharded after its backward (zero2 too), so the root and this block are gathered; the
    # block above's reduce-scatter input (in the reduce dtype, fp32 under mixed precision) is only freed when the
    # next reduce-scatter waits on it; the blocks above have landed their gradient shards.
    reduce_bytes = 4 if training.is_mixed else compute
    # The top block's reduce-scatter: FSDP2's foreach_reduce copies the unit's unsharded gradients into one flat
    # input (the reduce dtype) and frees them; the output shard is allocated before the collective. Under NCCL
    # (the trace replays its semantics) the peak holds the gathered block, the input and the output shard (traced:
    # tiny-gpt2 zero3 pytorch bf16-mixed, 1,439,736 B at w2, 1,028,024 B at w4). ProcessGroupGloo's
    # reduce_scatter_tensor_coalesced (_reduce_scatter_base) clones its whole input, all-reduces the clone and copies
    # this rank's chunk out at wait(), so at the call the rank holds the input twice; by then post_backward has
    # resharded the block (measured: the trace with --backend gloo and the runtime tracker, 1,539,832 B at w2,
    # `shardscope validate --models tiny-gpt2 --strategies zero3 --engines pytorch --world-sizes 2 --no-trace`).
    gloo = scenario.cluster.backend == "gloo"
    shard_out = (block // degree) * reduce_bytes
    top_reduce_scatter = block * reduce_bytes + shard_out + (block * (reduce_bytes - compute) if gloo else 0)
    return ModelStates(
        walks_block_backward=layout is not None,
        top_reduce_scatter_bytes=top_reduce_scatter,
        gloo_clone_moments=gloo and layout is not None,
        # By a unit's reduce-scatter the previous unit's input is freed (FSDP2 frees it when the next reduce
        # starts) and the unit's own gradients were copied in and freed; the unit itself is still gathered.
        bottom_reduce_scatter_bytes=(root + block) * compute + 2 * block * reduce_bytes,
        root_reduce_scatter_bytes=root * compute + 2 * root * reduce_bytes,
        root_landed_grads_bytes=blocks * (block // degree) * stored,
        bottom_block_moment=layout is not None,
        bottom_buffers_bytes=(root + block) * compute + (block * reduce_bytes if blocks > 1 else 0),
        bottom_landed_grads_bytes=max(blocks - 1, 0) * (block // degree) * stored,
        bottom_grads_bytes=head * compute,
        parameters_bytes=padded * stored,
        gradients_bytes=padded * stored,
        optimizer_state_bytes=local * moments * stored + owned * step_tensor_bytes(training.optimizer),
        forward_buffers_bytes=gathered_forward,
        backward_buffers_bytes=gathered_backward,
        boundary_buffers_bytes=gathered_boundary,
        forward_staging_bytes=staging,
        # measured (trace): in the first block's forward the next block's all-gather is prefetched, so two blocks
        # and both flat all-gather outputs are live beside the root
        first_block_buffers_bytes=(root + 2 * block) * compute + 2 * staging if staging and blocks > 1 else 0,
        backward_grads_bytes=head * compute + (0 if layout else in_flight_blocks * block_grads),
        boundary_grads_bytes=head * compute + in_flight_blocks * block_grads,
        optimizer_temporary_bytes=single_tensor_step_bytes(training.optimizer, largest * stored),
    )
