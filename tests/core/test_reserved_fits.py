"""`fits` is judged on the reserved peak (core.allocation_stream's caching allocator model) plus the framework context;
the reserved peak is never below the allocated one, and --allocator-headroom overrides the model."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from shardscope.cli import main
from shardscope.core.allocation_stream import allocator_peaks
from shardscope.core.allocation_stream_moments import moments_events
from shardscope.core.allocator import FREE, Event, replay
from shardscope.core.memory import estimate_memory
from shardscope.presets import gpu_preset, model_preset, with_memory
from shardscope.specs import ClusterSpec, Overheads, Scenario, Strategy, TrainingSpec
from shardscope.units import GIB


def _scenario(
    model: str = "llama-3-8b",
    strategy: str = "fsdp",
    engine: str = "pytorch",
    world: int = 8,
    offload: str = "none",
    checkpointing: str = "none",
) -> Scenario:
    return Scenario(
        model=model_preset(model),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=world),
        training=TrainingSpec(
            micro_batch_size=1, sequence_length=4096, precision="bf16-mixed", checkpointing=checkpointing
        ),
        strategy=Strategy(name=strategy, engine=engine, offload=offload),
    )


SCENARIOS = [
    _scenario(),
    _scenario(checkpointing="full", world=64),
    _scenario(strategy="ddp"),
    _scenario(strategy="zero2", engine="deepspeed"),
    _scenario(strategy="zero3", engine="paper"),
    _scenario(offload="optimizer+params"),
    _scenario(model="gpt2", strategy="zero1"),
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: f"{s.strategy.name}-{s.strategy.engine}")
def test_reserved_is_at_least_allocated_so_allocated_is_a_necessary_condition(scenario: Scenario) -> None:
    estimate = estimate_memory(scenario)
    stream_allocated, stream_reserved = allocator_peaks(scenario)
    assert estimate.reserved_peak_bytes == estimate.tensor_peak_bytes + stream_reserved - stream_allocated
    assert estimate.reserved_peak_bytes >= estimate.tensor_peak_bytes
    # what fails on allocated fails on reserved: a GPU just below the allocated peak plus context
    tight = with_memory(scenario.cluster.gpu, estimate.per_rank.peak_bytes - 1, "tight")
    squeezed = estimate_memory(replace(scenario, cluster=replace(scenario.cluster, gpu=tight)))
    assert not squeezed.fits


def test_fits_is_judged_on_the_reserved_peak_plus_context() -> None:
    scenario = _scenario()
    estimate = estimate_memory(scenario)
    context = scenario.overheads.context_bytes
    assert estimate.per_rank.overhead_bytes == context  # no allocator headroom folded into the allocated peak
    held = estimate.reserved_peak_bytes + context
    # llama-3-8b, fsdp on 8 ranks, one 4096-token sequence: 37.67 GiB allocated, 9.89 GiB more reserved
    assert estimate.tensor_peak_bytes == pytest.approx(37.67 * GIB, rel=1e-3)
    assert held - estimate.per_rank.peak_bytes == pytest.approx(9.89 * GIB, rel=1e-2)
    gpu = with_memory(scenario.cluster.gpu, held, "test")
    assert estimate_memory(replace(scenario, cluster=replace(scenario.cluster, gpu=gpu))).fits
    # a smaller GPU: the allocator gives cached segments back near its limit, so the reserved peak is the GPU's own
    for memory_bytes in (held - GIB, estimate.per_rank.peak_bytes + GIB, estimate.per_rank.peak_bytes):
        gpu = with_memory(scenario.cluster.gpu, memory_bytes, "test")
        smaller = estimate_memory(replace(scenario, cluster=replace(scenario.cluster, gpu=gpu)))
        assert smaller.per_rank == estimate.per_rank
        assert smaller.reserved_peak_bytes <= estimate.reserved_peak_bytes
        assert smaller.fits is (smaller.reserved_peak_bytes + context <= memory_bytes)
    gpu = with_memory(scenario.cluster.gpu, estimate.per_rank.peak_bytes, "test")
    assert not estimate_memory(replace(scenario, cluster=replace(scenario.cluster, gpu=gpu))).fits


def test_allocator_headroom_overrides_the_model() -> None:
    scenario = replace(_scenario(), overheads=Overheads(allocator_headroom=0.25))
    estimate = estimate_memory(scenario)
    assert estimate.reserved_peak_bytes == estimate.tensor_peak_bytes + int(estimate.tensor_peak_bytes * 0.25)
    # the override leaves the allocated peak alone: it is the same as under the model
    assert estimate.per_rank == estimate_memory(_scenario()).per_rank


def test_estimate_json_carries_the_reserved_peak_beside_the_allocated(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--model", "llama-3-8b", "--gpus", "8", "--strategy", "fsdp", "--engine", "pytorch", "--json"]
    assert main([*argv, "--seq-len", "4096"]) == 0
    entry = json.loads(capsys.readouterr().out)["strategies"][0]
    estimate = estimate_memory(_scenario())
    assert entry["per_rank"]["reserved_peak_bytes"] == estimate.reserved_peak_bytes
    assert entry["per_rank"]["peak_bytes"] == estimate.per_rank.peak_bytes
    assert entry["fits"] is True
    assert any("caching allocator" in note for note in entry["assumptions"])
    assert main([*argv, "--seq-len", "4096", "--allocator-headroom", "0.1"]) == 0
    entry = json.loads(capsys.readouterr().out)["strategies"][0]
    tensors = estimate.tensor_peak_bytes
    assert entry["per_rank"]["reserved_peak_bytes"] == tensors + int(tensors * 0.1)
    assert any("--allocator-headroom" in note for note in entry["assumptions"])


def test_the_text_table_shows_the_reserved_peak(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--model", "llama-3-8b", "--gpus", "8", "--strategy", "fsdp", "--seq-len", "4096"]
    assert main([*argv, "--engine", "pytorch"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("reserved peak"))
    estimate = estimate_memory(_scenario())
    held = estimate.reserved_peak_bytes + estimate.per_rank.overhead_bytes
    assert row.split()[-2:] == [f"{held / GIB:.2f}", "GiB"]
    assert "of GPU memory reserved" in out


def test_the_reserved_over_allocated_ratio_is_not_bounded_by_a_constant() -> None:
    """Why the planner does not confirm fits with a ratio margin yet: the allocator's share does not scale with the
    allocated peak (llama-3-8b, fsdp: 2.52 times at 7 GiB allocated, 1.17 times at 64 GiB)."""
    small = _scenario(checkpointing="full", world=64)
    small = estimate_memory(replace(small, model=replace(small.model, num_layers=8)))
    assert small.reserved_peak_bytes / small.tensor_peak_bytes == pytest.approx(2.52, abs=0.01)
    large = _scenario()
    large = replace(large, training=replace(large.training, sequence_length=8192))
    large_estimate = estimate_memory(large)
    assert large_estimate.reserved_peak_bytes / large_estimate.tensor_peak_bytes == pytest.approx(1.17, abs=0.01)


def test_a_stream_far_past_the_device_replays_quickly() -> None:
    """Near the limit every new segment first gives back the free ones; past it, cudaMallocs keep being retried: the
    model neither runs out of addresses nor rescans every free block each time."""
    events: list[Event] = []
    for handle in range(20_000):
        events.append((handle, 30 << 20))
        if handle % 2:
            events.append((handle, FREE))
    started = time.perf_counter()
    peaks = replay(events, device_bytes=1 << 30)
    assert time.perf_counter() - started < 5
    assert peaks.allocated_peak_bytes == 10_001 * (30 << 20)  # the even handles, and one odd before its free
    assert peaks.reserved_peak_bytes == peaks.allocated_peak_bytes


def test_moment_streams_with_everything_offloaded_are_not_written_byte_by_byte() -> None:
    scenario = _scenario(strategy="zero3", engine="pytorch", offload="optimizer+params", world=4)
    events, _window = moments_events(scenario)
    assert len(events) < 100_000
