"""The shortcuts that make a pipeline's step time fast give the numbers of the full computation, to the last bit:
every micro-batch's tensor, context and expert parallel calls and sharded data-parallel calls copied from the first
one's, each pipeline rank's tail (exposed communication and optimizer step after its last backward) read from its
proxy's runs without the ledger and the schedule, the shown rank's calls without the schedule, and the peak a
pipeline rank's order holds kept per order and weights."""

import dataclasses

import pytest

from shardscope.core.comm import with_micro_batches
from shardscope.core.engines import rules_for
from shardscope.core.expert_parallel import expert_parallel_events
from shardscope.core.model_parallel_comm import _context_parallel, _tensor_parallel, model_parallel_events
from shardscope.core.pipeline import rank_stages
from shardscope.core.pipeline_memory import rank_proxy
from shardscope.core.pipeline_schedule import _peak_in_flight, peak_in_flight, rank_actions
from shardscope.core.pipeline_time import pipeline_step
from shardscope.core.timeline import EXACT_MICRO_BATCHES, estimate_time, simulate, step_calls, step_runs
from shardscope.presets import gpu_preset, model_preset
from shardscope.presets.hardware import default_profile
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec


def scenario(model: str, gpus: int, micro_batches: int, checkpointing: str = "full", **strategy: object) -> Scenario:
    return Scenario(
        model=model_preset(model),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=gpus, gpus_per_node=8),
        training=TrainingSpec(
            micro_batch_size=1,
            sequence_length=4096,
            grad_accum_steps=micro_batches,
            precision="bf16-mixed",
            checkpointing=checkpointing,
        ),
        strategy=Strategy(**strategy),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    "case",
    [
        scenario("llama-3-8b", 32, 3, "selective", name="zero1", tp=4, cp=2),
        scenario("llama-3-8b", 16, 2, "full", name="fsdp", tp=2),
        scenario("mixtral-8x7b", 64, 3, "full", name="zero3", tp=2, ep=4),
    ],
)
def test_every_micro_batchs_model_parallel_calls_are_the_first_ones_renumbered(case: Scenario) -> None:
    built = []
    for micro_batch in range(case.training.grad_accum_steps):  # built one micro-batch at a time, as before
        built += _tensor_parallel(case, micro_batch, 2, True)
        built += _context_parallel(case, micro_batch)
        built += expert_parallel_events(case, micro_batch)
    copied = model_parallel_events(case, 2, True)
    assert len(built) > 100 and copied == built


@pytest.mark.parametrize("engine", ["paper", "pytorch", "deepspeed"])
@pytest.mark.parametrize(
    "case",
    [
        scenario("llama-3-8b", 32, 3, "full", name="zero3", tp=2, offload="optimizer+params"),
        scenario("llama-3-8b", 64, 4, "selective", name="hsdp", shard_group=4, tp=2),
    ],
)
def test_every_micro_batchs_sharded_calls_are_the_first_ones_renumbered(case: Scenario, engine: str) -> None:
    case = dataclasses.replace(case, strategy=dataclasses.replace(case.strategy, engine=engine))
    first = rules_for(case).step_events(with_micro_batches(case, 1))
    renumbered = [
        dataclasses.replace(call, micro_batch=micro_batch)
        for micro_batch in range(case.training.grad_accum_steps)
        for call in first
    ]
    assert len(first) > 20 and rules_for(case).step_events(case) == renumbered


@pytest.mark.parametrize(
    "case",
    [
        scenario("llama-3-70b", 256, 8, name="zero1", tp=8, pp=4),  # the whole step simulated
        scenario("llama-3-70b", 512, 24, name="ddp", tp=8, pp=8, pp_schedule="interleaved-1f1b"),  # extended
    ],
)
def test_each_ranks_tail_is_its_proxys_estimate(case: Scenario) -> None:
    profile = default_profile(case.cluster.gpu)
    step = pipeline_step(case, profile)
    for rank in range(case.strategy.pp):
        proxy = rank_proxy(case, rank_stages(case, rank))
        full = estimate_time(proxy, profile)
        optimizer = sum(duration for _, _, kind, _, duration, _ in full.schedule if kind == "optimizer")
        assert step.after_s(rank) == (full.exposed_comm_s, optimizer)
        calls = step_calls(proxy, step_runs(proxy, profile))
        assert calls == (full.ledger, full.wire_bytes_per_rank, full.comm_time_s, full.peak_flops_per_s)
        assert optimizer > 0 and full.exposed_comm_s > 0


def test_a_long_step_is_its_exact_part_extended() -> None:
    case = scenario("llama-3-8b", 32, EXACT_MICRO_BATCHES + 5, name="zero3", tp=2)
    profile = default_profile(case.cluster.gpu)
    before = simulate(with_micro_batches(case, EXACT_MICRO_BATCHES - 1), profile)
    last = simulate(with_micro_batches(case, EXACT_MICRO_BATCHES), profile)
    step = last.step_time_s + 5 * (last.step_time_s - before.step_time_s)
    compute = last.compute_time_s + 5 * (last.compute_time_s - before.compute_time_s)
    answer = estimate_time(case, profile)
    assert dataclasses.replace(answer, ledger=(), model_flops=0.0) == dataclasses.replace(
        last,
        scenario=case,
        ledger=(),
        wire_bytes_per_rank=round(
            last.wire_bytes_per_rank + 5 * (last.wire_bytes_per_rank - before.wire_bytes_per_rank)
        ),
        comm_time_s=last.comm_time_s + 5 * (last.comm_time_s - before.comm_time_s),
        exposed_comm_s=max(0.0, step - compute),
        compute_time_s=compute,
        step_time_s=step,
        model_flops=0.0,
    )


def test_a_kept_peak_in_flight_is_the_walk_of_the_actions() -> None:
    actions = rank_actions("interleaved-1f1b", 4, 2, 8, 1)
    weights = {1: 10, 5: 7}
    kept = peak_in_flight(actions, weights)
    kept[1].clear()  # the caller's copy, not the kept one
    walked = _peak_in_flight(actions, weights)
    assert peak_in_flight(list(actions), dict(weights)) == walked
    assert walked[0] > 0 and all(walked[1].values())
