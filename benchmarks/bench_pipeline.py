"""Speed of one pipeline plan's memory and step time: the calls the planner makes for each pipeline it estimates.

Each case runs in a fresh process: its first `estimate_memory` and `estimate_time` (every cache cold, as for the
planner's first plan of a shape) and the median of 4 more (its caches warm). The cases are the pipeline plans the
405B and cost questions of benchmarks/bench_plan.py estimate most: long interleaved steps on the pytorch engine, and
many micro-batches on few GPUs.
Run: .venv/bin/python benchmarks/bench_pipeline.py
Before/after a change, in one run: `git archive HEAD src | tar -x -C /tmp/old`, then
`PYTHONPATH=/tmp/old/src .venv/bin/python benchmarks/bench_pipeline.py` beside this tree's run.
"""

from __future__ import annotations

import json
import subprocess
import sys

CASES = {
    "405b hsdp pytorch pp16 interleaved m36": ("llama-3.1-405b", 8192, 6912, "hsdp", "pytorch", 6, 8, 16, 2, 36),
    "405b zero1 pytorch pp16 1f1b m16": ("llama-3.1-405b", 8192, 16384, "zero1", "pytorch", 0, 8, 16, 1, 16),
    "405b zero3 paper pp16 1f1b m36": ("llama-3.1-405b", 8192, 6912, "zero3", "paper", 0, 8, 16, 1, 36),
    "70b zero3 pytorch pp8 1f1b m128": ("llama-3-70b", 4096, 32, "zero3", "pytorch", 0, 1, 8, 1, 128),
    "70b zero1 deepspeed pp4 interleaved m64": ("llama-3-70b", 4096, 64, "zero1", "deepspeed", 0, 2, 4, 2, 64),
}

ONE_CASE = """
import json, statistics, sys, time
from shardscope.core.memory import estimate_memory
from shardscope.core.timeline import estimate_time
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec
model, seq, gpus, name, engine, group, tp, pp, virtual, m = json.loads(sys.argv[1])
schedule = {"pp_schedule": "interleaved-1f1b", "pp_virtual_stages": virtual} if virtual > 1 else {}
case = Scenario(
    model=model_preset(model),
    cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=gpus, gpus_per_node=8),
    training=TrainingSpec(micro_batch_size=1, sequence_length=seq, grad_accum_steps=m, precision="bf16-mixed",
                          checkpointing="full"),
    strategy=Strategy(name=name, engine=engine, shard_group=group, tp=tp, pp=pp, **schedule),
)
figures = {}
for what, call in (("memory", estimate_memory), ("time", estimate_time)):
    times = []
    for _ in range(5):
        start = time.perf_counter()
        call(case)
        times.append(time.perf_counter() - start)
    figures[what] = (times[0], statistics.median(times[1:]))
print(json.dumps(figures))
"""


def main() -> int:
    with open("/proc/loadavg") as file:
        print(f"load average at start: {file.read().split()[0]}")
    print("ms per call: first (cold caches) / median of 4 more (warm)\n")
    print(f"{'case':<42} {'memory first':>12} {'warm':>8} {'time first':>11} {'warm':>8}")
    for name, case in CASES.items():
        out = subprocess.run(
            [sys.executable, "-c", ONE_CASE, json.dumps(case)], capture_output=True, text=True, check=True
        )
        figures = json.loads(out.stdout)
        (memory_first, memory_warm), (time_first, time_warm) = figures["memory"], figures["time"]
        print(
            f"{name:<42} {memory_first * 1e3:12.1f} {memory_warm * 1e3:8.1f} "
            f"{time_first * 1e3:11.1f} {time_warm * 1e3:8.1f}"
        )
    with open("/proc/loadavg") as file:
        print(f"\nload average at end: {file.read().split()[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
