"""The planner's pipelines and expert parallelism: a pipeline wins where nothing fits without one, a pipeline plan's
numbers are `estimate --time`'s, its bound is under its step, its pruning loses nothing, and expert parallel
degrees are those that divide the experts and the GPUs they borrow."""

from __future__ import annotations

import dataclasses

import jsonschema
import pytest

from shardscope.core.memory import estimate_memory
from shardscope.core.timeline import estimate_time
from shardscope.planner import PlanRequest, plan
from shardscope.planner.pipeline import busiest_states_bytes, pipeline_bound_s
from shardscope.planner.result import PLAN_SCHEMA
from shardscope.planner.space import (
    Variant,
    batch_shapes,
    checkpointing_options,
    make_scenario,
    micro_batches,
    offloads_for,
    variants,
)
from shardscope.presets import gpu_preset, model_preset
from shardscope.presets.hardware import default_profile
from shardscope.schemas import load_schema
from shardscope.specs import SpecError, TrainingSpec


@pytest.fixture(scope="module")
def ddp_pipeline_request() -> PlanRequest:
    """llama-3-8b with DDP and no tensor parallelism on up to 16 H100s: its states alone (16 bytes per parameter,
    128 GB) exceed a GPU, so only a pipeline fits."""
    return PlanRequest(
        model=model_preset("llama-3-8b"),
        gpu=gpu_preset("h100-80gb"),
        training=TrainingSpec(sequence_length=2048),
        global_batch_tokens=64 * 2048,
        max_gpus=16,
        max_micro_batch=4,
        top=3,
        families=("ddp",),
        tensor_parallel=(1,),
        pipeline_parallel=(1, 2, 4),
    )


def _exhaustive(request: PlanRequest) -> dict[str, float]:
    """Every fitting point of the space simulated as `estimate --time` does, no pruning: the best step time of each
    family's pipelines."""
    hardware = default_profile(request.gpu)
    best: dict[str, float] = {}
    for shape in batch_shapes(request):
        for variant in variants(request, shape.gpus, shape.tp, shape.cp, shape.pp):
            for offload in offloads_for(request, variant.family):
                for checkpointing in checkpointing_options(request):
                    for size in micro_batches(request, shape.sequences_per_rank):
                        accum = shape.sequences_per_rank // size
                        if not variant.allows(accum):
                            continue
                        scenario = make_scenario(request, shape.gpus, variant, offload, checkpointing, size, accum)
                        if variant.pp > 1 and estimate_memory(scenario).per_rank.peak_bytes <= request.budget_bytes:
                            step = estimate_time(scenario, hardware).step_time_s
                            best[variant.family] = min(step, best.get(variant.family, step))
    return best


def test_a_pipeline_wins_where_the_states_do_not_fit_without_one(ddp_pipeline_request: PlanRequest) -> None:
    result = plan(ddp_pipeline_request)
    best = result.plans[0]
    strategy, training = best.scenario.strategy, best.scenario.training
    # 8.03B parameters x 16 bytes over 4 stages: about 32 GB of states a GPU; fewer stages do not fit 80 GiB
    assert (best.label, best.gpus, training.micro_batch_size, training.grad_accum_steps) == ("ddp+pp4(1f1b)", 16, 1, 16)
    assert strategy.pp == 4 and best.scenario.parallelism.data_parallel == 4
    assert best.mesh_reason == (
        "PP 4 (1f1b): without tensor, context or pipeline parallelism nothing fits in the space"
    )
    assert all(entry.scenario.strategy.pp > 1 for entry in result.plans)
    assert not any(entry.scenario.strategy.pp == 1 for entry in result.best_per_family)


def test_pipeline_plans_are_estimate_time_and_estimate_memory(ddp_pipeline_request: PlanRequest) -> None:
    hardware = default_profile(ddp_pipeline_request.gpu)
    result = plan(ddp_pipeline_request)
    jsonschema.validate(result.to_json(), load_schema(PLAN_SCHEMA))  # per_stage is part of a plan's document
    for entry in result.plans:
        full = estimate_time(entry.scenario, hardware)
        assert entry.timing.step_time_s == full.step_time_s  # the same simulation, to the last bit
        assert entry.timing.wire_bytes_per_rank == full.wire_bytes_per_rank
        assert entry.timing.mfu == full.mfu
        memory = estimate_memory(entry.scenario)
        assert entry.memory.per_rank == memory.per_rank and entry.memory.per_stage == memory.per_stage
        assert entry.to_json()["per_stage"]  # the plan's JSON carries every stage


