"""The planner's answer to a request: the search (`planner.search`) over every shape, then its plans, each family's
best, the families that fit nowhere with their closest miss, and the search's counts."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

from shardscope.planner.budget import overshoot
from shardscope.planner.mesh_reason import Ranked, mesh_reasons
from shardscope.planner.request import FAMILIES, PlanRequest
from shardscope.planner.result import PlanResult, Rejection, SearchStats
from shardscope.planner.search import Progress, _Search
from shardscope.planner.shape_order import fewest_gpus_fitting, fitting_with_pipelines
from shardscope.planner.space import batch_shapes, family_of


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cycle collector: the search allocates millions of short-lived tuples and frozen dataclasses and
    makes no cycles (reference counting frees them all), while each collector pass walks every estimate the search
    keeps. Measured on llama-3-70b's cost question, three runs each on the shared machine: plan() took 1.18-1.44 s
    of CPU with the collector off against 1.36-1.62 s with it on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def plan(request: PlanRequest, progress: Progress | None = None) -> PlanResult:
    """Search the space of the request and rank what fits."""
    with _collector_paused():
        return _plan(request, progress)


def _plan(request: PlanRequest, progress: Progress | None) -> PlanResult:
    search = _Search(request, progress)
    shapes = batch_shapes(request)
    fitting = fewest_gpus_fitting(search, shapes) if request.min_gpus else fitting_with_pipelines(search, shapes)
    ranked = search.rank(fitting)
    best: dict[str, Ranked] = {}
    for item in ranked:
        best.setdefault(family_of(item[1].scenario), item)
    reasons = mesh_reasons(request, fitting, ranked[: request.top] + list(best.values()), search.best_of)
    plans = tuple(search.plan(*item, reasons.get(item[1].scenario, "")) for item in ranked[: request.top])
    by_scenario = {plan.scenario: plan for plan in plans}
    best_plans = tuple(
        by_scenario.get(item[1].scenario) or search.plan(*item, reasons.get(item[1].scenario, ""))
        for item in best.values()
    )
    fitting_families = set(best)
    rejected = tuple(
        Rejection(family=family, category=overshoot(memory, request)[0], over_by_bytes=over, closest=memory)
        for family, (over, _, memory) in sorted(search.closest.items(), key=lambda item: FAMILIES.index(item[0]))
        if family not in fitting_families
    )
    stats = SearchStats(
        candidates=search.candidates,
        memory_evaluations=search.evaluator.memory_evaluations,
        fitting=len(fitting),
        time_evaluations=search.evaluator.time_evaluations,
    )
    return PlanResult(request=request, plans=plans, best_per_family=best_plans, rejected=rejected, stats=stats)
