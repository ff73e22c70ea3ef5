"""FSDP2 `fully_shard` on every block and the root, the 'pytorch' engine's zero2, zero3 and hsdp: what a rank holds,
and the moments of backward FSDP2's per-unit mechanism makes.

zero3 reshards after forward, zero2 keeps units gathered until backward, hsdp shards inside groups of the shard
degree. FSDP2 pads every parameter's dim 0 to a multiple of the shard degree, gathers units in the compute dtype
(MixedPrecisionPolicy) and keeps the head's gradients unsharded through backward. zero3 and hsdp reshard the root
too after its forward, before the loss (fully_shard is given reshard_after_forward explicitly, which turns off
torch's rule of keeping the root gathered: _fsdp_state.py, auto_reshard_after_forward), and gather it again when
backward reaches the output head. Besides the moments every engine has, it is followed through the output head's
forward (the root gathered; zero2: the last all-gather's output still held too), the first block's forward (both
all-gathers' outputs held when nothing reshards), the top block's MLP backward and its reduce-scatter, the bottom
block's backward and, under gloo, the bottom block's and the root's reduce-scatters, where gloo holds a clone of the
reduce-scatter input (what a collective allocates depends on the library, so the backend is the cluster's).
"""

from __future__ import annotations

from typing import NamedTuple

from shardscope.core.activations import ActivationEstimate
from shardscope.core.engines.base import (
    LOSS_GRAD_BYTES,
    LiveBytes,
    Moment,
    RankMemory,
    activations_for,
    as_live_bytes,
    gradients_in_base,
    shared_moments,
)
from shardscope.core.kept import kept
from shardscope.core.model_states import (
    KEPT_STATES_LIMIT,
    ModelStates,
    dtype_bytes,
    offload,
    optimizer_moments,
    step_tensor_bytes,
)
from shardscope.core.params import ParamLayout, head_numel, rank_facts
from shardscope.core.sharding import dim0_shards, dim0_unit_sizes, flat_shard_numel
from shardscope.specs import Scenario


def single_tensor_step_bytes(optimizer: str, largest_tensor_bytes: int) -> int:
    """Temporaries of a single-tensor (foreach=False) optimizer step, the torch engine's (runtime/trainer.py): Adam's
    `(exp_avg_sq.sqrt() / bias_correction2_sqrt)` holds two tensors the size of one parameter at once, one
    parameter at a time; SGD works in place (measured with runtime/tracker.py on torch 2.13)."""
    return 2 * largest_tensor_bytes if optimizer in ("adam", "adamw") else 0


class _UnitMoments(NamedTuple):
    """What FSDP2's per-unit moments hold beyond the shared ones (bytes; see `_states` for each term's source). A
    named tuple, not a frozen dataclass: a planner sweep builds one per scenario, and it is several times cheaper."""

    shaped: bool
    """The model has a shape (units to follow); without one only the shared moments apply."""
    gloo: bool
    top_reduce_scatter: int
    bottom_reduce_scatter: int
    root_reduce_scatter: int
    root_landed_grads: int
    bottom_buffers: int
    bottom_landed_grads: int
    bottom_grads: int
    forward_staging: int
    first_block_buffers: int
    head_buffers: int
    """Gathered in the output head's forward beyond the persistent buffers."""
    embedding_buffers: int
    """FSDP2's buffers while the embeddings' backward runs (see `_embedding_terms`)."""
    embedding_grads: int
    """The embeddings' gradients as their backward makes them, before FSDP2 takes them (see `_embedding_terms`)."""


def fsdp2_memory(scenario: Scenario, rank: int) -> RankMemory:
    """The rank's states and every moment FSDP2 makes."""
    states, units = _offloaded_states(scenario, rank)
    acts = activations_for(scenario, states.autocast)
    moments = _moments(scenario, states, units, acts)
    return RankMemory(states=states, activations=acts, moments=tuple(moments))


def fsdp2_states(scenario: Scenario, rank: int) -> ModelStates:
    """The rank's states as FSDP2 holds them (`fsdp2_memory`'s), without its moments."""
    return _offloaded_states(scenario, rank)[0]


