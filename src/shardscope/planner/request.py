"""What the planner is asked: a model, a GPU type, a sequence length, a global batch, and the room to search."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shardscope.choices import OFFLOADS, PIPELINE_SCHEDULES, Checkpointing, Offload, PipelineSchedule, StrategyName
from shardscope.mesh import comparable_strategies
from shardscope.presets.hardware import HardwareProfile
from shardscope.specs import (
    MAX_WORLD_SIZE,
    GpuSpec,
    ModelSpec,
    Overheads,
    SpecError,
    Strategy,
    TrainingSpec,
)

FAMILIES: tuple[StrategyName, ...] = comparable_strategies(grouped=True)
RANKINGS = ("step-time", "tokens-per-s", "cost")
# Cheapest first: the search treats an option later in these tuples as never faster than an earlier one.
CHECKPOINTING_ORDER: tuple[Checkpointing, ...] = ("none", "selective", "full")
"""The checkpointing modes the planner searches, cheapest in time first ('op' and 'every:N' are not searched)."""
OFFLOAD_ORDER: tuple[Offload, ...] = ("none", "optimizer", "optimizer+params")
PIPELINE_SCHEDULE_ORDER: tuple[PipelineSchedule, ...] = ("1f1b", "interleaved-1f1b")
"""Schedules searched unless asked otherwise; GPipe is left out: it has 1F1B's bubble and holds every micro-batch's
activations, so under the time model it is never faster and never smaller."""


def _require_subset(name: str, values: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    if not values:
        raise SpecError(f"PlanRequest.{name} is empty; allowed: {', '.join(allowed)}")
    for value in values:
        if value not in allowed:
            raise SpecError(f"PlanRequest.{name} has {value!r}; allowed: {', '.join(allowed)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRequest:
    """One planning question and the space to search for its answer."""

    model: ModelSpec
    """The model to train; it needs a shape (activations and the time model need one)."""
    gpu: GpuSpec
    """The accelerator every rank runs on."""
    training: TrainingSpec = field(default_factory=TrainingSpec)
    """The step's fixed settings (sequence length, precision, optimizer, attention); its micro-batch, accumulation
    and checkpointing are what the search varies, so the template's are not read."""
    strategy: Strategy = field(default_factory=lambda: Strategy(name="ddp"))
    """The strategy's fixed settings (engine, buckets); its name, shard group and offload are searched, so the
    template's are not read."""
    global_batch_tokens: int | None = None
    """Tokens per optimizer step across the job; None: one micro-batch per rank, no accumulation (--min-gpus)."""
    batch_tolerance: float = 0.05
    """How far a plan's global batch may be from the target, as a fraction (GPU counts rarely divide it exactly)."""
    gpus_per_node: int = 8
    """GPUs in one node; counts above one node are whole nodes."""
    max_gpus: int = 1024
    """The most GPUs a plan may use."""
    headroom: float = 0.05
    """Fraction of GPU memory kept free: a plan fits when its peak is at most (1 - headroom) x memory."""
    host_memory_bytes: int = 0
    """Host memory per node for offload; 0 when not stated (offload is then not checked against it)."""
    families: tuple[StrategyName, ...] = FAMILIES
    """Strategy families to search; hsdp is searched with every valid shard group."""
    offloads: tuple[Offload, ...] = OFFLOADS
    """Offload settings to search."""
    checkpointing: tuple[Checkpointing, ...] = CHECKPOINTING_ORDER
    """Checkpointing settings to search."""
    max_micro_batch: int = 32
    """The largest micro-batch (sequences per rank per forward) to try."""
    overheads: Overheads = field(default_factory=Overheads)
    """Framework context and allocator headroom assumptions."""
    rank_by: str = "step-time"
    """'step-time' (shortest first), 'tokens-per-s' (most first) or 'cost' (cheapest per million tokens first)."""
    price_per_gpu_hour: float | None = None
    """Price of one GPU for one hour, in the user's currency; no price is built in."""
    top: int = 5
    """How many ranked plans to keep."""
    min_gpus: bool = False
    """Answer 'the fewest GPUs that can train this': keep only plans at the smallest GPU count that fits."""
    hardware: HardwareProfile | None = None
    """Links and compute speed for the time model; None: the GPU's datasheet profile."""
    tensor_parallel: tuple[int, ...] = (1, 2, 4, 8)
    """Tensor parallel degrees to search; those above a node or not dividing the model's widths are skipped."""
    context_parallel: tuple[int, ...] = (1,)
    """Context parallel degrees to search; those not splitting the sequence into 2 x cp chunks are skipped. Only cp 1
    unless asked: context parallelism is for long sequences, and each degree multiplies the space searched."""
    pipeline_parallel: tuple[int, ...] = (1,)
    """Pipeline parallel degrees to search; those with more stages than the model has layers are skipped, and a
    pipeline needs at least pp micro-batches per step (the gradient accumulation steps). Only pp 1 unless asked:
    a pipeline's memory and schedule cost milliseconds each to estimate (the whole-layer estimates microseconds), so
    every degree adds seconds to a search (docs/benchmarks.md)."""
    pipeline_schedules: tuple[PipelineSchedule, ...] = PIPELINE_SCHEDULE_ORDER
    """Pipeline schedules to search (read where pp > 1)."""
    virtual_stages: tuple[int, ...] = (2,)
    """Stages per pipeline rank that interleaved-1f1b is searched with (at least 2; torchtitan's default is 2)."""
    expert_parallel: tuple[int, ...] = (1,)
    """Expert parallel degrees to search on a mixture-of-experts model (ignored for others); those not dividing the
    experts or the data-parallel shard x cp are skipped."""

    def __post_init__(self) -> None:
        owner = "PlanRequest"
        if not self.model.has_shape:
            raise SpecError(f"{owner}.model {self.model.name!r} has only a parameter count; planning needs its shape")
        for name, value, high in (
            ("gpus_per_node", self.gpus_per_node, 1024),
            ("max_gpus", self.max_gpus, MAX_WORLD_SIZE),
            ("max_micro_batch", self.max_micro_batch, 4096),
            ("top", self.top, 1000),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise SpecError(f"{owner}.{name}={value!r} must be a whole number between 1 and {high}")
        if self.global_batch_tokens is not None and self.global_batch_tokens < self.sequence_length:
            raise SpecError(
                f"{owner}.global_batch_tokens={self.global_batch_tokens} is less than one sequence "
                f"(sequence_length={self.sequence_length})"
            )
        if not 0.0 <= self.batch_tolerance < 1.0:
            raise SpecError(f"{owner}.batch_tolerance={self.batch_tolerance} must be at least 0 and below 1")
        if not 0.0 <= self.headroom < 1.0:
            raise SpecError(f"{owner}.headroom={self.headroom} must be at least 0 and below 1")
        if self.host_memory_bytes < 0:
            raise SpecError(f"{owner}.host_memory_bytes={self.host_memory_bytes} must be zero or more")
        for name in ("tensor_parallel", "context_parallel", "pipeline_parallel", "expert_parallel", "virtual_stages"):
            degrees = getattr(self, name)
            low = 2 if name == "virtual_stages" else 1
            bad = [d for d in degrees if isinstance(d, bool) or not isinstance(d, int) or not low <= d <= 1024]
            if not degrees or bad:
                raise SpecError(f"{owner}.{name}={degrees!r} must be whole numbers between {low} and 1024")
        _require_subset("pipeline_schedules", self.pipeline_schedules, PIPELINE_SCHEDULES)
        _require_subset("families", self.families, FAMILIES)
        _require_subset("offloads", self.offloads, OFFLOADS)
        _require_subset("checkpointing", self.checkpointing, CHECKPOINTING_ORDER)
        _require_subset("rank_by", (self.rank_by,), RANKINGS)
        price = self.price_per_gpu_hour
        if price is not None and not (price > 0 and math.isfinite(price)):
            raise SpecError(f"{owner}.price_per_gpu_hour={price} must be a positive number")
        if self.rank_by == "cost" and price is None:
            raise SpecError(f"{owner}.rank_by='cost' needs price_per_gpu_hour (no prices are built in)")
        if self.global_batch_tokens is None and not self.min_gpus:
            raise SpecError(f"{owner}.global_batch_tokens is needed to rank plans (only --min-gpus works without)")

    @property
    def sequence_length(self) -> int:
        """Tokens per sequence, the training template's."""
        return self.training.sequence_length

    @property
    def budget_bytes(self) -> int:
        """The most a rank's peak may be: GPU memory less the headroom."""
        return int(self.gpu.memory_bytes * (1.0 - self.headroom))
