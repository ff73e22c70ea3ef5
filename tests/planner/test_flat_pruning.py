"""The search skips settings without a pipeline whose least possible ranking value is over the limits the plans found
so far set (`_Search._beyond_limits`), before their memory is estimated: the answer (plans, family bests, the
closest misses of families that fit nowhere, mesh reasons) is that of the search that estimates every point, under
each ranking, where nothing without model parallelism fits, where the best unsplit plan is far slower than the
split ones, and where a family fits nowhere."""

from __future__ import annotations

import dataclasses

import pytest

from shardscope.planner import PlanRequest, plan, shape_order
from shardscope.planner.search import _Search
from shardscope.planner.space import BatchShape, Variant


def _requests(small_request: PlanRequest) -> dict[str, PlanRequest]:
    """llama-3-8b on 40 GiB GPUs with tensor parallelism: 16 sequences a step, so data parallelism alone stops at 16
    GPUs and the unsplit best is three times slower than TP 4 on 64; under each ranking; ddp alone (it fits only
    with TP 8: nothing unsplit fits); ddp beside zero3 without TP 4 (ddp fits nowhere, its closest miss is
    compared)."""
    few = dataclasses.replace(small_request, tensor_parallel=(1, 2, 4), global_batch_tokens=16 * 2048, max_gpus=64)
    tensor = dataclasses.replace(small_request, tensor_parallel=(1, 2, 4))
    return {
        "unsplit-far-slower": few,
        "tokens-per-s": dataclasses.replace(few, rank_by="tokens-per-s"),
        "cost": dataclasses.replace(tensor, rank_by="cost", price_per_gpu_hour=2.0),
        "nothing-unsplit-fits": dataclasses.replace(
            tensor, families=("ddp",), tensor_parallel=(1, 2, 4, 8), max_gpus=32
        ),
        "a-family-fits-nowhere": dataclasses.replace(
            tensor, families=("ddp", "zero3"), tensor_parallel=(1, 2), max_gpus=32
        ),
    }


@pytest.mark.parametrize(
    "case", ["unsplit-far-slower", "tokens-per-s", "cost", "nothing-unsplit-fits", "a-family-fits-nowhere"]
)
def test_pruned_flat_search_equals_the_one_that_estimates_every_point(
    small_request: PlanRequest, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    request = _requests(small_request)[case]
    beyond = _Search._beyond_limits
    skipped: list[tuple[int, int]] = []  # (GPU count, model-parallel degree) of each setting skipped

    def recording(search: _Search, shape: BatchShape, variant: Variant, checkpointing: str) -> bool:
        found = beyond(search, shape, variant, checkpointing)  # type: ignore[arg-type]
        if found:
            skipped.append((shape.gpus, variant.tp * variant.cp * variant.ep))
        return found

    with monkeypatch.context() as patch:
        patch.setattr(_Search, "_beyond_limits", recording)
        pruned = plan(request)
    with monkeypatch.context() as patch:  # every point, the shapes in their own order
        patch.setattr(_Search, "_beyond_limits", lambda *_: False)
        patch.setattr(shape_order, "_least_of_shape", lambda *_: 0.0)
        every = plan(request)
    pruned_json, every_json = pruned.to_json(), every.to_json()
    pruned_stats, every_stats = pruned_json.pop("stats"), every_json.pop("stats")
    assert pruned_json == every_json  # plans, family bests, rejections with their closest misses, mesh reasons
    assert pruned_stats["candidates"] == every_stats["candidates"]
    assert pruned_stats["memory_evaluations"] < every_stats["memory_evaluations"]
    assert pruned_stats["fitting"] <= every_stats["fitting"]
    assert skipped, "settings were skipped"
    reasons = [entry.mesh_reason for entry in pruned.plans if entry.mesh_reason]
    if case in ("unsplit-far-slower", "tokens-per-s"):
        assert any(degree == 1 for _, degree in skipped), "unsplit settings were skipped"
        assert reasons and all("data parallelism alone reaches at most 16 GPUs" in reason for reason in reasons)
    if case == "nothing-unsplit-fits":
        assert reasons and all("nothing fits in the space" in reason for reason in reasons)
    if case == "a-family-fits-nowhere":
        assert [rejection.family for rejection in pruned.rejected] == ["ddp"]


def test_progress_counts_the_shapes_then_the_simulations(small_request: PlanRequest) -> None:
    """The rankings along the memory search (for its limits) report nothing: the counter goes through the shapes
    once, in order, then through the final ranking's plans."""
    calls: list[tuple[str, int, int]] = []
    plan(_requests(small_request)["unsplit-far-slower"], progress=lambda *call: calls.append(call))
    memory = [call for call in calls if call[0] == "memory"]
    shapes = memory[0][2]
    assert memory == [("memory", done, shapes) for done in range(1, shapes + 1)]
    assert calls[: len(memory)] == memory
    assert {stage for stage, _, _ in calls[len(memory) :]} == {"simulating"}
