"""The core's reserved peak (core.allocation_stream, no torch) against the trace's and an H200's.

For each scenario: the core's allocated and reserved peaks (its derived allocation stream replayed through the caching
allocator model), the trace's (torch's engines on fake CPU tensors, every block traced, its recorded stream replayed
through the same model; with --trace), the H200's max_memory_allocated and max_memory_reserved where
benchmarks/results/gpu_check-h200*.json measured the scenario, the errors, and the core's cost per call.

    python benchmarks/bench_reserved.py               # the core only, with the H200 measurements
    python benchmarks/bench_reserved.py --trace       # and the trace of every scenario (a few minutes)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import ModuleType

from shardscope.core.allocation_stream import reserved_at_depth
from shardscope.core.memory import estimate_memory
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec

REPO = Path(__file__).resolve().parents[1]
RESULTS = ("gpu_check-h200.json", "gpu_check-h200-32blocks.json")  # the default allocator's measurements


def _gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def tiny(model: str, strategy: str, engine: str, mode: str = "none") -> Scenario:
    """A tiny model on 4 ranks of the gloo backend, as the CPU runs validate."""
    return Scenario(
        model=model_preset(model),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=4, backend="gloo"),
        training=TrainingSpec(
            micro_batch_size=4, sequence_length=256, precision="bf16-mixed", checkpointing=mode, optimizer="adamw"
        ),
        strategy=Strategy(name=strategy, engine=engine),
    )


def variant(change: str) -> Scenario:
    """llama-3-8b (gpt2-xl for "gpt2-xl") cut to 6 blocks, sequence 4096, 8 ranks of fsdp, with one thing changed."""
    base = _gpu_check().scenario_for("llama-3-8b", 6, 8192, 8, "none", "h200-141gb")
    base = replace(base, training=replace(base.training, sequence_length=4096))
    if change == "zero2":
        return replace(base, strategy=Strategy(name="zero2", engine="pytorch"))
    if change == "grad_accum_steps=2":
        return replace(base, training=replace(base.training, grad_accum_steps=2))
    if change == "bf16":
        return replace(base, training=replace(base.training, precision="bf16"))
    if change == "gpt2-xl":
        return replace(base, model=replace(model_preset("gpt2-xl"), num_layers=6))
    assert change == "ddp"
    return replace(base, strategy=Strategy(name="ddp", engine="pytorch"))


VARIANTS = ("zero2", "grad_accum_steps=2", "bf16", "gpt2-xl", "ddp")


def scenarios() -> list[tuple[str, Scenario, dict[str, int] | None]]:
    """(label, scenario, the H200's measurement or None)."""
    check = _gpu_check()
    rows: list[tuple[str, Scenario, dict[str, int] | None]] = []
    for name in RESULTS:
        document = json.loads((REPO / "benchmarks" / "results" / name).read_text())
        config = document["config"]
        for row in document["rows"]:
            scenario = check.scenario_for(
                config["model"], config["blocks"], config["seq_len"], row["world"], row["mode"], config["gpu"]
            )
            label = f"{config['model']}/{config['blocks']} w{row['world']} {row['mode']}"
            rows.append((label, scenario, row["measured"]))
    for change in VARIANTS:
        rows.append((f"6 blocks, seq 4096, w8: {change}", variant(change), None))
    for model in ("tiny-llama", "tiny-gpt2"):
        for strategy, engine in (("zero3", "pytorch"), ("zero2", "pytorch"), ("ddp", "pytorch"), ("zero3", "paper")):
            for mode in ("none", "full"):
                rows.append((f"{model} w4 {strategy}/{engine} {mode}", tiny(model, strategy, engine, mode), None))
    return rows


def _cost_s(scenario: Scenario, repeats: int = 3) -> float:
    depth = scenario.model.num_layers
    started = time.perf_counter()
    for _ in range(repeats):
        reserved_at_depth(scenario, depth)  # uncached: the cost of one new candidate
    return (time.perf_counter() - started) / repeats


def _traced(scenario: Scenario) -> tuple[int, int]:
    from shardscope.trace.request import TraceRequest
    from shardscope.trace.runner import run_in_subprocess

    result = run_in_subprocess(TraceRequest(scenario=scenario, traced_blocks=0))
    return result.per_rank.peak_bytes, result.reserved_peak_bytes or 0


def _gib(value: int | None) -> str:
    """GiB, or MiB under one GiB (the tiny models)."""
    if value is None:
        return "-"
    return f"{value / (1 << 30):.3f} GiB" if value >= 1 << 30 else f"{value / (1 << 20):.2f} MiB"


def _error(value: int, reference: int | None) -> str:
    return "-" if not reference else f"{100 * (value - reference) / reference:+.2f}%"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", action="store_true", help="also trace every scenario (needs torch)")
    args = parser.parse_args(argv)
    print(
        "| scenario | core allocated | core reserved | traced allocated | traced reserved | vs trace | "
        "H200 allocated | H200 reserved | vs H200 | core cost |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, scenario, measured in scenarios():
        allocated, reserved = reserved_at_depth(scenario, scenario.model.num_layers)
        cost = _cost_s(scenario)
        traced = _traced(scenario) if args.trace else None
        gpu = measured or {}
        print(
            f"| {label} | {_gib(allocated)} | {_gib(reserved)} | {_gib(traced[0] if traced else None)} | "
            f"{_gib(traced[1] if traced else None)} | {_error(reserved, traced[1] if traced else None)} | "
            f"{_gib(gpu.get('allocated_peak_bytes'))} | {_gib(gpu.get('reserved_peak_bytes'))} | "
            f"{_error(reserved, gpu.get('reserved_peak_bytes'))} | {cost * 1e3:.1f} ms |",
            flush=True,
        )
    big = Scenario(
        model=model_preset("llama-3-70b"),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=64, gpus_per_node=8),
        training=TrainingSpec(micro_batch_size=1, sequence_length=4096, precision="bf16-mixed", checkpointing="full"),
        strategy=Strategy(name="fsdp", engine="pytorch"),
    )
    estimate_s = time.perf_counter()
    estimate_memory(big)
    estimate_s = time.perf_counter() - estimate_s
    print(
        f"\nllama-3-70b, fsdp on 64 H100s, full checkpointing: core.allocation_stream {_cost_s(big) * 1e3:.0f} ms "
        f"per call (core.memory.estimate_memory {estimate_s * 1e3:.2f} ms)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
