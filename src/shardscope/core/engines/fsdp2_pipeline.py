"""FSDP2 `fully_shard` inside torch.distributed.pipelining: the moments of a pipeline rank's step and its
data-parallel calls, the 'pytorch' engine's `pipeline_moments` and `pipeline_data_parallel_rows` for the strategies
that run on fully_shard.

The rule, from torch 2.13's source. Before each backward of a micro-batch, PipelineStage.backward_maybe_with_nosync
(torch/distributed/pipelining/stage.py) calls `set_is_last_backward(False)`, `set_reshard_after_backward(False)` and
`set_requires_gradient_sync(False)` on the stage's module, for every unit in it. So FSDPParamGroup.post_backward
(torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py) neither reshards a unit after its backward nor
reduce-scatters its gradients: it keeps them unsharded, accumulated across micro-batches in the reduce dtype
(FSDPParam.to_accumulated_grad_if_needed in _fsdp_param.py). Only the schedule's last action,
PipelineStage.perform_reduce_grad, turns both back on and calls every unit's post_backward once: one reduce-scatter
per unit per step, then each unit reshards. A forward still reshards each unit after it runs
(FSDPParamGroup.post_forward, reshard_after_forward=True: zero3, fsdp, hsdp), so a backward that follows a forward of
its stage gathers its units again, one at a time from the output down (the head's root first on the last stage),
and keeps them; under zero2 (reshard_after_forward=False) the units stay gathered from the step's first forward.

So, on top of the rank's sharded parameters and optimizer state (its sharded gradients exist only from the step's
reduce-scatter on: the step starts with them set to None), a backward holds the micro-batches in flight, every
stage's accumulated gradients once its first backward has passed, every unit gathered since the last forward, and,
at each gather, the all-gather's flat output beside the unit it is copied into (foreach_all_gather_copy_out). The
moments followed, for each state of the schedule (which stages are gathered and which have run a backward) at its
most micro-batches in flight: in a backward, the loss's backward on the last stage, each unit's gather at the top and
the bottom of the stage and the top and bottom blocks' own backward (with the units still gathered, no forward
since, only the loss's and the blocks' backward); at a forward's end, the top block's forward and the loss's. Then
the step's reduce-scatters, with every unit gathered and every accumulated gradient, and the optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

from shardscope.core.comm_events import CommEvent
from shardscope.core.engines.base import (
    LOSS_GRAD_BYTES,
    LiveBytes,
    Moment,
    as_live_bytes,
)
from shardscope.core.engines.fsdp2_pipeline_states import fullest_actions, stage_bit
from shardscope.core.engines.pipeline_load import PipelineCalls, PipelineLoad, StageRows
from shardscope.core.kept import kept
from shardscope.core.model_states import dtype_bytes
from shardscope.core.pipeline import PipelineStage, layout_of
from shardscope.core.pipeline_schedule import Action
from shardscope.core.result import CollectiveRow, merge_ledger
from shardscope.core.sharding import dim0_unit_sizes
from shardscope.specs import Scenario


class _Units(NamedTuple):
    """One stage's FSDP units, in bytes."""

    stage: PipelineStage
    root: int
    """The stage root's parameters gathered (compute dtype): the embeddings, or the final norm and the head."""
    block: int
    """One block's parameters gathered."""
    root_gradients: int
    """The root's unsharded gradients as they accumulate (reduce dtype)."""
    block_gradients: int
    """One block's unsharded gradients as they accumulate (reduce dtype)."""
    staged: bool
    """An all-gather has a flat output of its own to copy out of: over one rank (dp 1) FSDPParamGroup.unshard reuses
    the sharded data and allocates none."""

    @property
    def gathered(self) -> int:
        """Every unit of the stage gathered."""
        return self.root + self.stage.layers * self.block

    @property
    def accumulated(self) -> int:
        """All the stage's unsharded gradients."""
        return self.root_gradients + self.stage.layers * self.block_gradients


def _units(scenario: Scenario, stage: PipelineStage, degree: int) -> _Units:
    training = scenario.training
    compute = dtype_bytes(training.precision)
    reduce = 4 if training.is_mixed else compute  # MixedPrecisionPolicy(reduce_dtype=float32) under mixed
    root, block = dim0_unit_sizes(layout_of(scenario, stage), degree)
    return _Units(stage, root * compute, block * compute, root * reduce, block * reduce, degree > 1)


