"""The search space: GPU counts and the tensor, context and pipeline parallel degrees that split them, how each
reaches the global batch, and the strategies (with their pipeline schedules and expert parallel degrees) each allows."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from shardscope.choices import Checkpointing, Offload, PipelineSchedule, StrategyName
from shardscope.mesh import DATA_PARALLEL_PRESETS
from shardscope.planner.request import CHECKPOINTING_ORDER, OFFLOAD_ORDER, PlanRequest
from shardscope.planner.unsearched import cp_ruled_out, ep_ruled_out, pp_ruled_out, tp_ruled_out
from shardscope.specs import ClusterSpec, GpuSpec, Scenario, Strategy, TrainingSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchShape:
    """How one GPU count reaches the global batch: sequences per rank per step, and the global batch it gives."""

    gpus: int
    """World size."""
    sequences_per_rank: int
    """micro_batch x grad_accum on every data-parallel rank (tp and cp ranks share their sequences)."""
    global_batch_tokens: int
    """data-parallel ranks x sequences_per_rank x sequence_length."""
    tp: int = 1
    """Tensor parallel degree."""
    cp: int = 1
    """Context parallel degree."""
    pp: int = 1
    """Pipeline parallel degree."""

    @property
    def data_parallel(self) -> int:
        """Ranks that each train their own sequences: the world divided by tp x cp x pp."""
        return self.gpus // (self.tp * self.cp * self.pp)


@dataclass(frozen=True, slots=True, kw_only=True)
class Variant:
    """A strategy setting at one GPU count: the family and, for hsdp, the shard group."""

    family: StrategyName
    """'ddp', 'zero1', 'zero2', 'zero3' or 'hsdp'."""
    shard_group: int = 0
    """hsdp: data-parallel ranks per shard group."""
    tp: int = 1
    """Tensor parallel degree."""
    cp: int = 1
    """Context parallel degree."""
    pp: int = 1
    """Pipeline parallel degree."""
    pp_schedule: PipelineSchedule = "1f1b"
    """The pipeline's schedule (read only when pp > 1)."""
    pp_virtual_stages: int = 0
    """interleaved-1f1b: stages per pipeline rank (0 for the other schedules)."""
    ep: int = 1
    """Expert parallel degree (mixture-of-experts models)."""

    @property
    def virtual_stages(self) -> int:
        """Pipeline stages per pipeline rank."""
        return self.pp_virtual_stages or 1

    def allows(self, grad_accum: int) -> bool:
        """Whether the pipeline runs `grad_accum` micro-batches: at least one per stage of a pipeline rank (fewer
        leaves most of the step a bubble, and torch's Schedule1F1B refuses them), and under interleaved-1f1b a
        multiple of its max(1, m // pp) rounds (torch's ScheduleInterleaved1F1B, `strategy.require_pipeline_shape`)."""
        if self.pp == 1:
            return True
        if grad_accum < self.pp:
            return False
        return self.pp_schedule != "interleaved-1f1b" or grad_accum % max(1, grad_accum // self.pp) == 0


def model_parallel_degrees(request: PlanRequest) -> tuple[tuple[int, int], ...]:
    """The (tp, cp) pairs the request searches that the model and sequence allow: tp within a node, dividing the
    heads, the KV heads, the FFN width and the vocabulary; cp splitting the sequence into 2 x cp chunks (and, with
    sequence parallelism, into cp x tp pieces). Smallest product first."""
    sequence = request.sequence_length
    tps = [tp for tp in request.tensor_parallel if not tp_ruled_out(request, tp)]
    cps = [cp for cp in request.context_parallel if not cp_ruled_out(request, cp)]
    pairs = [(tp, cp) for tp in tps for cp in cps if sequence % (tp * cp) == 0]
    return tuple(sorted(pairs, key=lambda pair: (pair[0] * pair[1], pair)))


def gpu_counts(request: PlanRequest) -> tuple[int, ...]:
    """Powers of two below one node, then whole nodes, up to the cap."""
    per_node = request.gpus_per_node
    counts = [count for count in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if count < per_node]
    counts += range(per_node, request.max_gpus + 1, per_node)
    return tuple(count for count in counts if count <= request.max_gpus)


def batch_shapes(request: PlanRequest) -> tuple[BatchShape, ...]:
    """GPU counts that reach the global batch within the tolerance, each with its sequences per rank.

    Ranking plans keeps, for each number of sequences per rank, the GPU count closest to the target (more GPUs at the
    same work per rank change only the batch, not the step time); --min-gpus keeps every count.
    A pipeline needs at least pp sequences per rank (a micro-batch per stage); without a target batch it runs pp
    micro-batches of one sequence.
    """
    seq, target = request.sequence_length, request.global_batch_tokens
    closest: dict[tuple[int, int, int, int], tuple[float, BatchShape]] = {}
    shapes = []
    for gpus in gpu_counts(request):
        for tp, cp in model_parallel_degrees(request):
            for pp in pipeline_degrees(request):
                if gpus % (tp * cp * pp):
                    continue
                data_parallel = gpus // (tp * cp * pp)
                per_rank = pp if target is None else max(1, round(target / (seq * data_parallel)))
                tokens = data_parallel * per_rank * seq
                error = 0.0 if target is None else abs(tokens - target) / target
                if error > request.batch_tolerance or per_rank < pp:
                    continue
                shape = BatchShape(
                    gpus=gpus, sequences_per_rank=per_rank, global_batch_tokens=tokens, tp=tp, cp=cp, pp=pp
                )
                shapes.append(shape)
                key = (per_rank, tp, cp, pp)
                if key not in closest or error < closest[key][0]:
                    closest[key] = (error, shape)
    if request.min_gpus or target is None:
        return tuple(shapes)
    return tuple(
        sorted((shape for _, shape in closest.values()), key=lambda shape: (shape.gpus, shape.tp, shape.cp, shape.pp))
    )


def pipeline_degrees(request: PlanRequest) -> tuple[int, ...]:
    """The pipeline degrees the request searches that the model's layers fill: pp (x virtual stages, for
    interleaved-1f1b) stages of at least one layer each. Smallest first."""
    return tuple(pp for pp in request.pipeline_parallel if not pp_ruled_out(request, pp))


def micro_batches(request: PlanRequest, sequences_per_rank: int) -> tuple[int, ...]:
    """Micro-batch sizes that divide the rank's sequences exactly, up to the largest allowed, smallest first."""
    if request.global_batch_tokens is None:  # one micro-batch per rank (pp of them in a pipeline)
        return tuple(size for size in (1, 2, 4, 8, 16, 32, 64, 128, 256) if size <= request.max_micro_batch)
    limit = min(request.max_micro_batch, sequences_per_rank)
    return tuple(size for size in range(1, limit + 1) if sequences_per_rank % size == 0)


def grad_accum_of(request: PlanRequest, shape: BatchShape, size: int) -> int:
    """Micro-batches per step of micro-batch `size`: the rank's sequences in micro-batches, or, without a target
    batch, one (a pipeline's pp)."""
    if request.global_batch_tokens is None:
        return shape.pp
    return max(1, shape.sequences_per_rank // size)


def variants(request: PlanRequest, gpus: int, tp: int = 1, cp: int = 1, pp: int = 1) -> tuple[Variant, ...]:
    """Strategy settings at a GPU count split tp x cp x pp; hsdp with every shard group that divides the
    data-parallel ranks and whose GPUs (group x tp x cp) stay node-aligned; a pipeline with every schedule (and
    virtual stage count) asked for; expert parallelism with every degree asked for that divides the experts and the
    GPUs it borrows (the data-parallel shard x cp)."""
    data_parallel = gpus // (tp * cp * pp)
    if data_parallel == 1:  # nothing to shard: the first family that replicates, as all are the same on one rank
        replicating = [family for family in request.families if not DATA_PARALLEL_PRESETS[family].shards]
        found = [Variant(family=(replicating or list(request.families))[0], tp=tp, cp=cp)]
    else:
        found = [
            Variant(family=family, tp=tp, cp=cp)
            for family in request.families
            if not DATA_PARALLEL_PRESETS[family].groups_replicate
        ]
        per_node = request.gpus_per_node
        for family in (family for family in request.families if DATA_PARALLEL_PRESETS[family].groups_replicate):
            for group in range(2, data_parallel):
                span = group * tp * cp
                aligned = per_node % span == 0 if span < per_node else span % per_node == 0
                if data_parallel % group == 0 and aligned:
                    found.append(Variant(family=family, shard_group=group, tp=tp, cp=cp))
    return tuple(
        replace(variant, pp=pp, pp_schedule=schedule, pp_virtual_stages=virtual, ep=ep)
        for variant in found
        for schedule, virtual in pipeline_schedules(request, pp)
        for ep in expert_degrees(request, variant, data_parallel)
    )


def pipeline_schedules(request: PlanRequest, pp: int) -> tuple[tuple[PipelineSchedule, int], ...]:
    """(schedule, virtual stages) of a pipeline of pp ranks: every schedule asked for, interleaved-1f1b with every
    virtual stage count whose pp x V stages the model's layers fill; ('1f1b', 0) without a pipeline."""
    if pp == 1:
        return (("1f1b", 0),)
    found: list[tuple[PipelineSchedule, int]] = []
    for schedule in request.pipeline_schedules:
        if schedule != "interleaved-1f1b":
            found.append((schedule, 0))
            continue
        found += [(schedule, v) for v in request.virtual_stages if pp * v <= request.model.num_layers]
    return tuple(found)


def expert_degrees(request: PlanRequest, variant: Variant, data_parallel: int) -> tuple[int, ...]:
    """Expert parallel degrees of a variant: 1, and for a mixture-of-experts model each degree asked for that
    divides its experts and the GPUs ep borrows (dp_shard x cp: the shard group of hsdp, every data-parallel rank of
    a sharding family, none of ddp's)."""
    model = request.model
    if model.family != "moe":
        return (1,)
    preset = DATA_PARALLEL_PRESETS[variant.family]
    shard = variant.shard_group if preset.groups_replicate else data_parallel if preset.shards else 1
    borrowed = shard * variant.cp
    return tuple(ep for ep in request.expert_parallel if not ep_ruled_out(request, ep) and borrowed % ep == 0)


def offloads_for(request: PlanRequest, family: StrategyName) -> tuple[Offload, ...]:
    """The offload settings a family allows, least offloaded first (parameters offload only when sharded)."""
    allowed = OFFLOAD_ORDER if DATA_PARALLEL_PRESETS[family].zero_stage == 3 else OFFLOAD_ORDER[:2]
    return tuple(offload for offload in allowed if offload in request.offloads)


def checkpointing_options(request: PlanRequest) -> tuple[Checkpointing, ...]:
    """Checkpointing settings, the cheapest in time first."""
    return tuple(option for option in CHECKPOINTING_ORDER if option in request.checkpointing)


def make_scenario(
    request: PlanRequest,
    gpus: int,
    variant: Variant,
    offload: Offload,
    checkpointing: Checkpointing,
    micro_batch: int,
    grad_accum: int,
) -> Scenario:
    """The scenario of one point of the space. Its parts are frozen, so points share them: building each part once
    (the memory search builds tens of thousands of points from a few hundred parts) took a fifth of llama-3.1-405b's
    search over 16384 GPUs before."""
    return Scenario(
        model=request.model,
        cluster=_cluster(request.gpu, gpus, request.gpus_per_node),
        training=point_training(request, checkpointing, micro_batch, grad_accum),
        strategy=_strategy(request.strategy, variant, offload),
        overheads=request.overheads,
    )


def point_training(
    request: PlanRequest, checkpointing: Checkpointing, micro_batch: int, grad_accum: int
) -> TrainingSpec:
    """The batch of one point of the space: the request's training with its micro-batch, count and checkpointing
    (one object per distinct batch, kept)."""
    return _training(request.training, micro_batch, grad_accum, checkpointing)


@lru_cache(maxsize=4096)
def _cluster(gpu: GpuSpec, gpus: int, gpus_per_node: int) -> ClusterSpec:
    return ClusterSpec(gpu=gpu, world_size=gpus, gpus_per_node=gpus_per_node)


@lru_cache(maxsize=4096)
def _training(base: TrainingSpec, micro_batch: int, grad_accum: int, checkpointing: Checkpointing) -> TrainingSpec:
    return replace(base, micro_batch_size=micro_batch, grad_accum_steps=grad_accum, checkpointing=checkpointing)


@lru_cache(maxsize=4096)
def _strategy(base: Strategy, variant: Variant, offload: Offload) -> Strategy:
    return replace(
        base,
        name=variant.family,
        shard_group=variant.shard_group,
        offload=offload,
        tp=variant.tp,
        cp=variant.cp,
        pp=variant.pp,
        pp_schedule=variant.pp_schedule,
        pp_virtual_stages=variant.pp_virtual_stages,
        ep=variant.ep,
    )


def family_of(scenario: Scenario) -> str:
    """The strategy family of a scenario ('fsdp' is zero3)."""
    return scenario.strategy.canonical_name
