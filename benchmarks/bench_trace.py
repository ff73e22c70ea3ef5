"""Speed and memory of `shardscope trace` at scale (issue 4, item 5): wall time and the worker's peak resident memory.

    .venv/bin/python benchmarks/bench_trace.py            # both cases
    .venv/bin/python benchmarks/bench_trace.py llama-3-8b # one case

Targets on a 2-core machine: llama-2-70b on 64 ranks under 60 s and 2 GiB RSS; llama-3-8b on 8 ranks under 15 s.
"""

from __future__ import annotations

import resource
import sys
import time

from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec
from shardscope.trace.request import TraceRequest
from shardscope.trace.runner import run_in_subprocess, stderr_progress
from shardscope.units import format_bytes

CASES = {
    "llama-2-70b": (64, 4096, 60.0),
    "llama-3-8b": (8, 4096, 15.0),
}


def bench(model: str) -> bool:
    """Trace one case; print time, worker RSS and the peak; True when within its time and memory targets."""
    world, seq, limit_s = CASES[model]
    scenario = Scenario(
        model=model_preset(model),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=world),
        training=TrainingSpec(micro_batch_size=1, sequence_length=seq, precision="bf16-mixed", checkpointing="full"),
        strategy=Strategy(name="zero3"),
    )
    started = time.monotonic()
    result = run_in_subprocess(TraceRequest(scenario=scenario, time_limit_s=600), stderr_progress(model))
    wall_s = time.monotonic() - started
    rss_bytes = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest child so far
    ok = wall_s < limit_s and rss_bytes < 2 * 1024**3
    print(
        f"{model:12} {world:3} ranks zero3 bf16-mixed seq {seq} full ckpt: {wall_s:6.1f} s wall "
        f"(target {limit_s:.0f} s), worker RSS {format_bytes(rss_bytes, 'MiB', 0)}, traced peak "
        f"{format_bytes(result.per_rank.peak_bytes)} at {result.peak_moment} {'OK' if ok else 'OVER TARGET'}"
    )
    return ok


if __name__ == "__main__":
    names = sys.argv[1:] or list(CASES)
    results = [bench(name) for name in names]
    sys.exit(0 if all(results) else 1)
