"""Memory of every pipeline rank: its stages' model states, the activations its schedule keeps in flight, and the
point-to-point receive buffers.

Model states are the scenario's engine's (`core.engines`) for the rank's own parameters: its stages' blocks, the
embeddings on the first stage, the final norm and output head on the last, sharded over the data-parallel ranks of
the pipeline rank (the world divided by pp x tp) as the strategy says; tensor parallelism splits them as it does
without a pipeline (`core.params`). `rank_proxy` is the model a rank holds, which the engine's rules price.

Activations: one micro-batch's activations of each stage, as the engine's pipeline holds them (its rules'
`pipeline_stage_activations`: the teaching pipeline's for 'paper', torch's PipelineStage's for 'pytorch'), times the
micro-batches of that stage in flight at the worst moment of the rank's schedule (`core.pipeline_schedule`), plus
what the engine's schedule holds for the whole step (`pipeline_step_activations`). torch's PipelineStage allocates one
activation receive buffer (all but the first stage) and one gradient receive buffer (all but the last) per
micro-batch and keeps them for the step (`_prepare_forward_infra`, `_setup_backward_recv_info` in
torch/distributed/pipelining/stage.py, torch 2.13): those are the rank's buffers, beside ZeRO-3's gathered unit.

The peak is the largest of the engine's moments of the rank's step (its rules' `pipeline_moments`), and each
category is its largest over them: for the paper and deepspeed engines, every term at its largest together and the
optimizer step; for FSDP2 inside torch's pipelining, the schedule followed action by action
(core.engines.fsdp2_pipeline).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache, partial
from typing import NamedTuple

from shardscope.core.activations import ActivationEstimate
from shardscope.core.engines import rules_for
from shardscope.core.engines.base import LOSS_GRAD_BYTES, EngineRules, activations_for, peak_of
from shardscope.core.engines.pipeline_load import PipelineLoad, RankSchedule
from shardscope.core.kept import kept
from shardscope.core.model_states import ModelStates
from shardscope.core.params import StageModel
from shardscope.core.pipeline import PipelineStage, pipeline_rank_of, pipeline_stages, rank_stages, stage_model
from shardscope.core.pipeline_schedule import Action, peak_in_flight
from shardscope.core.rank_share import activation_bytes_per_element, rank_share
from shardscope.core.result import MemoryBreakdown, MemoryEstimate, StageMemory
from shardscope.specs import ClusterSpec, ModelSpec, Scenario, Strategy


def boundary_bytes(scenario: Scenario) -> int:
    """One micro-batch's hidden states between two stages on one rank (the activation sent forward and its gradient
    sent back): tokens / cp (and / tp under sequence parallelism) x hidden x the compute dtype."""
    share, training = rank_share(scenario), scenario.training
    tokens = training.tokens_per_micro_batch // share.cp // share.boundary_split
    return tokens * scenario.model.hidden_size * activation_bytes_per_element(training)


@lru_cache(maxsize=4096)  # the planner asks every pipeline rank's of thousands of scenarios, several times each
def stage_proxy(scenario: Scenario, layers: int, embedding: bool = True, head: bool = True) -> Scenario:
    """The scenario without a pipeline whose model is what one pipeline rank holds (`layers` blocks, the
    embeddings and the head where `embedding` and `head` say, core.params.StageModel), on the GPUs of one pipeline
    rank (the world divided by pp): its engine rules price that rank's states exactly."""
    cluster, strategy = scenario.cluster, scenario.strategy
    world = cluster.world_size // strategy.pp
    per_node = cluster.gpus_per_node
    if world > per_node and world % per_node:
        per_node = math.gcd(world, per_node)
    return Scenario(
        model=kept(
            _stage_models,
            (scenario.model, layers, embedding, head),
            partial(stage_model, scenario.model, layers, embedding, head),
            KEPT_PARTS,
        ),
        cluster=kept(_clusters, (cluster, world, per_node), partial(_cluster, cluster, world, per_node), KEPT_PARTS),
        training=scenario.training,
        strategy=kept(_strategies, strategy, partial(_without_pipeline, strategy), KEPT_PARTS),
        overheads=scenario.overheads,
    )


