"""`run_training`: launch a real run and return what every rank measured, as result types the core shares."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardscope.core.params import count_parameters
from shardscope.core.result import CollectiveRow, MemoryBreakdown
from shardscope.mesh import Parallelism
from shardscope.runtime.config import RunConfig

SCHEMA = "shardscope.run/v1"
# The largest element-wise parameter difference from single-process training that still counts as equal.
PARITY_TOLERANCE = {"fp64": 1e-10, "fp32": 1e-3, "bf16-mixed": 5e-2}


@dataclass(frozen=True, slots=True, kw_only=True)
class Parity:
    """How far the run's final parameters are from single-process training on the same global batch."""

    reference: str
    """What was compared against."""
    max_abs_diff: float
    """Largest element-wise difference over all parameters."""
    tolerance: float
    """The bound for this precision."""

    @property
    def ok(self) -> bool:
        """The difference is within the tolerance."""
        return self.max_abs_diff <= self.tolerance

    def to_json(self) -> dict[str, object]:
        """The schema's `parity` object."""
        return {"reference": self.reference, "max_abs_diff": self.max_abs_diff, "ok": self.ok}


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """One real run: per-rank memory by category, the collective ledger, parity and step time."""

    config: RunConfig
    """What was run."""
    per_rank: tuple[MemoryBreakdown, ...]
    """Measured memory of each rank, in rank order."""
    peak_composition: tuple[dict[str, int], ...]
    """Per rank: what was live at the peak, by label (parameters, gradients, optimizer_state, buffers, forward,
    backward, optimizer, hidden_buffers)."""
    ledgers: tuple[tuple[CollectiveRow, ...], ...]
    """Each rank's collectives, in rank order: setup plus the measured (last) step (a pipeline's ranks differ)."""
    parity: Parity
    """Final parameters against a single process."""
    step_time_s: float
    """Median wall time of the unmeasured steps, slowest rank."""

    @property
    def ledger(self) -> tuple[CollectiveRow, ...]:
        """Rank 0's collectives, the ones the run document and validate report."""
        return self.ledgers[0]

    @property
    def parallelism(self) -> Parallelism:
        """The mesh the run's strategy and degrees made of its ranks."""
        return self.config.parallelism

    def to_json(self) -> dict[str, Any]:
        """The `shardscope.run/v1` document."""
        model = self.config.model_spec
        return {
            "schema": SCHEMA,
            "model": {"name": model.name, "parameters": count_parameters(model)},
            "strategy": self.config.strategy.name,
            "engine": self.config.strategy.engine,
            "world_size": self.config.world_size,
            "parallelism": self.parallelism.to_json(),
            "sequence_parallel": self.config.strategy.uses_sequence_parallel,
            "per_rank": [breakdown.to_json() for breakdown in self.per_rank],
            "ledger": [row.to_json() for row in self.ledger],
            "parity": self.parity.to_json(),
            "step_time_s": self.step_time_s,
        }


def result_from_launch(config: RunConfig, raw: dict[str, Any]) -> RunResult:
    """Turn rank 0's result file into a RunResult."""
    ranks = sorted(raw["ranks"], key=lambda item: item["rank"])
    fields = set(MemoryBreakdown.__dataclass_fields__)
    per_rank = tuple(MemoryBreakdown(**{k: v for k, v in r["memory"].items() if k in fields}) for r in ranks)
    precision = config.training.precision
    reference = "single process, float64" if precision == "fp64" else "single process, float32"
    return RunResult(
        config=config,
        per_rank=per_rank,
        peak_composition=tuple(r["memory"]["peak_composition"] for r in ranks),
        ledgers=tuple(tuple(CollectiveRow(**row) for row in r["ledger"]) for r in ranks),
        parity=Parity(reference=reference, max_abs_diff=raw["max_abs_diff"], tolerance=PARITY_TOLERANCE[precision]),
        step_time_s=max(r["step_time_s"] for r in ranks),
    )


def run_training(
    config: RunConfig | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    run_dir: Path | None = None,
    **fields: Any,
) -> RunResult:
    """Launch a run on local processes (gloo) and measure it; fields override RunConfig's, e.g.
    run_training(model="tiny-gpt2", strategy="zero3", world_size=4). Raises RunError when a rank fails."""
    from shardscope.runtime.launch import launch

    config = config or RunConfig.from_options(**fields)
    return result_from_launch(config, launch([config], progress=progress, run_dir=run_dir)[0])


def run_suite(
    configs: Sequence[RunConfig], *, progress: Callable[[str], None] | None = None, run_dir: Path | None = None
) -> list[RunResult]:
    """Several runs of one world size in a single launch (start-up paid once): one RunResult per config."""
    from shardscope.runtime.launch import launch

    raws = launch(list(configs), progress=progress, run_dir=run_dir)
    return [result_from_launch(config, raw) for config, raw in zip(configs, raws, strict=True)]
