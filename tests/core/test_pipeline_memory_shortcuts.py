"""The shortcuts that make pipeline memory fast give the numbers of the plain computation, to the last bit: what is
kept per schedule shape, weights and the moments' own inputs (an answer computed after many others of similar
scenarios equals the one computed with every cache empty), and the step's reduce-scatters weighed at each stage's
first block (equal to walking every unit)."""

import contextlib
import dataclasses
import itertools

import pytest
from test_pipeline_speed import scenario as pipeline  # the same 4096-token bf16-mixed pipelines on H100s

from shardscope.core.engines import fsdp2_pipeline, fsdp2_pipeline_states
from shardscope.core.engines.fsdp2_pipeline import _reduce_scatter, _Units
from shardscope.core.engines.pipeline_load import PipelineLoad, _orders
from shardscope.core.pipeline_memory import (
    _clusters,
    _in_flight_peaks,
    _stage_models,
    _strategies,
    pipeline_memory,
    pipeline_rank_memory,
)
from shardscope.specs import Scenario, Strategy

KEPT = (
    _orders,
    _in_flight_peaks,
    _stage_models,
    _clusters,
    _strategies,
    fsdp2_pipeline_states._fullest_kept,
    fsdp2_pipeline_states._states_kept,
    fsdp2_pipeline._moments_kept,
)


def scenario(strategy: Strategy, micro_batches: int, checkpointing: str, backend: str, gpus: int = 64) -> Scenario:
    """llama-3-8b's 4096-token bf16-mixed pipelines on H100s (test_pipeline_speed's), over `backend`."""
    case = pipeline("llama-3-8b", gpus, micro_batches, checkpointing, name="ddp")
    cluster = dataclasses.replace(case.cluster, backend=backend)
    return dataclasses.replace(case, cluster=cluster, strategy=strategy)


def strategies() -> list[Strategy]:
    """Every engine and data-parallel strategy, each schedule, with and without tensor parallelism."""
    found = []
    schedules = (("gpipe", 0), ("1f1b", 0), ("interleaved-1f1b", 2))
    for engine, name, (schedule, virtual), tp in itertools.product(
        ("paper", "pytorch", "deepspeed"), ("ddp", "zero1", "zero2", "zero3", "hsdp"), schedules, (1, 2)
    ):
        group = 2 if name == "hsdp" else 0
        try:
            found.append(
                Strategy(
                    name=name,
                    engine=engine,
                    shard_group=group,
                    tp=tp,
                    pp=4,
                    pp_schedule=schedule,
                    pp_virtual_stages=virtual,
                )  # type: ignore[arg-type]
            )
        except ValueError:
            continue
    return found


def cases() -> list[Scenario]:
    """Neighbours as a planner asks them: each strategy over few and many micro-batches (up to 36), on gloo too, and
    over one data-parallel rank (nothing sharded), so the later ones meet what the earlier ones kept."""
    found = []
    for strategy in strategies():
        for micro_batches, checkpointing in ((4, "full"), (8, "none"), (16, "full"), (36, "full")):
            for backend, gpus in (("nccl", 64), ("gloo", 64), ("nccl", 4 * strategy.tp)):
                with contextlib.suppress(ValueError):
                    found.append(scenario(strategy, micro_batches, checkpointing, backend, gpus))
    return found


def _empty_caches() -> None:
    for cache in KEPT:
        cache.clear()


def test_the_cases_cover_every_engine_schedule_and_many_micro_batches() -> None:
    found = cases()
    assert {case.strategy.engine for case in found} == {"paper", "pytorch", "deepspeed"}
    assert {case.strategy.pp_schedule for case in found} == {"gpipe", "1f1b", "interleaved-1f1b"}
    assert {case.strategy.tp for case in found} == {1, 2}
    assert max(case.training.grad_accum_steps for case in found) > 16
    assert {case.cluster.world_size // 4 // case.strategy.tp for case in found} == {1, 16, 8}


def test_each_answer_after_many_others_is_the_one_computed_alone() -> None:
    found = cases()
    _empty_caches()
    after_others = [pipeline_memory(case) for case in found]
    assert all(cache for cache in KEPT)  # the shortcuts were taken
    for case, answer in zip(found, after_others, strict=True):
        _empty_caches()
        assert pipeline_memory(case) == answer, case.strategy


def _every_unit(units: list[_Units], load: PipelineLoad, gloo: bool) -> tuple[int, ...]:
    """The step's reduce-scatters walked unit by unit: every stage's root, then every block of every stage."""
    sizes = [(u.root, u.root_gradients) for u in units]
    sizes += [(u.block, u.block_gradients) for u in units for _ in range(u.stage.layers)]
    gathered, accumulated = sum(u.gathered for u in units), sum(u.accumulated for u in units)
    states = load.states
    landed, best = 0, (0,) * 6
    for params, grads in sizes:
        gathered -= params
        shard = grads // load.shard_degree
        live = (
            states.parameters_bytes,
            landed + shard,
            states.optimizer_state_bytes,
            load.step_activations,
            load.receive_bytes + states.persistent_buffers_bytes + gathered,
            accumulated + (grads if gloo else 0),
        )
        best = max(best, live, key=sum)
        accumulated -= grads
        landed += shard
    return best


def test_the_reduce_scatters_weighed_at_each_stages_first_block_are_every_units(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[Scenario, PipelineLoad, list[_Units]]] = []

    def recorded(case: Scenario, load: PipelineLoad, units: list[_Units]) -> object:
        asked.append((case, load, units))
        return _reduce_scatter(case, load, units)

    monkeypatch.setattr(fsdp2_pipeline, "_reduce_scatter", recorded)
    _empty_caches()
    for case in cases():
        if case.strategy.engine == "pytorch":
            pipeline_memory(case)
    assert len(asked) > 100
    for case, load, units in asked:
        gloo = case.cluster.backend == "gloo"
        assert _reduce_scatter(case, load, units) == _every_unit(units, load, gloo)


def test_ranks_holding_the_same_model_share_its_states_as_computed_each() -> None:
    # 32 layers on 8 ranks: 4, 5, 4, 4, 4, 4, 4, 3, so ranks 2 to 6 hold the same model
    case = scenario(Strategy(name="zero3", engine="pytorch", pp=8), 8, "full", "nccl")
    memory = pipeline_memory(case)
    each = [pipeline_rank_memory(case, rank) for rank in range(case.strategy.pp)]
    assert memory.per_stage == tuple(entry for entry, _ in each)
    assert memory.host_bytes == tuple(host for _, host in each)
