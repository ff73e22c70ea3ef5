"""The teaching ZeRO stages over the data group of a tp x cp grid (ShardedModelParallel): the rank's tensor-parallel
slices are what gets flattened and sharded, over the ranks holding the same slice.

Parity: 4 gloo ranks train tiny-llama for 3 AdamW steps in float64 and the whole parameters, gathered over the data
group and then over tp, equal one process's trained on the whole batch within 1e-10 (DESIGN.md), as the teaching
grid's own parity tests (test_tensor_context_parallel.py) require of ddp. Prediction: the paper engine predicts the
run's parameters, gradients and optimizer state to the byte and its collectives call for call, as it does for the
teaching grid inside ddp (test_model_parallel_prediction.py, benchmarks/bench_tp_ledger.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from shardscope.core.comm import run_ledger
from shardscope.core.memory import estimate_memory
from shardscope.core.result import CollectiveRow
from shardscope.runtime import RunConfig, RunResult, run_suite
from shared_launch import register

pytestmark = pytest.mark.distributed
MICRO_BATCH, SEQUENCE = 2, 32
BASE: dict[str, Any] = {
    "model": "tiny-llama",
    "engine": "paper",
    "world_size": 4,
    "micro_batch_size": MICRO_BATCH,
    "sequence_length": SEQUENCE,
    "timeout_s": 120,
}
Key = tuple[str, str, int, int]


PARITY_CASES = {  # float64, 3 steps each
    "fsdp-tp2": {"strategy": "fsdp", "tp": 2},
    "zero2-tp2": {"strategy": "zero2", "tp": 2},
    "zero1-tp2-cp2": {"strategy": "zero1", "tp": 2, "cp": 2},
}
PREDICTED_CASES = {  # 2 steps each
    "fsdp2-tp2-bf16-mixed": {"strategy": "fsdp", "tp": 2, "precision": "bf16-mixed"},
    "zero1-tp2": {"strategy": "zero1", "tp": 2, "precision": "fp32", "sequence_parallel": False},
}


CONFIGS = {name: RunConfig.from_options(**BASE, precision="fp64", steps=3, **c) for name, c in PARITY_CASES.items()}
CONFIGS |= {name: RunConfig.from_options(**BASE, steps=2, **case) for name, case in PREDICTED_CASES.items()}
register(__name__, CONFIGS)


@pytest.fixture(scope="module")
def runs(shared_runs: dict[str, dict[str, RunResult]]) -> dict[str, tuple[RunConfig, RunResult]]:
    """Every 4-rank case of this file, launched with the other modules' 4-rank runs (shared_launch.py; start-up paid
    once, a hard deadline: the sum of the runs')."""
    return {name: (config, shared_runs[__name__][name]) for name, config in CONFIGS.items()}


def test_fsdp_and_zero2_with_tensor_parallel_match_one_process(runs: dict[str, tuple[RunConfig, RunResult]]) -> None:
    for _, result in (runs["fsdp-tp2"], runs["zero2-tp2"]):
        assert result.parity.max_abs_diff <= 1e-10, (result.config.strategy.label, result.parity)
        assert result.parity.reference == "single process, float64"


def test_zero1_with_tensor_and_context_parallel_matches_one_process(
    runs: dict[str, tuple[RunConfig, RunResult]],
) -> None:
    _, result = runs["zero1-tp2-cp2"]
    assert result.parity.max_abs_diff <= 1e-10, result.parity


def by_call(rows: tuple[CollectiveRow, ...]) -> dict[Key, int]:
    """Calls per (phase, op, group size, payload): the measured ledger knows neither a row's mesh group nor
    point-to-point calls (measure/ledger.py)."""
    calls: dict[Key, int] = {}
    for row in rows:
        if row.op not in ("send", "recv"):
            key = (row.phase, row.op, row.group_size, row.payload_bytes)
            calls[key] = calls.get(key, 0) + row.count
    return calls


@pytest.mark.parametrize("name", list(PREDICTED_CASES))
def test_sharded_model_parallel_run_holds_what_the_paper_engine_predicts(
    name: str, runs: dict[str, tuple[RunConfig, RunResult]]
) -> None:
    config, result = runs[name]
    assert result.parity.ok, result.parity
    predicted = estimate_memory(config.scenario()).per_rank
    for rank in result.per_rank:
        for field in ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes"):
            assert getattr(rank, field) == getattr(predicted, field), (name, field)
        assert rank.activations_bytes == pytest.approx(predicted.activations_bytes, rel=0.05)
        assert rank.peak_bytes == pytest.approx(predicted.peak_bytes, rel=0.05)
    measured, expected = by_call(result.ledger), by_call(run_ledger(config.scenario()))
    # under sequence parallelism this includes the Megatron re-gathers of backward (core/model_parallel_comm.py)
    assert measured == expected


@pytest.mark.slow
@pytest.mark.long
def test_hsdp_with_tensor_parallel_on_eight_ranks_matches_one_process_and_the_prediction() -> None:
    # dp 4 x tp 2: each tp slice's data group [t, t+2, t+4, t+6] shards over pairs of consecutive data ranks and
    # replicates across the pairs (core/network.py `placement`: replica groups strided by the shard group x tp)
    options = {**BASE, "world_size": 8, "timeout_s": 180}
    case = {"strategy": "hsdp", "shard_group": 2, "tp": 2, "sequence_parallel": False}
    config = RunConfig.from_options(**options, precision="fp64", steps=3, **case)
    (result,) = run_suite([config])
    assert result.parity.max_abs_diff <= 1e-10, result.parity
    predicted = estimate_memory(config.scenario()).per_rank
    for rank in result.per_rank:
        for field in ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes"):
            assert getattr(rank, field) == getattr(predicted, field), field
        assert rank.peak_bytes == pytest.approx(predicted.peak_bytes, rel=0.05)
    assert by_call(result.ledger) == by_call(run_ledger(config.scenario()))
