"""A step's model-parallel tasks and compute tasks, built once per shape and reused by every strategy, offload and GPU
count of it (`core.step_graph`), and the order of its calls kept by their places (`core.timeline_tasks`), give the
task graph that building every call and task of the step again gives, to the last bit: for every pipeline rank of
uniform and non-uniform pipelines under 1F1B, GPipe and interleaved 1F1B, so the same simulated steps, and the
planner's answer is the same whether it reuses them or not."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from test_pipeline_speed import scenario as pipeline  # the same 4096-token bf16-mixed pipelines on H100s

from shardscope.core import model_parallel_comm, timeline, timeline_tasks
from shardscope.core import step_graph as graphs
from shardscope.core.comm import comm_event_parts, with_micro_batches
from shardscope.core.compute import compute_model
from shardscope.core.engines import rules_for
from shardscope.core.network import network_model
from shardscope.core.pipeline import rank_stages
from shardscope.core.pipeline_memory import rank_proxy
from shardscope.core.ring_overlap import hidden_exchange
from shardscope.core.step_graph import EventPlacement, StepGraph, step_graph
from shardscope.core.timeline import EXACT_MICRO_BATCHES, estimate_time
from shardscope.core.timeline_tasks import build_comm_tasks, build_compute_tasks, event_costs, slow_beside_async
from shardscope.planner import PlanRequest, plan
from shardscope.presets import gpu_preset, model_preset
from shardscope.presets.hardware import HardwareProfile, HostOverheads, default_profile
from shardscope.specs import Scenario, TrainingSpec

H100 = default_profile(gpu_preset("h100-80gb"))
SERIAL = dataclasses.replace(  # no overlap, a wait at every blocking call, compute slowed beside async calls
    H100, overlap=False, host_overheads=HostOverheads(sync_wait_s=2e-4, async_compute_slowdown=0.25)
)


def rebuilt(
    scenario: Scenario, profile: HardwareProfile, placement: EventPlacement | None = None, merged: bool = False
) -> StepGraph:
    """The step's task graph with every call and compute task built again, the calls in one run of
    `comm_events` (the data-parallel ones as a pipeline rank's `placement` places them); never `merged`, so the
    planner's steps (`step_totals`, which merges runs of calls: `merged_runs`) are held to the graph of every call."""
    model_parallel_comm._calls.clear()
    timeline_tasks._stage_tasks.clear()
    timeline_tasks._comm_orders.clear()
    data_parallel, model_parallel, offload = comm_event_parts(scenario)
    events = (placement(scenario, data_parallel) if placement else data_parallel) + model_parallel + offload
    compute = compute_model(scenario, profile)
    costs = event_costs(scenario, events, network_model(profile))
    compute_tasks, where = build_compute_tasks(scenario, compute, profile)
    rules = rules_for(scenario)
    asynchronous = tuple(rules.is_async(scenario, event) for event in events)
    slowdown = profile.host_terms.async_compute_slowdown
    if slowdown:
        slow_beside_async(asynchronous, events, costs, compute_tasks, where, slowdown)
    computes, waits = len(compute_tasks), {}  # type: ignore[var-annotated]
    built = build_comm_tasks(events, costs, where, profile.host_terms.sync_wait_s, asynchronous, waits, computes)
    optimizer = where[("optimizer", 0, -1)]
    waits[optimizer] = [computes + index for index, task in enumerate(built.tasks) if task.key < optimizer]
    hidden = {computes + index: s for index, s in hidden_exchange(scenario, compute, events, costs).items()}
    return StepGraph(events, costs, compute, compute_tasks + built.tasks, computes, waits, hidden, {}, ())


CASES = [
    pipeline("llama-3-70b", 256, 8, name="zero1", tp=8, pp=4),  # uniform stages, 1F1B
    pipeline("llama-3-70b", 128, 6, "selective", name="zero3", tp=4, cp=2, pp=4, pp_schedule="gpipe",
             offload="optimizer", pp_layers=(18, 22, 20, 20)),  # non-uniform, ring attention, offload after tp
    pipeline("llama-3-70b", 512, 20, name="ddp", tp=8, pp=8, pp_schedule="interleaved-1f1b"),  # extended step
    pipeline("llama-3-8b", 64, 4, "none", name="hsdp", shard_group=2, tp=2, pp=4, pp_schedule="interleaved-1f1b",
             pp_virtual_stages=3, offload="optimizer+params"),  # default split of 32 layers in 12 stages: uneven
    pipeline("mixtral-8x7b", 64, 3, name="zero2", tp=2, ep=4, pp=2, pp_schedule="gpipe"),  # expert all-to-alls
]  # fmt: skip


def proxies(case: Scenario) -> Iterator[Scenario]:
    """Every pipeline rank's step as the time model runs it (two of them for a step extended from a shorter run)."""
    for rank in range(case.strategy.pp):
        proxy = rank_proxy(case, rank_stages(case, rank))
        if proxy.training.grad_accum_steps <= EXACT_MICRO_BATCHES:
            yield proxy
        else:
            yield with_micro_batches(proxy, EXACT_MICRO_BATCHES - 1)
            yield with_micro_batches(proxy, EXACT_MICRO_BATCHES)


OTHER = {"zero1": "ddp", "zero3": "zero2", "ddp": "zero3", "hsdp": "zero1", "zero2": "zero3"}


@pytest.mark.parametrize("profile", [H100, SERIAL], ids=["h100", "serial"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.strategy.label + "-" + case.strategy.pp_schedule)
def test_reused_model_parallel_tasks_build_the_graph_of_every_call(
    case: Scenario, profile: HardwareProfile, monkeypatch: pytest.MonkeyPatch
) -> None:
    graphs._built.clear()
    # Another strategy (other data-parallel calls before the model-parallel ones, so these move) and the same one on
    # twice the GPUs (other payloads and costs of its own calls) build the model-parallel tasks the case reuses.
    strategy = dataclasses.replace(case.strategy, name=OTHER[case.strategy.name], offload="none", shard_group=0)
    wider = dataclasses.replace(case.cluster, world_size=2 * case.cluster.world_size)
    for other in (dataclasses.replace(case, strategy=strategy), dataclasses.replace(case, cluster=wider)):
        for proxy in proxies(other):
            step_graph(proxy, profile)
    built: list[int] = []
    build = graphs._build
    monkeypatch.setattr(graphs, "_build", lambda *args: built.append(1) or build(*args))
    for proxy in proxies(case):
        graph = step_graph(proxy, profile)
        assert graph == rebuilt(proxy, profile)
        data_parallel, model_parallel, _ = comm_event_parts(proxy)
        assert model_parallel and data_parallel
    assert not built


@pytest.mark.parametrize("case", CASES[:3], ids=lambda case: case.strategy.pp_schedule)
def test_the_pipeline_step_is_the_one_of_every_call_built_again(
    case: Scenario, monkeypatch: pytest.MonkeyPatch
) -> None:
    reused = estimate_time(case, H100)
    monkeypatch.setattr(timeline, "step_graph", rebuilt)
    assert estimate_time(case, H100) == reused


@pytest.mark.parametrize("engine", ["paper", "pytorch", "deepspeed"])
def test_no_engine_issues_a_model_parallel_call_asynchronously(engine: str) -> None:
    # DDP's and ZeRO-1's gradient reductions are the engines' asynchronous calls (expert parallelism needs shards)
    for case, families in ((CASES[0], ("ddp", "zero1")), (CASES[4], ("zero1", "zero2"))):
        for family in families:
            strategy = dataclasses.replace(case.strategy, name=family, engine=engine, offload="none", pp_layers=())
            proxy = rank_proxy(dataclasses.replace(case, strategy=strategy), rank_stages(case, 0))
            rules = rules_for(proxy)
            _, model_parallel, _ = comm_event_parts(proxy)
            assert model_parallel and not any(rules.is_async(proxy, event) for event in model_parallel)


def test_the_plan_is_the_one_of_every_call_built_again(monkeypatch: pytest.MonkeyPatch) -> None:
    request = PlanRequest(  # only pipelines fit DDP's and ZeRO-1's states on these GPUs, most with tp 2
        model=model_preset("llama-3-8b"),
        gpu=gpu_preset("h100-80gb"),
        training=TrainingSpec(sequence_length=2048),
        global_batch_tokens=64 * 2048,
        max_gpus=16,
        families=("ddp", "zero1"),
        tensor_parallel=(1, 2),
        pipeline_parallel=(1, 2, 4),
        top=5,
    )
    graphs._built.clear()
    reused = plan(request)
    monkeypatch.setattr(timeline, "step_graph", rebuilt)
    built_again = plan(request)
    assert reused == built_again
    assert any(item.scenario.strategy.pp > 1 and item.scenario.strategy.tp > 1 for item in reused.plans)