KEPT_PARTS = 4096
"""Proxies' parts kept: the planner's scenarios share a few models, clusters and strategies, and replacing a field
of each anew (validation included) cost more than the rest of a proxy."""
_stage_models: dict[tuple[ModelSpec, int, bool, bool], StageModel] = {}
_clusters: dict[tuple[ClusterSpec, int, int], ClusterSpec] = {}
_strategies: dict[Strategy, Strategy] = {}


def _cluster(cluster: ClusterSpec, world: int, per_node: int) -> ClusterSpec:
    """The GPUs of one pipeline rank."""
    return replace(cluster, world_size=world, gpus_per_node=per_node)


def _without_pipeline(strategy: Strategy) -> Strategy:
    """The strategy over one pipeline stage."""
    return replace(strategy, pp=1, pp_schedule="1f1b", pp_virtual_stages=0, pp_layers=())


def pipeline_rank_actions(scenario: Scenario, pipeline_rank: int) -> tuple[Action, ...]:
    """The forwards and backwards pipeline rank `pipeline_rank` runs, in its schedule's order."""
    return rank_schedule(scenario, pipeline_rank).actions


def rank_schedule(scenario: Scenario, pipeline_rank: int) -> RankSchedule:
    """The shape of pipeline rank `pipeline_rank`'s order of forwards and backwards."""
    strategy = scenario.strategy
    return RankSchedule(
        strategy.pp_schedule, strategy.pp, strategy.virtual_stages, scenario.training.grad_accum_steps, pipeline_rank
    )


def rank_proxy(scenario: Scenario, stages: tuple[PipelineStage, ...]) -> Scenario:
    """`stage_proxy` of the pipeline rank holding `stages`."""
    layers = sum(stage.layers for stage in stages)
    return stage_proxy(scenario, layers, any(stage.embedding for stage in stages), any(stage.head for stage in stages))


def in_flight_peak(schedule: RankSchedule, weights: tuple[tuple[int, int], ...]) -> tuple[int, tuple[int, ...]]:
    """The most activations the rank's order keeps in flight (`weights`: bytes per micro-batch of each of its
    stages) and the micro-batches of each stage in flight then, in the order of `weights`. Kept per shape and
    weights: scenarios that differ only in how the data-parallel ranks shard their states share both."""

    def walk() -> tuple[int, tuple[int, ...]]:
        peak, counts = peak_in_flight(list(schedule.actions), dict(weights))
        return peak, tuple(counts[stage] for stage, _ in weights)

    return kept(_in_flight_peaks, (schedule, weights), walk, CACHED_IN_FLIGHT_PEAKS)


CACHED_IN_FLIGHT_PEAKS = 16384
_in_flight_peaks: dict[tuple[RankSchedule, tuple[tuple[int, int], ...]], tuple[int, tuple[int, ...]]] = {}


class _RankModel(NamedTuple):
    """What the engine makes of the model one pipeline rank holds: shared by the ranks holding as many layers and the
    same ends of the model."""

    proxy: Scenario
    states: ModelStates
    activations: ActivationEstimate


def pipeline_rank_memory(scenario: Scenario, pipeline_rank: int) -> tuple[StageMemory, int]:
    """One pipeline rank's memory (every rank of its data- and tensor-parallel group holds the same) and its host
    bytes under offload: each category at its largest over the engine's moments (`pipeline_moments`), and the
    largest moment as the peak."""
    stages = rank_stages(scenario, pipeline_rank)
    return _rank_memory(scenario, rules_for(scenario), pipeline_rank, stages, _shared(scenario))


class _RankParts(NamedTuple):
    """What a pipeline rank's memory and its floor read: its model, its schedule and what that keeps in flight."""

    model: _RankModel
    weights: tuple[tuple[int, int], ...]
    """Activation bytes per micro-batch of each of its stages."""
    schedule: RankSchedule
    in_flight_bytes: int
    counts: tuple[int, ...]
    """Micro-batches of each stage in flight at the fullest moment."""
    receive_bytes: int
    """The point-to-point receive buffers it keeps for the step."""


class _Shared(NamedTuple):
    """What the pipeline ranks of one scenario share, made as the first of them needs it."""

    models: dict[tuple[int, bool, bool], _RankModel]
    """The rank models, by the layers and ends a rank holds."""
    stage_bytes: dict[tuple[int, int, bool, bool], int]
    """A stage's activations per micro-batch (the engine's `pipeline_stage_activations`), by the identity of the
    rank model's activations (held in `models` meanwhile) and the stage's layers and ends."""
    boundary_bytes: int
    """`boundary_bytes` of the scenario."""


