"""The trace of transformers' modeling code against the trace of shardscope's reference modules, preset by preset
(issue 21, item 3; the table of docs/trace.md).

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/trace_hf_vs_reference.py              # the default presets
    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/trace_hf_vs_reference.py mistral-7b   # one preset
    ... --attn-implementation eager                                                        # the hf model's attention

Each preset is traced twice with the same scenario, `--implementation reference` and `--implementation hf`: zero3 on 8
ranks (nccl), bf16-mixed, micro-batch 1, seq 4096 (gpt2: its 1024 learned positions), no checkpointing, sdpa; 5 and 6
blocks traced and extrapolated. Prints a markdown table of rank 0's bytes and the differences, hf less reference.
"""

from __future__ import annotations

import argparse
import sys
import time

from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec
from shardscope.trace.request import ATTN_IMPLEMENTATIONS, TraceRequest
from shardscope.trace.result import TraceResult
from shardscope.trace.runner import TraceError, run_in_subprocess, stderr_progress

PRESETS = ("gpt2", "llama-2-7b", "llama-3-8b", "mistral-7b", "qwen2.5-7b", "mixtral-8x7b")
WORLD_SIZE = 8


def _scenario(preset: str) -> Scenario:
    model = model_preset(preset)
    sequence = min(4096, model.max_positions) if model.family == "gpt2" else 4096
    return Scenario(
        model=model,
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=WORLD_SIZE),
        training=TrainingSpec(micro_batch_size=1, sequence_length=sequence, precision="bf16-mixed"),
        strategy=Strategy(name="zero3"),
    )


def _trace(preset: str, implementation: str, attn_implementation: str) -> TraceResult | str:
    """The trace, or why it could not run (one line)."""
    request = TraceRequest(
        scenario=_scenario(preset),
        implementation=implementation,
        attn_implementation=attn_implementation if implementation == "hf" else "",
        time_limit_s=600,
    )
    try:
        return run_in_subprocess(request, stderr_progress(f"{preset} {implementation}"))
    except TraceError as error:
        return str(error)


def _gib(value: int) -> str:
    return f"{value / 1024**3:.2f}"


def _change(hf: int, reference: int) -> str:
    if hf == reference:
        return "0"
    return f"{hf - reference:+,} B ({(hf - reference) / reference:+.1%})" if reference else f"{hf:+,} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("presets", nargs="*", default=list(PRESETS))
    parser.add_argument("--attn-implementation", choices=ATTN_IMPLEMENTATIONS, default="sdpa")
    args = parser.parse_args()
    print(
        "| preset | parameters, GiB (both) | activations, GiB ref / hf | activations, hf - ref "
        "| temporary, GiB ref / hf | peak, GiB ref / hf | peak, hf - ref | FLOPs ref / hf |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for preset in args.presets:
        started = time.monotonic()
        reference = _trace(preset, "reference", "")
        hf = _trace(preset, "hf", args.attn_implementation)
        if isinstance(reference, str) or isinstance(hf, str):
            row = [
                f"{name}: {traced}"
                if isinstance(traced, str)
                else f"{name}: peak {_gib(traced.per_rank.peak_bytes)} "
                f"GiB, parameters {_gib(traced.per_rank.parameters_bytes)}, activations "
                f"{_gib(traced.per_rank.activations_bytes)}, temporary {_gib(traced.per_rank.temporary_bytes)}, FLOPs "
                f"{traced.flops.total_flops:.3e}"
                for name, traced in (("reference", reference), ("hf", hf))
            ]
            print(f"| {preset} | {'; '.join(row)} |||||||", flush=True)
            continue
        ref_rank, hf_rank = reference.per_rank, hf.per_rank
        parameters = (
            _gib(ref_rank.parameters_bytes)
            if ref_rank.parameters_bytes == hf_rank.parameters_bytes
            else f"{_gib(ref_rank.parameters_bytes)} / {_gib(hf_rank.parameters_bytes)}"
        )
        print(
            f"| {preset} | {parameters} "
            f"| {_gib(ref_rank.activations_bytes)} / {_gib(hf_rank.activations_bytes)} "
            f"| {_change(hf_rank.activations_bytes, ref_rank.activations_bytes)} "
            f"| {_gib(ref_rank.temporary_bytes)} / {_gib(hf_rank.temporary_bytes)} "
            f"| {_gib(ref_rank.peak_bytes)} / {_gib(hf_rank.peak_bytes)} "
            f"| {_change(hf_rank.peak_bytes, ref_rank.peak_bytes)} "
            f"| {reference.flops.total_flops:.3e} / {hf.flops.total_flops:.3e} |",
            flush=True,
        )
        print(f"{preset}: {time.monotonic() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
