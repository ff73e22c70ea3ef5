"""Run one validation case in all three layers: the core predicts, the trace replays, a real gloo run measures."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shardscope.core.comm import collective_ledger
from shardscope.core.memory import estimate_memory
from shardscope.core.result import CollectiveRow, MemoryBreakdown
from shardscope.presets.hardware import HardwareProfile
from shardscope.validate.cases import ValidationCase
from shardscope.validate.compare import ValidationRow, compare_case

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class CaseResult:
    """A case's rows, and why a layer is missing where one is."""

    case: ValidationCase
    """The case."""
    rows: tuple[ValidationRow, ...]
    """One per quantity."""
    notes: tuple[str, ...]
    """E.g. why the trace did not run."""

    @property
    def ok(self) -> bool:
        """Every row within its target."""
        return all(row.ok for row in self.rows)


def _trace(
    case: ValidationCase, progress: Progress
) -> tuple[MemoryBreakdown | None, tuple[CollectiveRow, ...] | None, str]:
    """The trace of rank 0, or None and the reason when the trace does not cover this case."""
    if case.engine != "pytorch":
        return None, None, "trace: replays torch's engines; teaching strategies are compared with the core and the run"
    from shardscope.trace.request import TraceRequest
    from shardscope.trace.runner import TraceError, run_in_subprocess

    try:
        result = run_in_subprocess(TraceRequest(scenario=case.scenario(), time_limit_s=300), progress)
    except TraceError as error:
        return None, None, f"trace failed: {error}"
    return result.per_rank, result.ledger, ""


def validate_case(
    case: ValidationCase,
    *,
    hardware: HardwareProfile | None = None,
    with_trace: bool = True,
    steps: int = 3,
    progress: Progress = lambda _text: None,
) -> CaseResult:
    """Predict, trace and run one case, and compare rank 0 of each."""
    from shardscope.runtime.api import run_training

    scenario = case.scenario()
    predicted = estimate_memory(scenario, rank=0).per_rank
    predicted_ledger = collective_ledger(scenario)
    predicted_step_s = float("nan")
    if hardware is not None:
        from shardscope.core.timeline import estimate_time

        predicted_step_s = estimate_time(scenario, hardware).step_time_s
    notes = []
    traced, traced_ledger = None, None
    if with_trace:
        traced, traced_ledger, note = _trace(case, progress)
        if note:
            notes.append(note)
    progress(f"running {case.label}")
    measured = run_training(
        model=case.model,
        strategy=case.strategy,
        engine=case.engine,
        world_size=case.world_size,
        steps=steps,
        precision=case.precision,
        micro_batch_size=case.micro_batch_size,
        sequence_length=case.sequence_length,
        checkpointing=case.checkpointing,
        shard_group=case.shard_group,
        progress=progress,
    )
    rows = compare_case(
        case,
        predicted,
        predicted_ledger,
        predicted_step_s,
        traced,
        traced_ledger,
        measured.per_rank[0],
        measured.ledger,
        measured.step_time_s,
    )
    if hardware is None:
        rows = tuple(row for row in rows if row.quantity != "step_time_s")
        notes.append("step time not predicted: give --hardware with a profile from `shardscope calibrate`")
    return CaseResult(case=case, rows=rows, notes=tuple(notes))
