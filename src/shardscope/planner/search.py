"""The search: memory prunes the space, a compute bound prunes the simulations, the time model ranks what is left.

1. For every GPU count that reaches the global batch, every strategy setting, offload and checkpointing, find the
   largest micro-batch that fits. Checkpointing settings are ordered cheapest first (none before checkpointing), and
   one is skipped where a cheaper one with the same offload already fits as large a micro-batch: under the time model
   it cannot be faster (more checkpointing adds recomputation, a smaller micro-batch adds micro-batches). Offload
   settings are not pruned against each other: the time model overlaps the host copies of parameter offload with
   compute but places optimizer offload's after backward, so offloading more can come out faster
   (tests/planner/test_search.py, llama-3-8b on 16 40 GiB GPUs: optimizer+params 5.175 s, optimizer 5.193 s).
2. Sort what fits by a lower bound of the ranking metric (the compute stream's busy time) and simulate in that order,
   stopping for each plan whose bound cannot beat the plans kept.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from shardscope.core.memory import estimate_memory
from shardscope.core.result import CATEGORIES, MemoryEstimate
from shardscope.planner.failure import diagnose
from shardscope.planner.request import FAMILIES, PlanRequest
from shardscope.planner.result import Plan, PlanResult, Rejection, SearchStats
from shardscope.planner.space import (
    BatchShape,
    batch_shapes,
    checkpointing_options,
    family_of,
    make_scenario,
    micro_batches,
    offloads_for,
    variants,
)
from shardscope.planner.timing import (
    PlanTiming,
    communication_floor,
    micro_batch_compute_s,
    plan_timing,
    tensor_parallel_floor_s,
)
from shardscope.presets.hardware import default_profile
from shardscope.specs import Scenario

Progress = Callable[[str, int, int], None]
SECONDS_PER_HOUR = 3600.0


class _Evaluator:
    """Memory, time and bounds of scenarios, each computed once."""

    def __init__(self, request: PlanRequest) -> None:
        self.request = request
        self.hardware = request.hardware or default_profile(request.gpu)
        self._memory: dict[Scenario, MemoryEstimate] = {}
        self._timing: dict[Scenario, PlanTiming] = {}
        self._tight: dict[Scenario, float] = {}
        self._micro_batch_compute: dict[tuple[int, str, int, int, bool], float] = {}
        self._bound: dict[tuple[int, int, str, int, int, bool], float] = {}
        self._tp_floor: dict[tuple[str, int, int, bool], float] = {}
        self._tp_floor_at: dict[tuple[str, int, int, bool, int], float] = {}

    def memory(self, scenario: Scenario) -> MemoryEstimate:
        found = self._memory.get(scenario)
        if found is None:
            found = self._memory[scenario] = estimate_memory(scenario)
        return found

    def new_memory(self, scenario: Scenario) -> MemoryEstimate:
        """The memory of a point of the search: each is asked once (every point differs in GPU count, degrees,
        setting or micro-batch), so the cache is written without the lookup (its key hashes a whole scenario)."""
        found = self._memory[scenario] = estimate_memory(scenario)
        return found

    def timing(self, scenario: Scenario) -> PlanTiming:
        found = self._timing.get(scenario)
        if found is None:
            found = self._timing[scenario] = plan_timing(scenario, self.hardware)
        return found

    def lower_bound_s(self, scenario: Scenario) -> float:
        training, strategy = scenario.training, scenario.strategy
        # what the compute stream does: the batch shape, the recompute, and each rank's share of the model
        shape = (training.checkpointing, strategy.tp, strategy.cp, strategy.uses_sequence_parallel)
        key = (training.micro_batch_size, training.grad_accum_steps, *shape)
        found = self._bound.get(key)
        if found is None:
            floor = self._tp_floor.get(shape)
            if floor is None:
                floor = self._tp_floor[shape] = tensor_parallel_floor_s(scenario, self.hardware)
            found = self._bound[key] = self.compute_bound_s(scenario) + floor * training.grad_accum_steps
        return found

    def compute_bound_s(self, scenario: Scenario) -> float:
        """compute_lower_bound_s, one micro-batch priced once for every micro-batch count."""
        training, strategy = scenario.training, scenario.strategy
        key = (
            training.micro_batch_size,
            training.checkpointing,
            strategy.tp,
            strategy.cp,
            strategy.uses_sequence_parallel,
        )
        found = self._micro_batch_compute.get(key)
        if found is None:
            found = self._micro_batch_compute[key] = micro_batch_compute_s(scenario, self.hardware)
        return found * training.grad_accum_steps

    def tight_bound_s(self, scenario: Scenario) -> float:
        """The lower bound with the communication floor (planner.timing.CommunicationFloor): costlier to compute, so
        asked only of a plan the compute bound did not prune, and kept: the second ranking (`_Search.mesh_reasons`)
        asks again."""
        found = self._tight.get(scenario)
        if found is None:
            found = self._tight[scenario] = self._tight_bound_s(scenario)
        return found

    def _tight_bound_s(self, scenario: Scenario) -> float:
        training, strategy = scenario.training, scenario.strategy
        shape = (training.checkpointing, strategy.tp, strategy.cp, strategy.uses_sequence_parallel)
        key = (*shape, training.micro_batch_size)
        floor = self._tp_floor_at.get(key)
        if floor is None:
            floor = self._tp_floor_at[key] = tensor_parallel_floor_s(scenario, self.hardware, training.micro_batch_size)
        chain = self.compute_bound_s(scenario) + floor * training.grad_accum_steps
        return communication_floor(scenario, self.hardware).bound_s(chain)

    @property
    def memory_evaluations(self) -> int:
        return len(self._memory)

    @property
    def time_evaluations(self) -> int:
        return len(self._timing)


def _fits(memory: MemoryEstimate, request: PlanRequest, budget_bytes: int) -> bool:
    """Whether the peak is within `budget_bytes` (request.budget_bytes, computed once by the caller) and the node's
    host memory within the request's."""
    host_ok = not request.host_memory_bytes or memory.host_bytes_per_node <= request.host_memory_bytes
    return memory.per_rank.peak_bytes <= budget_bytes and host_ok


