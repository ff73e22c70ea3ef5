"""Run one validation case in all three layers: the core predicts, the trace replays, a real gloo run measures."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardscope.core.comm import collective_ledger
from shardscope.core.engines import ENGINE_RULES
from shardscope.core.memory import estimate_memory
from shardscope.core.pipeline_time import pipeline_rank_ledger
from shardscope.core.result import CollectiveRow, MemoryBreakdown
from shardscope.presets.hardware import HardwareProfile
from shardscope.validate.cases import ValidationCase
from shardscope.validate.compare import ValidationRow, compare_case, ledger_differences

if TYPE_CHECKING:
    from shardscope.runtime.api import RunResult

Progress = Callable[[str], None]
VALIDATE_SCHEMA = "shardscope.validate/v1"


@dataclass(frozen=True, slots=True, kw_only=True)
class CaseResult:
    """A case's rows, and why a layer is missing where one is."""

    case: ValidationCase
    """The case."""
    rows: tuple[ValidationRow, ...]
    """One per quantity."""
    notes: tuple[str, ...]
    """E.g. why the trace did not run."""
    ledger_mismatches: tuple[str, ...] = ()
    """The kinds of collective call whose count the prediction and the run disagree on (compare.ledger_differences)."""
    not_run: str = ""
    """Why no run engine can run the case yet ('' when it ran): it has no rows."""

    @property
    def ok(self) -> bool:
        """Every row within its target and every collective call as predicted."""
        return all(row.ok for row in self.rows) and not self.ledger_mismatches


def validation_document(results: Sequence[CaseResult]) -> dict[str, Any]:
    """The `shardscope.validate/v1` document: every row of every case, and the notes of the cases that have any."""
    return {
        "schema": VALIDATE_SCHEMA,
        "ok": all(result.ok for result in results),
        "rows": [row.to_json() for result in results for row in result.rows],
        "notes": {result.case.label: list(result.notes) for result in results if result.notes},
    } | (
        {"not_run": {result.case.label: result.not_run for result in results if result.not_run}}
        if any(result.not_run for result in results)
        else {}
    )


def _trace(
    case: ValidationCase, progress: Progress
) -> tuple[MemoryBreakdown | None, tuple[CollectiveRow, ...] | None, int | None, str]:
    """The trace of rank 0 and its comparable peak, or None and the reason where the trace does not cover a case."""
    if not ENGINE_RULES[case.scenario().strategy.engine].torch_engines:
        return (
            None,
            None,
            None,
            ("trace: replays torch's engines; teaching strategies are compared with the core and the run"),
        )
    from shardscope.trace.request import TraceRequest
    from shardscope.trace.runner import TraceError, run_in_subprocess

    try:
        result = run_in_subprocess(TraceRequest(scenario=case.scenario(), time_limit_s=300), progress)
    except TraceError as error:
        return None, None, None, f"trace failed: {error}"
    if result.per_stage:  # a pipeline's rank 0 holds the first stage, whichever stage is the busiest
        first = result.per_stage[0]
        return first.per_rank, first.ledger, first.per_rank.peak_bytes, ""
    return result.per_rank, result.ledger, result.per_rank.peak_bytes, ""


def validate_cases(
    cases: Sequence[ValidationCase],
    *,
    hardware: HardwareProfile | None = None,
    with_trace: bool = True,
    steps: int = 3,
    isolate: bool = True,
    progress: Progress = lambda _text: None,
) -> list[CaseResult]:
    """Predict, trace and really run every case, and compare rank 0 of each. Each real run has its own launch
    unless `isolate` is off (one launch per world size: faster, less exact); the measured step is the last (DDP
    reallocates its buckets in the second step, so steps >= 3)."""
    from shardscope.runtime.api import run_suite, run_training
    from shardscope.runtime.config import RunConfig

    pending = {case: case.not_runnable() for case in cases}
    runnable = [case for case in cases if not pending[case]]
    configs = {case: RunConfig.from_options(**case.run_options(steps)) for case in runnable}
    measured = {}
    if isolate:
        # One launch per case: in a shared launch a run's measured peak can carry bytes left by the run before it
        # (a bf16-mixed run after an fp32 one).
        for index, case in enumerate(runnable, 1):
            progress(f"running case {index}/{len(runnable)}: {case.label}")
            measured[case] = run_training(configs[case], progress=progress)
    else:
        for world in sorted({case.world_size for case in runnable}):
            group = [case for case in runnable if case.world_size == world]
            progress(f"running {len(group)} cases on {world} ranks in one launch")
            for case, result in zip(
                group, run_suite([configs[case] for case in group], progress=progress), strict=True
            ):
                measured[case] = result
    return [
        _compare(case, measured[case], hardware, with_trace, progress)
        if case in measured
        else CaseResult(case=case, rows=(), notes=(), not_run=pending[case])
        for case in cases
    ]


def _compare(
    case: ValidationCase, measured: RunResult, hardware: HardwareProfile | None, with_trace: bool, progress: Progress
) -> CaseResult:
    scenario = case.scenario()
    predicted = estimate_memory(scenario, rank=0).per_rank
    # a pipeline's rank 0 holds the first stage: its own collectives and messages (core.pipeline_time)
    predicted_ledger = pipeline_rank_ledger(scenario, 0) if scenario.strategy.pp > 1 else collective_ledger(scenario)
    predicted_step_s = float("nan")
    if hardware is not None:
        from shardscope.core.timeline import estimate_time

        predicted_step_s = estimate_time(scenario, hardware).step_time_s
    notes = []
    traced, traced_ledger, traced_peak = None, None, None
    if with_trace:
        traced, traced_ledger, traced_peak, note = _trace(case, progress)
        if note:
            notes.append(note)
    rows = compare_case(
        case,
        predicted,
        predicted_ledger,
        predicted_step_s,
        traced,
        traced_ledger,
        traced_peak,
        measured.per_rank[0],
        measured.ledger,
        measured.step_time_s,
    )
    if hardware is None:
        rows = tuple(row for row in rows if row.quantity != "step_time_s")
        notes.append("step time not predicted: give --hardware with a profile from `shardscope calibrate`")
    return CaseResult(
        case=case,
        rows=rows,
        notes=tuple(notes),
        ledger_mismatches=ledger_differences(predicted_ledger, measured.ledger),
    )
