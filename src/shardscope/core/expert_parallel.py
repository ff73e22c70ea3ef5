"""Expert parallelism: what one rank holds of a mixture-of-experts model, and the all-to-alls that move its tokens.

Weights. The `ep` ranks of an expert group split every MoE layer's experts: each holds num_experts / ep whole experts
(their SwiGLU weights, split tp ways as a dense MLP's are), while the router, the attention and the norms stay as
without experts (core/params.py builds that layout). The data-parallel strategy then shards the rank's experts over
the ranks left to them: torchtitan's ParallelDims splits dp_shard x cp into dp_shard_mod_ep = dp_shard x cp / ep
and dp_shard_in_ep = ep / cp, and fully_shard()s the experts over dp_shard_mod_ep while every other weight is
sharded over the whole dp_shard x cp (pytorch/torchtitan, torchtitan/distributed/parallel_dims.py, `_build_mesh_with_
ep`, at commit 73bb964d8f66f585d977b40fe3de88301cdd03cd). So a sharded state holds X / ep experts over D / ep ranks,
X / D per rank: the same as without expert parallelism. What ep saves is what the strategy does not shard (ZeRO-1's
16-bit weights and gradients, ZeRO-2's weights) and the experts a unit gathers (FSDP's gathered block). Most engines'
states are scaled to that from the rank's layout (`expert_parallel_states`), and their data-parallel ledger keeps
one call per unit whose payload holds the rank's experts (X / ep, right) but is priced on the dense weights' group
of D ranks: an approximation that overstates the experts' data-parallel time. The paper engine is exact under every
stage (`experts_placed_from_stage`), as the teaching run (runtime/teaching/expert_data_parallel.py) allocates and
sends it: each block's experts are a flat buffer of their own padded to the D / ep ranks holding them
(`expert_flat_units`), all-reduced over those ranks (ddp), reduce-scattered and all-gathered after the step
(zero1, zero2: `expert_bucket_events`), or gathered and reduce-scattered as FSDP's units (zero3, hsdp:
`expert_unit_events`).

Tokens. Routing is dropless, as Mixtral and torchtitan's default MoE run it: every token goes to its top-k experts,
no capacity factor, none dropped. Per MoE layer and micro-batch a rank sends each of its tokens k times, so its
dispatch all-to-all carries tokens x k x hidden elements in the working dtype, and the combine all-to-all brings the
same number of expert outputs back. A ledger row's payload is the rank's send buffer: exactly tokens x k rows for the
forward dispatch and the backward combine, whatever the routing; the forward combine and the backward dispatch send
back the rows the rank received, which routing decides (even routing: the same tokens x k; over an expert group
they always add up to ep times that). Before the dispatch the ranks swap how many rows each sends to each expert (an
all-to-all of num_experts int64 counts, as torchtitan's token dispatch does before its own), since the receivers
cannot know it. Routing is data-dependent; the prediction assumes every expert gets an even
share, so (ep - 1) / ep of those bytes leave the rank (core/network.py applies that fraction). Backward runs the
two all-to-alls again, each the other's conjugate, in reverse order; a whole block's re-forward (full checkpointing)
repeats both, while torchtitan's op policy saves all_to_all_single's output (shardscope.reference_models.OP_SAVE_LIST)
and selective checkpointing recomputes only attention.

Under the capacity rule (ModelSpec.capacity_factor, expert_routing.py) the send buffer has a fixed size whatever the
routing: every expert's capacity rows of each of the rank's sequences, num_experts x sequences x capacity rows, padded;
each rank sends an even 1 / ep of it to every rank of its group and gets as much back, so no counts are swapped and
every message is known.
"""

from __future__ import annotations

from shardscope.choices import checkpoints_block
from shardscope.core.comm_events import CommEvent, Place, event, gradient_reductions, step_gathers
from shardscope.core.model_states import ModelStates, dtype_bytes
from shardscope.core.params import ParamLayout, param_layout
from shardscope.core.sharding import FlatUnits, ceil_div
from shardscope.specs import ModelSpec, Scenario


def expert_numel(model: ModelSpec, tp: int = 1, ep: int = 1) -> int:
    """Elements of every MoE layer's experts that one of `tp` tensor-parallel, `ep` expert-parallel ranks holds."""
    if model.family != "moe":
        return 0
    return sum(t.numel for t in param_layout(model, tp, ep).block if ".experts." in t.name) * model.num_layers