def fsdp2_pipeline_moments(scenario: Scenario, load: PipelineLoad) -> list[Moment]:
    """The moments of the rank's step (see the module docstring), the largest of each kind kept."""
    units = {stage.index: _units(scenario, stage, load.shard_degree) for stage in load.stages}
    moments = [(name, _live(load, *terms)) for name, terms in _action_moments(scenario, load, units)]
    moments.append(("the step's reduce-scatters", _reduce_scatter(scenario, load, list(units.values()))))
    states = load.states
    step = (states.parameters_bytes, states.gradients_bytes, states.optimizer_state_bytes, 0)
    buffers = load.receive_bytes + states.persistent_buffers_bytes
    moments.append(("optimizer step", as_live_bytes((*step, buffers, states.optimizer_temporary_bytes))))
    return moments


_Terms = tuple[int, int, int]
"""(activations, buffers, temporary) of a moment of a forward or backward, beside what `_live` adds."""


def _action_moments(scenario: Scenario, load: PipelineLoad, units: dict[int, _Units]) -> tuple[tuple[str, _Terms], ...]:
    """The largest moment of each kind the schedule's forwards and backwards meet (the first of them), named by
    where it falls. Kept by everything it reads: a planner's scenarios that differ only in the rank's sharded
    states (the zero stage, offload, the world beyond the shard group), which every moment holds alike, share it."""
    model, training = scenario.model, scenario.training
    key = (
        load.schedule,
        _reshards_after_forward(scenario),
        load.weights,
        tuple(units.values()),
        load.activations,
        load.step_activations,
        training.precision,
        model.ffn_hidden_size,
        model.hidden_size,
        scenario.strategy.tp,
    )
    return kept(_moments_kept, key, lambda: _walk_action_moments(scenario, load, units), CACHED_ACTION_MOMENTS)


CACHED_ACTION_MOMENTS = 16384
_moments_kept: dict[tuple[object, ...], tuple[tuple[str, _Terms], ...]] = {}


def _walk_action_moments(
    scenario: Scenario, load: PipelineLoad, units: dict[int, _Units]
) -> tuple[tuple[str, _Terms], ...]:
    """`_action_moments`, computed."""
    # each kind's largest (the first of them): its bytes beside what every moment of a backward holds
    # (`_live`), the action's stage, direction and micro-batch, and (activations, buffers, temporary)
    found: dict[str, tuple[int, int, bool, int, _Terms]] = {}
    output = load.activations.hidden_bytes  # what a stage sends forward: one micro-batch's output
    fullest = fullest_actions(load.schedule, _reshards_after_forward(scenario), load.weights, output)
    for (backward, index, gathered, backwarded), in_flight, micro_batch in fullest:
        held = load.step_activations + in_flight
        own = units[index]
        others = gradients = 0
        for i, other in units.items():
            if i != index:
                others += other.gathered if gathered & stage_bit(i) else 0
                gradients += other.accumulated if backwarded & stage_bit(i) else 0
        own_gathered, own_backwarded = bool(gathered & stage_bit(index)), bool(backwarded & stage_bit(index))
        if backward:
            made = _backward(scenario, load, own, held, own_gathered, own_backwarded)
        else:
            gradients += own.accumulated if own_backwarded else 0
            made = _forward(scenario, load, own, held, own_gathered)
        for kind, (activations, buffers, temporary) in made:
            terms = (activations, others + buffers, gradients + temporary)
            total = sum(terms)
            if kind not in found or total > found[kind][0]:
                found[kind] = (total, index, backward, micro_batch, terms)
    return tuple(
        (f"stage {index} {'backward' if backward else 'forward'} {micro_batch}: {kind}", terms)
        for kind, (_, index, backward, micro_batch, terms) in found.items()
    )


def _live(load: PipelineLoad, activations: int, buffers: int, temporary: int) -> LiveBytes:
    """A backward's moment: the sharded parameters and optimizer state, no sharded gradients yet."""
    states = load.states
    persistent = load.receive_bytes + states.persistent_buffers_bytes
    return as_live_bytes(
        (states.parameters_bytes, 0, states.optimizer_state_bytes, activations, persistent + buffers, temporary)
    )


