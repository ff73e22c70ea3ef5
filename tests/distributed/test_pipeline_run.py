"""The teaching pipeline (runtime/teaching/pipeline.py) ends where one process ends and holds and sends what the
prediction's `per_stage` says.

Each case trains in float64 for 3 AdamW steps on gloo (parity within 1e-10, DESIGN.md), then every rank's measured model
states and buffers and every message of its step (the sends and receives of each micro-batch and boundary, and its
data-parallel all-reduces) must equal the prediction for its pipeline rank (core/pipeline_memory.py,
core/pipeline_time.py `pipeline_rank_ledger`), its activations and peak within 5% (validate's targets). One short case
runs by default (pp 2 x dp 2, 1F1B, in the session's shared 4-rank launch, shared_launch.py; the teaching tensor
parallelism runs by default in test_sharded_model_parallel.py and test_model_parallel_prediction.py); pp 2 x tp 2, the
4-stage ones (tiny-llama-8, so 8 interleaved stages have a layer each), the sharded strategies and the 8-rank pp 2 x tp
2 x dp 2 mesh are long and run under `pytest -m long`, each launch with a hard deadline (RunConfig.timeout_s).

Inside ZeRO-1, ZeRO-2 and ZeRO-3 the buffers are exact too on pp 2 x dp 2: the receive buffers, the gathered units,
the flat gradient copies and the shard-sized buffers of the reduce-scatters and all-gathers (core/engines/
teaching_pipeline.py's moments), and on the 8-rank mesh and a stage of the head only.
"""

from __future__ import annotations

from typing import Any

import pytest

from shardscope.core.pipeline_memory import pipeline_memory
from shardscope.core.pipeline_time import pipeline_rank_ledger
from shardscope.core.result import CollectiveRow
from shardscope.runtime import RunConfig, RunResult, run_training
from shared_launch import register

pytestmark = pytest.mark.distributed
OPTIONS = {"strategy": "ddp", "engine": "paper", "precision": "fp64", "steps": 3, "micro_batch_size": 2}
STATES = ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "buffers_bytes")
TOLERANCE = 0.05  # validate's target for activations and the peak (validate/compare.py TARGETS)


def config_of(options: dict[str, Any]) -> RunConfig:
    """One case's run: OPTIONS with the case's own, a hard deadline of 240 s."""
    return RunConfig.from_options(**{**OPTIONS, "timeout_s": 240, **options})


PP2_DP2 = config_of({"model": "tiny-llama", "world_size": 4, "pp": 2, "grad_accum": 4})
register(__name__, {"pp2 dp2": PP2_DP2})  # the default case joins the session's 4-rank launch (shared_launch.py)


def run_and_compare(options: dict[str, Any], peak_checked: tuple[int, ...] | None = None) -> RunResult:
    """Launch one case on its own and compare it (`compare`)."""
    config = config_of(options)
    return compare(config, run_training(config), peak_checked)


def compare(config: RunConfig, result: RunResult, peak_checked: tuple[int, ...] | None = None) -> RunResult:
    """Assert parity, and every rank against its pipeline rank's prediction: its model states and buffers exactly,
    activations and (on the pipeline ranks of `peak_checked`, all by default) the peak within 5%. Returns the run."""
    assert result.parity.max_abs_diff <= 1e-10, result.parity
    scenario = config.scenario()
    predicted = pipeline_memory(scenario).per_stage
    data_parallel = config.world_size // config.strategy.pp
    for rank, (measured, ledger) in enumerate(zip(result.per_rank, result.ledgers, strict=True)):
        pipeline_rank = rank // data_parallel  # pp is the outermost mesh dimension
        expected = predicted[pipeline_rank].per_rank
        for name in STATES:
            assert getattr(measured, name) == getattr(expected, name), (rank, name)
        error = abs(expected.activations_bytes - measured.activations_bytes) / measured.activations_bytes
        assert error <= TOLERANCE, (rank, expected.activations_bytes, measured.activations_bytes)
        if peak_checked is None or pipeline_rank in peak_checked:
            error = abs(expected.peak_bytes - measured.peak_bytes) / measured.peak_bytes
            assert error <= TOLERANCE, (rank, expected.peak_bytes, measured.peak_bytes)
        step = sorted(
            (row.phase, row.op, row.group_size, row.payload_bytes, row.count) for row in ledger if row.phase != "setup"
        )
        want = sorted(
            (row.phase, row.op, row.group_size, row.payload_bytes, row.count)
            for row in pipeline_rank_ledger(scenario, pipeline_rank)
        )
        assert step == want, rank
    return result


def test_pp2_dp2_one_f_one_b_matches_one_process_and_its_prediction(
    shared_runs: dict[str, dict[str, RunResult]],
) -> None:
    ledgers = compare(PP2_DP2, shared_runs[__name__]["pp2 dp2"]).ledgers

    # tiny-llama on 2 stages: embed + layer 0, layer 1 + head; per micro-batch one tokens x hidden message a boundary
    # (2 x 32 x 64 float64 = 32 KiB) each way, and each stage's units all-reduced once over its 2 data-parallel ranks
    def messages(ledger: tuple[CollectiveRow, ...]) -> dict[tuple[str, str], int]:
        return {(row.phase, row.op): row.count for row in ledger if row.op in ("send", "recv")}

    assert messages(ledgers[0]) == messages(ledgers[1]) == {("forward", "send"): 4, ("backward", "recv"): 4}
    assert messages(ledgers[2]) == messages(ledgers[3]) == {("forward", "recv"): 4, ("backward", "send"): 4}
    assert {row.payload_bytes for row in ledgers[0] if row.op == "send"} == {2 * 32 * 64 * 8}


