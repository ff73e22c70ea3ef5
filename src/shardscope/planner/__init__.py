"""The planner: which strategy, offload, micro-batch, accumulation, checkpointing, GPU count and tensor, context,
pipeline and expert parallel degrees fit a model on a GPU type at a sequence length, which is fastest (or cheapest),
and what each plan runs into next.

torch-free and fast: memory from `core.memory`, time from `core.timeline`, thousands of candidates in about a second.
"""

from shardscope.planner.answer import plan
from shardscope.planner.failure import FailureMode
from shardscope.planner.request import FAMILIES, RANKINGS, PlanRequest
from shardscope.planner.result import Plan, PlanResult, Rejection, SearchStats
from shardscope.planner.timing import PlanTiming, plan_timing

__all__ = [
    "FAMILIES",
    "RANKINGS",
    "FailureMode",
    "Plan",
    "PlanRequest",
    "PlanResult",
    "PlanTiming",
    "Rejection",
    "SearchStats",
    "plan",
    "plan_timing",
]
