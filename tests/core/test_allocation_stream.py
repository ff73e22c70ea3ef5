"""core.allocation_stream: the reserved peak the core derives without torch, against the trace's and an H200's.

The traced figures are `python benchmarks/bench_reserved.py --trace` (torch's engines on fake CPU tensors, every block
traced, the recorded stream replayed through core.allocator); the H200's are benchmarks/results/gpu_check-h200*.json
(torch.cuda.max_memory_reserved over the last of 6 steps)."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest

from shardscope.core.allocation_stream import (
    ALL_GATHER_STREAM,
    REDUCE_SCATTER_STREAM,
    allocator_peaks,
    fsdp2_events,
    reserved_at_depth,
    reserved_peak_bytes,
)
from shardscope.core.allocator import FREE
from shardscope.core.memory import estimate_memory
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec

REPO = Path(__file__).resolve().parents[2]


def _gpu_check_scenario(blocks: int, world: int, mode: str) -> Scenario:
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    scenario: Scenario = module.scenario_for("llama-3-8b", blocks, 8192, world, mode, "h200-141gb")
    return scenario


def _tiny(model: str, strategy: str, mode: str) -> Scenario:
    return Scenario(
        model=model_preset(model),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=4, backend="gloo"),
        training=TrainingSpec(
            micro_batch_size=4, sequence_length=256, precision="bf16-mixed", checkpointing=mode, optimizer="adamw"
        ),
        strategy=Strategy(name=strategy, engine="pytorch"),
    )


# (blocks, world, checkpointing): the trace's reserved peak (bytes), the H200's max_memory_reserved
CASES = {
    (8, 8, "none"): (38_073_794_560, 38_375_784_448),
    (8, 8, "full"): (28_544_335_872, 28_837_937_152),
    (8, 8, "op"): (32_067_551_232, 32_369_541_120),
    (8, 8, "every:2"): (34_009_513_984, 34_076_622_848),
    (8, 64, "none"): (35_731_275_776, 35_798_384_640),
    (8, 64, "full"): (26_128_416_768, 25_960_644_608),
    (8, 64, "op"): (29_725_032_448, 29_792_141_312),
}


@pytest.mark.parametrize("case", list(CASES), ids=lambda case: f"{case[0]}blocks-w{case[1]}-{case[2]}")
def test_core_reserved_matches_the_trace_and_the_h200(case: tuple[int, int, str]) -> None:
    traced, measured = CASES[case]
    reserved = reserved_peak_bytes(_gpu_check_scenario(*case))
    assert abs(reserved - traced) / traced < 0.015  # measured: -0.3% to +1.4% (full checkpointing the most)
    assert abs(reserved - measured) / measured < 0.025  # measured: -0.9% to +2.1%


def test_the_whole_model_under_op_is_closer_to_the_h200_than_the_trace() -> None:
    """llama-3-8b, all 32 blocks, 8 ranks, op checkpointing: the trace reserves 56.03 GiB, 9.3% over the H200's
    51.26 GiB; the core's stream 50.73 GiB."""
    reserved = reserved_peak_bytes(_gpu_check_scenario(32, 8, "op"))
    assert abs(reserved - 55_035_559_936) / 55_035_559_936 < 0.012
    assert reserved < 0.95 * 56.03 * (1 << 30)  # the trace's, 9.3% over the H200


def test_allocated_peak_of_the_stream_is_the_cores_tensor_peak() -> None:
    """The stream allocates what core.memory counts: its allocated peak is the estimate's tensor peak."""
    for case in ((8, 8, "none"), (8, 8, "full"), (8, 64, "op"), (8, 8, "every:2")):
        scenario = _gpu_check_scenario(*case)
        per_rank = estimate_memory(scenario, rank=0).per_rank
        tensors = per_rank.peak_bytes - per_rank.overhead_bytes
        allocated, _reserved = allocator_peaks(scenario)
        assert abs(allocated - tensors) / tensors < 0.001, case


