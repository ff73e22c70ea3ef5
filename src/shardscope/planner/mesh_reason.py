"""Why a ranked plan splits the model (tensor, context, pipeline or expert parallelism): nothing fits without it,
or the best plan without it is slower, by how much, and where data parallelism alone stops."""

from __future__ import annotations

from collections.abc import Callable

from shardscope.core.result import MemoryEstimate
from shardscope.planner.request import PlanRequest
from shardscope.planner.timing import PlanTiming
from shardscope.specs import Scenario

Ranked = tuple[float, MemoryEstimate, PlanTiming]
"""(ranking value, memory, timing) of a simulated plan, as the search ranks them."""


def model_parallel(scenario: Scenario) -> int:
    """How many GPUs one copy of the model is split over."""
    strategy = scenario.strategy
    return strategy.tp * strategy.cp * strategy.pp * strategy.ep


def splitting(request: PlanRequest) -> str:
    """The ways of splitting the model the request searches, as the reasons name them."""
    ways = ["tensor", "context"]
    ways += ["pipeline"] if request.pipeline_parallel != (1,) else []
    ways += ["expert"] if request.expert_parallel != (1,) and request.model.family == "moe" else []
    return ", ".join(ways[:-1]) + f" or {ways[-1]} parallelism"


def degrees_text(scenario: Scenario) -> str:
    """'TP 8 inside the node', 'CP 2', 'TP 4 x CP 2'."""
    strategy, per_node = scenario.strategy, scenario.cluster.gpus_per_node
    parts = []
    if strategy.tp > 1:
        parts.append(f"TP {strategy.tp}" + (" inside the node" if strategy.tp <= per_node else " across nodes"))
    if strategy.cp > 1:
        parts.append(f"CP {strategy.cp}")
    if strategy.pp > 1:
        virtual = f", {strategy.virtual_stages} stages a rank" if strategy.virtual_stages > 1 else ""
        parts.append(f"PP {strategy.pp} ({strategy.pp_schedule}{virtual})")
    if strategy.ep > 1:
        parts.append(f"EP {strategy.ep}")
    return " x ".join(parts)


def mesh_reasons(
    request: PlanRequest,
    fitting: list[MemoryEstimate],
    ranked: list[Ranked],
    best_of: Callable[[list[MemoryEstimate]], Ranked | None],
) -> dict[Scenario, str]:
    """Why each ranked plan that splits the model does: nothing fits without it, or the best plan without it
    and how much slower that is (and where data parallelism alone stops, when it stops at fewer GPUs).
    `best_of`: the best of some fitting plans by the request's ranking (the search's), None when there are none."""
    split = [item for item in ranked if model_parallel(item[1].scenario) > 1]
    if not split:
        return {}
    unsplit = best_of([memory for memory in fitting if model_parallel(memory.scenario) == 1])
    reasons = {}
    for _, memory, timing in split:
        scenario = memory.scenario
        degrees = degrees_text(scenario)
        if unsplit is None:
            reasons[scenario] = f"{degrees}: without {splitting(request)} nothing fits in the space"
            continue
        _, other, other_timing = unsplit
        gpus = other.scenario.cluster.world_size
        text = (
            f"{degrees}: the best plan without it ({other.scenario.strategy.label} on {gpus} GPUs) takes "
            f"{other_timing.step_time_s:.3f} s a step against {timing.step_time_s:.3f} s"
        )
        if gpus < scenario.cluster.world_size:
            widest = max(m.scenario.cluster.world_size for m in fitting if model_parallel(m.scenario) == 1)
            text += f"; data parallelism alone reaches at most {widest} GPUs at this batch"
        reasons[scenario] = text
    return reasons
