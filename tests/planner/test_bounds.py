"""The planner's lower bounds never exceed the step they bound, and pruning with them returns what simulating every
fitting plan returns, ranked by step time and by cost, tensor parallelism included."""

from __future__ import annotations

import dataclasses

import pytest

from shardscope.core.result import MemoryEstimate
from shardscope.planner import PlanRequest, plan
from shardscope.planner.search import _Search
from shardscope.planner.space import batch_shapes, family_of
from shardscope.planner.timing import communication_floor
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import TrainingSpec


def _fitting(search: _Search) -> list[MemoryEstimate]:
    return [memory for shape in batch_shapes(search.request) for memory in search.fitting(shape)]


def _requests(small_request: PlanRequest) -> list[PlanRequest]:
    priced = dataclasses.replace(small_request, rank_by="cost", price_per_gpu_hour=2.0)
    return [small_request, priced]


@pytest.mark.slow
def test_bounds_never_exceed_the_simulated_step(small_request: PlanRequest) -> None:
    search = _Search(small_request, None)
    fitting = _fitting(search)
    assert any(memory.scenario.strategy.tp > 1 for memory in fitting)
    evaluator = search.evaluator
    tighter = 0
    for memory in fitting[::3]:  # every third fitting plan: all families, tp degrees, offloads and checkpointing
        scenario = memory.scenario
        step = evaluator.timing(scenario).step_time_s
        loose, tight = evaluator.lower_bound_s(scenario), evaluator.tight_bound_s(scenario)
        assert loose <= step and tight <= step, scenario
        assert evaluator.optimizer_bound_s(scenario) <= tight, scenario
        tighter += tight > loose * 1.001
    assert tighter > len(fitting[::3]) // 2  # the communication floor and the tp floor at size raise most bounds


@pytest.mark.slow
def test_communication_floor_holds_on_a_wide_70b_step() -> None:
    """llama-3-70b zero3 over 976 GPUs at one sequence per rank: the exposed first gathers and last reduce-scatter
    close more than half the gap between the compute bound and the simulated step, without passing it."""
    request = PlanRequest(
        model=model_preset("llama-3-70b"),
        gpu=gpu_preset("h100-80gb"),
        training=TrainingSpec(sequence_length=4096),
        global_batch_tokens=4_000_000,
        families=("zero3",),
        tensor_parallel=(1,),
        offloads=("none",),
        checkpointing=("full",),
    )
    search = _Search(request, None)
    memory = next(m for m in search.fitting(batch_shapes(request)[-1]))
    scenario = memory.scenario
    step = search.evaluator.timing(scenario).step_time_s
    floor = communication_floor(scenario, search.evaluator.hardware)
    loose, tight = search.evaluator.lower_bound_s(scenario), search.evaluator.tight_bound_s(scenario)
    assert scenario.cluster.world_size == 976
    assert floor.edges_s == pytest.approx(0.0398, rel=1e-3)  # the first layer's gathers and the last reduce-scatter
    assert loose < tight <= step  # 3.570 < 3.610 <= 3.639 s
    assert tight - loose > 0.5 * (step - loose)


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["step-time", "cost"])
def test_pruned_search_returns_the_exhaustive_ranking(small_request: PlanRequest, objective: str) -> None:
    request = _requests(small_request)[objective == "cost"]
    result = plan(request)
    exhaustive = _Search(request, None)
    fittings = _fitting(exhaustive)
    ranked = sorted(
        (
            exhaustive.metric(m.scenario, exhaustive.evaluator.timing(m.scenario).step_time_s),
            m.scenario.cluster.world_size,
            i,
        )
        for i, m in enumerate(fittings)
    )
    assert result.stats.time_evaluations < len(fittings) // 2
    top = [fittings[i].scenario for _, _, i in ranked[: request.top]]
    assert [entry.scenario for entry in result.plans] == top
    assert any(memory.scenario.strategy.tp > 1 for memory in fittings)
    best: dict[str, object] = {}
    for _, _, i in ranked:
        best.setdefault(family_of(fittings[i].scenario), fittings[i].scenario)
    assert [entry.scenario for entry in result.best_per_family] == list(best.values())
    unsplit = [m for m in fittings if m.scenario.strategy.tp == 1]
    found = exhaustive.best_of(unsplit)  # what a mesh reason compares a split plan with
    assert found is not None and found[1].scenario == next(
        fittings[i].scenario for _, _, i in ranked if fittings[i] in unsplit
    )