@pytest.mark.parametrize(
    ("model", "strategy", "mode", "traced"),
    [
        ("tiny-llama", "zero3", "none", 16_777_216),
        ("tiny-llama", "zero2", "none", 16_777_216),
        ("tiny-gpt2", "zero3", "none", 12_582_912),
        ("tiny-gpt2", "zero3", "full", 10_485_760),
        ("tiny-llama", "ddp", "none", 14_680_064),
        ("tiny-gpt2", "ddp", "full", 8_388_608),
    ],
)
def test_tiny_models_on_gloo_reserve_what_the_trace_does(model: str, strategy: str, mode: str, traced: int) -> None:
    assert reserved_peak_bytes(_tiny(model, strategy, mode)) == traced


def test_tiny_llama_full_checkpointing_is_one_segment_short_of_the_trace() -> None:
    """A known gap: under full checkpointing the trace holds one more 2 MiB small-pool segment (its recomputed
    block's small tensors, which the core's stream lays out as fewer, larger ones)."""
    assert reserved_peak_bytes(_tiny("tiny-llama", "zero3", "full")) == 12_582_912 - (2 << 20)


def test_fsdp2_stream_uses_its_collective_streams_and_frees_what_a_step_makes() -> None:
    scenario = _gpu_check_scenario(8, 8, "none")
    events, window = fsdp2_events(scenario, 8)
    streams = {event[2] for event in events if len(event) == 3}
    assert streams == {ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM}
    live: dict[int, int] = {}
    for event in events[:window]:
        if event[1] == FREE:
            del live[event[0]]
        else:
            live[event[0]] = event[1]
    held_between_steps = sum(live.values())
    for event in events[window:]:
        if event[1] == FREE:
            del live[event[0]]
        else:
            live[event[0]] = event[1]
    # The second step ends holding what the first did: weights, optimizer state and the batch only.
    assert sum(live.values()) == held_between_steps


def test_reserved_is_not_affine_in_depth_so_every_block_is_replayed() -> None:
    """Why no shortcut extrapolates from a few blocks: +274 MiB per block to 24 blocks, then a jump of 4,282 MiB."""
    scenario = _gpu_check_scenario(32, 8, "full")
    reserved = [reserved_at_depth(scenario, depth)[1] for depth in (22, 23, 24, 25)]
    steps = [(after - before) >> 20 for before, after in pairwise(reserved)]
    assert steps == [274, 274, 4282]


def test_a_memory_estimate_of_another_scenario_is_refused() -> None:
    scenario = _gpu_check_scenario(8, 8, "none")
    other = estimate_memory(replace(scenario, strategy=Strategy(name="zero2", engine="pytorch")))
    with pytest.raises(ValueError, match="another scenario"):
        reserved_peak_bytes(scenario, other)
    assert reserved_peak_bytes(scenario, estimate_memory(scenario)) == reserved_peak_bytes(scenario)


def test_results_files_named_here_hold_the_h200_figures() -> None:
    document = json.loads((REPO / "benchmarks" / "results" / "gpu_check-h200.json").read_text())
    measured = {(row["world"], row["mode"]): row["measured"]["reserved_peak_bytes"] for row in document["rows"]}
    for (blocks, world, mode), (_traced, h200) in CASES.items():
        assert blocks == 8 and measured[world, mode] == h200


def _variant(change: str) -> Scenario:
    spec = importlib.util.spec_from_file_location("bench_reserved", REPO / "benchmarks" / "bench_reserved.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    scenario: Scenario = module.variant(change)
    return scenario


# The trace's reserved peak of each variant (`python benchmarks/bench_reserved.py --trace`) and the tolerance met:
# FSDP2's derived stream within 0.1%; DDP, whose stream is built from the moments, +5.0%.
VARIANTS = {
    "zero2": (25_478_299_648, 0.002),
    "grad_accum_steps=2": (23_903_338_496, 0.002),
    "bf16": (20_000_538_624, 0.002),
    "gpt2-xl": (4_989_124_608, 0.002),
    "ddp": (59_141_783_552, 0.06),
}


@pytest.mark.parametrize("change", list(VARIANTS))
def test_variants_match_the_trace(change: str) -> None:
    traced, tolerance = VARIANTS[change]
    reserved = reserved_peak_bytes(_variant(change))
    assert abs(reserved - traced) / traced < tolerance
