"""The 'paper' engine: "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (Rajbhandari et al.),
Section 3 and Figure 1, as shardscope's teaching strategies (shardscope.runtime.teaching) allocate and send it.

Mixed-precision Adam holds 2 + 2 + K bytes per parameter with K = 12 (fp32 master, momentum, variance); stage 1
shards the K bytes over N ranks, stage 2 also the gradients, stage 3 also the parameters. The teaching strategies
keep one flat buffer per unit (the root: embeddings, final norm and head; then each block), padded to a multiple of
the shard degree D, so a rank holds ceil(P_u / D) elements of unit u, and Adam keeps one 4-byte step per buffer.
Without a shape (--params) the model is one flat buffer, which is the paper's own accounting. Communication volumes
follow the paper's Section 7: DDP and ZeRO-1/2 move 2 x parameters per step, ZeRO-3 3 x.

On a pipeline rank (its proxy's model a StageModel) the data-parallel strategy runs over flat buffers of its stages
as above, its micro-batches' gradients accumulated (runtime/teaching/pipeline_data.py).

With tensor or context parallelism every stage runs in the teaching grid (runtime/teaching/model_parallel.py): rank 0's
whole model broadcast to the world tensor by tensor before each rank keeps its slice. DDP (ModelParallelTeaching) then,
every micro-batch after backward, all-reduces each parameter tensor (its tp slice) over the dp x cp ranks holding it,
blocking, and its optimizer steps over the tensors, not flat buffers; ZeRO-1/2/3 and HSDP (ShardedModelParallel) are
the strategies above over those ranks, their flat buffers made of the rank's tp slices.
"""

from __future__ import annotations

from shardscope.choices import EngineName, checkpoints_block
from shardscope.core.activations import INDEX_BYTES, ActivationEstimate
from shardscope.core.comm_events import (
    CommEvent,
    event,
    gradient_reductions,
    per_tensor_broadcasts,
    step_gathers,
)
from shardscope.core.engines.base import (
    LOSS_GRAD_BYTES,
    LiveBytes,
    Moment,
    RankMemory,
    RulesDefaults,
    TimePlace,
    activations_for,
    as_live_bytes,
    held,
    plus,
    shared_memory,
    shared_moments,
)
from shardscope.core.engines.pipeline_load import PipelineLoad
from shardscope.core.engines.python_ops import bookkeeping_ops, hook_calls
from shardscope.core.engines.teaching_pipeline import shard_buffer_moments, teaching_pipeline_moments
from shardscope.core.expert_parallel import (
    block_expert_numel,
    expert_bucket_events,
    expert_flat_units,
    expert_shard_degree,
    expert_unit_events,
)
from shardscope.core.model_states import ModelStates, dtype_bytes, offload, optimizer_moments, step_tensor_bytes
from shardscope.core.params import ParamLayout, StageModel, head_numel, param_layout, rank_facts, rank_layout
from shardscope.core.rank_share import rank_share, ring_attention_backward_bytes, sizes_of
from shardscope.core.result import CollectiveRow
from shardscope.core.sharded_calls import sharded_events
from shardscope.core.sharding import FlatUnits, flat_shard_numel, flat_units
from shardscope.presets.hardware import HardwareProfile
from shardscope.specs import Scenario

ADAM_TEMPORARIES = 3


