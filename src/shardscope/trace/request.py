"""What one trace is asked to do, and its passage to the worker subprocess as JSON (no torch needed here)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from shardscope.specs import ClusterSpec, GpuSpec, ModelSpec, Overheads, Scenario, SpecError, Strategy, TrainingSpec

DEFAULT_TIME_LIMIT_S = 600.0
DEFAULT_TRACED_BLOCKS = 6
IMPLEMENTATIONS = ("reference", "hf")
"""Whose modeling code a trace runs: shardscope's reference modules, or transformers' own."""
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")
"""transformers' attn_implementation values the 'hf' model takes, spelt as transformers spells them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRequest:
    """A scenario to replay on fake tensors, and where its model comes from."""

    scenario: Scenario
    """The model shape (for counting), cluster, training setup and strategy."""
    implementation: str = "reference"
    """Whose modeling code runs: 'reference' (shardscope's modules, built from the ModelSpec) or 'hf' (transformers'
    own, from config_path or, without one, the preset's config.json)."""
    config_path: str = ""
    """The Hugging Face config.json the 'hf' implementation builds from."""
    attn_implementation: str = ""
    """The 'hf' model's attention as transformers spells it (IMPLEMENTATIONS); '' follows the scenario's attention."""
    factory: str = ""
    """Build the model with this `package.module:function`, which returns (module, sample batch)."""
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    """Stop the trace after this many seconds."""
    steps: int = 2
    """Training steps to replay; the last one is reported (the first allocates optimizer state and buffers)."""
    traced_blocks: int = DEFAULT_TRACED_BLOCKS
    """A deeper model is traced with traced_blocks - 1 and traced_blocks of its identical blocks and extrapolated
    to its depth; 0 traces every block."""
    memory_snapshot: str = ""
    """Write the step's allocations here as a CUDA memory snapshot (pickle), traced whole (core.memory_snapshot)."""

    def __post_init__(self) -> None:
        if self.config_path and self.factory:
            raise SpecError("TraceRequest: give config_path or factory, not both")
        if self.implementation not in IMPLEMENTATIONS:
            raise SpecError(
                f"TraceRequest.implementation={self.implementation!r} must be one of {', '.join(IMPLEMENTATIONS)}"
            )
        if self.implementation == "hf" and self.factory:
            raise SpecError(
                "TraceRequest: a factory's module is its own implementation; implementation 'hf' needs none"
            )
        if self.config_path and self.implementation != "hf":
            raise SpecError("TraceRequest.config_path is built by transformers: implementation must be 'hf'")
        if self.scenario.model.capacity_factor and (self.implementation == "hf" or self.factory):
            source = "--module" if self.factory else "--implementation hf"
            raise SpecError(
                f"capacity factor {self.scenario.model.capacity_factor:g} with {source}: only shardscope's reference "
                "MoE routes under the capacity rule (transformers' Mixtral is dropless); trace --model without it"
            )
        if self.attn_implementation and self.implementation != "hf":
            raise SpecError(
                f"TraceRequest.attn_implementation={self.attn_implementation!r} applies to implementation 'hf' only"
            )
        if self.attn_implementation and self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise SpecError(
                f"TraceRequest.attn_implementation={self.attn_implementation!r} must be one of "
                f"{', '.join(ATTN_IMPLEMENTATIONS)}"
            )
        if self.factory and ":" not in self.factory:
            raise SpecError(f"TraceRequest.factory={self.factory!r} must look like package.module:function")
        if not self.time_limit_s > 0:
            raise SpecError(f"TraceRequest.time_limit_s={self.time_limit_s} must be more than 0")
        if self.traced_blocks != 0 and not 6 <= self.traced_blocks <= 1024:
            raise SpecError(
                f"TraceRequest.traced_blocks={self.traced_blocks} must be 0 (trace every block) or between 6 and 1024"
            )
        if not 2 <= self.steps <= 10:
            raise SpecError(f"TraceRequest.steps={self.steps} must be between 2 and 10")

    @property
    def world_size(self) -> int:
        """Ranks of the fake process group."""
        return self.scenario.cluster.world_size

    def to_json(self) -> str:
        """The request as one JSON document."""
        return json.dumps(dataclasses.asdict(self))


def _build(cls: Any, data: dict[str, Any]) -> Any:
    return cls(**data)


def request_from_json(text: str) -> TraceRequest:
    """Read back what TraceRequest.to_json wrote."""
    data = json.loads(text)
    raw = data.pop("scenario")
    gpu = dict(raw["cluster"]["gpu"])
    gpu["peak_flops_per_s"] = tuple(tuple(pair) for pair in gpu["peak_flops_per_s"])
    cluster = dict(raw["cluster"], gpu=GpuSpec(**gpu))
    scenario = Scenario(
        model=_build(ModelSpec, raw["model"]),
        cluster=_build(ClusterSpec, cluster),
        training=_build(TrainingSpec, raw["training"]),
        strategy=_build(Strategy, raw["strategy"]),
        overheads=_build(Overheads, raw["overheads"]),
    )
    return TraceRequest(scenario=scenario, **data)


def pipeline_refusal(request: TraceRequest) -> str:
    """Why this pipeline cannot be replayed, in one line, or '' when it can."""
    strategy = request.scenario.strategy
    if request.factory or request.implementation == "hf":
        source = "--module" if request.factory else "--implementation hf"
        return f"--pp {strategy.pp} with {source}: the trace cuts shardscope's reference modules only (--model)"
    if strategy.tp > 1 or strategy.cp > 1:
        return f"--pp {strategy.pp} with --tp or --cp is not replayed yet; use `shardscope estimate`"
    if strategy.preset.zero_stage in (0, 1):
        return (
            f"--pp {strategy.pp} with --strategy {strategy.name}: the pipeline trace shards stages with fully_shard "
            "(fsdp, zero2, zero3, hsdp); use one of those or `shardscope estimate`"
        )
    if request.scenario.model.family == "moe":
        return f"--pp {strategy.pp} with model {request.scenario.model.name}: experts are not replayed in a pipeline"
    return ""
