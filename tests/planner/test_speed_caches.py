"""The planner's shortcuts return what the direct computation returns: the fast start of ZeroRedundancyOptimizer's
greedy assignment, the cached meshes, the evaluator's caches of bounds, and the miss bookkeeping of the memory
search (issues 19 and 20: they exist for speed and must not change an answer)."""

from __future__ import annotations

import dataclasses

import pytest

from shardscope.choices import SpecError
from shardscope.core import sharded_calls
from shardscope.core.comm import comm_events as step_calls
from shardscope.core.engines import fsdp2, pytorch
from shardscope.core.memory import estimate_memory
from shardscope.core.model_states import offload
from shardscope.core.params import param_layout
from shardscope.core.sharding import WholeTensorShards, whole_tensor_shards
from shardscope.mesh import data_parallel_mesh
from shardscope.planner import PlanRequest
from shardscope.planner.budget import over_by, overshoot
from shardscope.planner.evaluator import Evaluator
from shardscope.planner.search import _Search
from shardscope.planner.space import batch_shapes
from shardscope.planner.timing import compute_lower_bound_s, micro_batch_compute_s
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec


def _greedy_reference(numels: list[int], world_size: int) -> WholeTensorShards:
    """ZeroRedundancyOptimizer._partition_parameters as written: every tensor, largest first, to the rank holding
    the fewest elements so far, ties to the lowest rank."""
    sizes, counts, largest = [0] * world_size, [0] * world_size, [0] * world_size
    for numel in sorted(numels, reverse=True):
        rank = min(range(world_size), key=lambda r: (sizes[r], r))
        sizes[rank] += numel
        counts[rank] += 1
        largest[rank] = max(largest[rank], numel)
    return WholeTensorShards(
        numel_per_rank=tuple(sizes), tensors_per_rank=tuple(counts), largest_per_rank=tuple(largest)
    )


@pytest.mark.parametrize("model", ["tiny-llama", "llama-3-8b"])
def test_whole_tensor_shards_match_the_plain_greedy_rule(model: str) -> None:
    layout = param_layout(model_preset(model))
    numels = [tensor.numel for tensor in layout.tensors()]
    count = len(numels)
    # fewer ranks than tensors (the heap runs on), exactly as many, and more (some ranks hold nothing)
    for world_size in (1, 3, 8, count - 1, count, count + 5, 2 * count):
        assert whole_tensor_shards(layout, world_size) == _greedy_reference(numels, world_size), world_size


def test_more_ranks_than_tensors_leaves_the_last_ranks_empty() -> None:
    layout = param_layout(model_preset("tiny-llama"))
    count = sum(1 for _ in layout.tensors())
    shards = whole_tensor_shards(layout, count + 3)
    assert shards.tensors_per_rank == (1,) * count + (0, 0, 0)
    assert shards.numel_per_rank[-3:] == (0, 0, 0)
    assert sum(shards.numel_per_rank) == layout.total_numel


def test_a_cached_mesh_still_refuses_every_time() -> None:
    assert data_parallel_mesh("hsdp", 64, 8, tp=2) == data_parallel_mesh("hsdp", 64, 8, tp=2)
    for _ in range(2):  # a refusal is not cached as an answer
        with pytest.raises(SpecError, match="does not divide the 12 GPUs"):
            data_parallel_mesh("zero3", 12, tp=8)


def test_evaluator_bounds_equal_the_direct_ones(small_request: PlanRequest) -> None:
    """The compute bound priced per micro-batch and reused, and the tight bound kept, equal fresh computations on
    every fitting plan of the small space, tensor parallelism included."""
    request = dataclasses.replace(small_request, tensor_parallel=(1, 2, 4))
    search = _Search(request, None)
    fitting = [memory for shape in batch_shapes(request) for memory in search.fitting(shape)]
    assert len({memory.scenario.training.grad_accum_steps for memory in fitting}) > 2
    evaluator = search.evaluator
    for memory in fitting:
        scenario = memory.scenario
        assert evaluator.compute_bound_s(scenario) == compute_lower_bound_s(scenario, evaluator.hardware)
        fresh = Evaluator(request)
        assert evaluator.tight_bound_s(scenario) == fresh._tight_bound_s(scenario)
    steps = {memory.scenario.training.grad_accum_steps: memory.scenario for memory in fitting}
    one, many = steps[min(steps)], steps[max(steps)]
    per_micro_batch = micro_batch_compute_s(many, evaluator.hardware)
    assert per_micro_batch > 0
    assert compute_lower_bound_s(many, evaluator.hardware) == per_micro_batch * many.training.grad_accum_steps
    assert compute_lower_bound_s(one, evaluator.hardware) > 0


