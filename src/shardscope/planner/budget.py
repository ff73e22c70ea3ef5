"""Whether a plan's memory fits the request's budget, and by how much and where a plan that does not fit misses it
(the planner's closest misses and rejections)."""

from __future__ import annotations

from shardscope.core.result import CATEGORIES, MemoryEstimate
from shardscope.planner.request import PlanRequest


def fits_budget(memory: MemoryEstimate, request: PlanRequest, budget_bytes: int) -> bool:
    """Whether the peak is within `budget_bytes` (request.budget_bytes, computed once by the caller) and the node's
    host memory within the request's."""
    host_ok = not request.host_memory_bytes or memory.host_bytes_per_node <= request.host_memory_bytes
    return memory.per_rank.peak_bytes <= budget_bytes and host_ok


def over_by(memory: MemoryEstimate, request: PlanRequest, budget_bytes: int) -> int:
    """By how many bytes a plan that does not fit is over: its peak, else its node's host memory (`overshoot`'s)."""
    over = memory.per_rank.peak_bytes - budget_bytes
    return over if over > 0 else memory.host_bytes_per_node - request.host_memory_bytes


def overshoot(memory: MemoryEstimate, request: PlanRequest) -> tuple[str, int]:
    """(the category that breaks the budget, by how many bytes the peak is over it)."""
    over = over_by(memory, request, request.budget_bytes)
    if memory.per_rank.peak_bytes <= request.budget_bytes:
        return "host", over
    running = 0
    for category in CATEGORIES:  # the category at which the running sum crosses the budget
        running += memory.per_rank.category_bytes(category)
        if running > request.budget_bytes:
            return category, over
    return CATEGORIES[-1], over
