"""The planner's answers: everything it returns fits and reaches the batch, its pruning loses nothing, its ranking
is ordered, and the families it rejects really do not fit."""

from __future__ import annotations

import dataclasses

import pytest

from shardscope.core.memory import estimate_memory
from shardscope.planner import PlanRequest, plan, plan_timing
from shardscope.planner.search import _Search
from shardscope.planner.space import (
    batch_shapes,
    checkpointing_options,
    gpu_counts,
    make_scenario,
    micro_batches,
    model_parallel_degrees,
    offloads_for,
    variants,
)
from shardscope.presets import gpu_preset, model_preset
from shardscope.presets.hardware import default_profile
from shardscope.specs import SpecError, TrainingSpec


def test_every_plan_fits_and_reaches_the_batch(big_request: PlanRequest) -> None:
    result = plan(big_request)
    assert result.plans, "llama-3-70b must fit somewhere on up to 1024 H100s"
    for entry in [*result.plans, *result.best_per_family]:
        assert entry.memory.per_rank.peak_bytes <= big_request.budget_bytes
        assert entry.gpus <= big_request.max_gpus
        error = abs(entry.global_batch_tokens - 4_000_000) / 4_000_000
        assert error <= big_request.batch_tolerance
        training = entry.scenario.training
        data_parallel = entry.gpus // (entry.scenario.strategy.tp * entry.scenario.strategy.cp)
        assert entry.global_batch_tokens == training.micro_batch_size * training.grad_accum_steps * 4096 * data_parallel
    times = [entry.timing.step_time_s for entry in result.plans]
    assert times == sorted(times)


def test_rejected_families_do_not_fit_and_say_by_how_much(big_request: PlanRequest) -> None:
    big_request = dataclasses.replace(big_request, tensor_parallel=(1,), context_parallel=(1,))
    result = plan(big_request)
    rejected = {rejection.family: rejection for rejection in result.rejected}
    # 70B parameters in fp32 (torch keeps fp32 weights under autocast) are 282 GB on every DDP rank.
    assert "ddp" in rejected and rejected["ddp"].category == "parameters"
    for rejection in result.rejected:
        peak = rejection.closest.per_rank.peak_bytes
        assert rejection.over_by_bytes == peak - big_request.budget_bytes > 0
        assert rejection.family not in {entry.family for entry in result.best_per_family}


def _exhaustive_best(request: PlanRequest) -> float:
    """Simulate every fitting point of the space, no pruning."""
    hardware = default_profile(request.gpu)
    best = float("inf")
    for shape in batch_shapes(request):
        for variant in variants(request, shape.gpus, shape.tp, shape.cp):
            for offload in offloads_for(request, variant.family):
                for checkpointing in checkpointing_options(request):
                    for size in micro_batches(request, shape.sequences_per_rank):
                        accum = shape.sequences_per_rank // size
                        scenario = make_scenario(request, shape.gpus, variant, offload, checkpointing, size, accum)
                        if estimate_memory(scenario).per_rank.peak_bytes <= request.budget_bytes:
                            best = min(best, plan_timing(scenario, hardware).step_time_s)
    return best


@pytest.mark.long  # tests/planner/test_pipelines.py checks the pruned search against an exhaustive one by default
def test_pruning_finds_the_exhaustive_best(small_request: PlanRequest) -> None:
    result = plan(small_request)
    assert result.stats.time_evaluations < result.stats.fitting
    assert result.plans[0].timing.step_time_s == pytest.approx(_exhaustive_best(small_request), rel=1e-9)


def _settings(request: PlanRequest) -> list[PlanRequest]:
    """The small space under each engine and objective, with tensor parallelism, and 70B's fewest GPUs."""
    small = dataclasses.replace(request, tensor_parallel=(1, 2, 4))
    paper = dataclasses.replace(small.strategy, engine="paper")
    deepspeed = dataclasses.replace(small.strategy, engine="deepspeed")
    return [
        small,
        dataclasses.replace(small, strategy=paper, rank_by="cost", price_per_gpu_hour=2.0),
        dataclasses.replace(small, strategy=deepspeed, headroom=0.3),
        dataclasses.replace(
            small, model=model_preset("llama-3-70b"), gpu=gpu_preset("h100-80gb"), max_gpus=64, min_gpus=True
        ),
    ]


