"""A pipeline rank's data-parallel calls placed through the micro-batch map (`stands_for`, what `rank_placement`
gives its engine's `pipeline_step_events`) are those of the placement it replaced: every call of the proxy renumbered
to the step's micro-batch it stands for, placed as a proxy of the whole step, and numbered back. Checked for every
engine, data-parallel strategy and schedule, with and without tensor parallelism, on steps the time model simulates
whole and on longer ones (its runs of EXACT_MICRO_BATCHES - 1 and EXACT_MICRO_BATCHES micro-batches)."""

from dataclasses import replace
from itertools import product

import pytest

from shardscope.core.comm import comm_event_parts, with_micro_batches
from shardscope.core.comm_events import CommEvent
from shardscope.core.engines import rules_for
from shardscope.core.engines.base import PipelineCalls
from shardscope.core.pipeline import rank_stages
from shardscope.core.pipeline_memory import pipeline_rank_actions, rank_proxy
from shardscope.core.pipeline_time import REPEATED_FROM_END, rank_placement, stands_for
from shardscope.core.timeline import EXACT_MICRO_BATCHES
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec

SCHEDULES = {
    "gpipe": {"pp_schedule": "gpipe"},
    "1f1b": {"pp_schedule": "1f1b"},
    "interleaved": {"pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2},
}


def question(engine: str, name: str, schedule: str, tp: int, micro_batches: int) -> Scenario:
    group = {"shard_group": 2} if name == "hsdp" else {}
    return Scenario(
        model=model_preset("llama-3-8b"),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=16 * tp),
        training=TrainingSpec(grad_accum_steps=micro_batches, checkpointing="full"),
        strategy=Strategy(name=name, engine=engine, tp=tp, pp=4, **group, **SCHEDULES[schedule]),  # type: ignore[arg-type]
    )


def renumbered(case: Scenario, rank: int, run: Scenario, events: tuple[CommEvent, ...]) -> tuple[CommEvent, ...]:
    """The placement before the map: the calls renumbered to the step's micro-batches, placed, numbered back."""
    steps, count = case.training.grad_accum_steps, run.training.grad_accum_steps
    step = [k if k < count - REPEATED_FROM_END else steps - (count - k) for k in range(count)]
    back = {full: k for k, full in enumerate(step)}
    calls = PipelineCalls(rank_stages(case, rank), pipeline_rank_actions(case, rank))
    whole = tuple(replace(call, micro_batch=step[call.micro_batch]) for call in events)
    placed = rules_for(case).pipeline_step_events(case, calls, whole, range(steps))
    return tuple(replace(call, micro_batch=back[call.micro_batch]) for call in placed)


CASES = [
    (engine, name, schedule, tp, micro_batches)
    for engine, name, schedule, tp, micro_batches in product(
        ("paper", "pytorch", "deepspeed"),
        ("ddp", "zero1", "zero2", "fsdp", "hsdp"),
        SCHEDULES,
        (1, 2),
        (8, 16, 20, 40),
    )
    if tp == 1 or micro_batches in (8, 20)
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(map(str, case)))
def test_placed_through_the_map_as_renumbered(case: tuple[str, str, str, int, int]) -> None:
    whole = question(*case)
    steps = whole.training.grad_accum_steps
    counts = [steps] if steps <= EXACT_MICRO_BATCHES else [EXACT_MICRO_BATCHES - 1, EXACT_MICRO_BATCHES]
    for rank in range(whole.strategy.pp):
        proxy = rank_proxy(whole, rank_stages(whole, rank))
        for count in counts:
            run = with_micro_batches(proxy, count)
            events = comm_event_parts(run)[0]
            placed = rank_placement(whole, rank)(run, events)
            assert placed == renumbered(whole, rank, run, events), (rank, count)


def test_a_longer_run_stands_for_one_more_micro_batch_from_the_middle() -> None:
    assert stands_for(12, 12) == tuple(range(12))
    shorter, longer = stands_for(15, 40), stands_for(16, 40)
    assert set(longer) - set(shorter) == {8} and shorter[-REPEATED_FROM_END:] == tuple(range(33, 40))