def _over_by(memory: MemoryEstimate, request: PlanRequest, budget_bytes: int) -> int:
    """By how many bytes a plan that does not fit is over: its peak, else its node's host memory (_overshoot's)."""
    over = memory.per_rank.peak_bytes - budget_bytes
    return over if over > 0 else memory.host_bytes_per_node - request.host_memory_bytes


def _overshoot(memory: MemoryEstimate, request: PlanRequest) -> tuple[str, int]:
    """(the category that breaks the budget, by how many bytes the peak is over it)."""
    over = _over_by(memory, request, request.budget_bytes)
    if memory.per_rank.peak_bytes <= request.budget_bytes:
        return "host", over
    running = 0
    for category in CATEGORIES:  # the category at which the running sum crosses the budget
        running += memory.per_rank.category_bytes(category)
        if running > request.budget_bytes:
            return category, over
    return CATEGORIES[-1], over


class _Search:
    def __init__(self, request: PlanRequest, progress: Progress | None) -> None:
        self.request = request
        self.progress = progress
        self.evaluator = _Evaluator(request)
        self.candidates = 0
        self.closest: dict[str, tuple[int, MemoryEstimate]] = {}
        self.budget_bytes = request.budget_bytes

    def _note_miss(self, memory: MemoryEstimate) -> None:
        family = family_of(memory.scenario)
        over = _over_by(memory, self.request, self.budget_bytes)
        if family not in self.closest or over < self.closest[family][0]:
            self.closest[family] = (over, memory)

    def fitting(self, shape: BatchShape) -> list[MemoryEstimate]:
        """The largest fitting micro-batch of every setting at one GPU count, cheaper settings dominating."""
        request, found = self.request, []
        sizes = micro_batches(request, shape.sequences_per_rank)
        for variant in variants(request, shape.gpus, shape.tp, shape.cp):
            fitted: list[tuple[int, int, int]] = []
            for offload_rank, offload in enumerate(offloads_for(request, variant.family)):
                for checkpoint_rank, checkpointing in enumerate(checkpointing_options(request)):
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
                        grad_accum = max(1, shape.sequences_per_rank // size)
                        scenario = make_scenario(request, shape.gpus, variant, offload, checkpointing, size, grad_accum)
                        memory = self.evaluator.new_memory(scenario)
                        if _fits(memory, request, self.budget_bytes):
                            best = memory
                        else:
                            failed = True
                            self._note_miss(memory)
                    if best is not None:
                        fitted.append((offload_rank, checkpoint_rank, best.scenario.training.micro_batch_size))
                        found.append(best)
        return found

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

    def rank(self, fitting: list[MemoryEstimate]) -> list[tuple[float, MemoryEstimate, PlanTiming]]:
        """Simulate in order of the bound; skip what cannot enter the top plans or beat its family's best."""
        evaluator, top = self.evaluator, self.request.top
        bounded = sorted(
            ((self.metric(m.scenario, evaluator.lower_bound_s(m.scenario)), index) for index, m in enumerate(fitting)),
        )
        kept: list[tuple[float, MemoryEstimate, PlanTiming]] = []
        family_best: dict[str, float] = {}
        for done, (bound, index) in enumerate(bounded):
            memory = fitting[index]
            family = family_of(memory.scenario)
            top_value = kept[top - 1][0] if len(kept) >= top else math.inf
            if bound >= top_value and bound >= family_best.get(family, math.inf):
                continue
            tight = self.metric(memory.scenario, evaluator.tight_bound_s(memory.scenario))
            if tight >= top_value and tight >= family_best.get(family, math.inf):
                continue
            timing = evaluator.timing(memory.scenario)
            value = self.metric(memory.scenario, timing.step_time_s)
            kept.append((value, memory, timing))
            kept.sort(key=lambda item: (item[0], item[1].scenario.cluster.world_size))
            family_best[family] = min(value, family_best.get(family, math.inf))
            if self.progress is not None:
                self.progress("simulating", done + 1, len(bounded))
        return kept

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

    def mesh_reasons(
        self, fitting: list[MemoryEstimate], ranked: list[tuple[float, MemoryEstimate, PlanTiming]]
    ) -> dict[Scenario, str]:
        """Why each ranked plan that splits the model does: nothing fits without it, or the best plan without it
        and how much slower that is (and where data parallelism alone stops, when it stops at fewer GPUs)."""
        split = [item for item in ranked if _model_parallel(item[1].scenario) > 1]
        if not split:
            return {}
        unsplit = self.rank([memory for memory in fitting if _model_parallel(memory.scenario) == 1])
        reasons = {}
        for _, memory, timing in split:
            scenario = memory.scenario
            degrees = _degrees_text(scenario)
            if not unsplit:
                reasons[scenario] = f"{degrees}: without tensor or context parallelism nothing fits in the space"
                continue
            _, other, other_timing = unsplit[0]
            gpus = other.scenario.cluster.world_size
            text = (
                f"{degrees}: the best plan without it ({other.scenario.strategy.label} on {gpus} GPUs) takes "
                f"{other_timing.step_time_s:.3f} s a step against {timing.step_time_s:.3f} s"
            )
            if gpus < scenario.cluster.world_size:
                widest = max(m.scenario.cluster.world_size for m in fitting if _model_parallel(m.scenario) == 1)
                text += f"; data parallelism alone reaches at most {widest} GPUs at this batch"
            reasons[scenario] = text
        return reasons


def _model_parallel(scenario: Scenario) -> int:
    return scenario.strategy.tp * scenario.strategy.cp


def _degrees_text(scenario: Scenario) -> str:
    """'TP 8 inside the node', 'CP 2', 'TP 4 x CP 2'."""
    strategy, per_node = scenario.strategy, scenario.cluster.gpus_per_node
    parts = []
    if strategy.tp > 1:
        parts.append(f"TP {strategy.tp}" + (" inside the node" if strategy.tp <= per_node else " across nodes"))
    if strategy.cp > 1:
        parts.append(f"CP {strategy.cp}")
    return " x ".join(parts)


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
    fitting: list[MemoryEstimate] = []
    for done, shape in enumerate(shapes):
        fitting += search.fitting(shape)
        if progress is not None:
            progress("memory", done + 1, len(shapes))
        if request.min_gpus and fitting:
            break
    ranked = search.rank(fitting)
    best: dict[str, tuple[float, MemoryEstimate, PlanTiming]] = {}
    for item in ranked:
        best.setdefault(family_of(item[1].scenario), item)
    reasons = search.mesh_reasons(fitting, ranked[: request.top] + list(best.values()))
    plans = tuple(search.plan(*item, reasons.get(item[1].scenario, "")) for item in ranked[: request.top])
    by_scenario = {plan.scenario: plan for plan in plans}
    best_plans = tuple(
        by_scenario.get(item[1].scenario) or search.plan(*item, reasons.get(item[1].scenario, ""))
        for item in best.values()
    )
    fitting_families = set(best)
    rejected = tuple(
        Rejection(family=family, category=_overshoot(memory, request)[0], over_by_bytes=over, closest=memory)
        for family, (over, memory) in sorted(search.closest.items(), key=lambda item: FAMILIES.index(item[0]))
        if family not in fitting_families
    )
    stats = SearchStats(
        candidates=search.candidates,
        memory_evaluations=search.evaluator.memory_evaluations,
        fitting=len(fitting),
        time_evaluations=search.evaluator.time_evaluations,
    )
    return PlanResult(request=request, plans=plans, best_per_family=best_plans, rejected=rejected, stats=stats)