class PaperRules(RulesDefaults):
    """The ZeRO paper's accounting, as the teaching strategies run it: 16-bit weights and gradients move."""

    name: EngineName = "paper"
    summary = "the ZeRO paper's accounting (16-bit weights and gradients, fp32 master and moments when mixed)"
    fused_optimizer = False
    torch_engines = False
    megatron_tensor_parallel = True
    experts_placed_from_stage = 0  # runtime/teaching/expert_data_parallel.py: each block's experts a unit of their own

    def rank_memory(self, scenario: Scenario, rank: int) -> RankMemory:
        """Every rank holds the same; ZeRO-1 adds the reduce-scatters it runs after the whole backward. Tensor
        parallelism is Megatron-LM's, as the paper's Table 2 counts it: the column-parallel linears keep their
        sequence-sharded input and all-gather it again in backward; the tp/cp grid's backward through the output
        head and the top block is followed op by op (`_grid_backward`)."""
        states, after_backward = _states(scenario)
        states = offload(scenario, states)
        megatron = self.megatron_tensor_parallel
        if _in_model_parallel_grid(scenario):
            acts = activations_for(scenario, states.autocast, megatron)
            top, head = _grid_backward(scenario, states, acts)
            moments = shared_moments(scenario, states, acts, top_block=top)
            moments.insert(2, ("output head's backward", head))
            return RankMemory(states=states, activations=acts, moments=tuple(moments))
        if not after_backward:
            return shared_memory(scenario, states, regathers_in_backward=megatron)
        return shared_memory(
            scenario,
            states,
            ("reduce-scatter after backward", plus(held(states, True), buffers=after_backward)),
            regathers_in_backward=megatron,
        )

    def rank_states(self, scenario: Scenario, rank: int) -> ModelStates:
        """Every rank holds the same."""
        return offload(scenario, _states(scenario)[0])

    def pipeline_moments(self, scenario: Scenario, load: PipelineLoad) -> list[Moment]:
        """ZeRO-2 and ZeRO-3 reduce-scatter every micro-batch's gradients as its backward lands them: the teaching
        pipeline's own moments (core.engines.teaching_pipeline); ddp and ZeRO-1 keep whole flat gradients, the
        shared rule. ZeRO-1 and ZeRO-2 add the moments of their shard-sized buffers."""
        stage = scenario.strategy.stage
        moments = super().pipeline_moments(scenario, load) if stage < 2 else teaching_pipeline_moments(scenario, load)
        return moments + shard_buffer_moments(scenario, load) if stage in (1, 2) else moments

    def gradient_buckets(self, scenario: Scenario) -> tuple[tuple[int, int], ...]:
        """One flat bucket per unit reduced over the data-parallel ranks: the blocks in reverse, then the root (under
        expert parallelism a block's dense weights: its experts are a bucket over their own ranks,
        core.expert_parallel.expert_bucket_events)."""
        layout = rank_layout(scenario)
        element = self.grad_comm_bytes(scenario)
        dense = layout.block_numel - (block_expert_numel(layout) if scenario.strategy.ep > 1 else 0)
        blocks = [(dense * element, index + 1) for index in reversed(range(layout.num_blocks))]
        return (*blocks, (layout.root_numel * element, 0))

    def step_events(self, scenario: Scenario) -> list[CommEvent]:
        """DDP all-reduces each unit's bucket as it fills (each tensor after the backward in the tp/cp grid);
        ZeRO-1 reduce-scatters every unit after the whole backward and ZeRO-2 as each fills, then both all-gather
        each unit's padded flat buffer (root, then blocks); ZeRO-3 gathers and reduce-scatters per unit, keeping the
        root gathered from forward into backward."""
        stage, layout = scenario.strategy.stage, rank_layout(scenario)
        grad, param = self.grad_comm_bytes(scenario), self.param_comm_bytes(scenario)
        experts = block_expert_numel(layout) if scenario.strategy.ep > 1 else 0  # a unit of their own
        if stage == 3:
            degree = scenario.shard_degree
            gathered = (
                flat_shard_numel(layout.root_numel, degree) * degree,
                flat_shard_numel(layout.block_numel - experts, degree) * degree,
            )
            # a teaching pipeline rank's micro-batches in flight share its root: gathered once a step
            # (runtime/teaching/pipeline_data.py)
            pipeline = isinstance(scenario.model, StageModel)
            events = sharded_events(scenario, gathered, param, grad, regather_root=False, root_once=pipeline)
            return events + expert_unit_events(scenario, param, grad) if experts else events
        if _in_model_parallel_grid(scenario):
            return _grid_reductions(scenario, grad)
        buckets = self.gradient_buckets(scenario)
        events = gradient_reductions(scenario, buckets, grad, all_reduce=stage == 0, after_whole_backward=stage == 1)
        events += expert_bucket_events(scenario, param, grad) if experts else []
        if stage == 0:
            return events
        blocks = [(layout.block_numel - experts, f"block {i}") for i in range(layout.num_blocks)]
        return events + step_gathers(scenario, [(layout.root_numel, "root"), *blocks], param)

    def setup_rows(self, scenario: Scenario) -> list[CollectiveRow]:
        """Every parameter tensor broadcast from rank 0 (with tp or cp, under every stage, the whole tensor to the
        world, before the ranks keep their slices)."""
        element = dtype_bytes(scenario.training.precision)
        if scenario.parallelism.splits_model or scenario.strategy.ep > 1:
            world = scenario.cluster.world_size
            return [
                CollectiveRow(phase="setup", op="broadcast", group_size=world, payload_bytes=t.numel * element, count=1)
                for t in param_layout(scenario.model).tensors()
            ]
        return per_tensor_broadcasts(scenario, element)

    def framework_s(self, scenario: Scenario, profile: HardwareProfile) -> dict[TimePlace, float]:
        """The teaching strategies' Python hook calls where they fire and their bookkeeping ops, as many as the
        profile's host extension says they run (shardscope.runtime.teaching declares them; the tp/cp grid declares
        none, so none are counted for it)."""
        extra: dict[TimePlace, float] = {}
        if _in_model_parallel_grid(scenario):
            return extra
        host = profile.host_terms
        counts = host.python_ops_at(scenario.strategy.stage)
        if host.hook_overhead_s:
            for place, calls in hook_calls(scenario, counts).items():
                extra[place] = extra.get(place, 0.0) + calls * host.hook_overhead_s
        if host.bookkeeping_op_overhead_s:
            for place, ops in bookkeeping_ops(scenario, counts).items():
                extra[place] = extra.get(place, 0.0) + ops * host.bookkeeping_op_overhead_s
        return extra

    def optimizer_tensors(self, scenario: Scenario) -> int:
        """One flat buffer (or shard) per unit; every parameter tensor in the tp/cp grid."""
        layout = rank_layout(scenario)
        if _in_model_parallel_grid(scenario):
            return layout.tensor_count
        experts = scenario.strategy.ep > 1 and scenario.strategy.stage >= self.experts_placed_from_stage
        return (2 if experts else 1) * layout.num_blocks + 1  # each block's experts a buffer of their own

    def is_async(self, scenario: Scenario, event: CommEvent) -> bool:
        """The teaching DDP (DataParallelBucket) all-reduces its buckets with async_op=True from backward; the tp/cp
        grid's all-reduces block."""
        return (
            scenario.strategy.stage == 0
            and event.trigger == "after_backward"
            and event.group in ("world", "experts")
            and not _in_model_parallel_grid(scenario)
        )


