"""The planner's fast path (`core.step_totals.step_totals`) gives `simulate`'s numbers to the last bit: the same run of
the streams, read without building the ledger and the spans; and that run is the schedule as the timeline defines it."""

from __future__ import annotations

import dataclasses

import pytest
from timecases import scenario

from shardscope.core.step_graph import step_graph
from shardscope.core.step_totals import step_totals
from shardscope.core.timeline import STREAMS, run_step, simulate
from shardscope.presets import gpu_preset
from shardscope.presets.hardware import HardwareProfile, default_profile
from shardscope.specs import Scenario

H100 = default_profile(gpu_preset("h100-80gb"))
NO_OVERLAP = dataclasses.replace(H100, overlap=False)


def _with(base: Scenario, *, tp: int = 1, cp: int = 1, micro_batch: int = 1) -> Scenario:
    return dataclasses.replace(
        base,
        strategy=dataclasses.replace(base.strategy, tp=tp, cp=cp),
        training=dataclasses.replace(base.training, micro_batch_size=micro_batch),
    )


CASES = [
    scenario(strategy="ddp"),
    scenario(strategy="zero1", grad_accum=3),
    scenario(strategy="zero2", engine="paper", grad_accum=2),
    scenario(strategy="zero3", checkpointing="full", grad_accum=2),
    scenario(strategy="zero3", engine="deepspeed", offload="optimizer"),
    scenario(strategy="hsdp", shard_group=8, offload="optimizer+params", grad_accum=2, world_size=32),
    scenario(model="gpt2", strategy="zero2", checkpointing="selective", world_size=4, sequence_length=1024),
    scenario(model="llama-3-70b", strategy="zero3", checkpointing="full", world_size=976, grad_accum=2),
    _with(scenario(strategy="zero3", checkpointing="full", grad_accum=2), tp=2),
    _with(scenario(strategy="hsdp", shard_group=2, checkpointing="op", world_size=32), tp=4, micro_batch=2),
    _with(scenario(strategy="zero2", offload="optimizer", sequence_length=8192), cp=2),
    _with(scenario(strategy="zero3", checkpointing="selective", world_size=64, sequence_length=8192), tp=8, cp=2),
]


@pytest.mark.parametrize("profile", [H100, NO_OVERLAP], ids=["overlap", "one-stream"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.model.name}-{case.strategy.label}")
def test_step_totals_equal_the_full_simulation(case: Scenario, profile: object) -> None:
    assert isinstance(profile, type(H100))
    full, fast = simulate(case, profile), step_totals(case, profile)
    assert fast.step_time_s == full.step_time_s > 0
    assert fast.compute_time_s == full.compute_time_s
    assert fast.comm_time_s == full.comm_time_s
    assert fast.exposed_comm_s == full.exposed_comm_s
    assert fast.host_copy_s == full.host_copy_s
    assert fast.wire_bytes_per_rank == full.wire_bytes_per_rank
    assert fast.peak_flops_per_s == full.peak_flops_per_s
    if case.strategy.offload != "none":
        assert fast.host_copy_s > 0


@pytest.mark.parametrize("profile", [H100, NO_OVERLAP], ids=["overlap", "one-stream"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.model.name}-{case.strategy.label}")
def test_the_run_issues_by_key_then_index_and_starts_each_task_when_its_stream_and_inputs_are_ready(
    case: Scenario, profile: HardwareProfile
) -> None:
    # `_run` sorts int and float keys as floats and skips lookups it does not need; the schedule is still the plain
    # definition: issue order by (key, index), each task starting at the latest of its stream's free time, the ends
    # of its inputs and those of the calls it waits for (less what ring attention hides).
    run, graph = run_step(case, profile), step_graph(case, profile)
    tasks = graph.tasks
    assert run.order == sorted(range(len(tasks)), key=lambda index: (tasks[index].key, index))
    free = dict.fromkeys(STREAMS, 0.0)
    for index in run.order:
        task = tasks[index]
        stream = task.stream if profile.overlap else "compute"
        ready = [run.finish[dep] for dep in task.after]
        ready += [run.finish[dep] - graph.hidden.get(dep, 0.0) for dep in graph.waits.get(index, ())]
        assert run.starts[index] == max([free[stream], *ready])
        free[stream] = run.finish[index]
        assert run.finish[index] == run.starts[index] + task.duration_s


@pytest.mark.parametrize("case", CASES[8:], ids=lambda case: f"{case.model.name}-{case.strategy.label}")
def test_the_planner_runs_each_run_of_model_parallel_calls_as_one_task(case: Scenario) -> None:
    # `step_totals` runs the merged graph (`core.step_graph.merged_runs`), which the tests above hold to `simulate`:
    # it stands for every call, in the same order, with far fewer tasks to run
    merged, every = step_graph(case, H100, merged=True), step_graph(case, H100)
    calls = every.tasks[every.computes :]
    assert merged.tasks[: merged.computes] == every.tasks[: every.computes]
    assert len(merged.tasks) - len(merged.runs) + sum(map(len, merged.runs.values())) == len(every.tasks)
    if case.strategy.tp > 1:  # a stage's tensor-parallel calls follow one another; ring attention's stay apart
        assert len(merged.tasks) < 0.8 * len(every.tasks)
        assert merged.call_seconds == tuple(task.duration_s for task in calls)
    else:
        assert merged.tasks == every.tasks and not merged.runs and not merged.call_seconds