def _reshards_after_forward(scenario: Scenario) -> bool:
    """fully_shard(reshard_after_forward=True): zero3, fsdp and hsdp; zero2 keeps every unit gathered from its first
    forward to the step's end (FSDPParamGroup.reshard returns at once in forward)."""
    strategy = scenario.strategy
    return strategy.stage == 3 and strategy.reshard_after_forward


def _forward(
    scenario: Scenario, load: PipelineLoad, units: _Units, held: int, gathered: bool
) -> list[tuple[str, tuple[int, int, int]]]:
    """(kind, (activations, gathered bytes, temporary bytes)) as a forward of the stage ends, `held` the activations
    in flight with its micro-batch's: the root stays gathered through the stage's forward, each block reshards after
    its own (zero2's stay gathered), and with implicit prefetching FSDP2 keeps the last all-gather's flat output
    until the next copy-out (FSDPParamGroup.wait_for_unshard), so past the stage's forward. Units still gathered by
    a backward are not gathered again."""
    acts, stage = load.activations, units.stage
    staged = 0 if gathered or not units.staged else (units.block if stage.layers else units.root)
    reshards = _reshards_after_forward(scenario)
    moments = []
    if stage.layers:  # the top block's output being made, before the head's forward
        made = held - (acts.head_bytes + acts.logits_bytes if stage.head else 0)
        kept = units.root + units.block if reshards else units.gathered
        moments.append(("top block's forward", (made, kept, staged + acts.hidden_bytes)))
    if stage.head:  # the loss's spike beyond the logits, which the weight counts as the stage's cached output
        spike = acts.loss_forward_spike_bytes - acts.logits_bytes
        moments.append(("loss's forward", (held, units.root if reshards else units.gathered, staged + spike)))
    return moments


def _backward(
    scenario: Scenario, load: PipelineLoad, units: _Units, held: int, gathered: bool, backwarded: bool
) -> list[tuple[str, tuple[int, int, int]]]:
    """(kind, (activations, gathered bytes, temporary bytes)) at the moments of one backward of the stage, `held`
    the activations in flight as it starts. FSDP2's pre-backward hooks run as the gradient reaches each unit's
    output: the head stage's root first (its output is the logits), then the top block, then, on the other stages,
    the stage root at once (its output is the top block's)."""
    acts, stage = load.activations, units.stage
    stored = acts.stored_block_bytes
    # the head's backward frees what the loss and the head kept (the logits the stage cached as its output stay)
    head_freed = acts.head_bytes if stage.head else 0
    # the previous backward's input gradient, kept by the stage until its send completes
    sending = acts.hidden_bytes if backwarded and not stage.embedding else 0
    own = acts.block_backward_bytes
    if backwarded and not scenario.training.is_mixed:
        # the gradients stay on the parameters in their own dtype: AccumulateGrad adds the output projection's
        # weight gradient into them, so the MLP's backward holds no weight gradient of its own
        model, element = scenario.model, dtype_bytes(scenario.training.precision)
        own -= model.ffn_hidden_size // scenario.strategy.tp * model.hidden_size * element

    def accumulated(blocks_done: int) -> int:
        if backwarded:
            return units.accumulated
        return blocks_done * units.block_gradients

    # the head's own gradients, made as autograd reaches them, wait in the compute dtype for the root's
    # post-backward at the end of the stage's backward, unless AccumulateGrad adds them into the accumulated ones
    head_new = units.root if stage.head and (scenario.training.is_mixed or not backwarded) else 0

    moments = []
    if stage.head:  # the loss's backward: its fp32 gradients, nothing of the micro-batch freed yet
        loss = acts.loss_backward_spike_bytes + LOSS_GRAD_BYTES + accumulated(0) + sending
        moments.append(("loss's backward", (held, units.gathered if gathered else 0, loss)))
    for j, kind in ((0, "top block"), (stage.layers - 1, "bottom block")) if stage.layers else ():
        flowing = acts.hidden_bytes + LOSS_GRAD_BYTES if stage.head or j else 0
        activations = held - head_freed - j * stored
        grads = accumulated(j) + sending + flowing + head_new
        blocks = units.root + (j + 1) * units.block
        if gathered:
            moments.append((f"{kind}'s backward", (activations, units.gathered, grads + own)))
            continue
        # while a block runs backward FSDP2 has the next block's all-gather in flight (its backward prefetch)
        prefetched = units.block if j < stage.layers - 1 and units.staged else 0
        moments.append((f"{kind}'s backward", (activations, blocks, grads + own + prefetched)))
        before = blocks if stage.head or j else units.block
        moments.append((f"{kind} gathered", (activations, before, grads + units.block * units.staged)))
    if gathered or not units.root:
        return moments
    if stage.head:
        # the loss's backward has made the logits' gradient and freed its log-softmax
        loss = acts.head_gradient_bytes + LOSS_GRAD_BYTES
        grads = accumulated(0) + sending + loss
        moments.append(
            ("root gathered", (held - acts.log_softmax_bytes, units.root, grads + units.root * units.staged))
        )
    else:
        moments.append(("root gathered", (held, units.root + units.block, accumulated(0) + units.root * units.staged)))
    return moments