@pytest.mark.slow
@pytest.mark.long
def test_pp4_one_f_one_b() -> None:
    run_and_compare({"model": "tiny-llama-8", "world_size": 4, "pp": 4, "grad_accum": 4, "pp_schedule": "1f1b"})


@pytest.mark.slow
@pytest.mark.long
def test_pp4_interleaved_one_f_one_b() -> None:
    ledgers = run_and_compare(
        {
            "model": "tiny-llama-8",
            "world_size": 4,
            "pp": 4,
            "grad_accum": 4,
            "pp_schedule": "interleaved-1f1b",
            "pp_virtual_stages": 2,
        }
    ).ledgers
    # rank 3 holds stage 3 and stage 7 (the head only): it sends forward from stage 3 alone, 4 micro-batches
    sends = sum(row.count for row in ledgers[3] if (row.phase, row.op) == ("forward", "send"))
    assert sends == 4


@pytest.mark.slow
@pytest.mark.long
def test_pp4_gpipe_with_a_stage_of_the_embeddings_only() -> None:
    # Stage 0 holds only the embeddings: its states, activations and messages are exact, but its peak is the
    # optimizer step, where the paper engine counts three Adam temporaries of the largest unit (core/engines/paper.py
    # ADAM_TEMPORARIES) and this run's peak shows at most two: checked on the other stages only.
    run_and_compare(
        {
            "model": "tiny-llama-8",
            "world_size": 4,
            "pp": 4,
            "grad_accum": 4,
            "pp_schedule": "gpipe",
            "pp_layers": (0, 3, 3, 2),
        },
        peak_checked=(1, 2, 3),
    )


def test_the_worker_reads_a_pipeline_from_its_flags() -> None:
    # under torchrun each rank gets the config as flags (runtime/worker.py), --pp-layers as options() writes it
    from shardscope.runtime.worker import parse_config

    config = config_of({"model": "tiny-llama-8", "world_size": 4, "pp": 4, "grad_accum": 4, "pp_layers": (0, 3, 3, 2)})
    argv = [f"--{name.replace('_', '-')}={value}" for name, value in config.options().items()]
    (parsed,), _ = parse_config(argv)
    assert parsed.options() == config.options()
    assert parsed.strategy.pp_layers == (0, 3, 3, 2) and parsed.training.grad_accum_steps == 4


@pytest.mark.slow
@pytest.mark.long  # by default pp 2 x dp 2 above runs the teaching pipeline, test_sharded_model_parallel.py its tp
def test_pp2_tp2_matches_one_process_and_its_prediction() -> None:
    # each stage's layers split over 2 tp ranks (sequence parallel): stage boundaries carry each tp rank's seq/tp tokens
    ledgers = run_and_compare({"model": "tiny-llama", "world_size": 4, "pp": 2, "tp": 2, "grad_accum": 4}).ledgers
    assert {row.payload_bytes for row in ledgers[0] if row.op == "send"} == {2 * 32 // 2 * 64 * 8}


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_pp2_inside_a_sharded_strategy(strategy: str) -> None:
    # each pipeline rank's units sharded over its 2 data-parallel ranks; ZeRO-2/3 reduce-scatter every micro-batch
    ledgers = run_and_compare(
        {"model": "tiny-llama", "world_size": 4, "pp": 2, "grad_accum": 4, "strategy": strategy}
    ).ledgers
    scatters = sum(row.count for row in ledgers[0] if (row.phase, row.op) == ("backward", "reduce_scatter"))
    assert scatters == (2 if strategy == "zero1" else 2 * 4)  # the root and one block, once or every micro-batch


@pytest.mark.slow
@pytest.mark.long
def test_pp2_inside_zero2_with_a_stage_of_the_head_only() -> None:
    # the head stage's one unit, the final norm and head, reduce-scattered from its flat copy after each backward
    ledgers = run_and_compare(
        {"model": "tiny-llama", "world_size": 4, "pp": 2, "grad_accum": 4, "strategy": "zero2", "pp_layers": (2, 0)}
    ).ledgers
    scatters = sum(row.count for row in ledgers[2] if (row.phase, row.op) == ("backward", "reduce_scatter"))
    assert scatters == 4  # its root, every micro-batch


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_pp2_tp2_dp2_on_8_ranks(strategy: str) -> None:
    # issue 20's 3-D case: pp outermost, tp innermost, the strategy over the 2 ranks of each (pipeline, tp) cell
    ledgers = run_and_compare(
        {"model": "tiny-llama", "world_size": 8, "pp": 2, "tp": 2, "grad_accum": 4, "strategy": strategy}
    ).ledgers
    data_parallel = {row.group_size for row in ledgers[5] if row.group == "dp" and row.phase != "setup"}
    assert data_parallel == {2}
