"""The search: memory prunes the space, a compute bound prunes the simulations, the time model ranks what is left.

1. For every GPU count that reaches the global batch, every strategy setting, offload and checkpointing, find the
   largest micro-batch that fits. Checkpointing settings are ordered cheapest first (none before checkpointing), and
   one is skipped where a cheaper one with the same offload already fits as large a micro-batch: under the time model
   it cannot be faster (more checkpointing adds recomputation, a smaller micro-batch adds micro-batches). Offload
   settings are not pruned against each other: the time model overlaps the host copies of parameter offload with
   compute but places optimizer offload's after backward, so offloading more can come out faster
   (tests/planner/test_search.py, llama-3-8b on 16 40 GiB GPUs: optimizer+params 5.175 s, optimizer 5.193 s).
   A point is estimated only where it may fit or become its family's closest miss: its peak floor
   (`core.peak_floor`: the weights, optimizer state, persistent buffers and context, plus the larger of the saved
   activations and the gradients, at a fraction of an estimate's cost) is weighed first, and a point over the budget
   by it is left once its family fits elsewhere or has a miss at least as close; a setting whose states alone break
   the budget so is left whole.
   Shapes are searched best lower bound first, the plans found ranked as they come, and a setting whose least
   possible ranking value is over the limits those plans set is skipped before any memory estimate
   (`_Search._beyond_limits`, `shape_order.flat_fitting`; a micro-batch whose saved activations alone break the
   budget has no value to bound, `_Search.batch_may_fit`): so the counts of memory estimates and fitting plans
   are of the points estimated, not of the whole space.
2. Simulate what fits best bound first (`_Search.rank`): a plan's compute bound, then its tight bound (the
   communication floor; for a pipeline its schedule's backward ends plus a floor under each rank's tail), then for a
   pipeline the exact end of its likeliest last ranks, each asked only when the bound before puts the plan first in
   line; a plan whose bound cannot beat the plans kept is never simulated.
3. Pipelines (pp > 1, when the request searches them) come after the rest, shape by shape in the order of their least
   possible ranking value: every micro-batch that fits competes (a smaller one runs more micro-batches, so a smaller
   bubble), a setting whose busiest stage's model states exceed the budget is dropped before any memory estimate, and
   a point whose lower bounds (`planner.pipeline.pipeline_bound_s`, then its schedule's backward ends, shared by
   every family and offload of its shape) cannot enter the top plans nor beat its family's best is never estimated.
   Their step is `core.pipeline_time`'s simulation of the schedule, as `estimate --time`.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable

from shardscope.choices import Checkpointing
from shardscope.core.peak_floor import batch_floor_bytes
from shardscope.core.pipeline_memory import pipeline_peak_floor_bytes
from shardscope.core.result import MemoryEstimate
from shardscope.planner.budget import fits_budget, over_by
from shardscope.planner.evaluator import Evaluator
from shardscope.planner.failure import diagnose
from shardscope.planner.mesh_reason import Ranked, model_parallel
from shardscope.planner.peak_floors import PeakFloors, SettingFloor
from shardscope.planner.pipeline import busiest_states_bytes
from shardscope.planner.request import PlanRequest
from shardscope.planner.result import Plan
from shardscope.planner.shape_order import LeastValue
from shardscope.planner.space import (
    BatchShape,
    Variant,
    checkpointing_options,
    family_of,
    grad_accum_of,
    make_scenario,
    micro_batches,
    offloads_for,
    pipeline_schedules,
    point_training,
    variants,
)
from shardscope.planner.timing import (
    PlanTiming,
)
from shardscope.specs import Scenario

Progress = Callable[[str, int, int], None]
SECONDS_PER_HOUR = 3600.0


class _Search:
    def __init__(self, request: PlanRequest, progress: Progress | None) -> None:
        self.request = request
        self.progress = progress
        self.evaluator = Evaluator(request)
        self.candidates = 0
        self.closest: dict[str, tuple[int, int, MemoryEstimate]] = {}
        """Per family, its closest miss: (bytes over, place of its shape, memory); the first of the closest in the
        order of places, whatever the order the shapes are searched in."""
        self.place = 0
        """The place of the shape being searched: its index among the shapes without a pipeline, then the pipeline
        shapes in the order they are searched."""
        self.fitting_families: set[str] = set()
        self.budget_bytes = request.budget_bytes
        self.limits: dict[str, float] = {}
        """Per family, the ranking value a plan must beat to enter the top plans or be its family's best (set from
        the plans ranked so far, `_Search.set_limits`); a family missing has no limit."""
        self.unsplit_limit = math.inf
        """The best ranking value of the plans without model parallelism found so far
        (`shape_order.flat_fitting`): what an unsplit plan must beat to become the one `mesh_reasons` compares the
        split plans with."""
        self.widest_unsplit = 0
        """The most GPUs at which a plan without model parallelism was found to fit (`mesh_reasons`' widest)."""
        self._least: dict[tuple[BatchShape, str], LeastValue] = {}
        self.floors = PeakFloors()
        self._batch_may_fit: dict[tuple[int, int, str, int], bool] = {}

    def set_limits(self, ranked: list[Ranked]) -> None:
        """The limits that ranking `ranked` (some of the fitting plans) leaves: a plan whose lower bound reaches both
        the top plans' last value and its family's best would be skipped by `rank` (whose values only fall as it
        keeps more plans), so its memory need not be estimated."""
        top = self.request.top
        top_value = ranked[top - 1][0] if len(ranked) >= top else math.inf
        best: dict[str, float] = {}
        for value, memory, _ in ranked:
            best.setdefault(family_of(memory.scenario), value)
        self.limits = {family: max(top_value, best.get(family, math.inf)) for family in self.request.families}

    def _hopeless(self, family: str, floor_bytes: int) -> bool:
        """Whether no point whose peak is at least `floor_bytes` (`core.peak_floor`: of one point, or of a whole
        setting, a strategy and offload at one shape, from its states alone) can fit or change the answer: the floor
        breaks the budget, and the family fits elsewhere (its closest miss is not reported) or already has a miss at
        least as close from a shape at or before this one (`_note_miss` keeps the first of the closest by place)."""
        over = floor_bytes - self.budget_bytes
        if over <= 0:
            return False
        if family in self.fitting_families:
            return True
        return family in self.closest and self.closest[family][:2] <= (over, self.place)

    def _note_miss(self, memory: MemoryEstimate) -> None:
        family = family_of(memory.scenario)
        over = over_by(memory, self.request, self.budget_bytes)
        if family not in self.closest or (over, self.place) < self.closest[family][:2]:
            self.closest[family] = (over, self.place, memory)

    def fitting(self, shape: BatchShape) -> list[MemoryEstimate]:
        """The largest fitting micro-batch of every setting at one GPU count, cheaper settings dominating; for a
        pipeline every fitting micro-batch (a smaller one runs more micro-batches, so a smaller bubble)."""
        request, found = self.request, []
        sizes = micro_batches(request, shape.sequences_per_rank)
        for variant in variants(request, shape.gpus, shape.tp, shape.cp, shape.pp):
            pipelined = variant.pp > 1
            fitted: list[tuple[int, int, int]] = []
            for offload_rank, offload in enumerate(offloads_for(request, variant.family)):
                states_checked = False
                setting: SettingFloor | None = None  # its peak floor's parts, once a point is weighed
                for checkpoint_rank, checkpointing in enumerate(checkpointing_options(request)):
                    if setting is not None and self._hopeless(setting.family, setting.held.states_bytes):
                        self.candidates += len(sizes)  # and it stays so: misses only get closer, families only fit
                        continue
                    if not pipelined and self._beyond_limits(shape, variant, checkpointing):
                        self.candidates += len(sizes)
                        continue
                    floor = max(
                        (mb for o, c, mb in fitted if o == offload_rank and c <= checkpoint_rank),
                        default=0,
                    )
                    best: MemoryEstimate | None = None
                    failed = False
                    for size in sizes:
                        self.candidates += 1
                        whole = size == shape.sequences_per_rank
                        if size <= floor or (failed and not whole):
                            continue  # dominated, or larger than a micro-batch that already does not fit
                        grad_accum = grad_accum_of(request, shape, size)
                        if not variant.allows(grad_accum):
                            continue
                        if not pipelined:
                            setting = setting or self.floors.setting(
                                make_scenario(request, shape.gpus, variant, offload, checkpointing, size, grad_accum)
                            )
                            training = point_training(request, checkpointing, size, 1)
                            if self._hopeless(setting.family, self.floors.point_bytes(setting, training)):
                                failed = True  # it cannot fit, nor be its family's closest miss
                                continue
                        scenario = make_scenario(request, shape.gpus, variant, offload, checkpointing, size, grad_accum)
                        if pipelined and self._out_of_reach(scenario, self.limits.get(variant.family, math.inf)):
                            continue  # cannot enter the top plans nor beat its family's best
                        if pipelined and not states_checked:
                            states_checked = True
                            if busiest_states_bytes(scenario) > self.budget_bytes:
                                break  # no micro-batch or checkpointing fits the model states
                        if pipelined and self._hopeless(variant.family, pipeline_peak_floor_bytes(scenario)):
                            failed = True  # it cannot fit, nor be its family's closest miss
                            continue
                        memory = self.evaluator.new_memory(scenario)
                        if not fits_budget(memory, request, self.budget_bytes):
                            failed = True
                            self._note_miss(memory)
                            continue
                        self.fitting_families.add(family_of(scenario))
                        if model_parallel(scenario) == 1:
                            self.widest_unsplit = max(self.widest_unsplit, shape.gpus)
                        if pipelined:  # every size that fits competes
                            fitted.append((offload_rank, checkpoint_rank, size))
                            found.append(memory)
                        else:
                            best = memory
                    else:
                        if best is not None:
                            fitted.append((offload_rank, checkpoint_rank, best.scenario.training.micro_batch_size))
                            found.append(best)
                        continue
                    break  # the states do not fit: neither does any checkpointing of this offload
        return found

    def _beyond_limits(self, shape: BatchShape, variant: Variant, checkpointing: Checkpointing) -> bool:
        """Whether no plan of a setting without a pipeline (a variant and offload at `shape` with `checkpointing`)
        can change the answer, so none of its memory is estimated: its least possible ranking value
        (`_least_over`) is over its family's limit (`set_limits`) and, for a plan without model parallelism, over
        the best unsplit value seen, at a GPU count no wider than where an unsplit plan already fits (so the mesh
        reasons' comparison and widest count are the whole space's). Strictly over: `rank` over every fitting point
        then skips each of its plans (a plan at or under its bound that the limits came from comes first in line),
        ties included.

        A skipped setting leaves no micro-batch for the costlier checkpointing settings of its offload to beat, so
        one of them may now fit a micro-batch it would have been dominated at. That plan is no faster than the
        skipped setting's own (more recomputation, more micro-batches: the dominance the memory search relies on),
        whose value is at or over its bound, over the limits: it enters neither the top plans, nor its family's
        best, nor (unsplit) the comparison, and its GPU count is no wider than an unsplit fit already found. So
        only the count of fitting plans can change."""
        limit = self.limits.get(variant.family, math.inf)
        if variant.tp * variant.cp * variant.ep == 1:
            if shape.gpus > self.widest_unsplit:
                return False
            limit = max(limit, self.unsplit_limit)
        return limit < math.inf and self._least_over(shape, checkpointing, limit)

    def _least_over(self, shape: BatchShape, checkpointing: Checkpointing, limit: float) -> bool:
        """Whether the least ranking value of the plans without a pipeline at `shape` with `checkpointing` is over
        `limit`: each micro-batch's bound (`value_bound`) asked largest first (usually the least) and only until one
        is at or under `limit`, of the micro-batches that may fit (`batch_may_fit`); what was asked is kept, and a
        later question (the limits only fall) resumes there."""
        key = (shape, checkpointing)
        least = self._least.get(key)
        if least is None:
            sizes = list(micro_batches(self.request, shape.sequences_per_rank))  # asked from the end
            least = self._least[key] = LeastValue(known=math.inf, sizes_left=sizes)
        while least.known > limit and least.sizes_left:
            size = least.sizes_left.pop()
            if self.batch_may_fit(shape, checkpointing, size):
                least.known = min(least.known, self.value_bound(shape, checkpointing, size))
        return least.known > limit

    def batch_may_fit(self, shape: BatchShape, checkpointing: Checkpointing, size: int) -> bool:
        """Whether a plan without a pipeline at `shape` with `checkpointing` and micro-batch `size` may fit: no plan
        of any family, shard group or offload does where the context and the saved activations alone break the
        budget (`core.peak_floor.batch_floor_bytes`), so such a batch has no ranking value to bound. Always, for a
        request that searches expert parallelism (its degrees cut the activations too)."""
        if self.request.expert_parallel != (1,):
            return True
        key = (shape.tp, shape.cp, checkpointing, size)  # the rest it reads is the request's (not the GPU count)
        found = self._batch_may_fit.get(key)
        if found is None:
            variant = Variant(family="ddp", tp=shape.tp, cp=shape.cp)
            probe = make_scenario(self.request, shape.gpus, variant, "none", checkpointing, size, 1)
            found = self._batch_may_fit[key] = batch_floor_bytes(probe) <= self.budget_bytes
        return found

    def value_bound(
        self, shape: BatchShape, checkpointing: Checkpointing, size: int, variant: Variant | None = None
    ) -> float:
        """The least ranking value of a plan at `shape` with `checkpointing` and micro-batch `size` (of `variant`, by
        default the shape's without a pipeline): its lower bound (`Evaluator.lower_bound_s`, which reads the
        micro-batch, its count, the checkpointing, the model-parallel degrees and the schedule, no family, shard
        group nor offload)."""
        variant = variant or Variant(family="ddp", tp=shape.tp, cp=shape.cp)
        grad_accum = grad_accum_of(self.request, shape, size)
        scenario = make_scenario(self.request, shape.gpus, variant, "none", checkpointing, size, grad_accum)
        return self.metric(scenario, self.evaluator.lower_bound_s(scenario))

    def _least_of(self, shape: BatchShape, variant: Variant, checkpointing: Checkpointing) -> float:
        """The least ranking value of a pipeline `variant` at `shape`: its lower bound at the best micro-batch it
        allows."""
        sizes = micro_batches(self.request, shape.sequences_per_rank)
        allowed = (size for size in sizes if variant.allows(grad_accum_of(self.request, shape, size)))
        return min((self.value_bound(shape, checkpointing, size, variant) for size in allowed), default=math.inf)

    def _out_of_reach(self, scenario: Scenario, limit: float) -> bool:
        """Whether a pipeline's bounds already reach `limit`: the cheap one, then its schedule's (shared by every
        family and offload of its shape)."""
        evaluator = self.evaluator
        if self.metric(scenario, evaluator.lower_bound_s(scenario)) >= limit:
            return True
        return self.metric(scenario, evaluator.schedule_bound_s(scenario)) >= limit

    def optimistic(self, shape: BatchShape) -> float:
        """The least ranking value any plan of a pipeline shape can have: its lower bound at the cheapest
        checkpointing, the best schedule and micro-batch (the bound is the same for every family and offload)."""
        checkpointing = checkpointing_options(self.request)[0]
        return min(
            self._least_of(
                shape,
                Variant(
                    family="ddp", tp=shape.tp, cp=shape.cp, pp=shape.pp, pp_schedule=schedule, pp_virtual_stages=virtual
                ),
                checkpointing,
            )
            for schedule, virtual in pipeline_schedules(self.request, shape.pp)
        )

    def metric(self, scenario: Scenario, step_time_s: float) -> float:
        """The ranking value, smaller is better."""
        request = self.request
        tokens = scenario.tokens_per_step
        if request.rank_by == "tokens-per-s":
            return -tokens / step_time_s
        if request.rank_by == "cost":
            return self.cost(scenario, tokens / step_time_s) or math.inf
        return step_time_s

    def cost(self, scenario: Scenario, tokens_per_s: float) -> float | None:
        price = self.request.price_per_gpu_hour
        if price is None:
            return None
        return price * scenario.cluster.world_size / SECONDS_PER_HOUR / tokens_per_s * 1e6

    def rank(self, fitting: list[MemoryEstimate], best_only: bool = False, quiet: bool = False) -> list[Ranked]:
        """Simulate what can enter the top plans or beat its family's best (with `best_only`, what can beat the best
        plan: only the first of the answer is meant), best bound first: a plan's cheap bound, then its further
        bounds one by one (`Evaluator.further_bound_s`: the optimizer step's, then the communication floor; a
        pipeline's floor, then the exact ends of its likeliest last ranks), each asked only when the one before
        leaves the plan first in line, so the limits fall as soon as they can and the costlier bounds are asked
        least. The answer is ordered by value, then GPU count, then cheap bound and place in `fitting`, whatever the
        order of the simulations. `quiet`: no progress reports (a ranking along the memory search, for its
        limits)."""
        evaluator, top = self.evaluator, 1 if best_only else self.request.top
        queue = [
            (bound, 0, bound, index)
            for index, m in enumerate(fitting)
            for bound in (self.metric(m.scenario, evaluator.lower_bound_s(m.scenario)),)
        ]
        heapq.heapify(queue)
        kept: list[tuple[float, int, float, int, Ranked]] = []
        family_best: dict[str, float] = {}
        resolved = 0
        while queue:
            key, checked, bound, index = heapq.heappop(queue)
            scenario = fitting[index].scenario
            family = family_of(scenario)
            top_value = kept[top - 1][0] if len(kept) >= top else math.inf
            limit = top_value if best_only else max(top_value, family_best.get(family, math.inf))
            if key >= limit:
                resolved += 1
                continue  # the limits only fall: it stays out
            further_s = evaluator.further_bound_s(scenario, checked)
            if further_s is not None:  # one bound tighter, then back in line
                heapq.heappush(queue, (max(key, self.metric(scenario, further_s)), checked + 1, bound, index))
                continue
            timing = evaluator.timing(scenario)
            value = self.metric(scenario, timing.step_time_s)
            item = (value, scenario.cluster.world_size, bound, index, (value, fitting[index], timing))
            bisect.insort(kept, item, key=lambda item: item[:4])
            family_best[family] = min(value, family_best.get(family, math.inf))
            resolved += 1
            if self.progress is not None and not quiet:
                self.progress("simulating", resolved, len(fitting))
        return [item[4] for item in kept]

    def best_of(self, fitting: list[MemoryEstimate], quiet: bool = False) -> Ranked | None:
        """The best of `fitting` by the request's ranking, None when it is empty."""
        ranked = self.rank(fitting, best_only=True, quiet=quiet)
        return ranked[0] if ranked else None

    def plan(self, value: float, memory: MemoryEstimate, timing: PlanTiming, reason: str = "") -> Plan:
        evaluator = self.evaluator
        risks = diagnose(memory.scenario, memory, timing, self.request, evaluator.memory, evaluator.timing)
        return Plan(
            memory=memory,
            timing=timing,
            failure_mode=risks[0],
            risks=risks,
            cost_per_million_tokens=self.cost(memory.scenario, timing.tokens_per_s),
            mesh_reason=reason,
        )
