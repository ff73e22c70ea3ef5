"""Where the time an engine costs beyond FLOPs, ops and collectives is paid in the step.

Each engine's rules (`core.engines`) pair measured profile terms (presets.hardware, measured by `shardscope
calibrate`) with the compute tasks they run beside: torch DDP's per-step bookkeeping, FSDP2's per-unit bookkeeping,
the teaching strategies' hook calls and bookkeeping ops. This module holds what is the same for every engine: async
collectives (issued with async_op=True from backward) slow the compute that runs while one is in flight, by the
measured extra per second in flight.
"""

from __future__ import annotations

from collections.abc import Sequence


def async_slowdown_s(
    compute_s: Sequence[float], issued: Sequence[tuple[int, float]], wait_at: int, slowdown: float
) -> list[float]:
    """Extra seconds of each compute task while async collectives are in flight beside it.

    compute_s: the compute tasks' durations in issue order; issued: (index of the compute task after which the
    collective is issued, its duration) in issue order; wait_at: the compute task that waits for them all (the
    optimizer step). Time runs on the compute stream's clock, as if overlap were free; gloo's thread runs the
    collectives one after another, each from its issue or from the end of the one before, whichever is later.
    Each compute task before wait_at is charged slowdown x the part of it that some collective overlaps.
    """
    starts, clock = [], 0.0
    for duration in compute_s:
        starts.append(clock)
        clock += duration
    windows, busy_until = [], 0.0
    for after, duration in issued:
        begin = max(busy_until, starts[after] + compute_s[after])
        busy_until = begin + duration
        windows.append((begin, busy_until))
    extra = [0.0] * len(compute_s)
    for index in range(min(wait_at, len(compute_s))):
        start, end = starts[index], starts[index] + compute_s[index]
        overlap = sum(max(0.0, min(end, stop) - max(start, begin)) for begin, stop in windows)
        extra[index] = slowdown * overlap
    return extra