def dispatch_bytes(scenario: Scenario) -> int:
    """Bytes one rank sends in one dispatch (or combine) all-to-all of one MoE layer: the rows its experts' layer
    runs on (tokens x top-k, or the capacity rule's padded buffer: ModelSpec.expert_rows) x hidden in the working
    dtype (the send buffer; core/network.py counts the (ep - 1) / ep of it that leaves the rank)."""
    model, training = scenario.model, scenario.training
    rows = model.expert_rows(training.micro_batch_size, training.sequence_length // scenario.strategy.cp)
    return rows * model.hidden_size * dtype_bytes(training.precision)


COUNT_BYTES = 8  # the row counts per expert are int64 (torch.bincount's dtype)


def block_expert_numel(layout: ParamLayout) -> int:
    """Elements of one block's experts in a rank's layout (its num_experts / ep of them)."""
    return sum(t.numel for t in layout.block if ".experts." in t.name)


def expert_shard_degree(scenario: Scenario) -> int:
    """Ranks that hold the same experts as one rank, one per expert group, in its shard group (hsdp's; else every
    data-parallel rank): D / ep. The teaching strategies shard (or, ddp, average) each block's experts over them."""
    return scenario.shard_degree // scenario.strategy.ep


def expert_flat_units(layout: ParamLayout, degree: int, expert_degree: int) -> FlatUnits:
    """The flat buffers of the teaching expert parallelism (runtime/teaching/expert_data_parallel.py): the root and
    each block's dense weights padded to a multiple of the `degree` ranks they are sharded over, each block's experts
    a unit of their own padded to a multiple of the `expert_degree` ranks that hold the same experts (both 1 under
    ddp, which shards nothing). Exact, padding included."""
    experts = block_expert_numel(layout)
    root = ceil_div(layout.root_numel, degree)
    dense = ceil_div(layout.block_numel - experts, degree)
    expert = ceil_div(experts, expert_degree)
    blocks = layout.num_blocks
    return FlatUnits(
        count=(1 if root else 0) + 2 * blocks,
        shard_numel=root + blocks * (dense + expert),
        padded_numel=root * degree + blocks * (dense * degree + expert * expert_degree),
        largest_shard_numel=max(root, dense, expert),
        root_padded_numel=root * degree,
        block_padded_numel=dense * degree + expert * expert_degree,
    )


def expert_bucket_events(scenario: Scenario, param_bytes: int, grad_bytes: int) -> list[CommEvent]:
    """The experts' own calls under the teaching ddp, zero1 and zero2 (`expert_flat_units`): each block's experts a
    gradient bucket of their own, all-reduced (ddp) or reduce-scattered (zero1 after the whole backward, zero2 as it
    fills) over the D / ep ranks holding them (the group 'experts'); under zero1 and zero2 their updated shards are
    then all-gathered over the same ranks after the step."""
    layout, stage = param_layout(scenario.model, scenario.strategy.tp, scenario.strategy.ep), scenario.strategy.stage
    ranks, numel = expert_shard_degree(scenario), block_expert_numel(layout)
    buckets = [(numel * grad_bytes, block + 1) for block in reversed(range(layout.num_blocks))]
    events = gradient_reductions(scenario, buckets, grad_bytes, stage == 0, stage == 1, "experts", ranks)
    if stage == 0:
        return events
    pieces = [(numel, f"experts {block}") for block in range(layout.num_blocks)]
    return events + step_gathers(scenario, pieces, param_bytes, "experts", ranks)


def expert_unit_events(scenario: Scenario, param_bytes: int, grad_bytes: int) -> list[CommEvent]:
    """The experts' own calls under the teaching zero3 and hsdp (`expert_flat_units`): per micro-batch and block,
    the rank's experts all-gathered over the D / ep ranks holding them before the MoE layer runs, again before its
    backward (reshard after forward), and their gradients reduce-scattered over the same ranks when complete (the
    group 'experts': one rank per expert group, strided by ep); under hsdp the shard is then averaged across the
    replica groups."""
    layout, expert_degree = (
        param_layout(scenario.model, scenario.strategy.tp, scenario.strategy.ep),
        expert_shard_degree(scenario),
    )
    numel = ceil_div(block_expert_numel(layout), expert_degree) * expert_degree
    events: list[CommEvent] = []
    for micro_batch in range(scenario.training.grad_accum_steps):
        for block in range(layout.num_blocks):
            at: Place = (micro_batch, block + 1, "before_forward")
            name = f"experts {block}"
            events.append(event("forward", "all_gather", expert_degree, numel * param_bytes, "experts", at, name))
        for block in reversed(range(layout.num_blocks)):
            name = f"experts {block}"
            if scenario.strategy.reshard_after_forward:
                at = (micro_batch, block + 1, "before_backward")
                events.append(event("backward", "all_gather", expert_degree, numel * param_bytes, "experts", at, name))
            at = (micro_batch, block + 1, "after_backward")
            events.append(event("backward", "reduce_scatter", expert_degree, numel * grad_bytes, "experts", at, name))
            if scenario.replica_degree > 1:  # hsdp: the shard averaged across the replica groups, as the dense ones
                shard = numel // expert_degree * grad_bytes
                events.append(event("backward", "all_reduce", scenario.replica_degree, shard, "replica", at, name))
    return events


def expert_parallel_states(scenario: Scenario, states: ModelStates) -> ModelStates:
    """The engine's states (computed on the rank's layout, num_experts / ep experts per layer, sharded as if over
    dp_shard x cp) with its sharded categories put back to X / D: experts are sharded over D / ep ranks only.
    Each sharded category grows by the ratio of the rank's parameters without and with the ep split (padding of
    the expert shards is not modelled apart from the unit's)."""
    ep = scenario.strategy.ep
    if ep == 1 or not scenario.model.has_shape:
        return states
    from shardscope.core.engines import rules_for  # the engines build their states on this module's hook

    if scenario.strategy.stage >= rules_for(scenario).experts_placed_from_stage:
        return states  # the engine sharded each expert unit over its own ranks (expert_flat_units)
    tp, model = scenario.strategy.tp, scenario.model
    whole = param_layout(model, tp).total_numel
    mine = param_layout(model, tp, ep).total_numel
    stage = scenario.strategy.stage

    def sharded(value: int, from_stage: int) -> int:
        return value * whole // mine if stage >= from_stage else value

    return ModelStates(
        parameters_bytes=sharded(states.parameters_bytes, rules_for(scenario).parameters_sharded_from_stage),
        gradients_bytes=sharded(states.gradients_bytes, 2),
        optimizer_state_bytes=sharded(states.optimizer_state_bytes, 1),
        persistent_buffers_bytes=states.persistent_buffers_bytes,
        forward_buffers_bytes=states.forward_buffers_bytes,
        backward_buffers_bytes=states.backward_buffers_bytes,
        boundary_buffers_bytes=states.boundary_buffers_bytes,
        backward_grads_bytes=states.backward_grads_bytes,
        boundary_grads_bytes=states.boundary_grads_bytes,
        recompute_grads_bytes=states.recompute_grads_bytes,
        forward_temporary_bytes=states.forward_temporary_bytes,
        optimizer_temporary_bytes=sharded(states.optimizer_temporary_bytes, 1),
        autocast=states.autocast,
        gradients_persist=states.gradients_persist,
        host_bytes=sharded(states.host_bytes, 1),  # offloaded shards (DeepSpeed's engine offloads in its states)
    )


def expert_parallel_events(scenario: Scenario, micro_batch: int) -> list[CommEvent]:
    """The dispatch and combine all-to-alls of every MoE layer of one micro-batch (none when ep is 1)."""
    ep = scenario.strategy.ep
    if ep == 1:
        return []
    rows, counts = dispatch_bytes(scenario), scenario.model.num_experts * COUNT_BYTES
    layers, checkpointing = scenario.model.num_layers, scenario.training.checkpointing
    forward: tuple[tuple[str, int], ...] = (("dispatch", rows), ("combine", rows))
    if not scenario.model.capacity_factor:  # dropless: the receivers learn the rows' counts first
        forward = (("counts", counts), *forward)
    events: list[CommEvent] = []

    def exchange(phase: str, block: int, at: Place, calls: tuple[tuple[str, int], ...]) -> None:
        for name, payload in calls:
            events.append(event(phase, "all_to_all", ep, payload, "ep", at, f"all_to_all ep {phase} {name} {block}"))

    for block in range(1, layers + 1):
        exchange("forward", block - 1, (micro_batch, block, "during_forward"), forward)
    for block in reversed(range(1, layers + 1)):
        if checkpoints_block(checkpointing, block - 1):
            exchange("backward", block - 1, (micro_batch, block, "during_recompute"), forward)
        exchange(
            "backward", block - 1, (micro_batch, block, "during_backward"), (("combine", rows), ("dispatch", rows))
        )
    return events
