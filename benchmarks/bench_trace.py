"""Speed and memory of `shardscope trace` at scale (issue 4, item 5): wall time and the worker's peak resident memory.

    .venv/bin/python benchmarks/bench_trace.py            # both cases
    .venv/bin/python benchmarks/bench_trace.py llama-3-8b # one case
    .venv/bin/python benchmarks/bench_trace.py --full     # every block traced (--traced-blocks 0)

Targets on a 2-core machine: llama-2-70b on 64 ranks under 60 s and 2 GiB RSS; llama-3-8b on 8 ranks under 15 s.
The machine is shared, so the worker's CPU time (user + system) is printed next to the wall time.
"""

from __future__ import annotations

import resource
import sys
import time

from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec
from shardscope.trace.request import DEFAULT_TRACED_BLOCKS, TraceRequest
from shardscope.trace.runner import run_in_subprocess, stderr_progress
from shardscope.units import format_bytes

CASES = {
    "llama-2-70b": (64, 4096, 60.0),
    "llama-3-8b": (8, 4096, 15.0),
}


def bench(model: str, traced_blocks: int) -> bool:
    """Trace one case; print time, worker RSS and the peak; True when within its time and memory targets."""
    world, seq, limit_s = CASES[model]
    scenario = Scenario(
        model=model_preset(model),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=world),
        training=TrainingSpec(micro_batch_size=1, sequence_length=seq, precision="bf16-mixed", checkpointing="full"),
        strategy=Strategy(name="zero3"),
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    request = TraceRequest(scenario=scenario, time_limit_s=600, traced_blocks=traced_blocks)
    result = run_in_subprocess(request, stderr_progress(model))
    wall_s = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    rss_bytes = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest child so far
    ok = wall_s < limit_s and rss_bytes < 2 * 1024**3
    print(
        f"{model:12} {world:3} ranks zero3 bf16-mixed seq {seq} full ckpt, traced blocks "
        f"{'/'.join(map(str, result.traced_blocks)) or 'all'}: {wall_s:6.1f} s wall, {cpu_s:5.1f} s CPU "
        f"(target {limit_s:.0f} s), worker RSS {format_bytes(rss_bytes, 'MiB', 0)}, traced peak "
        f"{format_bytes(result.per_rank.peak_bytes)} at {result.peak_moment} {'OK' if ok else 'OVER TARGET'}"
    )
    return ok


if __name__ == "__main__":
    full = "--full" in sys.argv
    names = [arg for arg in sys.argv[1:] if arg != "--full"] or list(CASES)
    results = [bench(name, 0 if full else DEFAULT_TRACED_BLOCKS) for name in names]
    sys.exit(0 if all(results) else 1)
