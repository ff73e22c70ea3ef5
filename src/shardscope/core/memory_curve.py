"""Memory over one simulated step, by category, laid along the timeline's compute spans.

An approximation drawn from the per-category sizes of `core.memory`: activations grow with each forward stage and are
released by each backward stage; gradients fill in during backward and stay for the optimizer step (from the first
micro-batch on under accumulation); the loss spike and the optimizer's workspace (the temporary category's largest
size) appear only in the head's and the optimizer's spans; parameters, optimizer state, buffers and overhead are held
throughout. Its highest point is close to, not equal to,
the predicted peak, which the chart draws as its own line.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardscope.core.result import MemoryEstimate
from shardscope.core.timeline import TimeEstimate

MAX_POINTS = 600  # beyond this the curve is thinned evenly; a page stays small


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryCurve:
    """Bytes by category at points in time."""

    times_s: tuple[float, ...]
    """When each point is, from the start of the step."""
    categories: tuple[str, ...]
    """The stacked categories, bottom first."""
    bytes_by_category: tuple[tuple[int, ...], ...]
    """One series per category, aligned with times_s."""


def memory_curve(memory: MemoryEstimate, timeline: TimeEstimate) -> MemoryCurve:
    """The curve of one rank's step."""
    per_rank = memory.per_rank
    stages = timeline.scenario.model.num_layers + 2
    accumulating = timeline.scenario.training.grad_accum_steps > 1
    held = {
        "parameters": per_rank.parameters_bytes,
        "optimizer_state": per_rank.optimizer_state_bytes,
        "buffers": per_rank.buffers_bytes,
        "overhead": per_rank.overhead_bytes,
    }
    categories = ("parameters", "optimizer_state", "buffers", "overhead", "gradients", "activations", "temporary")
    activations = gradients = 0.0
    points: list[tuple[float, dict[str, int]]] = []

    def record(time_s: float, temporary: int) -> None:
        levels = dict(held, gradients=int(gradients), activations=int(activations), temporary=temporary)
        points.append((time_s, levels))

    record(0.0, 0)
    for span in (span for span in timeline.spans if span.stream == "compute"):
        spike = 0
        if span.category == "forward":
            activations = min(per_rank.activations_bytes, activations + per_rank.activations_bytes / stages)
            spike = per_rank.temporary_bytes if span.name.startswith("forward head") else 0
        elif span.category == "backward":
            activations = max(0.0, activations - per_rank.activations_bytes / stages)
            gradients = min(per_rank.gradients_bytes, gradients + per_rank.gradients_bytes / stages)
            spike = per_rank.temporary_bytes if span.name.startswith("backward head") else 0
        elif span.category == "optimizer":
            spike = per_rank.temporary_bytes
        record(span.start_s, spike)
        record(span.end_s, spike)
        if span.category == "backward" and accumulating and span.name.startswith("backward embed"):
            gradients = per_rank.gradients_bytes
    record(timeline.step_time_s, 0)
    stride = max(1, len(points) // MAX_POINTS)
    kept = points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])
    return MemoryCurve(
        times_s=tuple(time_s for time_s, _ in kept),
        categories=categories,
        bytes_by_category=tuple(tuple(levels[name] for _, levels in kept) for name in categories),
    )
