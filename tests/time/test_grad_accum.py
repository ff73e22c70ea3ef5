"""Gradient accumulation costs the time model O(1) in the number of micro-batches (issue 17): long steps are the
simulation of EXACT_MICRO_BATCHES extended by the last micro-batch's difference, and the ledger is counted from one
and two micro-batches. Both must equal the whole simulation."""

from __future__ import annotations

import dataclasses

import pytest
from timecases import scenario

from shardscope.core.comm import collective_ledger, comm_events
from shardscope.core.result import merge_ledger
from shardscope.core.timeline import EXACT_MICRO_BATCHES, estimate_time, simulate
from shardscope.presets.hardware import HostOverheads, default_profile

CASES = [
    (strategy, engine)
    for strategy in ("ddp", "zero1", "zero2", "zero3", "hsdp")
    for engine in ("paper", "pytorch", "deepspeed")
]


@pytest.mark.parametrize(("strategy", "engine"), CASES)
@pytest.mark.parametrize("micro_batches", [3, 7])
def test_the_ledger_counted_from_two_micro_batches_is_the_whole_steps(
    strategy: str, engine: str, micro_batches: int
) -> None:
    case = scenario(
        strategy=strategy, engine=engine, grad_accum=micro_batches, shard_group=8 if strategy == "hsdp" else 0
    )
    assert collective_ledger(case) == merge_ledger([event.row for event in comm_events(case)])


@pytest.mark.parametrize(("strategy", "engine"), CASES[::2])
@pytest.mark.parametrize("cpu_like", [False, True])
def test_a_long_step_extended_from_the_simulated_part_equals_its_whole_simulation(
    strategy: str, engine: str, cpu_like: bool
) -> None:
    case = scenario(
        strategy=strategy, engine=engine, grad_accum=EXACT_MICRO_BATCHES + 5, shard_group=8 if strategy == "hsdp" else 0
    )
    profile = default_profile(case.cluster.gpu)
    if cpu_like:  # the terms only a CPU host has: one stream, a rank wait, compute slowed beside async collectives
        host = HostOverheads(sync_wait_s=2e-4, async_compute_slowdown=0.3)
        profile = dataclasses.replace(profile, overlap=False, host_overheads=host)
    whole, extended = simulate(case, profile), estimate_time(case, profile)
    assert extended.simulated_micro_batches == EXACT_MICRO_BATCHES < whole.simulated_micro_batches
    for name in ("step_time_s", "compute_time_s", "comm_time_s", "exposed_comm_s", "model_flops"):
        assert getattr(extended, name) == pytest.approx(getattr(whole, name), rel=1e-9, abs=1e-12), name
    assert extended.wire_bytes_per_rank == whole.wire_bytes_per_rank
    assert extended.ledger == whole.ledger


def test_a_million_micro_batches_keep_the_schedule_of_the_simulated_part() -> None:
    case = scenario(strategy="zero3", grad_accum=1_000_000)
    estimate = estimate_time(case)
    drawn = simulate(
        dataclasses.replace(case, training=dataclasses.replace(case.training, grad_accum_steps=EXACT_MICRO_BATCHES)),
        estimate.hardware,
    )
    assert len(estimate.schedule) == len(drawn.schedule)
    assert estimate.tokens_per_s == pytest.approx(drawn.tokens_per_s, rel=0.01)  # per-token speed is that of the part
    assert sum(row.count for row in estimate.ledger) > 1_000_000