def test_memory_search_records_direct_estimates_and_overshoots(small_request: PlanRequest) -> None:
    """Each point's estimate is estimate_memory's, and the closest miss of each family is over by what overshoot
    says (the search computes only the bytes, without the category)."""
    search = _Search(small_request, None)
    for shape in batch_shapes(small_request):
        search.fitting(shape)
    estimates = search.evaluator._memory
    assert len(estimates) == search.evaluator.memory_evaluations > 50
    for scenario, memory in list(estimates.items())[::7]:
        assert memory == estimate_memory(scenario)
    assert search.closest, "the small space has families that miss"
    budget = small_request.budget_bytes
    for over, _, memory in search.closest.values():
        assert over == over_by(memory, small_request, budget) == overshoot(memory, small_request)[1] > 0


def test_kept_states_equal_fresh_ones(small_request: PlanRequest) -> None:
    """The torch engine's states are kept by what they read, not by the micro-batch, checkpointing or micro-batch
    count: every point the memory search asks (ddp and zero1 on DDP, zero2, zero3 and hsdp on FSDP2; offloads, tp
    degrees, GPU counts) gets the states a fresh computation gives, whichever point filled the cache first."""
    search = _Search(small_request, None)
    for shape in batch_shapes(small_request):
        search.fitting(shape)
    points = list(search.evaluator._memory)
    settings = {(s.training.micro_batch_size, s.training.checkpointing, s.strategy.offload) for s in points}
    assert {s.strategy.stage for s in points} == {0, 1, 2, 3} and len(settings) > 6
    for order in (points, points[::-1]):  # either point of a setting first
        fsdp2._STATES_CACHE.clear()
        pytorch._STATES_CACHE.clear()
        for scenario in order:
            rank = estimate_memory(scenario).rank
            if scenario.strategy.stage >= 2:
                states, units = fsdp2._states(scenario, rank)
                assert fsdp2._offloaded_states(scenario, rank) == (offload(scenario, states), units)
            else:
                kept = pytorch._offloaded_replicated(scenario, rank)
                assert kept == offload(scenario, pytorch._replicated(scenario, rank))


def test_kept_states_tell_expert_parallel_degrees_apart() -> None:
    """A rank holds num_experts / ep of an MoE's experts, so the states kept for one expert parallel degree are not
    another's: mixtral-8x7b on 8 GPUs, the estimate with ep 1 is the same whether ep 2's was made first or not."""
    for family in ("zero1", "zero3"):
        one, two = (
            Scenario(
                model=model_preset("mixtral-8x7b"),
                cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=8, gpus_per_node=8),
                training=TrainingSpec(sequence_length=256, precision="bf16-mixed"),
                strategy=Strategy(name=family, engine="pytorch", ep=ep),  # type: ignore[arg-type]
            )
            for ep in (1, 2)
        )
        fresh = estimate_memory(one)
        fsdp2._STATES_CACHE.clear()
        pytorch._STATES_CACHE.clear()
        assert estimate_memory(two).per_rank != fresh.per_rank
        assert estimate_memory(one) == fresh, family


def test_kept_sharded_calls_equal_fresh_ones(small_request: PlanRequest) -> None:
    """FSDP's calls of a step are kept by what they read (layout, degrees, offload, dtypes, micro-batches), so the
    planner's bound and simulation of a plan share them: every sharded point of the small space, under each engine,
    gets the calls a fresh computation gives whichever point came first, and a caller changing its list changes no
    later answer."""
    request = dataclasses.replace(small_request, tensor_parallel=(1, 2))
    search = _Search(request, None)
    for shape in batch_shapes(request):
        search.fitting(shape)
    kinds = {
        (
            s.strategy.name,
            s.strategy.shard_group,
            s.strategy.offload,
            s.training.grad_accum_steps,
            s.cluster.world_size,
        ): s
        for s in search.evaluator._memory
        if s.strategy.stage == 3
    }
    points = [
        dataclasses.replace(scenario, strategy=dataclasses.replace(scenario.strategy, engine=engine))
        for scenario in kinds.values()
        for engine in ("pytorch", "paper", "deepspeed")
    ]
    assert len(points) > 30 and {s.strategy.offload for s in points} == {"none", "optimizer", "optimizer+params"}
    fresh = {}
    for scenario in points:
        sharded_calls._sharded_step.cache_clear()
        sharded_calls._sharded_micro_batch.cache_clear()
        fresh[scenario] = step_calls(scenario)
    for order in (points, points[::-1]):
        sharded_calls._sharded_step.cache_clear()
        sharded_calls._sharded_micro_batch.cache_clear()
        for scenario in order:
            assert step_calls(scenario) == fresh[scenario]
    kept = sharded_calls.sharded_events(points[0], (8, 8), 2, 4, regather_root=True)
    kept.clear()
    assert sharded_calls.sharded_events(points[0], (8, 8), 2, 4, regather_root=True)
