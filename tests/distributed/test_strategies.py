"""Every strategy, ours and torch's, ends where single-process training ends, and keeps what its stage promises.

One launch per (strategy, engine) checks parity in float64, the bytes per category and the ledger together.
"""

from __future__ import annotations

import math

import pytest

from shardscope.core.params import param_layout
from shardscope.presets import model_preset
from shardscope.runtime import RunConfig, RunResult
from shared_launch import register

pytestmark = pytest.mark.distributed
FP64 = 8
STEP_COUNTER = 4  # torch's Adam keeps `step` as a float32 scalar tensor per parameter


def unit_numels(model: str) -> list[int]:
    layout = param_layout(model_preset(model))
    return [layout.root_numel] + [layout.block_numel] * layout.num_blocks


def padded(model: str, degree: int) -> int:
    return sum(math.ceil(n / degree) * degree for n in unit_numels(model))


def shard(model: str, degree: int) -> int:
    return sum(math.ceil(n / degree) for n in unit_numels(model))


def ops(result: RunResult, phase: str) -> set[str]:
    return {row.op for row in result.ledger if row.phase == phase}


CASES = [  # engine, strategy, model, world size, shard group
    ("teaching", "ddp", "tiny-gpt2", 2, 0),
    ("teaching", "zero1", "tiny-llama", 2, 0),
    ("teaching", "zero2", "tiny-gpt2", 2, 0),
    ("teaching", "zero3", "tiny-llama", 3, 0),  # 3 divides no unit: padding
    ("teaching", "hsdp", "tiny-gpt2", 4, 2),
    ("pytorch", "ddp", "tiny-gpt2", 2, 0),
    ("pytorch", "zero1", "tiny-gpt2", 2, 0),
    ("pytorch", "zero2", "tiny-llama", 2, 0),
    ("pytorch", "zero3", "tiny-llama", 3, 0),
    ("pytorch", "hsdp", "tiny-llama", 4, 2),
]


CONFIGS = {
    f"{e} {s}": RunConfig.from_options(
        engine=e, strategy=s, model=m, world_size=w, shard_group=g, steps=3, timeout_s=60
    )
    for e, s, m, w, g in CASES
}
register(__name__, CONFIGS)


@pytest.fixture(scope="module")
def results(shared_runs: dict[str, dict[str, RunResult]]) -> dict[tuple[str, str], RunResult]:
    """All cases, launched with the other modules' runs of their world size (shared_launch.py; a hard deadline)."""
    return {(e, s): shared_runs[__name__][f"{e} {s}"] for e, s, *_ in CASES}


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "hsdp"])
def test_teaching_parity_and_stage_promises(results: dict[tuple[str, str], RunResult], strategy: str) -> None:
    result = results["teaching", strategy]
    model, world, group = result.config.model, result.config.world_size, result.config.strategy.shard_group
    assert result.parity.max_abs_diff <= 1e-10, result.parity
    degree = {"ddp": 1, "hsdp": group}.get(strategy, world)
    full, mine = padded(model, degree) * FP64, shard(model, degree) * FP64
    units = len(unit_numels(model))
    expected = {  # parameters, gradients, optimizer state (two moments of the shard + step counters)
        "ddp": (full, full, 2 * full + units * STEP_COUNTER),
        "zero1": (full, full, 2 * mine + units * STEP_COUNTER),
        "zero2": (full, mine, 2 * mine + units * STEP_COUNTER),
        "zero3": (mine, mine, 2 * mine + units * STEP_COUNTER),
        "hsdp": (mine, mine, 2 * mine + units * STEP_COUNTER),
    }[strategy]
    for breakdown in result.per_rank:
        assert (breakdown.parameters_bytes, breakdown.gradients_bytes, breakdown.optimizer_state_bytes) == expected
        assert breakdown.activations_bytes > 0
        assert breakdown.peak_bytes <= breakdown.total_bytes
    if strategy in ("zero3", "hsdp"):
        assert ops(result, "forward") == {"all_gather"}
        gathered = [r for r in result.ledger if r.phase == "forward"]
        assert sum(r.payload_bytes * r.count for r in gathered) == padded(model, degree) * FP64
        # at most the root, one block and that block's flat gradients are whole at once
        largest_block = max(unit_numels(model)[1:]) * FP64
        assert result.per_rank[0].buffers_bytes <= unit_numels(model)[0] * FP64 + 2 * largest_block + 64
    else:
        assert not ops(result, "forward")
    if strategy == "hsdp":
        assert {r.group_size for r in result.ledger if r.op == "all_reduce"} == {world // group}
        assert {r.group_size for r in result.ledger if r.op == "reduce_scatter"} == {group}


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "hsdp"])
def test_pytorch_parity_and_sharding(results: dict[tuple[str, str], RunResult], strategy: str) -> None:
    result = results["pytorch", strategy]
    model, world, group = result.config.model, result.config.world_size, result.config.strategy.shard_group
    assert result.parity.max_abs_diff <= 1e-10, result.parity
    total = sum(unit_numels(model)) * FP64
    rank0 = result.per_rank[0]
    if strategy in ("ddp", "zero1"):
        assert rank0.parameters_bytes == total and rank0.gradients_bytes == total
        assert rank0.buffers_bytes == total  # DDP's reducer buckets: a second copy of the gradients
        assert ops(result, "backward") == {"all_reduce"}
        states = [b.optimizer_state_bytes for b in result.per_rank]
        assert (sum(states) < 2.2 * total) if strategy == "zero1" else all(s > 2 * total for s in states)
    else:
        degree = group or world
        assert total / degree <= rank0.parameters_bytes < total / degree * 1.05  # dim-0 padding only
        assert rank0.gradients_bytes == rank0.parameters_bytes
        assert "all_gather" in ops(result, "forward")
