"""The tensor-parallel floor counts each distinct call once and multiplies (the calls of models of one and two blocks):
it equals every tensor-parallel call inside a stage of one micro-batch of the whole model priced one by one (written
out below as the reference), for tp 2, 4 and 8, with and without sequence parallelism, under every checkpointing, at
one sequence and at the plan's micro-batch, under each engine's weights, beside context and expert parallelism; and
it reads none of the calls after backward (the gradient all-reduces of sequence parallelism's
replicated weights), which a reference counting them shows."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from shardscope.choices import EngineName
from shardscope.core.model_parallel_comm import model_parallel_events
from shardscope.core.network import event_cost, network_model
from shardscope.core.timeline import INSIDE_STAGE
from shardscope.planner.timing import tensor_parallel_floor_s
from shardscope.presets import gpu_preset, model_preset
from shardscope.presets.hardware import HardwareProfile, default_profile
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec

GPU = gpu_preset("h100-80gb")
HARDWARE = default_profile(GPU)


def _scenario(
    tp: int, sequence_parallel: bool, checkpointing: str, engine: EngineName, model: str = "llama-3-8b", **split: int
) -> Scenario:
    return Scenario(
        model=model_preset(model),
        cluster=ClusterSpec(gpu=GPU, world_size=64, gpus_per_node=8),
        training=TrainingSpec(
            micro_batch_size=2, sequence_length=2048, grad_accum_steps=3, checkpointing=checkpointing
        ),
        strategy=Strategy(name="zero3", tp=tp, sequence_parallel=sequence_parallel, engine=engine, **split),
    )


def _reference(
    scenario: Scenario, hardware: HardwareProfile, micro_batch_size: int, triggers: tuple[str, ...]
) -> float:
    """Every tensor-parallel call of one micro-batch at `triggers`, priced and summed one by one."""
    once = dataclasses.replace(
        scenario,
        training=dataclasses.replace(scenario.training, micro_batch_size=micro_batch_size, grad_accum_steps=1),
    )
    net = network_model(hardware)
    return sum(
        event_cost(event, once, net).time_s
        for event in model_parallel_events(once, weight_bytes=4)
        if event.group == "tp" and event.trigger in triggers
    )


CASES = list(
    itertools.product((2, 4, 8), (True, False), ("none", "selective", "full"), ("pytorch", "paper", "deepspeed"))
)


@pytest.mark.parametrize(("tp", "sequence_parallel", "checkpointing", "engine"), CASES)
def test_the_counted_floor_equals_every_call_summed(
    tp: int, sequence_parallel: bool, checkpointing: str, engine: EngineName
) -> None:
    try:
        scenario = _scenario(tp, sequence_parallel, checkpointing, engine)
    except ValueError as error:  # a combination the engine does not model
        pytest.skip(str(error))
    for size in (1, scenario.training.micro_batch_size):
        floor = tensor_parallel_floor_s(scenario, HARDWARE, size)
        assert floor > 0
        assert floor == pytest.approx(_reference(scenario, HARDWARE, size, INSIDE_STAGE), rel=1e-12, abs=0)


@pytest.mark.parametrize(
    ("model", "split"), [("llama-3-8b", {"cp": 2}), ("mixtral-8x7b", {"ep": 4}), ("mixtral-8x7b", {"cp": 2, "ep": 2})]
)
@pytest.mark.parametrize("tp", [2, 4])
def test_the_floor_beside_context_and_expert_parallelism_equals_every_call_summed(
    model: str, split: dict[str, int], tp: int
) -> None:
    scenario = _scenario(tp, True, "full", "pytorch", model, **split)
    for size in (1, scenario.training.micro_batch_size):
        floor = tensor_parallel_floor_s(scenario, HARDWARE, size)
        assert floor > 0
        assert floor == pytest.approx(_reference(scenario, HARDWARE, size, INSIDE_STAGE), rel=1e-12, abs=0)


def test_the_calls_after_backward_are_left_out() -> None:
    """Under sequence parallelism the replicated weights' gradients are all-reduced after backward: a floor that
    counted them would be another, larger sum."""
    scenario = _scenario(4, True, "none", "pytorch")
    floor = tensor_parallel_floor_s(scenario, HARDWARE, 2)
    with_after = _reference(scenario, HARDWARE, 2, (*INSIDE_STAGE, "after_backward"))
    assert floor < with_after
    assert floor != pytest.approx(with_after, rel=1e-6)