def test_pruned_pipeline_search_equals_the_exhaustive_one(ddp_pipeline_request: PlanRequest) -> None:
    # ddp fits only with a pipeline, zero1 also without one: the plans without one set limits that prune its
    # pipelines (the best plan of each family that only fits with one is found all the same)
    request = dataclasses.replace(
        ddp_pipeline_request, families=("ddp", "zero1"), offloads=("none", "optimizer"), checkpointing=("none", "full")
    )
    result = plan(request)
    assert result.stats.time_evaluations < result.stats.fitting
    exhaustive = _exhaustive(request)
    assert result.plans[0].timing.step_time_s == min(exhaustive.values())
    assert {entry.family: entry.timing.step_time_s for entry in result.best_per_family}["ddp"] == exhaustive["ddp"]


def test_pipeline_bound_and_states_are_under_the_real_numbers(ddp_pipeline_request: PlanRequest) -> None:
    hardware = default_profile(ddp_pipeline_request.gpu)
    request = dataclasses.replace(ddp_pipeline_request, pipeline_schedules=("gpipe", "1f1b", "interleaved-1f1b"))
    checked = 0
    for schedule, virtual in (("gpipe", 0), ("1f1b", 0), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4)):
        for checkpointing, accum in (("none", 16), ("full", 8), ("selective", 4)):
            variant = Variant(family="zero1", pp=4, pp_schedule=schedule, pp_virtual_stages=virtual)
            scenario = make_scenario(request, 16, variant, "none", checkpointing, 16 // accum, accum)
            step = estimate_time(scenario, hardware).step_time_s
            bound = pipeline_bound_s(scenario, hardware)
            assert bound <= step
            assert bound >= 0.7 * step  # tight enough to prune: only the data-parallel tail is left out
            assert busiest_states_bytes(scenario) <= estimate_memory(scenario).per_rank.peak_bytes
            checked += 1
    assert checked == 12


def test_pipelines_need_a_micro_batch_per_stage(ddp_pipeline_request: PlanRequest) -> None:
    one_f_one_b = Variant(family="ddp", pp=4)
    assert not one_f_one_b.allows(3) and one_f_one_b.allows(4) and one_f_one_b.allows(7)
    interleaved = Variant(family="ddp", pp=4, pp_schedule="interleaved-1f1b", pp_virtual_stages=2)
    assert interleaved.allows(8) and not interleaved.allows(9)  # 9 micro-batches run in 2 rounds of 4 and 1 left
    # 64 sequences on 16 GPUs with pp 16 would be 4 sequences a rank: fewer than 16 stages
    deep = dataclasses.replace(ddp_pipeline_request, pipeline_parallel=(16,))
    assert all(shape.sequences_per_rank >= 16 for shape in batch_shapes(deep))


def test_expert_parallel_degrees_divide_the_experts_and_the_borrowed_gpus() -> None:
    request = PlanRequest(
        model=model_preset("mixtral-8x7b"),
        gpu=gpu_preset("h100-80gb"),
        training=TrainingSpec(sequence_length=4096),
        global_batch_tokens=4_000_000,
        expert_parallel=(1, 2, 4, 8, 16),
    )
    found = {(variant.family, variant.shard_group, variant.ep) for variant in variants(request, 32, tp=2)}
    assert {ep for family, _, ep in found if family == "zero3"} == {1, 2, 4, 8}  # 16 data-parallel ranks, 8 experts
    assert {ep for family, _, ep in found if family == "ddp"} == {1}  # DDP shards nothing to borrow from
    assert {ep for family, group, ep in found if family == "hsdp" and group == 2} == {1, 2}
    with pytest.raises(SpecError, match="virtual_stages"):
        dataclasses.replace(request, virtual_stages=(1,))


def test_mixtral_plans_with_expert_parallelism() -> None:
    request = PlanRequest(
        model=model_preset("mixtral-8x7b"),
        gpu=gpu_preset("h100-80gb"),
        training=TrainingSpec(sequence_length=4096),
        global_batch_tokens=1_000_000,
        max_gpus=64,
        families=("zero3",),
        tensor_parallel=(1,),
        offloads=("none",),
        expert_parallel=(1, 2, 4, 8),
        top=10,
    )
    result = plan(request)
    hardware = default_profile(request.gpu)
    degrees = {entry.scenario.strategy.ep for entry in result.plans}
    assert degrees - {1}, f"no expert-parallel plan among {[entry.label for entry in result.plans]}"
    for entry in result.plans:
        assert entry.timing.step_time_s == pytest.approx(estimate_time(entry.scenario, hardware).step_time_s, rel=0.01)
        assert entry.memory.per_rank == estimate_memory(entry.scenario).per_rank