def _in_model_parallel_grid(scenario: Scenario) -> bool:
    """DDP with tp or cp, which the teaching runs as ModelParallelTeaching; not on a pipeline rank (a StageModel),
    whose flat buffers are all-reduced unit by unit (runtime/teaching/pipeline_data.py)."""
    pipeline = isinstance(scenario.model, StageModel)
    return scenario.strategy.stage == 0 and scenario.parallelism.splits_model and not pipeline


def _grid_backward(scenario: Scenario, states: ModelStates, acts: ActivationEstimate) -> tuple[LiveBytes, LiveBytes]:
    """(the top block's backward, the output head's backward) as the teaching grid runs them, at the op that
    holds the most of each (measured with the run's tracker: tests/distributed/test_model_parallel_prediction.py).

    The gradients accumulate in place into the flat buffers, so a weight's gradient is live from the matmul that
    makes it until it is added, unless the weight is tied: autograd holds the output head's gradient until the
    embedding's is added to it, at the end of backward. The head's backward holds the logits' gradient (less the
    loss's saved tensors, freed before) with the head's weight gradient and its input's gradient, or, past the
    matmuls, that input gradient and its copy that f all-reduces; under sequence parallelism Megatron-LM's entry
    holds the whole-sequence input gradient and its contiguous copy (and gloo's clone of it) while it
    reduce-scatters, then the input gathered again (a contiguous copy) for the weight gradient. The top block's
    backward peaks in the output projection's: its weight and input gradients beside the output's gradient
    (gathered under sequence parallelism), or in llama's SwiGLU product, whose two gradients outlive the
    projection's saved input; or in ring attention's (core.rank_share), or in selective checkpointing's re-forward
    of the attention core. Full checkpointing is not followed exactly: the grid passes the RoPE tables and the
    causal mask to every checkpointed block, which keeps them (counted here as recomputed), and the recomputed
    block at its MLP's backward is counted up to one tokens x hidden tensor over (its input, which the stored
    input and its first norm share)."""
    model, training = scenario.model, scenario.training
    share = rank_share(scenario, megatron=True)
    sizes = sizes_of(model, training, share)
    element, hidden, tp = sizes.element, model.hidden_size, share.tp
    whole_input = sizes.tokens * hidden * element  # one tokens x hidden tensor of the rank's sequence chunk
    head_weight = model.vocab_size // tp * hidden * element
    tied = head_weight if model.tie_embeddings else 0
    # The loss value and its gradient; torch's cross entropy (tp 1) counts its total weight in `saved` instead.
    loss = LOSS_GRAD_BYTES + (sizes.stat if share.vocab_parallel_loss else 0)
    loss_saved = sizes.tokens * (INDEX_BYTES + (1 if share.vocab_parallel_loss else 0))
    params, optimizer = states.parameters_bytes, states.optimizer_state_bytes
    grads, persistent = states.gradients_bytes, states.persistent_buffers_bytes
    # The logits' gradient the head's backward reads: one tokens x vocab fp32 tensor, or its 16-bit cast.
    logits_grad = acts.log_softmax_bytes if element == sizes.stat else acts.logits_bytes
    if share.sequence_parallel:
        # gloo's reduce-scatter clones its whole input too (ProcessGroupGloo::reduce_scatter_tensor_coalesced)
        scatter = (3 if scenario.cluster.backend == "gloo" else 2) * whole_input
        matmuls = whole_input // tp + max(scatter, whole_input + head_weight)
        head_temporary = logits_grad + matmuls
    else:
        head_temporary = max(logits_grad + head_weight + whole_input, 2 * whole_input + tied)
    head_acts = acts.saved_bytes - acts.log_softmax_bytes - loss_saved
    head = as_live_bytes((params, grads, optimizer, head_acts, persistent, head_temporary + loss))
    ffn = sizes.tokens * sizes.ffn * element
    output_grad = whole_input if share.sequence_parallel else 0  # without it the residual's gradient is the one
    projection = sizes.ffn * hidden * element + ffn + output_grad
    product = 2 * ffn if model.family == "llama" else ffn
    own = max(projection, product, ring_attention_backward_bytes(sizes, share))
    top_acts = acts.saved_bytes - acts.head_bytes
    if checkpoints_block(training.checkpointing, model.num_layers - 1):
        top_acts += acts.recompute_bytes  # the whole block made again before its backward
    else:  # selective recomputes the attention core inside the attention's backward, after the MLP's
        own = max(own, acts.recompute_bytes)
    top = as_live_bytes((params, grads, optimizer, top_acts, persistent, acts.hidden_bytes + loss + tied + own))
    return top, head


