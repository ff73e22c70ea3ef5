"""A step's asynchronous calls, asked once per (trigger, group) and not at all when no pair is asynchronous
(`core.step_graph.asynchronous_calls`), are those of asking the engine about each call, for every engine,
data-parallel strategy, offload and model-parallel grid, DDP's and ZeRO-1's asynchronous bucket reductions included."""

from __future__ import annotations

import itertools

import pytest

from shardscope.core.comm import comm_event_parts
from shardscope.core.engines import rules_for
from shardscope.core.step_graph import asynchronous_calls
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec


def _scenario(model: str, engine: str, name: str, offload: str, grid: dict[str, int]) -> Scenario:
    return Scenario(
        model=model_preset(model),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=16, gpus_per_node=8),
        training=TrainingSpec(micro_batch_size=1, sequence_length=2048, grad_accum_steps=2, precision="bf16-mixed"),
        strategy=Strategy(
            name=name,  # type: ignore[arg-type]
            engine=engine,  # type: ignore[arg-type]
            offload=offload,  # type: ignore[arg-type]
            shard_group=4 if name == "hsdp" else 0,
            **grid,
        ),
    )


GRIDS = [("llama-3-8b", {}), ("llama-3-8b", {"tp": 2}), ("llama-3-8b", {"cp": 2}), ("mixtral-8x7b", {"ep": 4})]
FAMILIES = ["ddp", "zero1", "zero2", "zero3", "hsdp"]


@pytest.mark.parametrize("engine", ["paper", "pytorch", "deepspeed"])
def test_asked_per_pair_equals_asked_per_call(engine: str) -> None:
    asynchronous = 0
    for (model, grid), name, offload in itertools.product(GRIDS, FAMILIES, ["none", "optimizer"]):
        if name in ("ddp", "zero1") and grid.get("ep"):
            continue  # expert parallelism needs sharded states
        scenario = _scenario(model, engine, name, offload, grid)
        rules = rules_for(scenario)
        data_parallel, model_parallel, offloads = comm_event_parts(scenario)
        for events in (data_parallel + offloads, model_parallel, data_parallel + model_parallel + offloads):
            one_by_one = tuple(rules.is_async(scenario, event) for event in events)
            assert asynchronous_calls(scenario, events) == one_by_one, (engine, name, offload, grid)
            asynchronous += any(one_by_one)
    # DDP's buckets are the paper's and torch's asynchronous calls, so their per-pair path is held too; DeepSpeed's
    # calls all block
    assert bool(asynchronous) == (engine != "deepspeed")
