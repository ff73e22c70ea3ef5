"""A simulated step as a Chrome trace: the Trace Event Format that chrome://tracing and Perfetto open.

Format: "Trace Event Format" (Google, the catapult project's document): complete events (ph 'X') with ts and dur in
microseconds, one thread per stream, thread names as metadata events (ph 'M'), counters (ph 'C') for bytes in flight
and, given the step's memory estimate, for the rank's memory by category (core.memory_curve: one counter with a series
per category, which chrome://tracing stacks and Perfetto shows as one track per category). A pipeline's step
(`pipeline_chrome_trace`) is one process per pipeline rank and one thread per stage, so its bubble shows as gaps.
"""

from __future__ import annotations

from shardscope.core.memory_curve import memory_curve
from shardscope.core.pipeline import rank_stages
from shardscope.core.pipeline_time import PipelineStep
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


def pipeline_chrome_trace(step: PipelineStep) -> dict[str, object]:
    """The trace of a pipeline's step: one process per pipeline rank, one thread per stage it holds with that stage's
    forwards and backwards (the gaps between them are the bubble), one thread for what the rank does after its last
    backward, and a counter of the micro-batches whose activations the rank holds."""
    scenario, strategy = step.scenario, step.scenario.strategy
    after_tid = strategy.pipeline_stages  # one past the last stage's thread
    events: list[dict[str, object]] = []
    for rank, actions in enumerate(step.actions):
        stages = rank_stages(scenario, rank)
        described = ", ".join(f"stage {stage.index}: {stage.described}" for stage in stages)
        events.append(_metadata("process_name", rank, 0, f"pipeline rank {rank} ({described})"))
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for stage in stages:
            events.append(_metadata("thread_name", rank, stage.index, f"stage {stage.index}: {stage.described}"))
        events.append(_metadata("thread_name", rank, after_tid, "after the last backward"))
        held = 0
        for action, start, end in actions:
            kind = "backward" if action.backward else "forward"
            events.append(
                {
                    "name": f"{kind} micro-batch {action.micro_batch}",
                    "cat": kind,
                    "ph": "X",
                    "pid": rank,
                    "tid": action.stage,
                    "ts": start * _MICROSECONDS,
                    "dur": (end - start) * _MICROSECONDS,
                    "args": {"stage": action.stage, "micro_batch": action.micro_batch},
                }
            )
            # a forward's activations are held from its start until its backward has ended
            held += -1 if action.backward else 1
            moment = end if action.backward else start
            events.append(_counter("micro-batches in flight", rank, moment, {"micro_batches": held}))
        start = actions[-1][2]
        names = (("exposed data-parallel communication", "comm"), ("optimizer step", "optimizer"))
        for (name, kind), duration in zip(names, step.after_s(rank), strict=True):
            if duration > 0:
                events.append(
                    {
                        "name": name,
                        "cat": kind,
                        "ph": "X",
                        "pid": rank,
                        "tid": after_tid,
                        "ts": start * _MICROSECONDS,
                        "dur": duration * _MICROSECONDS,
                    }
                )
                start += duration
    summary: dict[str, object] = {
        "step_time_s": step.step_time_s,
        "pipeline_span_s": step.span_s,
        "bubble_fraction": step.bubble_fraction,
        "last_pipeline_rank": step.shown_rank,
        "send_s": step.send.time_s,
        "pp": strategy.pp,
        "pp_schedule": strategy.pp_schedule,
        "pp_virtual_stages": strategy.virtual_stages,
        "micro_batches": scenario.training.grad_accum_steps,
    }
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": summary}


def _metadata(kind: str, pid: int, tid: int, name: str) -> dict[str, object]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def _counter(name: str, pid: int, time_s: float, values: dict[str, int]) -> dict[str, object]:
    return {"name": name, "ph": "C", "pid": pid, "ts": time_s * _MICROSECONDS, "args": values}