def _grid_reductions(scenario: Scenario, element: int) -> list[CommEvent]:
    """ModelParallelTeaching.backward: each parameter tensor's gradient all-reduced over the dp x cp ranks holding
    the same tp slice, every micro-batch, after the whole backward (none when those ranks are one)."""
    ranks = scenario.state_ranks
    if ranks == 1:
        return []
    tensors = rank_layout(scenario).tensors()
    return [
        event("backward", "all_reduce", ranks, t.numel * element, "world", (micro_batch, 0, "after_backward"), t.name)
        for micro_batch in range(scenario.training.grad_accum_steps)
        for t in tensors
    ]


def _states(scenario: Scenario) -> tuple[ModelStates, int]:
    """Model states, gathered units and in-flight gradients of one rank (every rank holds the same), and the buffers
    of ZeRO-1's reduce-scatters after backward (0 for the other stages)."""
    training, stage = scenario.training, scenario.strategy.stage
    total, layout = rank_facts(scenario)
    units = _flat_units(scenario, layout if layout is not None else total)
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
    states = ModelStates(
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
        forward_buffers_bytes=in_flight[0],
        backward_buffers_bytes=in_flight[1],
        boundary_buffers_bytes=in_flight[2],
        backward_grads_bytes=in_flight[3],
        boundary_grads_bytes=in_flight[4],
    )
    return states, after_backward


def _flat_units(scenario: Scenario, layout: ParamLayout | int) -> FlatUnits:
    """The teaching strategies' flat buffers of one rank: one per unit over the shard degree (none for ddp), each
    block's experts a unit of their own under expert parallelism (core.expert_parallel)."""
    stage, ep = scenario.strategy.stage, scenario.strategy.ep
    degree = scenario.shard_degree if stage else 1
    if ep > 1 and stage >= PaperRules.experts_placed_from_stage and isinstance(layout, ParamLayout):
        return expert_flat_units(layout, degree, expert_shard_degree(scenario) if stage else 1)
    return flat_units(layout, degree)


def _in_flight(
    layout: ParamLayout | None, root_padded: int, block_padded: int, weight: int, stage: int
) -> tuple[int, int, int, int, int]:
    """(gathered when forward ends, gathered in the top block's backward, gathered between blocks, gradients in
    flight in the top block's backward, and between blocks).

    Stages 0 and 1 keep whole flat gradient buffers: nothing else is in flight. Stages 2 and 3: a unit's
    per-parameter gradients live until its last one lands and is reduce-scattered; the root's land last, so they are
    in flight through all of backward, but while the blocks run only the head's (final norm, output head) exist: an
    untied embedding's gradient is made after the bottom block (measured: `shardscope validate` case
    tiny-llama zero3 teaching w4 fp32 ckpt). Stage 3 also keeps the root gathered from forward to the end of
    backward, a block while it runs, and the next block gathered at the boundary."""
    if layout is None or stage < 2:
        return 0, 0, 0, 0, 0
    head, block = head_numel(layout) * weight, layout.block_numel * weight
    if stage < 3:
        return 0, 0, 0, head, head + block + block_padded * weight
    gathered_root, gathered_block = root_padded * weight, block_padded * weight
    return (gathered_root, gathered_root + gathered_block, gathered_root + 2 * gathered_block, head, head + block)
