"""A step of k micro-batches extended from one run of two (`core.step_totals.step_totals_and_increment`) equals the
extension from runs of one and two, total by total: ZeRO-3, FSDP and HSDP steps for every engine, offload, hsdp shard
group, tensor, context and expert parallel degree, DDP and ZeRO-1 steps (which reduce in the last micro-batch only),
on a GPU's profile and on one that waits for the later rank. Where one run would miss the step's growth (ZeRO-2's
reductions and the paper's DDP's beside context parallelism, after every backward, piling up on their stream), the
planner runs one micro-batch too, and a profile without overlap always does."""

from __future__ import annotations

import dataclasses

import pytest

from shardscope.choices import EngineName
from shardscope.core.step_totals import StepTotals, step_totals, step_totals_and_increment
from shardscope.core.timeline import estimate_time
from shardscope.planner.timing import plan_timing
from shardscope.presets import gpu_preset, model_preset
from shardscope.presets.hardware import HardwareProfile, HostOverheads, default_profile
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec

GPU = gpu_preset("h100-80gb")
H100 = default_profile(GPU)
WAITING = dataclasses.replace(H100, host_overheads=HostOverheads(sync_wait_s=1e-3))
REPEATING = [
    (Strategy(name="zero3"), "llama-3-8b"),
    (Strategy(name="zero3", offload="optimizer+params"), "llama-3-8b"),
    (Strategy(name="fsdp", reshard_after_forward=False, offload="optimizer"), "llama-3-8b"),
    (Strategy(name="hsdp", shard_group=8), "llama-3-8b"),
    (Strategy(name="hsdp", shard_group=4, offload="optimizer+params", tp=2), "llama-3-8b"),
    (Strategy(name="zero3", tp=2, cp=2), "llama-3-8b"),
    (Strategy(name="zero3", ep=8), "mixtral-8x7b"),
    (Strategy(name="fsdp", cp=2, ep=2, offload="optimizer"), "mixtral-8x7b"),
    (Strategy(name="ddp"), "llama-3-8b"),
    (Strategy(name="zero1", offload="optimizer", tp=2), "llama-3-8b"),
    (Strategy(name="zero1", ep=4), "mixtral-8x7b"),
    (Strategy(name="ddp", cp=2), "llama-3-8b"),
]
PILING_UP = [  # reductions after every backward that no compute waits for
    (Strategy(name="zero2"), "pytorch"),
    (Strategy(name="zero2", offload="optimizer", tp=2), "deepspeed"),
    (Strategy(name="ddp", cp=2), "paper"),
]


def _scenario(strategy: Strategy, engine: EngineName, model: str, micro_batches: int) -> Scenario:
    return Scenario(
        model=model_preset(model),
        cluster=ClusterSpec(gpu=GPU, world_size=64, gpus_per_node=8),
        training=TrainingSpec(
            micro_batch_size=1, sequence_length=2048, grad_accum_steps=micro_batches, checkpointing="full"
        ),
        strategy=dataclasses.replace(strategy, engine=engine),
    )


def _two_runs(scenario: Scenario, hardware: HardwareProfile) -> StepTotals:
    """The totals of runs of one and two micro-batches, extended to the scenario's count (the planner's way for
    every other step)."""
    one, two = (
        step_totals(
            dataclasses.replace(scenario, training=dataclasses.replace(scenario.training, grad_accum_steps=k)), hardware
        )
        for k in (1, 2)
    )
    extra = scenario.training.grad_accum_steps - 2
    return StepTotals._make(b + extra * (b - a) for a, b in zip(one, two, strict=True))


@pytest.mark.parametrize(("strategy", "model"), REPEATING)
@pytest.mark.parametrize("engine", ["pytorch", "paper", "deepspeed"])
@pytest.mark.parametrize("micro_batches", [3, 7])
@pytest.mark.parametrize("hardware", [H100, WAITING], ids=["h100", "waiting"])
def test_one_run_extends_as_two_runs(
    strategy: Strategy, model: str, engine: EngineName, micro_batches: int, hardware: HardwareProfile
) -> None:
    try:
        scenario = _scenario(strategy, engine, model, micro_batches)
    except ValueError as error:  # a combination the engine does not model
        pytest.skip(str(error))
    timing, expected = plan_timing(scenario, hardware), _two_runs(scenario, hardware)
    assert timing.simulated_micro_batches == 2
    assert timing.step_time_s == pytest.approx(expected.step_time_s, rel=1e-12, abs=0)
    assert timing.compute_time_s == pytest.approx(expected.compute_time_s, rel=1e-12, abs=0)
    assert timing.comm_time_s == pytest.approx(expected.comm_time_s, rel=1e-12, abs=0)
    assert timing.host_copy_s == pytest.approx(expected.host_copy_s, rel=1e-12, abs=0)
    assert timing.wire_bytes_per_rank == pytest.approx(expected.wire_bytes_per_rank, rel=1e-12, abs=1)
    assert timing.step_time_s > timing.compute_time_s > 0 and timing.comm_time_s > 0


@pytest.mark.parametrize(("strategy", "engine"), PILING_UP)
def test_reductions_that_pile_up_keep_two_runs(strategy: Strategy, engine: EngineName) -> None:
    scenario = _scenario(strategy, engine, "llama-3-8b", 2)
    assert step_totals_and_increment(scenario, H100)[1] is None
    assert step_totals_and_increment(_scenario(Strategy(name="zero3"), engine, "llama-3-8b", 2), H100)[1] is not None


def test_a_step_that_grows_by_its_reductions_is_the_full_simulation() -> None:
    """The paper's DDP over context parallelism reduces after every micro-batch, more than its compute hides: the
    step grows by the reductions, not the compute, and the planner's step is the full simulation's (one run's
    increment, the end of one backward to the next, would be 12% short at 3 micro-batches)."""
    scenario = _scenario(Strategy(name="ddp", cp=2), "paper", "llama-3-8b", 3)
    full = estimate_time(scenario, H100)
    assert plan_timing(scenario, H100).step_time_s == pytest.approx(full.step_time_s, rel=1e-12)
    assert full.comm_time_s > full.compute_time_s


def test_without_overlap_two_runs() -> None:
    serial = dataclasses.replace(H100, overlap=False)
    assert step_totals_and_increment(_scenario(Strategy(name="zero3"), "pytorch", "llama-3-8b", 2), serial)[1] is None
