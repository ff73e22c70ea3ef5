"""The search space: GPU counts and the tensor and context parallel degrees that split them, how each reaches the
global batch, and the strategies each allows."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from shardscope.choices import Checkpointing, Offload, StrategyName
from shardscope.mesh import DATA_PARALLEL_PRESETS
from shardscope.planner.request import CHECKPOINTING_ORDER, OFFLOAD_ORDER, PlanRequest
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


def model_parallel_degrees(request: PlanRequest) -> tuple[tuple[int, int], ...]:
    """The (tp, cp) pairs the request searches that the model and sequence allow: tp within a node, dividing the
    heads, the KV heads, the FFN width and the vocabulary; cp splitting the sequence into 2 x cp chunks (and, with
    sequence parallelism, into cp x tp pieces). Smallest product first."""
    model, sequence = request.model, request.sequence_length
    widths = (model.num_heads, model.num_kv_heads, model.ffn_hidden_size, model.vocab_size)
    tps = [tp for tp in request.tensor_parallel if tp <= request.gpus_per_node and not any(w % tp for w in widths)]
    pairs = [
        (tp, cp)
        for tp in tps
        for cp in request.context_parallel
        if sequence % (2 * cp) == 0 and sequence % (tp * cp) == 0
    ]
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
    """
    seq, target = request.sequence_length, request.global_batch_tokens
    closest: dict[tuple[int, int, int], tuple[float, BatchShape]] = {}
    shapes = []
    for gpus in gpu_counts(request):
        for tp, cp in model_parallel_degrees(request):
            if gpus % (tp * cp):
                continue
            data_parallel = gpus // (tp * cp)
            per_rank = 1 if target is None else max(1, round(target / (seq * data_parallel)))
            tokens = data_parallel * per_rank * seq
            error = 0.0 if target is None else abs(tokens - target) / target
            if error > request.batch_tolerance:
                continue
            shape = BatchShape(gpus=gpus, sequences_per_rank=per_rank, global_batch_tokens=tokens, tp=tp, cp=cp)
            shapes.append(shape)
            key = (per_rank, tp, cp)
            if key not in closest or error < closest[key][0]:
                closest[key] = (error, shape)
    if request.min_gpus or target is None:
        return tuple(shapes)
    return tuple(sorted((shape for _, shape in closest.values()), key=lambda shape: (shape.gpus, shape.tp, shape.cp)))


def micro_batches(request: PlanRequest, sequences_per_rank: int) -> tuple[int, ...]:
    """Micro-batch sizes that divide the rank's sequences exactly, up to the largest allowed, smallest first."""
    if request.global_batch_tokens is None:
        return tuple(size for size in (1, 2, 4, 8, 16, 32, 64, 128, 256) if size <= request.max_micro_batch)
    limit = min(request.max_micro_batch, sequences_per_rank)
    return tuple(size for size in range(1, limit + 1) if sequences_per_rank % size == 0)


def variants(request: PlanRequest, gpus: int, tp: int = 1, cp: int = 1) -> tuple[Variant, ...]:
    """Strategy settings at a GPU count split tp x cp; hsdp with every shard group that divides the data-parallel
    ranks and whose GPUs (group x tp x cp) stay node-aligned."""
    data_parallel = gpus // (tp * cp)
    if data_parallel == 1:  # nothing to shard: the first family that replicates, as all are the same on one rank
        replicating = [family for family in request.families if not DATA_PARALLEL_PRESETS[family].shards]
        return (Variant(family=(replicating or list(request.families))[0], tp=tp, cp=cp),)
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
    return tuple(found)


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
        training=_training(request.training, micro_batch, grad_accum, checkpointing),
        strategy=_strategy(request.strategy, variant, offload),
        overheads=request.overheads,
    )


@lru_cache(maxsize=4096)
def _cluster(gpu: GpuSpec, gpus: int, gpus_per_node: int) -> ClusterSpec:
    return ClusterSpec(gpu=gpu, world_size=gpus, gpus_per_node=gpus_per_node)


@lru_cache(maxsize=4096)
def _training(base: TrainingSpec, micro_batch: int, grad_accum: int, checkpointing: Checkpointing) -> TrainingSpec:
    return replace(base, micro_batch_size=micro_batch, grad_accum_steps=grad_accum, checkpointing=checkpointing)


@lru_cache(maxsize=4096)
def _strategy(base: Strategy, variant: Variant, offload: Offload) -> Strategy:
    return replace(
        base, name=variant.family, shard_group=variant.shard_group, offload=offload, tp=variant.tp, cp=variant.cp
    )


def family_of(scenario: Scenario) -> str:
    """The strategy family of a scenario ('fsdp' is zero3)."""
    return scenario.strategy.canonical_name
