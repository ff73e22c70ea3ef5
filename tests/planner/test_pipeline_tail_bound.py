"""The planner's tight bound of a pipeline takes each pipeline rank's last backward where the schedule puts it and
counts what the rank does after it: its optimizer step and, in a tensor-parallel step simulated whole, its
tensor-parallel calls; it stays under the step `estimate --time` gives and is tighter than the bound without them, and
a step extended from a shorter run gets its optimizer step alone. One pipeline rank's exact end, which the search asks
before it simulates every rank, is that rank's end in the whole simulation."""

from __future__ import annotations

import pytest

from shardscope.core.pipeline_time import pipeline_step
from shardscope.core.timeline import EXACT_MICRO_BATCHES, estimate_time
from shardscope.planner import PlanRequest
from shardscope.planner.evaluator import RANKS_TRIED, Evaluator
from shardscope.planner.pipeline import pipeline_bound_s, tail_floor_s
from shardscope.planner.space import Variant, make_scenario
from shardscope.planner.timing import ROUNDING_MARGIN
from shardscope.presets import gpu_preset, model_preset
from shardscope.presets.hardware import default_profile
from shardscope.specs import TrainingSpec

REQUEST = PlanRequest(
    model=model_preset("llama-3-70b"),
    gpu=gpu_preset("h100-80gb"),
    training=TrainingSpec(sequence_length=4096),
    global_batch_tokens=512 * 4096,
    max_gpus=256,
    pipeline_parallel=(1, 4),
)


@pytest.mark.parametrize(
    ("family", "schedule", "virtual", "checkpointing", "size", "accum"),
    [
        ("zero1", "1f1b", 0, "full", 1, 8),
        ("ddp", "interleaved-1f1b", 2, "selective", 2, 8),
        ("zero3", "gpipe", 0, "none", 1, 16),
    ],
)
def test_the_tail_floor_is_under_each_ranks_exposed_time_and_the_step(
    family: str, schedule: str, virtual: int, checkpointing: str, size: int, accum: int
) -> None:
    hardware = default_profile(REQUEST.gpu)
    variant = Variant(family=family, tp=8, pp=4, pp_schedule=schedule, pp_virtual_stages=virtual)  # type: ignore[arg-type]
    scenario = make_scenario(REQUEST, 256, variant, "none", checkpointing, size, accum)  # type: ignore[arg-type]
    step = pipeline_step(scenario, hardware)
    floors = tail_floor_s(scenario, hardware)
    for rank, floor in enumerate(floors):
        exposed, optimizer = step.after_s(rank)
        assert optimizer < floor <= exposed + optimizer
    loose = pipeline_bound_s(scenario, hardware)
    evaluator = Evaluator(REQUEST)
    tight = evaluator.tight_bound_s(scenario)
    step_s = estimate_time(scenario, hardware).step_time_s
    assert pipeline_bound_s(scenario, hardware, after_s=floors) <= tight <= step_s
    assert tight > loose + 0.9 * min(floors)  # each rank's bound grew by its floor
    ends = [actions[-1][2] for actions in step.actions]
    assert evaluator.backward_ends_s(scenario) == ends  # planner.pipeline.schedule_ends_s
    assert loose <= evaluator.schedule_bound_s(scenario) <= tight
    assert tight == max(end + floor for end, floor in zip(ends, floors, strict=True)) * (1.0 - ROUNDING_MARGIN)
    exact = [evaluator.pipeline_rank_end_s(scenario, nth) for nth in range(RANKS_TRIED)]
    assert evaluator.pipeline_rank_end_s(scenario, RANKS_TRIED) is None
    assert all(end_s in [step.end_s(rank) for rank in range(4)] and end_s <= step_s for end_s in exact)  # type: ignore[operator]
    latest = max(range(4), key=lambda rank: evaluator.pipeline_rank_floors_s(scenario)[rank])
    assert exact[0] == step.end_s(latest)


def test_a_step_extended_from_a_shorter_run_gets_its_optimizer_step_as_tail_floor() -> None:
    hardware = default_profile(REQUEST.gpu)
    scenario = make_scenario(REQUEST, 128, Variant(family="zero1", tp=8, pp=4), "none", "full", 1, 32)
    assert scenario.training.grad_accum_steps > EXACT_MICRO_BATCHES
    step = pipeline_step(scenario, hardware)
    floors = tail_floor_s(scenario, hardware)
    assert floors == [step.after_s(rank)[1] for rank in range(4)] and min(floors) > 0
    tight = Evaluator(REQUEST).tight_bound_s(scenario)
    assert (
        pipeline_bound_s(scenario, hardware, after_s=floors) <= tight <= estimate_time(scenario, hardware).step_time_s
    )
    assert pipeline_bound_s(scenario, hardware) < tight
