"""torch's engines under context parallelism on 4 gloo ranks: fully_shard over dp 2 x cp 2 (torchtitan's
dp_shard_cp) with the teaching ring attention (shardscope.trace.context_parallel). The run ends where one process ends
in float64 after 3 steps, and its rank 0 holds and sends what the fake-tensor trace of the same scenario says, byte for
byte: model states, every collective and every send/recv of the ring.

The fsdp case runs by default (about 35 s on 2 shared cores: the run and the trace); the case with tensor parallelism
too is slower and runs only when asked for: `pytest -m long tests/distributed/test_torch_context_parallel.py`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from shardscope.core.result import CollectiveRow
from shardscope.runtime import RunConfig, RunResult, run_suite
from shared_launch import register
from shared_traces import SharedTraces
from shared_traces import register as register_traces

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
pytest.importorskip("torch")
from shardscope.trace.request import TraceRequest  # noqa: E402
from shardscope.trace.result import TraceResult  # noqa: E402
from shardscope.trace.runner import run_in_subprocess  # noqa: E402

OPTIONS: dict[str, Any] = {
    "model": "tiny-llama",
    "strategy": "fsdp",
    "engine": "pytorch",
    "world_size": 4,
    "cp": 2,
    "precision": "fp64",
    "micro_batch_size": 2,
    "sequence_length": 32,
    "steps": 3,
    "timeout_s": 180,  # the hard deadline of the launch; the run takes about 25 s on 2 cores
}
FP64 = 8


def _calls(rows: tuple[CollectiveRow, ...]) -> Counter[tuple[str, str, str, int, int]]:
    return Counter(
        {
            (row.phase, row.op, row.group, row.group_size, row.payload_bytes): row.count
            for row in rows
            if row.count and row.phase != "setup"
        }
    )


def _run_and_trace(options: dict[str, Any]) -> tuple[RunResult, TraceResult]:
    config = RunConfig.from_options(**options)
    run = run_suite([config])[0]
    trace = run_in_subprocess(TraceRequest(scenario=config.scenario(), time_limit_s=240, traced_blocks=0))
    return run, trace


CONFIG = RunConfig.from_options(**OPTIONS)
register(__name__, {"fsdp cp2": CONFIG})
TRACE = TraceRequest(scenario=CONFIG.scenario(), time_limit_s=240, traced_blocks=0)
register_traces(__name__, [TRACE])


@pytest.fixture(scope="module")
def fsdp_cp(shared_runs: dict[str, dict[str, RunResult]], shared_trace: SharedTraces) -> tuple[RunResult, TraceResult]:
    """The run (launched with the other modules' 4-rank runs: shared_launch.py) and the trace of its scenario
    (replayed beside the other modules' default traces: shared_traces.py)."""
    trace = shared_trace(TRACE)
    return shared_runs[__name__]["fsdp cp2"], trace


def test_float64_parity_with_one_process(fsdp_cp: tuple[RunResult, TraceResult]) -> None:
    assert fsdp_cp[0].parity.max_abs_diff < 1e-10


def test_model_states_and_ledger_equal_the_trace(fsdp_cp: tuple[RunResult, TraceResult]) -> None:
    run, trace = fsdp_cp
    real = run.per_rank[0]
    assert trace.per_rank.parameters_bytes == real.parameters_bytes
    assert trace.per_rank.gradients_bytes == real.gradients_bytes
    assert trace.per_rank.optimizer_state_bytes == real.optimizer_state_bytes
    # fully_shard over dp x cp: a quarter of tiny-llama's 125,248 float64 parameters
    assert real.parameters_bytes == 125_248 // 4 * FP64
    measured = _calls(run.ledger)
    assert measured == _calls(trace.ledger)
    # the ring: the K and V chunk pair (2 x batch 2 x 2 kv heads x 16 tokens x 16) sent and received once per block
    # in forward, K/V once and dK/dV twice per block in backward
    kv = 2 * 2 * 2 * 16 * 16 * FP64
    for op in ("send", "recv"):
        assert measured[("forward", op, "cp", 2, kv)] == 2
        assert measured[("backward", op, "cp", 2, kv)] == 6


def test_activations_and_peak_equal_the_trace_but_the_targets(fsdp_cp: tuple[RunResult, TraceResult]) -> None:
    """The trace's step loop holds rank 0's targets (2 x 16 int64 of its tokens) through backward; the run slices
    them from the global batch inside its loss and autograd frees them after the loss's backward. Before the ring
    dropped its requests once waited on, the run peaked 32,768 B higher: a gloo Work keeps the tensor it sent or
    received (a K/V chunk pair, a dK/dV pair) until it is dropped, the fake process group's Work nothing."""
    run, trace = fsdp_cp
    real = run.per_rank[0]
    assert real.activations_bytes == trace.per_rank.activations_bytes
    targets = 2 * 16 * 8
    assert trace.per_rank.peak_bytes - real.peak_bytes == targets  # 2,854,884 B against 2,854,628


@pytest.mark.long
def test_tensor_and_context_parallel_together_equal_the_trace() -> None:
    # tp 2 x cp 2 on 4 ranks (dp 1): DTensor's sequence-parallel plan inside each cp rank's tokens, the ring over
    # cp, fully_shard over the cp ranks
    run, trace = _run_and_trace({**OPTIONS, "tp": 2})
    real = run.per_rank[0]
    assert run.parity.max_abs_diff < 1e-10
    assert (real.parameters_bytes, real.gradients_bytes, real.optimizer_state_bytes) == (
        trace.per_rank.parameters_bytes,
        trace.per_rank.gradients_bytes,
        trace.per_rank.optimizer_state_bytes,
    )
    assert _calls(run.ledger) == _calls(trace.ledger)
    assert real.activations_bytes == trace.per_rank.activations_bytes
    assert trace.per_rank.peak_bytes - real.peak_bytes == 2 * 16 * 8  # the targets, as in the fsdp case
