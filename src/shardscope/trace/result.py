"""What a trace found, in the shared result types, and its JSON schema `shardscope.trace/v1` (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardscope.core.result import CollectiveRow, MemoryBreakdown
from shardscope.specs import Scenario

SCHEMA = "shardscope.trace/v1"


@dataclass(frozen=True, slots=True, kw_only=True)
class ModuleRow:
    """One unit of the model (the embedding, a block, the head) as rank 0 holds and runs it."""

    name: str
    """Module path relative to the root, e.g. 'layers.3' or 'lm_head'."""
    parameters_bytes: int
    """Parameter bytes this rank stores for the module (its shard under zero3)."""
    activations_bytes: int
    """Bytes the module's forward left alive for backward (steady-state step)."""
    flops: int
    """Forward plus backward FLOPs of the module on this rank."""

    def to_json(self) -> dict[str, Any]:
        """One row of `per_module`."""
        return {
            "name": self.name,
            "parameters_bytes": self.parameters_bytes,
            "activations_bytes": self.activations_bytes,
            "flops": self.flops,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class FlopCount:
    """FLOPs of one training step on rank 0 (all micro-batches)."""

    forward_flops: int
    """Forward pass, loss included."""
    backward_flops: int
    """Backward pass, recomputation under checkpointing included."""
    optimizer_flops: int
    """Optimizer step (torch's counter counts matmul-like ops only, so usually 0)."""
    attention_formula_flops: int
    """The part counted by formula for the CPU flash-attention kernel, which torch's counter skips."""

    @property
    def total_flops(self) -> int:
        """Forward, backward and optimizer."""
        return self.forward_flops + self.backward_flops + self.optimizer_flops

    def to_json(self) -> dict[str, int]:
        """The `flops` object."""
        return {
            "forward_flops": self.forward_flops,
            "backward_flops": self.backward_flops,
            "optimizer_flops": self.optimizer_flops,
            "attention_formula_flops": self.attention_formula_flops,
            "total_flops": self.total_flops,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class StageTrace:
    """One pipeline rank of a pipeline trace: its stages, and what its first GPU held and sent."""

    pipeline_rank: int
    """Its place in the pipeline, 0 to pp - 1."""
    stages: tuple[str, ...]
    """What each of its stages holds, e.g. 'embed+layers 0-2' (core.pipeline's split)."""
    layers: int
    """Transformer layers it holds."""
    per_rank: MemoryBreakdown
    """Its bytes by category (each category's largest size in the steady-state step) and its peak."""
    peak_moment: str
    """Stage, phase and micro-batch of the peak, e.g. 'forward: stage 0 forward 1'."""
    ledger: tuple[CollectiveRow, ...]
    """Its collectives and point-to-point messages in the steady-state step."""
    reserved_peak_bytes: int | None
    """The CUDA caching allocator's reserved peak for its step, replayed."""

    def to_json(self) -> dict[str, Any]:
        """One entry of `per_stage`."""
        per_rank: dict[str, Any] = dict(self.per_rank.to_json())
        per_rank["ledger"] = [row.to_json() for row in self.ledger]
        per_rank["reserved_peak_bytes"] = self.reserved_peak_bytes
        return {
            "pipeline_rank": self.pipeline_rank,
            "stages": list(self.stages),
            "layers": self.layers,
            "per_rank": per_rank,
            "peak_moment": self.peak_moment,
        }


def _stage_from_json(data: dict[str, Any]) -> StageTrace:
    per_rank = data["per_rank"]
    return StageTrace(
        pipeline_rank=data["pipeline_rank"],
        stages=tuple(data["stages"]),
        layers=data["layers"],
        per_rank=_breakdown(per_rank),
        peak_moment=data["peak_moment"],
        ledger=tuple(CollectiveRow(**row) for row in per_rank["ledger"]),
        reserved_peak_bytes=per_rank["reserved_peak_bytes"],
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceResult:
    """Rank 0 of a training step replayed on fake tensors over a fake process group."""

    world_size: int
    """Ranks of the fake process group."""
    strategy: str
    """The strategy as asked ('zero3', ...)."""
    engine: str
    """torch's engine that ran it, e.g. 'torch fully_shard (reshard_after_forward=True)'."""
    per_rank: MemoryBreakdown
    """Rank 0's bytes by category (each category's largest size in the steady-state step) and its peak."""
    peak_moment: str
    """Phase and module where the peak happened, e.g. 'backward: layers.0'."""
    peak_by_category: tuple[tuple[str, int], ...]
    """Bytes by category at the peak moment."""
    ledger: tuple[CollectiveRow, ...]
    """Collectives rank 0 issued in the steady-state step."""
    flops: FlopCount
    """FLOPs of the steady-state step."""
    per_module: tuple[ModuleRow, ...]
    """Units of the model, in order."""
    fallbacks: tuple[tuple[str, str], ...] = ()
    """(category, why) for categories taken from the core's closed form instead of the trace."""
    notes: tuple[str, ...] = ()
    """What the trace did differently from the request, in plain words."""
    traced_blocks: tuple[int, ...] = ()
    """Depths actually traced when the result was extrapolated to the model's depth (empty: every block traced)."""
    elapsed_s: float = 0.0
    """Wall time of the trace, building included."""
    reserved_peak_bytes: int | None = None
    """What PyTorch's CUDA caching allocator would hold at most in the measured step (max_memory_reserved): the
    trace's allocations and frees, from the first step on, replayed through shardscope.core.allocator (default
    settings, one stream). None when not computed: an extrapolated trace (its notes say why)."""
    per_stage: tuple[StageTrace, ...] = ()
    """Under a pipeline, every pipeline rank first to last (the fields above are the busiest one's)."""

    def to_json(self, scenario: Scenario) -> dict[str, Any]:
        """The `shardscope.trace/v1` document of the trace of `scenario`."""
        per_rank: dict[str, Any] = dict(self.per_rank.to_json())
        per_rank["ledger"] = [row.to_json() for row in self.ledger]
        per_rank["flops"] = self.flops.to_json()
        per_rank["peak_moment"] = self.peak_moment
        per_rank["reserved_peak_bytes"] = self.reserved_peak_bytes
        return {
            "schema": SCHEMA,
            "model": scenario.model.name,
            "world_size": self.world_size,
            "strategy": self.strategy,
            "engine": self.engine,
            "parallelism": scenario.parallelism.to_json(),
            "per_rank": per_rank,
            "peak_by_category": {name: size for name, size in self.peak_by_category},
            "per_module": [row.to_json() for row in self.per_module],
            "fallbacks": [{"category": category, "reason": why} for category, why in self.fallbacks],
            "notes": list(self.notes),
            "traced_blocks": list(self.traced_blocks),
            "elapsed_s": round(self.elapsed_s, 3),
            **({"per_stage": [entry.to_json() for entry in self.per_stage]} if self.per_stage else {}),
        }


def _breakdown(per_rank: dict[str, Any]) -> MemoryBreakdown:
    return MemoryBreakdown(
        **{
            key: per_rank[key]
            for key in (
                "parameters_bytes",
                "gradients_bytes",
                "optimizer_state_bytes",
                "activations_bytes",
                "buffers_bytes",
                "temporary_bytes",
                "overhead_bytes",
                "peak_bytes",
            )
        }
    )


def result_from_json(data: dict[str, Any]) -> TraceResult:
    """Read back a `shardscope.trace/v1` document (the worker subprocess sends one)."""
    per_rank = dict(data["per_rank"])
    breakdown = _breakdown(per_rank)
    flops = {key: value for key, value in per_rank["flops"].items() if key != "total_flops"}
    return TraceResult(
        world_size=data["world_size"],
        strategy=data["strategy"],
        engine=data["engine"],
        per_rank=breakdown,
        peak_moment=per_rank["peak_moment"],
        peak_by_category=tuple(data["peak_by_category"].items()),
        ledger=tuple(CollectiveRow(**row) for row in per_rank["ledger"]),
        flops=FlopCount(**flops),
        per_module=tuple(ModuleRow(**row) for row in data["per_module"]),
        fallbacks=tuple((item["category"], item["reason"]) for item in data["fallbacks"]),
        notes=tuple(data["notes"]),
        traced_blocks=tuple(data.get("traced_blocks", ())),
        elapsed_s=data["elapsed_s"],
        reserved_peak_bytes=per_rank.get("reserved_peak_bytes"),
        per_stage=tuple(_stage_from_json(entry) for entry in data.get("per_stage", ())),
    )