_STATES_CACHE: dict[tuple[object, ...], tuple[ModelStates, _UnitMoments]] = {}


def _offloaded_states(scenario: Scenario, rank: int) -> tuple[ModelStates, _UnitMoments]:
    """`_states` after `offload`, kept by what the two read: the model, the precision and optimizer, tp and ep, the
    stage, resharding, offload, the shard degree, the backend and the rank (tests/planner/test_speed_caches.py holds
    the kept value to a fresh one)."""
    training, strategy = scenario.training, scenario.strategy
    key = (
        scenario.model,
        training.precision,
        training.optimizer,
        strategy.tp,
        strategy.ep,
        strategy.stage,
        strategy.reshard_after_forward,
        strategy.offload,
        scenario.shard_degree,
        scenario.cluster.backend,
        rank,
    )

    def make() -> tuple[ModelStates, _UnitMoments]:
        states, units = _states(scenario, rank)
        return offload(scenario, states), units

    return kept(_STATES_CACHE, key, make, KEPT_STATES_LIMIT)


def _moments(scenario: Scenario, states: ModelStates, units: _UnitMoments, acts: ActivationEstimate) -> list[Moment]:
    # Moments as (parameters, gradients, optimizer state, activations, buffers, temporary), built as plain tuples
    # because a planner sweep builds millions of them.
    landed = not gradients_in_base(scenario, states)
    params, optimizer, persistent = (
        states.parameters_bytes,
        states.optimizer_state_bytes,
        states.persistent_buffers_bytes,
    )
    grads = 0 if landed else states.gradients_bytes
    after_head = acts.saved_bytes - acts.head_bytes
    # The top block's backward seen at its two high points: in its MLP's backward (its saved tensors, the MLP's
    # gradients), and at its reduce-scatter (its saved tensors freed; the collective's buffers, per backend).
    top_grads, top_buffers = grads + states.backward_grads_bytes, persistent + states.backward_buffers_bytes
    top_temporary = acts.hidden_bytes + LOSS_GRAD_BYTES
    top = as_live_bytes(
        (params, top_grads, optimizer, after_head, top_buffers, top_temporary + acts.block_backward_bytes)
    )
    moments = shared_moments(scenario, states, acts, top if units.shaped else None)
    if units.head_buffers:
        # The output head's forward: the loss has not yet made its log-softmax; the root is gathered and, under
        # zero2, the last all-gather's output still held (traced: zero2 peaks at 'forward: lm_head').
        buffers = persistent + units.head_buffers
        saved = acts.saved_bytes - acts.log_softmax_bytes
        moments.append(
            ("output head's forward", as_live_bytes((params, grads, optimizer, saved, buffers, acts.logits_bytes)))
        )
    if units.first_block_buffers:
        # The first block's forward: what the embeddings and the block saved (or, checkpointed, its stored input)
        # and the block's output being made, with the next block prefetched (validated on tiny-moe zero2).
        saved = acts.saved_bytes - acts.head_bytes - (acts.stored_blocks_bytes - acts.first_stored_block_bytes)
        buffers = persistent + units.first_block_buffers
        moments.append(
            ("first block's forward", as_live_bytes((params, grads, optimizer, saved, buffers, acts.hidden_bytes)))
        )
    if not units.shaped:
        return moments
    scatter = (
        params,
        top_grads,
        optimizer,
        after_head - acts.stored_block_bytes,
        top_buffers + units.top_reduce_scatter,
        top_temporary,
    )
    moments.append(("top block's reduce-scatter", as_live_bytes(scatter)))
    # The blocks above have freed what they stored and landed their gradient shards; the bottom block holds its own
    # stored tensors, what its backward makes, and the gradient flowing in from above.
    bottom_grads = grads + units.bottom_grads + (units.bottom_landed_grads if landed else 0)
    bottom = (
        params,
        bottom_grads,
        optimizer,
        after_head - (acts.stored_blocks_bytes - acts.first_stored_block_bytes),
        persistent + units.bottom_buffers,
        acts.first_block_backward_bytes + acts.hidden_bytes + LOSS_GRAD_BYTES,
    )
    moments.append(("bottom block's backward", as_live_bytes(bottom)))
    if units.embedding_grads:
        moments.append(("embeddings' backward", _embedding_moment(states, units, acts, grads, landed)))
    if units.gloo:
        # gloo's reduce-scatter holds a clone of its input: the bottom block's, with its backward's tensors freed,
        # and the root's, with every block's stored tensors freed and their gradient shards landed.
        after_blocks = after_head - acts.stored_blocks_bytes
        bottom_scatter = (
            params,
            bottom_grads,
            optimizer,
            after_blocks,
            persistent + units.bottom_reduce_scatter,
            LOSS_GRAD_BYTES + acts.hidden_bytes,
        )
        root_grads = grads + (units.root_landed_grads if landed else 0)
        root_scatter = (
            params,
            root_grads,
            optimizer,
            after_blocks,
            persistent + units.root_reduce_scatter,
            LOSS_GRAD_BYTES,
        )
        moments.append(("bottom block's reduce-scatter", as_live_bytes(bottom_scatter)))
        moments.append(("root's reduce-scatter", as_live_bytes(root_scatter)))
    return moments


