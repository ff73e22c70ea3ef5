"""The search weighs each point's peak floor (planner/peak_floors.py, core/peak_floor.py) before it estimates the
point's memory, and a batch's floor before it bounds the batch's ranking value: the kept floors equal fresh ones,
and the answer is that of the search that estimates and bounds every point the floors would have left, closest
misses included."""

from __future__ import annotations

import dataclasses

import pytest

from shardscope.core.memory import estimate_memory
from shardscope.core.peak_floor import batch_floor_bytes, peak_floor_bytes
from shardscope.planner import PlanRequest, plan
from shardscope.planner.peak_floors import PeakFloors
from shardscope.planner.search import _Search
from shardscope.planner.space import (
    Variant,
    batch_shapes,
    checkpointing_options,
    grad_accum_of,
    make_scenario,
    micro_batches,
    offloads_for,
    point_training,
    variants,
)


def test_kept_floors_equal_fresh_ones(small_request: PlanRequest) -> None:
    """Every point of a space with tensor and context parallelism: the setting's kept parts, and the activations kept
    at one micro-batch a step, give the floor of the point itself; the batch's floor of a ddp point without
    offload at one micro-batch a step on another GPU count (what `_Search.batch_may_fit` keeps it by) is the point's
    own."""
    request = dataclasses.replace(small_request, tensor_parallel=(1, 2), context_parallel=(1, 2))
    floors, weighed = PeakFloors(), 0
    for shape in batch_shapes(request):
        for variant in variants(request, shape.gpus, shape.tp, shape.cp):
            for offload in offloads_for(request, variant.family):
                setting = None
                for checkpointing in checkpointing_options(request):
                    for size in micro_batches(request, shape.sequences_per_rank):
                        accum = grad_accum_of(request, shape, size)
                        point = make_scenario(request, shape.gpus, variant, offload, checkpointing, size, accum)
                        setting = setting or floors.setting(point)
                        kept = floors.point_bytes(setting, point_training(request, checkpointing, size, 1))
                        assert kept == peak_floor_bytes(point)
                        probe = Variant(family="ddp", tp=shape.tp, cp=shape.cp)  # as _Search.batch_may_fit asks
                        alone = make_scenario(request, shape.tp * shape.cp, probe, "none", checkpointing, size, 1)
                        assert batch_floor_bytes(alone) == batch_floor_bytes(point)
                        weighed += 1
    assert weighed > 500


def _requests(small_request: PlanRequest) -> dict[str, PlanRequest]:
    """llama-3-8b on 40 GiB GPUs: the default space; with tensor parallelism ranked by cost; ddp beside zero3, where
    ddp fits nowhere and its closest miss is reported."""
    tensor = dataclasses.replace(small_request, tensor_parallel=(1, 2, 4))
    return {
        "step-time": small_request,
        "cost": dataclasses.replace(tensor, rank_by="cost", price_per_gpu_hour=2.0),
        "a-family-fits-nowhere": dataclasses.replace(
            tensor, families=("ddp", "zero3"), tensor_parallel=(1, 2), max_gpus=32
        ),
    }


@pytest.mark.parametrize("case", ["step-time", "cost", "a-family-fits-nowhere"])
def test_the_answer_is_that_of_the_search_without_floors(
    small_request: PlanRequest, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    request = _requests(small_request)[case]
    weighed = plan(request)
    with monkeypatch.context() as patch:  # every point the floors would leave is estimated
        patch.setattr(_Search, "_hopeless", lambda *_: False)
        patch.setattr(_Search, "batch_may_fit", lambda *_: True)
        every = plan(request)
    weighed_json, every_json = weighed.to_json(), every.to_json()
    weighed_stats, every_stats = weighed_json.pop("stats"), every_json.pop("stats")
    assert weighed_json == every_json  # plans, family bests, rejections with their closest misses, mesh reasons
    assert weighed_stats["memory_evaluations"] < every_stats["memory_evaluations"]
    if case == "a-family-fits-nowhere":
        assert [rejection.family for rejection in weighed.rejected] == ["ddp"]


def test_a_batch_said_not_to_fit_has_no_fitting_point(small_request: PlanRequest) -> None:
    """Every point of llama-3-8b's space on 40 GiB GPUs with tensor parallelism, estimated: each batch with a point
    that fits may fit, and some batches are found not to (their saved activations alone break the budget)."""
    request = dataclasses.replace(small_request, tensor_parallel=(1, 2), max_micro_batch=16)
    search = _Search(request, None)
    said_no = 0
    for shape in batch_shapes(request):
        for checkpointing in checkpointing_options(request):
            for size in micro_batches(request, shape.sequences_per_rank):
                may_fit = search.batch_may_fit(shape, checkpointing, size)
                said_no += not may_fit
                accum = grad_accum_of(request, shape, size)
                for variant in variants(request, shape.gpus, shape.tp, shape.cp):
                    for offload in offloads_for(request, variant.family):
                        point = make_scenario(request, shape.gpus, variant, offload, checkpointing, size, accum)
                        fits = estimate_memory(point).per_rank.peak_bytes <= request.budget_bytes
                        assert may_fit or not fits
    assert said_no > 0