def _reduce_scatter(scenario: Scenario, load: PipelineLoad, units: list[_Units]) -> LiveBytes:
    """The step's end, PipelineStage.perform_reduce_grad: FSDPParamGroup.post_backward of every unit in turn (each
    stage's root first, then its blocks in order) reshards the unit, copies its accumulated gradients into the
    reduce-scatter input and reduce-scatters it (gloo holds a clone of the input: core.engines.fsdp2), and the shard
    lands as the unit's sharded gradient. The largest of those moments (the first of them), the step's token ids and
    targets held.

    Along a stage's alike blocks each moment holds what the one before held less the block's gathered parameters and
    its gradients plus their shard, no larger than them: the first block's is the largest of them (the first of the
    largest), so it alone is weighed, whatever the layers."""
    runs = [(u.root, u.root_gradients, 1) for u in units]  # (unit, its gradients, how many in a row)
    runs += [(u.block, u.block_gradients, u.stage.layers) for u in units if u.stage.layers]
    clone = scenario.cluster.backend == "gloo"
    gathered = sum(u.gathered for u in units)
    accumulated = sum(u.accumulated for u in units)
    states = load.states
    held = load.receive_bytes + states.persistent_buffers_bytes
    # every moment holds the same parameters, optimizer state, activations and persistent buffers: the moments are
    # weighed by their totals and only the largest (the first of them) is built
    alike = states.parameters_bytes + states.optimizer_state_bytes + load.step_activations + held
    landed, best, best_total = 0, (0, 0, 0), 0
    for params, grads, count in runs:
        shard = grads // load.shard_degree
        terms = (landed + shard, gathered - params, accumulated + (grads if clone else 0))
        total = alike + terms[0] + terms[1] + terms[2]
        if total > best_total:
            best, best_total = terms, total
        gathered -= count * params
        accumulated -= count * grads
        landed += count * shard
    if not best_total:
        return as_live_bytes((0,) * 6)
    gradients, buffers, temporary = best
    return as_live_bytes(
        (
            states.parameters_bytes,
            gradients,
            states.optimizer_state_bytes,
            load.step_activations,
            held + buffers,
            temporary,
        )
    )


def _gathers(scenario: Scenario, actions: tuple[Action, ...]) -> frozenset[tuple[int, bool, int]]:
    """The (stage, backward, micro-batch) of the actions that find their stage's units not gathered: in forward at
    the start or after a forward, in backward after a forward (zero2's stay gathered from the first forward)."""
    gathered: dict[int, bool] = {}
    found = set()
    for action in actions:
        if not gathered.get(action.stage, False):
            found.add((action.stage, action.backward, action.micro_batch))
        gathered[action.stage] = action.backward or not _reshards_after_forward(scenario)
    return frozenset(found)


def _reduces_once(phase: str, op: str, group: str) -> bool:
    """A data-parallel gradient reduction (the reduce-scatter, hsdp's all-reduce of the shard): once per step."""
    return phase == "backward" and group == "dp" and op in ("reduce_scatter", "all_reduce")


