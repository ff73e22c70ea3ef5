"""A simulated step as a Chrome trace: the Trace Event Format that chrome://tracing and Perfetto open.

Format: "Trace Event Format" (Google, the catapult project's document): complete events (ph 'X') with ts and dur in
microseconds, one thread per stream, thread names as metadata events (ph 'M'), counters (ph 'C') for bytes in flight
and, given the step's memory estimate, for the rank's memory by category (core.memory_curve: one counter with a series
per category, which chrome://tracing stacks and Perfetto shows as one track per category).
"""

from __future__ import annotations

from shardscope.core.memory_curve import memory_curve
from shardscope.core.result import MemoryEstimate
from shardscope.core.timeline import STREAMS, TimeEstimate

_MICROSECONDS = 1e6


def chrome_trace(estimate: TimeEstimate, memory: MemoryEstimate | None = None, pid: int = 0) -> dict[str, object]:
    """The trace of one rank's step as a JSON-ready dict; with `memory` (core.memory.estimate_memory of the same
    scenario) it also carries the rank's memory by category over the step."""
    scenario = estimate.scenario
    events: list[dict[str, object]] = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": pid,
            "tid": 0,
            "args": {"name": f"rank 0: {scenario.model.name} {scenario.strategy.name} ({scenario.strategy.engine})"},
        },
    ]
    for tid, stream in enumerate(STREAMS):
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": f"{stream} stream"}})
    in_flight: list[tuple[float, int]] = []
    for span in estimate.spans:
        event: dict[str, object] = {
            "name": span.name,
            "cat": span.category,
            "ph": "X",
            "pid": pid,
            "tid": STREAMS.index(span.stream),
            "ts": span.start_s * _MICROSECONDS,
            "dur": span.duration_s * _MICROSECONDS,
        }
        if span.payload_bytes:
            event["args"] = {"payload_bytes": span.payload_bytes}
            in_flight += [(span.start_s, span.payload_bytes), (span.end_s, -span.payload_bytes)]
        events.append(event)
    total = 0
    for time_s, delta in sorted(in_flight):
        total += delta
        events.append(
            {
                "name": "communication in flight",
                "ph": "C",
                "pid": pid,
                "ts": time_s * _MICROSECONDS,
                "args": {"payload_bytes": total},
            }
        )
    if memory is not None:
        events += _memory_counters(memory, estimate, pid)
    summary: dict[str, object] = {
        "step_time_s": estimate.step_time_s,
        "compute_time_s": estimate.compute_time_s,
        "comm_time_s": estimate.comm_time_s,
        "exposed_comm_s": estimate.exposed_comm_s,
        "tokens_per_s": estimate.tokens_per_s,
        "mfu": estimate.mfu,
        "hardware": estimate.hardware.name,
        "micro_batches": estimate.scenario.training.grad_accum_steps,
        "micro_batches_drawn": estimate.simulated_micro_batches,
    }
    if memory is not None:
        summary["peak_bytes"] = memory.per_rank.peak_bytes
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": summary}


def _memory_counters(memory: MemoryEstimate, estimate: TimeEstimate, pid: int) -> list[dict[str, object]]:
    curve = memory_curve(memory, estimate)
    levels = zip(*curve.bytes_by_category, strict=True)  # one tuple per point, a value per category
    return [
        {
            "name": "memory by category (bytes)",
            "ph": "C",
            "pid": pid,
            "ts": time_s * _MICROSECONDS,
            "args": dict(zip(curve.categories, point, strict=True)),
        }
        for time_s, point in zip(curve.times_s, levels, strict=True)
    ]