def _shared(scenario: Scenario) -> _Shared:
    return _Shared({}, {}, boundary_bytes(scenario))


def _rank_parts(
    scenario: Scenario, rules: EngineRules, pipeline_rank: int, stages: tuple[PipelineStage, ...], shared: _Shared
) -> _RankParts:
    """The parts of pipeline rank `pipeline_rank`, with `shared` what the scenario's ranks made so far."""
    layers = sum(stage.layers for stage in stages)
    embedding, head = any(stage.embedding for stage in stages), any(stage.head for stage in stages)
    held = shared.models.get((layers, embedding, head))
    if held is None:
        proxy = stage_proxy(scenario, layers, embedding, head)
        states = rules.rank_states(proxy, 0)
        acts = activations_for(scenario, states.autocast, rules.megatron_tensor_parallel)
        held = shared.models[layers, embedding, head] = _RankModel(proxy, states, acts)
    weights = tuple((stage.index, _stage_bytes(scenario, rules, held.activations, stage, shared)) for stage in stages)
    schedule = rank_schedule(scenario, pipeline_rank)
    in_flight_bytes, counts = in_flight_peak(schedule, weights)
    last = scenario.strategy.pipeline_stages - 1
    receives = sum((stage.index > 0) + (stage.index < last) for stage in stages)
    receive_bytes = receives * scenario.training.grad_accum_steps * shared.boundary_bytes
    return _RankParts(held, weights, schedule, in_flight_bytes, counts, receive_bytes)


def _stage_bytes(
    scenario: Scenario, rules: EngineRules, acts: ActivationEstimate, stage: PipelineStage, shared: _Shared
) -> int:
    """The engine's `pipeline_stage_activations` of `stage`, which reads only its layers and ends of the stage, once
    per kind of stage (the ranks of a pipeline hold a few kinds: the first, the last and the rest)."""
    kind = (id(acts), stage.layers, stage.embedding, stage.head)
    found = shared.stage_bytes.get(kind)
    if found is None:
        found = shared.stage_bytes[kind] = rules.pipeline_stage_activations(scenario, acts, stage)
    return found


def _by_rank(scenario: Scenario) -> list[tuple[PipelineStage, ...]]:
    """Each pipeline rank's stages, first rank to last."""
    by_rank: list[list[PipelineStage]] = [[] for _ in range(scenario.strategy.pp)]
    for stage in pipeline_stages(scenario):
        by_rank[stage.rank].append(stage)
    return [tuple(stages) for stages in by_rank]


def pipeline_peak_floor_bytes(scenario: Scenario) -> int:
    """A floor under the busiest pipeline rank's peak (`pipeline_memory`), at a fraction of its cost: the planner
    asks it before it estimates a pipeline, and one whose floor already breaks the budget cannot fit.

    Every engine's pipeline moments include the optimizer step (the weights, every gradient, the optimizer state, the
    persistent and receive buffers) and a moment of the schedule's fullest, which holds the weights, the optimizer
    state, those buffers and every micro-batch in flight then. So each rank's peak is at least the framework context
    plus the weights, optimizer state and buffers, plus the larger of its gradients and its activations in flight.
    tests/core/test_pipeline_peak_floor.py holds it under every rank's peak of every engine and schedule."""
    rules, floor, shared = rules_for(scenario), 0, _shared(scenario)
    for rank, stages in enumerate(_by_rank(scenario)):
        parts = _rank_parts(scenario, rules, rank, stages, shared)
        states = parts.model.states
        held = states.parameters_bytes + states.optimizer_state_bytes + states.persistent_buffers_bytes
        floor = max(floor, held + parts.receive_bytes + max(states.gradients_bytes, parts.in_flight_bytes))
    return floor + scenario.overheads.context_bytes