def test_settings_whose_states_break_the_budget_are_skipped_without_changing_the_answer(
    small_request: PlanRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memory search skips a setting whose model states alone break the budget once its family fits or has a
    miss at least as close: plans, family bests, rejections and their closest misses are those of the search that
    estimates every point (only the count of memory estimates falls)."""
    hopeless = _Search._hopeless
    skipped: set[str] = set()

    def recording(search: _Search, family: str, states_floor_bytes: int) -> bool:
        found = hopeless(search, family, states_floor_bytes)
        if found:
            skipped.add(family)
        return found

    pruned_counts, exhaustive_counts, rejected = [], [], set()
    for request in _settings(small_request):
        with monkeypatch.context() as patch:  # the time pruning off: it would skip some of the same settings
            patch.setattr(_Search, "_beyond_limits", lambda *_: False)
            patch.setattr(_Search, "_hopeless", recording)
            pruned = plan(request)
        with monkeypatch.context() as patch:
            patch.setattr(_Search, "_beyond_limits", lambda *_: False)
            patch.setattr(_Search, "_hopeless", lambda *_: False)
            exhaustive = plan(request)
        pruned_json, exhaustive_json = pruned.to_json(), exhaustive.to_json()
        pruned_counts.append(pruned_json.pop("stats").pop("memory_evaluations"))
        exhaustive_counts.append(exhaustive_json.pop("stats").pop("memory_evaluations"))
        assert pruned_json == exhaustive_json
        assert pruned.stats == dataclasses.replace(exhaustive.stats, memory_evaluations=pruned.stats.memory_evaluations)
        rejected |= {rejection.family for rejection in pruned.rejected}
    assert all(p < e for p, e in zip(pruned_counts, exhaustive_counts, strict=True)), (pruned_counts, exhaustive_counts)
    assert skipped & rejected, "a family that fits nowhere had settings skipped: its closest miss is compared"
    assert skipped - rejected, "a family that fits had settings skipped"


def test_cost_ranking_orders_by_cost_and_needs_a_price(small_request: PlanRequest) -> None:
    with pytest.raises(SpecError, match="price_per_gpu_hour"):
        dataclasses.replace(small_request, rank_by="cost")
    priced = dataclasses.replace(small_request, rank_by="cost", price_per_gpu_hour=2.0)
    costs = [entry.cost_per_million_tokens for entry in plan(priced).plans]
    assert all(cost is not None for cost in costs)
    assert costs == sorted(costs)  # type: ignore[type-var]


def test_min_gpus_is_the_smallest_count_that_fits(big_request: PlanRequest) -> None:
    request = dataclasses.replace(big_request, min_gpus=True, global_batch_tokens=None)
    result = plan(request)
    fewest = result.fewest_gpus
    assert fewest is not None and all(entry.gpus == fewest for entry in result.plans)
    # Nothing below it fits, even with every memory-saving setting at micro-batch 1.
    smaller = [
        (gpus, tp, cp)
        for gpus in gpu_counts(request)
        if gpus < fewest
        for tp, cp in model_parallel_degrees(request)
        if gpus % (tp * cp) == 0
    ]
    for gpus, tp, cp in smaller:
        for variant in variants(request, gpus, tp, cp):
            offload = offloads_for(request, variant.family)[-1]
            scenario = make_scenario(request, gpus, variant, offload, "full", 1, 1)
            assert estimate_memory(scenario).per_rank.peak_bytes > request.budget_bytes


def test_batch_shapes_stay_within_tolerance(big_request: PlanRequest) -> None:
    shapes = batch_shapes(big_request)
    # one GPU count per work per rank and mesh: more GPUs at the same work per rank change only the batch
    assert shapes and len({(shape.sequences_per_rank, shape.tp, shape.cp) for shape in shapes}) == len(shapes)
    for shape in shapes:
        assert shape.gpus % 8 == 0 or shape.gpus < 8
        assert abs(shape.global_batch_tokens - 4_000_000) <= 0.05 * 4_000_000


def test_hsdp_shard_groups_divide_the_world_and_align_with_nodes(big_request: PlanRequest) -> None:
    groups = [variant.shard_group for variant in variants(big_request, 48) if variant.family == "hsdp"]
    assert groups == [2, 4, 8, 16, 24]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_micro_batch": 0}, "max_micro_batch"),
        ({"global_batch_tokens": 100}, "less than one sequence"),
        ({"headroom": 1.5}, "headroom"),
        ({"families": ("ddp", "zero4")}, "zero4"),
        ({"global_batch_tokens": None}, "global_batch_tokens is needed"),
    ],
)
def test_bad_requests_name_the_field(big_request: PlanRequest, change: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        dataclasses.replace(big_request, **change)  # type: ignore[arg-type]


def test_cpu_adam_keeps_full_offload_from_ranking_first() -> None:
    """llama-3-8b on 8 H100s at a 256K-token batch: offloading everything to run without checkpointing at a larger
    micro-batch ranked first while the optimizer step under offload was priced at GPU memory bandwidth; with
    CPU-Adam at the host's memory bandwidth (core.compute.optimizer_step_s) a plan without offload ranks first."""
    gpu = gpu_preset("h100-80gb")
    request = PlanRequest(
        model=model_preset("llama-3-8b"),
        gpu=gpu,
        training=TrainingSpec(sequence_length=2048),
        global_batch_tokens=256 * 1024,
        max_gpus=8,
        top=4,
    )
    plans = plan(request).plans
    assert plans[0].scenario.strategy.offload == "none"
    assert all(entry.scenario.strategy.offload != "optimizer+params" for entry in plans[:3])
