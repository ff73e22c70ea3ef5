"""Under tensor and context parallelism a checkpointed block keeps its inputs (RoPE's tables and the mask) until its
backward: the core's activations against what the runs and the trace measured."""

from __future__ import annotations

import pytest

from shardscope.core.memory import estimate_memory
from shardscope.runtime.config import RunConfig
from shardscope.specs import Scenario, Strategy, TrainingSpec


def run_scenario(
    model: str, tp: int, cp: int, sequence_parallel: bool, checkpointing: str = "full", engine: str = "paper"
) -> Scenario:
    """The scenario `shardscope run` measures: 4 gloo ranks, ddp (paper) or fsdp (pytorch), fp32, 2 x 32 tokens."""
    strategy = "ddp" if engine == "paper" else "fsdp"
    return RunConfig(
        model=model,
        training=TrainingSpec(micro_batch_size=2, sequence_length=32, precision="fp32", checkpointing=checkpointing),
        strategy=Strategy(name=strategy, engine=engine, tp=tp, cp=cp, sequence_parallel=sequence_parallel),
        world_size=4,
        steps=2,
    ).scenario()


# Measured with runtime.api.run_training on the scenario above (the teaching ModelParallelTeaching, rank 0's
# activations after forward), and the trace's for the pytorch engine:
#   shardscope trace --model tiny-llama --gpus 4 --tp 2 --strategy fsdp --precision fp32 --micro-batch 2
#   --seq-len 32 --backend gloo --checkpointing MODE
# Before the checkpoint inputs were counted the core was under by the mask and the tables: 5,120 B at tp 2 (32 x 32
# one-byte mask, two 32 x 16 fp32 tables), 2,304 B under cp 2 (16 x 16 and 16 x 16 x 2), 1,024 B for gpt2.
@pytest.mark.parametrize(
    ("model", "tp", "cp", "sequence_parallel", "checkpointing", "engine", "measured"),
    [
        ("tiny-llama", 2, 1, True, "full", "paper", 80_128),
        ("tiny-llama", 2, 2, True, "full", "paper", 39_808),
        ("tiny-llama", 1, 2, False, "full", "paper", 76_676),
        ("tiny-gpt2", 2, 1, False, "full", "paper", 101_248),
        ("tiny-llama", 2, 1, True, "full", "pytorch", 88_196),
        ("tiny-llama", 2, 1, True, "op", "pytorch", 240_772),
        ("tiny-llama", 2, 1, True, "every:2", "pytorch", 260_996),
    ],
)
def test_activations_equal_the_measured(
    model: str, tp: int, cp: int, sequence_parallel: bool, checkpointing: str, engine: str, measured: int
) -> None:
    scenario = run_scenario(model, tp, cp, sequence_parallel, checkpointing, engine)
    assert estimate_memory(scenario).per_rank.activations_bytes == measured


def test_the_traced_peak_under_full_checkpointing_is_exact() -> None:
    # the trace above with --checkpointing full peaks at 'backward: layers.0' with 970,204 B
    estimate = estimate_memory(run_scenario("tiny-llama", 2, 1, True, engine="pytorch")).per_rank
    assert estimate.peak_bytes - estimate.overhead_bytes == 970_204


def test_data_parallel_numbers_do_not_move() -> None:
    # The same inputs are kept without tp and cp (the trace measures 153,860 B here), but those numbers are held
    # fixed (benchmarks/compare_estimates.py) until they are validated again.
    scenario = RunConfig(
        model="tiny-llama",
        training=TrainingSpec(micro_batch_size=2, sequence_length=32, precision="fp32", checkpointing="full"),
        strategy=Strategy(name="fsdp", engine="pytorch"),
        world_size=2,
        steps=2,
    ).scenario()
    assert estimate_memory(scenario).per_rank.activations_bytes == 148_740
