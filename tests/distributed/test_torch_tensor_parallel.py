"""torch's own engines under tensor parallelism on 4 gloo ranks (fsdp over 2 data-parallel ranks x tp 2, the trace's
DTensor plan, shardscope.trace.tensor_parallel): the run ends where one process ends in float64, and its rank 0
holds and sends what the fake-tensor trace of the same scenario says, byte for byte."""

from __future__ import annotations

from collections import Counter

import pytest

from shardscope.core.result import CollectiveRow
from shardscope.runtime import RunConfig, RunResult
from shardscope.specs import Scenario
from shared_launch import register
from shared_traces import SharedTraces
from shared_traces import register as register_traces

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
pytest.importorskip("torch")
from shardscope.trace.request import TraceRequest  # noqa: E402
from shardscope.trace.result import TraceResult  # noqa: E402

OPTIONS = {
    "model": "tiny-llama",
    "strategy": "fsdp",
    "engine": "pytorch",
    "world_size": 4,
    "tp": 2,
    "precision": "fp64",
    "micro_batch_size": 2,
    "sequence_length": 32,
    "steps": 3,
    "timeout_s": 180,  # the hard deadline of the launch; the run takes about 30 s on 2 cores
}


def _calls(rows: tuple[CollectiveRow, ...]) -> Counter[tuple[str, str, str, int, int]]:
    return Counter(
        {(row.phase, row.op, row.group, row.group_size, row.payload_bytes): row.count for row in rows if row.count}
    )


CONFIG = RunConfig.from_options(**OPTIONS)
register(__name__, {"fsdp tp2": CONFIG})
TRACE = TraceRequest(scenario=CONFIG.scenario(), time_limit_s=240, traced_blocks=0)
register_traces(__name__, [TRACE])


@pytest.fixture(scope="module")
def run_and_trace(
    shared_runs: dict[str, dict[str, RunResult]], shared_trace: SharedTraces
) -> tuple[RunResult, TraceResult, Scenario]:
    """The run (launched with the other modules' 4-rank runs: shared_launch.py) and the trace of its scenario
    (replayed beside the other modules' default traces: shared_traces.py)."""
    run = shared_runs[__name__]["fsdp tp2"]
    scenario = CONFIG.scenario()
    trace = shared_trace(TRACE)
    return run, trace, scenario


def test_float64_parity_with_one_process(run_and_trace: tuple[RunResult, TraceResult, Scenario]) -> None:
    run = run_and_trace[0]
    assert run.parity.max_abs_diff < 1e-10


def test_model_states_and_ledger_equal_the_trace(run_and_trace: tuple[RunResult, TraceResult, Scenario]) -> None:
    run, trace, _scenario = run_and_trace
    real = run.per_rank[0]
    assert trace.per_rank.parameters_bytes == real.parameters_bytes
    assert trace.per_rank.gradients_bytes == real.gradients_bytes
    assert trace.per_rank.optimizer_state_bytes == real.optimizer_state_bytes
    measured = _calls(tuple(row for row in run.ledger if row.phase != "setup"))
    assert measured == _calls(trace.ledger)
    # the tp rows are there and named so: loss parallel's three all-reduces of b x s float64 values, in forward
    assert measured[("forward", "all_reduce", "tp", 2, 2 * 32 * 8)] == 3


def test_activations_and_peak_equal_the_trace_but_the_global_batch(
    run_and_trace: tuple[RunResult, TraceResult, Scenario],
) -> None:
    """The run's tracker counts the global targets and inputs it slices this rank's batch from (1 KiB here), the
    trace rank 0's own (tests/trace/test_trace.py). It used to count 65,536 B more: the AsyncCollectiveTensor
    wrappers a functional collective returns on gloo (four of the sequence-parallel reduce-scatters' outputs alive
    at the end of forward), whose own storage holds nothing (measure/storage.local_tensor unwraps them)."""
    run, trace, _scenario = run_and_trace
    real = run.per_rank[0]
    global_batch = 1024
    assert real.activations_bytes - trace.per_rank.activations_bytes == global_batch
    assert real.peak_bytes - trace.per_rank.peak_bytes == global_batch  # 2,207,588 B against 2,206,564


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"model": "tiny-gpt2"}, "fused c_attn.*--engine paper runs it"),
        ({"strategy": "ddp"}, "zero2, zero3, fsdp, hsdp"),
    ],
)
def test_what_torch_cannot_run_is_refused_before_launch(extra: dict[str, object], says: str) -> None:
    from shardscope.specs import SpecError

    with pytest.raises(SpecError, match=says):
        RunConfig.from_options(**{**OPTIONS, **extra})