def _unit_gather(phase: str, op: str, group: str) -> bool:
    """A unit's all-gather in forward or backward (tensor parallelism's gathers come every micro-batch)."""
    return phase in ("forward", "backward") and group == "dp" and op == "all_gather"


def fsdp2_pipeline_rows(scenario: Scenario, load: PipelineCalls, rows_of: StageRows) -> list[CollectiveRow]:
    """The rank's data-parallel collectives under the rule of the module docstring, stage by stage, from those of
    the stage without a pipeline (every micro-batch gathering each unit in forward and again in backward, and
    reduce-scattering it): each reduce-scatter (and hsdp's all-reduce of the shard) once per step; each all-gather as
    often as the schedule reaches the stage with its units not gathered (`_gathers`)."""
    micro_batches = scenario.training.grad_accum_steps
    gathers = _gathers(scenario, load.actions)
    result = []
    for stage in load.stages:
        for row in rows_of((stage,)):
            count = row.count
            if _unit_gather(row.phase, row.op, row.group):
                times = sum((stage.index, row.phase == "backward", k) in gathers for k in range(micro_batches))
                count = row.count * times // micro_batches
            elif _reduces_once(row.phase, row.op, row.group):
                count = row.count // micro_batches
            result.append(replace(row, count=count))
    return list(merge_ledger(result))


CACHED_GATHERS = 1024
_kept_gathers: dict[tuple[tuple[Action, ...], bool], frozenset[tuple[int, bool, int]]] = {}
"""`_gathers` of a rank's actions, kept for `fsdp2_pipeline_events`: the time model places each rank's calls for two
runs of a long step, and the planner asks the same schedules for many plans."""


def fsdp2_pipeline_events(
    scenario: Scenario, load: PipelineCalls, events: tuple[CommEvent, ...], micro_batches: Sequence[int]
) -> tuple[CommEvent, ...]:
    """The calls `fsdp2_pipeline_rows` counts, from the proxy's (every micro-batch gathering and reduce-scattering
    each unit, compute stages numbered over the rank's stages in order; its micro-batch k standing for the step's
    `micro_batches[k]`): a unit's all-gather kept only where the schedule finds its stage not gathered, and the
    reduce-scatters of the last micro-batch alone, moved after its whole backward, where
    PipelineStage.perform_reduce_grad issues them after the schedule's last action. Calls of nothing (the root unit
    of a stage without one) are not made."""
    key = (load.actions, _reshards_after_forward(scenario))
    gathers = kept(_kept_gathers, key, lambda: _gathers(scenario, load.actions), CACHED_GATHERS)
    owner: list[int] = []  # the pipeline stage of each compute stage of the proxy
    for stage in load.stages:
        owner += [stage.index] * stage.layers
    root = next((stage.index for stage in load.stages if stage.embedding or stage.head), load.stages[0].index)
    last = scenario.training.grad_accum_steps - 1
    kinds: dict[int, str] = {}  # by the row's id: every micro-batch's calls share micro-batch 0's rows
    placed = []
    for call in events:
        row = call.row
        kind = kinds.get(id(row))
        if kind is None:
            kind = kinds[id(row)] = _kind(row)
        if kind == "kept":
            placed.append(call)
        elif kind == "gather":
            index = owner[call.stage - 1] if 0 < call.stage <= len(owner) else root
            if (index, row.phase == "backward", micro_batches[call.micro_batch]) in gathers:
                placed.append(call)
        elif kind == "reduce" and micro_batches[call.micro_batch] == last:
            placed.append(replace(call, stage=0, trigger="after_backward"))
    return tuple(placed)


def _kind(row: CollectiveRow) -> str:
    """What `fsdp2_pipeline_events` does with a call of `row`: drops it (a call of nothing), keeps it where the
    schedule finds its unit not gathered ('gather'), on the last micro-batch only ('reduce'), or always ('kept')."""
    if not row.payload_bytes and row.group == "dp":
        return "dropped"
    if _unit_gather(row.phase, row.op, row.group):
        return "gather"
    if _reduces_once(row.phase, row.op, row.group):
        return "reduce"
    return "kept"