def _rank_memory(
    scenario: Scenario,
    rules: EngineRules,
    pipeline_rank: int,
    stages: tuple[PipelineStage, ...],
    shared: _Shared,
) -> tuple[StageMemory, int]:
    """`pipeline_rank_memory`, with `shared` what the scenario's ranks made so far."""
    strategy, training, model = scenario.strategy, scenario.training, scenario.model
    parts = _rank_parts(scenario, rules, pipeline_rank, stages, shared)
    held, weights, schedule, counts = parts.model, parts.weights, parts.schedule, parts.counts
    states, acts = held.states, held.activations
    layers = sum(stage.layers for stage in stages)
    embedding, head = any(stage.embedding for stage in stages), any(stage.head for stage in stages)
    # the head stage's loss: its forward spike, or the start of its backward (the log-softmax's gradient), the larger
    spike = max(acts.loss_forward_spike_bytes, acts.loss_backward_spike_bytes + LOSS_GRAD_BYTES) if head else 0
    # the first backward after the warm-up starts with every micro-batch in flight: a block's backward working set
    # (its MLP's activation and weight gradients, core.activations) on top of them
    working = acts.block_backward_bytes if layers else 0
    if not working and embedding:  # the embedding's backward makes a dense gradient
        working = model.vocab_size // strategy.tp * model.hidden_size * activation_bytes_per_element(training)
    load = PipelineLoad(
        stages=stages,
        states=states,
        activations=acts,
        schedule=schedule,
        weights=weights,
        in_flight_bytes=parts.in_flight_bytes,
        in_flight=sum(counts),
        step_activations=rules.pipeline_step_activations(scenario, stages),
        receive_bytes=parts.receive_bytes,
        working_bytes=max(spike, working),
        shard_degree=held.proxy.shard_degree,
    )
    moments = rules.pipeline_moments(scenario, load)
    moment, peak = peak_of(moments)
    largest = [max(category) for category in zip(*(live for _, live in moments), strict=True)]
    overhead = scenario.overheads.context_bytes
    per_rank = MemoryBreakdown(
        parameters_bytes=largest[0],
        gradients_bytes=largest[1],
        optimizer_state_bytes=largest[2],
        activations_bytes=largest[3],
        buffers_bytes=largest[4],
        temporary_bytes=largest[5],
        overhead_bytes=overhead,
        peak_bytes=peak.total + overhead,
    )
    stage_memory = StageMemory(
        pipeline_rank=pipeline_rank,
        stages=tuple(stage.described for stage in stages),
        layers=layers,
        in_flight=counts,
        per_rank=per_rank,
        peak_moment=moment,
    )
    return stage_memory, states.host_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineMemory:
    """Every pipeline rank's memory, and which is the busiest."""

    per_stage: tuple[StageMemory, ...]
    """One entry per pipeline rank, first to last."""
    host_bytes: tuple[int, ...]
    """Host bytes of one GPU of each pipeline rank under offload."""

    @property
    def busiest(self) -> int:
        """The pipeline rank with the highest peak (the first of them)."""
        peaks = [entry.per_rank.peak_bytes for entry in self.per_stage]
        return peaks.index(max(peaks))


def pipeline_memory(scenario: Scenario) -> PipelineMemory:
    """The memory of every pipeline rank of the scenario."""
    rules = rules_for(scenario)
    shared = _shared(scenario)
    entries = [_rank_memory(scenario, rules, rank, stages, shared) for rank, stages in enumerate(_by_rank(scenario))]
    return PipelineMemory(per_stage=tuple(entry for entry, _ in entries), host_bytes=tuple(host for _, host in entries))


def estimate_pipeline_memory(scenario: Scenario, rank: int | None = None) -> MemoryEstimate:
    """The estimate of a pipeline: `per_rank` of the busiest pipeline rank's GPUs (or of `rank`'s), and every
    pipeline rank in `per_stage`."""
    world = scenario.cluster.world_size
    memory = pipeline_memory(scenario)
    if rank is None:
        shown = memory.busiest
        rank = shown * (world // scenario.strategy.pp)
    elif not 0 <= rank < world:
        raise ValueError(f"rank={rank} must be between 0 and world_size-1={world - 1}")
    else:
        shown = pipeline_rank_of(scenario, rank)
    entry = memory.per_stage[shown]
    return MemoryEstimate(
        scenario=scenario,
        per_rank=entry.per_rank,
        host_bytes_per_node=memory.host_bytes[shown] * scenario.cluster.ranks_per_node,
        peak_moment=entry.peak_moment,
        activations_estimated=True,
        rank=rank,
        per_stage=memory.per_stage,
    )
