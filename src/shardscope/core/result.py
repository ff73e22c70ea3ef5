"""Result types shared by all three layers (predict, replay, run), so validate can lay them side by side."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardscope.choices import LEDGER_GROUPS
from shardscope.core.params import count_parameters
from shardscope.specs import Scenario, SpecError

if TYPE_CHECKING:
    from shardscope.core.timeline import TimeEstimate

ESTIMATE_SCHEMA = "shardscope.estimate/v1"

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "buffers", "temporary", "overhead")
PHASES = ("setup", "forward", "backward", "optimizer")
OPS = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "all_to_all",
    "send",
    "recv",
    "host_to_device",
    "device_to_host",
)
LedgerKey = tuple[str, str, str, int, int]
"""(phase, op, group, group size, payload bytes): what makes two ledger rows the same kind of call."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    """Bytes one rank holds, by category, and its peak.

    Each category is that category's largest size during a step (activations at the end of forward, gradients
    after backward, ...). The peak is the largest total at any one moment, so it is at most the plain sum.
    """

    parameters_bytes: int = 0
    """Model parameters the rank keeps (its shard, or the whole model), in their stored dtype."""
    gradients_bytes: int = 0
    """Gradients the rank keeps."""
    optimizer_state_bytes: int = 0
    """Optimizer moments, the fp32 master copy under mixed precision, and step counters."""
    activations_bytes: int = 0
    """Tensors saved for backward, at the end of forward."""
    buffers_bytes: int = 0
    """Communication and bucket buffers, gathered parameter shards."""
    temporary_bytes: int = 0
    """Short-lived workspace: the loss and logits spike, optimizer step temporaries, autocast copies."""
    overhead_bytes: int = 0
    """Framework context (an assumption, predicted only); what the caching allocator holds beyond live tensors is
    not in it (MemoryEstimate.reserved_peak_bytes)."""
    peak_bytes: int = 0
    """The most bytes live at one moment of the step, overhead included."""

    @property
    def total_bytes(self) -> int:
        """Plain sum of the categories (an upper bound on the peak)."""
        return (
            self.parameters_bytes
            + self.gradients_bytes
            + self.optimizer_state_bytes
            + self.activations_bytes
            + self.buffers_bytes
            + self.temporary_bytes
            + self.overhead_bytes
        )

    @property
    def model_state_bytes(self) -> int:
        """Parameters, gradients and optimizer state: what the ZeRO paper calls model states."""
        return self.parameters_bytes + self.gradients_bytes + self.optimizer_state_bytes

    def category_bytes(self, category: str) -> int:
        """Bytes of one category by its DESIGN.md name."""
        if category not in CATEGORIES:
            raise SpecError(f"category {category!r} is not known; allowed: {', '.join(CATEGORIES)}")
        value: int = getattr(self, f"{category}_bytes")
        return value

    def to_json(self) -> dict[str, int]:
        """The `per_rank` object of the estimate, trace and run schemas."""
        data = {f"{category}_bytes": self.category_bytes(category) for category in CATEGORIES}
        data["total_bytes"] = self.total_bytes
        data["peak_bytes"] = self.peak_bytes
        return data


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveRow:
    """One kind of collective call in a step: which, where, how big, how often."""

    phase: str
    """'setup', 'forward', 'backward' or 'optimizer'."""
    op: str
    """'all_reduce', 'reduce_scatter', 'all_gather', 'broadcast', 'send' and 'recv' (ring attention's exchange), or a
    host transfer under offload."""
    group_size: int
    """Ranks taking part."""
    payload_bytes: int
    """Bytes per rank per call: the full buffer for all_reduce and broadcast, the unsharded (gathered) size for
    all_gather and reduce_scatter."""
    count: int
    """Calls of this shape in one step."""
    group: str = "dp"
    """The mesh dimension it runs on (choices.LedgerGroup): 'dp' (the data-parallel ranks, cp's included, that hold
    one tensor-parallel slice), 'tp', 'cp', 'ep', or 'host'; a tp and a dp call of the same size and payload differ."""

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise SpecError(f"CollectiveRow.phase={self.phase!r} is not known; allowed: {', '.join(PHASES)}")
        if self.op not in OPS:
            raise SpecError(f"CollectiveRow.op={self.op!r} is not known; allowed: {', '.join(OPS)}")
        if self.group not in LEDGER_GROUPS:
            raise SpecError(f"CollectiveRow.group={self.group!r} is not known; allowed: {', '.join(LEDGER_GROUPS)}")

    @property
    def key(self) -> LedgerKey:
        """What makes two rows the same kind of call (everything but the count)."""
        return self.phase, self.op, self.group, self.group_size, self.payload_bytes

    @property
    def total_payload_bytes(self) -> int:
        """payload_bytes times count."""
        return self.payload_bytes * self.count

    def to_json(self) -> dict[str, object]:
        """One ledger row of the JSON schemas."""
        return {
            "phase": self.phase,
            "op": self.op,
            "group": self.group,
            "group_size": self.group_size,
            "payload_bytes": self.payload_bytes,
            "count": self.count,
        }


def merge_ledger(rows: list[CollectiveRow] | tuple[CollectiveRow, ...]) -> tuple[CollectiveRow, ...]:
    """Add up rows of the same phase, op, group, group size and payload; order by phase, then first appearance."""
    counts: dict[LedgerKey, int] = {}
    for row in rows:
        counts[row.key] = counts.get(row.key, 0) + row.count
    ordered = sorted(counts.items(), key=lambda item: PHASES.index(item[0][0]))
    return tuple(ledger_row(key, count) for key, count in ordered if count)


def ledger_row(key: LedgerKey, count: int) -> CollectiveRow:
    """The row of `count` calls of the kind `key` names."""
    phase, op, group, size, payload = key
    return CollectiveRow(phase=phase, op=op, group=group, group_size=size, payload_bytes=payload, count=count)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageMemory:
    """One pipeline rank's memory: the stages it holds and what one of its GPUs holds at its peak."""

    pipeline_rank: int
    """Its place in the pipeline, 0 to pp - 1."""
    stages: tuple[str, ...]
    """What each of its stages holds, e.g. 'embed+layers 0-7' (V stages under interleaved 1F1B)."""
    layers: int
    """Transformer layers it holds."""
    in_flight: tuple[int, ...]
    """Micro-batches of each of its stages whose activations are live at its peak."""
    per_rank: MemoryBreakdown
    """One of its GPUs' memory by category."""
    peak_moment: str
    """When its peak happens."""

    def to_json(self) -> dict[str, Any]:
        """One entry of `per_stage`."""
        return {
            "pipeline_rank": self.pipeline_rank,
            "stages": list(self.stages),
            "layers": self.layers,
            "in_flight": list(self.in_flight),
            "per_rank": self.per_rank.to_json(),
            "peak_moment": self.peak_moment,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryEstimate:
    """The core's answer for one scenario: memory per rank by category, host memory, and whether it fits."""

    scenario: Scenario
    """The question."""
    per_rank: MemoryBreakdown
    """The busiest rank's memory."""
    host_bytes_per_node: int
    """Host (CPU) memory per node under offload; 0 without offload."""
    peak_moment: str
    """When the peak happens: 'end of forward', 'backward', or 'optimizer step'."""
    activations_estimated: bool
    """False when the model has no shape (only --params), so activations are not counted."""
    rank: int
    """The rank shown (the busiest unless asked for another)."""
    per_stage: tuple[StageMemory, ...] = ()
    """Under pipeline parallelism, every pipeline rank's memory (`per_rank` is the busiest's); empty otherwise."""

    @property
    def tensor_peak_bytes(self) -> int:
        """The allocated peak without the context: what `torch.cuda.max_memory_allocated()` reports."""
        return self.per_rank.peak_bytes - self.per_rank.overhead_bytes

    @property
    def reserved_peak_bytes(self) -> int:
        """What the caching allocator holds at most in the step (`torch.cuda.max_memory_reserved()`; the context is
        not in it): the allocated tensor peak plus what the allocator holds beyond its stream's allocated peak when
        core.allocation_stream replays the step's derived allocations (derived when first asked, cached per
        scenario). Anchored so on this estimate's allocated peak, it is never below it, and a derived stream that
        misjudges an allocated byte count (offload, the moment-by-moment streams) moves only the allocator's share.
        With Overheads.allocator_headroom set, the allocated tensor peak x (1 + headroom) instead of the model."""
        allocated = self.tensor_peak_bytes
        headroom = self.scenario.overheads.allocator_headroom
        if headroom is not None:
            return allocated + int(allocated * headroom)
        from shardscope.core.allocation_stream import allocator_peaks  # it builds on this module: imported when asked

        stream_allocated, stream_reserved = allocator_peaks(self.scenario)
        return allocated + max(0, stream_reserved - stream_allocated)

    @property
    def fits(self) -> bool:
        """The reserved peak plus the framework context fits in the GPU's memory."""
        return self.reserved_peak_bytes + self.per_rank.overhead_bytes <= self.scenario.cluster.gpu.memory_bytes

    def to_json(self) -> dict[str, Any]:
        """One entry of `strategies` in `shardscope.estimate/v1` (and the first fields of a plan in `plan/v1`)."""
        from shardscope.core.memory import describe_assumptions  # core.memory builds this type: imported when called

        scenario = self.scenario
        return {
            "strategy": scenario.strategy.name,
            "engine": scenario.strategy.engine,
            "world_size": scenario.cluster.world_size,
            "shard_group": scenario.shard_degree,
            "parallelism": _parallelism_json(scenario),
            "sequence_parallel": scenario.strategy.uses_sequence_parallel,
            "offload": scenario.strategy.offload,
            "parameters": count_parameters(scenario.model),
            "per_rank": {**self.per_rank.to_json(), "reserved_peak_bytes": self.reserved_peak_bytes},
            "host_bytes": self.host_bytes_per_node,
            "fits": self.fits,
            "peak_moment": self.peak_moment,
            "activations_estimated": self.activations_estimated,
            "assumptions": list(describe_assumptions(self)),
            **({"per_stage": [entry.to_json() for entry in self.per_stage]} if self.per_stage else {}),
        }


def _parallelism_json(scenario: Scenario) -> dict[str, Any]:
    """The mesh degrees, and under pipeline parallelism its schedule and stages per pipeline rank."""
    degrees = scenario.parallelism.to_json()
    strategy = scenario.strategy
    if strategy.pp > 1:
        degrees.update(pp_schedule=strategy.pp_schedule, pp_virtual_stages=strategy.virtual_stages)
    return degrees


def estimate_document(estimates: Sequence[MemoryEstimate], times: Sequence[TimeEstimate] = ()) -> dict[str, Any]:
    """The `shardscope.estimate/v1` document: estimates of one model, cluster and training setup, one per strategy,
    each with its time when `times` (one per estimate) are given."""
    if times and len(times) != len(estimates):
        raise SpecError(f"estimate_document: {len(times)} times for {len(estimates)} estimates; give one per estimate")
    first = estimates[0].scenario
    strategies = [estimate.to_json() for estimate in estimates]
    for entry, time in zip(strategies, times, strict=False):
        entry.update(time.to_json())
    return {
        "schema": ESTIMATE_SCHEMA,
        "model": {**first.model.to_json(), "parameters": count_parameters(first.model)},
        "cluster": first.cluster.to_json(),
        "training": first.training.to_json(),
        "strategies": strategies,
    }
