"""Scenario builders shared by the time-model tests."""

from __future__ import annotations

from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec


def scenario(
    model: str = "llama-3-8b",
    strategy: str = "ddp",
    engine: str = "pytorch",
    world_size: int = 16,
    gpus_per_node: int = 8,
    grad_accum: int = 1,
    precision: str = "bf16-mixed",
    checkpointing: str = "none",
    shard_group: int = 0,
    offload: str = "none",
    sequence_length: int = 2048,
) -> Scenario:
    """A scenario with the test's choices and the rest fixed."""
    return Scenario(
        model=model_preset(model),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=world_size, gpus_per_node=gpus_per_node),
        training=TrainingSpec(
            micro_batch_size=1,
            sequence_length=sequence_length,
            grad_accum_steps=grad_accum,
            precision=precision,
            checkpointing=checkpointing,
        ),
        strategy=Strategy(name=strategy, engine=engine, shard_group=shard_group, offload=offload),
    )
