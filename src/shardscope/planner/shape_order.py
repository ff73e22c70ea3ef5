"""The order in which the search visits the shapes of the space, and what it ranks along the way so that its limits
fall early: the fewest GPUs that fit (--min-gpus), or every shape without a pipeline best bound first, then the
pipeline shapes best bound first (`planner.search` explains the pruning each step relies on)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardscope.core.result import MemoryEstimate
from shardscope.planner.mesh_reason import Ranked, model_parallel
from shardscope.planner.space import BatchShape, checkpointing_options, micro_batches

if TYPE_CHECKING:
    from shardscope.planner.search import _Search as Search


@dataclass(slots=True)
class LeastValue:
    """What the search knows of the least ranking value of the plans without a pipeline at one shape and
    checkpointing (`_Search._least_over`): the least of the bounds asked so far, and the micro-batches not asked."""

    known: float
    sizes_left: list[int]
    """Smallest first: the largest is asked next."""


def fewest_gpus_fitting(search: Search, shapes: tuple[BatchShape, ...]) -> list[MemoryEstimate]:
    """What fits at the smallest GPU count that fits anything."""
    fitting: list[MemoryEstimate] = []
    for done, shape in enumerate(shapes):
        search.place = done
        fitting += search.fitting(shape)
        if search.progress is not None:
            search.progress("memory", done + 1, len(shapes))
        if fitting:
            break
    return fitting


def flat_fitting(search: Search, flat: list[BatchShape]) -> list[MemoryEstimate]:
    """What fits of the shapes without a pipeline, searched in the order of their likeliest least ranking value (the
    likeliest best plans first, so the limits fall early), each setting estimated only where a plan of it can still
    change the answer (`_Search._beyond_limits`). The plans found are ranked with those kept so far (which hold the
    top plans and each family's best, so the limits are those of everything ranked) each time their number has
    doubled since the last ranking: often enough that the limits fall early, seldom enough that a question whose
    plans stay close (ranked by cost) does not re-rank hundreds of kept plans at every shape; the plans without
    model parallelism likewise with the best of those so far. The answer lists the plans in the shapes' own order,
    which the final ranking's ties read."""
    order = sorted(range(len(flat)), key=lambda index: (_least_of_shape(search, flat[index]), index))
    found: list[list[MemoryEstimate]] = [[] for _ in flat]
    ranked: list[Ranked] = []
    pending: list[MemoryEstimate] = []  # found since the last ranking
    ranked_count = 0  # found by the last ranking
    unsplit_best: list[MemoryEstimate] = []  # the best plan without model parallelism ranked so far
    unsplit_pending: list[MemoryEstimate] = []  # plans without model parallelism found since
    unsplit_count = 0  # plans without model parallelism found by the last ranking of them
    for done, index in enumerate(order):
        if pending and len(pending) >= ranked_count:
            ranked = search.rank([memory for _, memory, _ in ranked] + pending, quiet=True)
            search.set_limits(ranked)
            ranked_count, pending = ranked_count + len(pending), []
        if unsplit_pending and len(unsplit_pending) >= unsplit_count:
            best = search.best_of(unsplit_best + unsplit_pending, quiet=True)
            unsplit_count, unsplit_pending = unsplit_count + len(unsplit_pending), []
            if best is not None:
                search.unsplit_limit, unsplit_best = best[0], [best[1]]
        search.place = index
        found[index] = search.fitting(flat[index])
        pending += found[index]
        unsplit_pending += [memory for memory in found[index] if model_parallel(memory.scenario) == 1]
        if search.progress is not None:
            search.progress("memory", done + 1, len(flat))
    return [memory for shape_found in found for memory in shape_found]


def _least_of_shape(search: Search, shape: BatchShape) -> float:
    """The likeliest least ranking value of a shape without a pipeline, its order: the bound at its cheapest
    checkpointing and largest micro-batch that may fit (`_Search.batch_may_fit`), none when no batch may (any order
    gives the same answer; a better one prunes more)."""
    for checkpointing in checkpointing_options(search.request):
        for size in reversed(micro_batches(search.request, shape.sequences_per_rank)):
            if search.batch_may_fit(shape, checkpointing, size):
                return search.value_bound(shape, checkpointing, size)
    return math.inf


def fitting_with_pipelines(search: Search, shapes: tuple[BatchShape, ...]) -> list[MemoryEstimate]:
    """What fits: the shapes without a pipeline (`flat_fitting`), then the pipeline shapes in the order of their
    least possible ranking value, each estimated only where a plan of it can still enter the top plans or beat its
    family's best (the plans ranked so far set those limits, `_Search.set_limits`, and they only fall as more are
    ranked, so `rank` over everything fitting skips whatever this skips: the answer is the whole space's)."""
    flat = [shape for shape in shapes if shape.pp == 1]
    fitting = flat_fitting(search, flat)
    piped = sorted(
        ((search.optimistic(shape), index, shape) for index, shape in enumerate(shapes) if shape.pp > 1),
    )
    if not piped:
        return fitting
    ranked = search.rank(fitting)
    search.set_limits(ranked)
    for done, (least, _, shape) in enumerate(piped):
        if least >= max(search.limits.values()):
            break  # neither this shape nor any later one has a plan that can matter
        search.place = len(flat) + done
        found = search.fitting(shape)
        if found:
            fitting += found
            ranked = search.rank([memory for _, memory, _ in ranked] + found)
            search.set_limits(ranked)
        if search.progress is not None:
            search.progress("pipelines", done + 1, len(piped))
    return fitting
