"""Speed of the core: scenario evaluations per second, and the wall time of a cold `shardscope estimate`.

Goals (issue 2): at least 100,000 evaluations per second for one model and strategy in one process, and a cold
`shardscope estimate --model llama-3-70b --gpus 64 --strategy all` under 0.3 s without importing torch.
Run: .venv/bin/python benchmarks/bench_core.py
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import replace

from shardscope.core.memory import estimate_memory
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec

REPEATS = 5
COLD_RUNS = 7


def evaluations_per_second(strategy: str, engine: str) -> float:
    """Evaluate scenarios that differ in micro-batch (so results are not one cached object) for about a second."""
    base = Scenario(
        model=model_preset("llama-3-70b"),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=64),
        training=TrainingSpec(sequence_length=4096),
        strategy=Strategy(name=strategy, engine=engine),
    )
    scenarios = [replace(base, training=replace(base.training, micro_batch_size=m)) for m in range(1, 9)]
    for scenario in scenarios:  # warm the per-model caches, as a planner or a long-lived process would have them
        estimate_memory(scenario)
    rates = []
    for _ in range(REPEATS):
        count, start = 0, time.process_time()
        while time.process_time() - start < 0.2:
            for scenario in scenarios:
                estimate_memory(scenario)
            count += len(scenarios)
        rates.append(count / (time.process_time() - start))
    return statistics.median(rates)


def cold_estimate_seconds() -> tuple[float, bool]:
    """Median wall time of a fresh process running the estimate; and whether torch stayed unimported."""
    code = (
        "import sys, runpy; sys.argv = ['shardscope', 'estimate', '--model', 'llama-3-70b', '--gpus', '64', "
        "'--strategy', 'all']; import shardscope.cli as c; rc = c.main(sys.argv[1:]); "
        "sys.stderr.write('TORCH' if 'torch' in sys.modules else 'NOTORCH')"
    )
    times, torch_free = [], True
    for _ in range(COLD_RUNS):
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        times.append(time.perf_counter() - start)
        torch_free &= result.stderr.endswith("NOTORCH")
    return statistics.median(times), torch_free


def main() -> None:
    # CPU time of this process, so other work on a shared machine does not count against the core.
    print("scenario evaluations per CPU-second (llama-3-70b, 64 ranks, median of 5 runs of 0.2 s)")
    print(f"{'strategy':<10}{'engine':<11}{'evaluations/s':>15}")
    for engine in ("paper", "pytorch", "deepspeed"):
        for strategy in ("ddp", "zero1", "zero3"):
            print(f"{strategy:<10}{engine:<11}{evaluations_per_second(strategy, engine):>15,.0f}")
    seconds, torch_free = cold_estimate_seconds()
    print(
        f"\ncold `shardscope estimate --model llama-3-70b --gpus 64 --strategy all`: median {seconds:.3f} s over "
        f"{COLD_RUNS} runs, torch imported: {'no' if torch_free else 'YES'}"
    )


if __name__ == "__main__":
    main()