def _embedding_moment(
    states: ModelStates, units: _UnitMoments, acts: ActivationEstimate, grads: int, landed: bool
) -> LiveBytes:
    """The embeddings' backward, as FSDP2's root post-backward takes their gradients: every block has freed what it
    stored and landed its gradient shard, the head's gradients wait for the root's reduce-scatter, and only the
    inputs are still saved."""
    return as_live_bytes(
        (
            states.parameters_bytes,
            grads + units.bottom_grads + (units.root_landed_grads if landed else 0),
            states.optimizer_state_bytes,
            acts.inputs_bytes,
            states.persistent_buffers_bytes + units.embedding_buffers,
            units.embedding_grads + LOSS_GRAD_BYTES,
        )
    )


def _states(scenario: Scenario, rank: int) -> tuple[ModelStates, _UnitMoments]:
    training, strategy = scenario.training, scenario.strategy
    total, layout = rank_facts(scenario)
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
    if strategy.stage == 2 or not strategy.reshard_after_forward:
        # Traced: the last block's flat all-gather output is held through the output head's forward and freed when
        # the loss runs; in backward the block's gradients add nothing beyond the gathered model.
        gathered_forward = gathered_backward = gathered_boundary = (root + blocks * block) * compute
        in_flight_blocks, staging = 0, block * compute
        head_gathered = gathered_forward + staging
    else:
        # traced (llama-3-8b cut to 8 blocks, and an H200 running it: docs/accuracy-gpu.md): the root is resharded
        # after its forward, so the loss runs with nothing gathered
        gathered_forward, head_gathered = 0, root * compute
        # traced: FSDP2 prefetches the next block's all-gather while a block runs backward
        gathered_backward = (root + block + (block if blocks > 1 else 0)) * compute
        gathered_boundary = (root + block) * compute  # traced: FSDP2 frees a block before gathering the next
    moments = optimizer_moments(training.optimizer)
    # The bottom block's backward (traced on tiny-llama zero2 bf16-mixed with full checkpointing, as the gloo run):
    # every block above has resharded after its backward (zero2 too), so the root and this block are gathered; the
    # block above's reduce-scatter input (in the reduce dtype, fp32 under mixed precision) is only freed when the
    # next reduce-scatter waits on it; the blocks above have landed their gradient shards.
    reduce_bytes = 4 if training.is_mixed else compute
    # The top block's reduce-scatter: FSDP2's foreach_reduce copies the unit's unsharded gradients into one flat
    # input (the reduce dtype) and frees them; the output shard is allocated before the collective. Under NCCL
    # (the trace replays its semantics) the peak holds the gathered block, the input and the output shard.
    # ProcessGroupGloo's reduce_scatter_tensor_coalesced (_reduce_scatter_base) clones its whole input, all-reduces
    # the clone and copies this rank's chunk out at wait(), so at the call the rank holds the input twice; by then
    # post_backward has resharded the block (the trace with --backend gloo and the runtime tracker agree).
    gloo = scenario.cluster.backend == "gloo"
    shard_out = (block // degree) * reduce_bytes
    units = _UnitMoments(
        shaped=layout is not None,
        gloo=gloo and layout is not None,
        top_reduce_scatter=block * reduce_bytes + shard_out + (block * (reduce_bytes - compute) if gloo else 0),
        # By a unit's reduce-scatter the previous unit's input is freed (FSDP2 frees it when the next reduce
        # starts) and the unit's own gradients were copied in and freed; the unit itself is still gathered.
        bottom_reduce_scatter=(root + block) * compute + 2 * block * reduce_bytes,
        root_reduce_scatter=root * compute + 2 * root * reduce_bytes,
        root_landed_grads=blocks * (block // degree) * stored,
        bottom_buffers=(root + block) * compute + (block * reduce_bytes if blocks > 1 else 0),
        bottom_landed_grads=max(blocks - 1, 0) * (block // degree) * stored,
        bottom_grads=head * compute,
        forward_staging=staging,
        # traced: in the first block's forward the next block's all-gather is prefetched, so two blocks and both
        # flat all-gather outputs are live beside the root
        first_block_buffers=(root + 2 * block) * compute + 2 * staging if staging and blocks > 1 else 0,
        head_buffers=head_gathered if layout is not None else 0,
        **_embedding_terms(scenario, layout, root, block, compute, reduce_bytes),
    )
    states = ModelStates(
        parameters_bytes=padded * stored,
        gradients_bytes=padded * stored,
        optimizer_state_bytes=local * moments * stored + owned * step_tensor_bytes(training.optimizer),
        forward_buffers_bytes=gathered_forward,
        backward_buffers_bytes=gathered_backward,
        boundary_buffers_bytes=gathered_boundary,
        backward_grads_bytes=head * compute + (0 if layout else in_flight_blocks * block_grads),
        boundary_grads_bytes=head * compute + in_flight_blocks * block_grads,
        optimizer_temporary_bytes=single_tensor_step_bytes(training.optimizer, largest * stored),
    )
    return states, units


def _embedding_terms(
    scenario: Scenario, layout: ParamLayout | None, root: int, block: int, compute: int, reduce_bytes: int
) -> dict[str, int]:
    """What the embeddings' backward holds besides the states. The root is gathered (every block resharded after its
    backward) and the bottom block's reduce-scatter input (the reduce dtype) is held until the root's reduce-scatter
    starts. aten.embedding_dense_backward makes each embedding's gradient in the compute dtype, with as many rows as
    the weight has. Under tensor parallelism the token embedding is DTensor's vocabulary-split RowwiseParallel, and
    torch has no sharding rule that makes its gradient split by rows (torch/distributed/tensor/_ops/_embedding_ops.py:
    embedding_dense_backward's strategies shard dim 1, or the batch, or stay Partial), so the gradient is made whole,
    vocab x hidden, on every rank; FSDP2's post-backward then redistributes it to the parameter's Shard(0) placement
    (FSDPParam._get_grad_inner_tensor), which copies this rank's rows out while the whole gradient is still live.
    Followed under tensor parallelism only: without it the gradient is the parameter's own size and not copied, and
    the place holds most later, at the root's reduce-scatter (traced), which only the gloo moments follow so far."""
    tp = scenario.strategy.tp
    if layout is None or tp == 1:
        return {"embedding_buffers": 0, "embedding_grads": 0}
    tokens = next((tensor for tensor in layout.root if tensor.name.startswith("embed_tokens")), None)
    if tokens is None:  # a pipeline stage without the embeddings
        return {"embedding_buffers": 0, "embedding_grads": 0}
    copied = tokens.numel * compute  # this rank's rows, copied out of the whole gradient
    buffers = root * compute + (block * reduce_bytes if layout.num_blocks else 0) + copied
    return {"embedding_buffers": buffers, "embedding_grads": tokens.numel * tp * compute}
