"""Where a planner question's time goes: the seconds and calls of each costly part of the search, in one process.

The parts are the planner's evaluations (`planner.evaluator`'s imports, wrapped): the simulations (`plan_timing`),
the communication floors, the tensor-parallel floor, the memory estimates, the optimizer step's floor and the
compute bound's per-micro-batch pricing; what is left of plan() is the search itself. The wrapping adds a little to
each call, so the parts are for comparing with each other, not with `bench_plan.py`'s timings.
Run: .venv/bin/python benchmarks/plan_split.py [--question cost] (the questions of benchmarks/bench_plan.py)
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import shardscope.planner.evaluator as evaluator
from bench_plan import QUESTIONS
from shardscope.cli import build_parser
from shardscope.cli.plan import request_from_args
from shardscope.planner import plan

PARTS = (
    "plan_timing",
    "communication_floor",
    "tensor_parallel_floor_s",
    "estimate_memory",
    "optimizer_floor_s",
    "micro_batch_compute_s",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", choices=list(QUESTIONS), default="cost")
    question = QUESTIONS[parser.parse_args(argv).question]
    seconds: Counter[str] = Counter()
    calls: Counter[str] = Counter()

    def timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start
                calls[name] += 1

        return wrapper

    for name in PARTS:
        setattr(evaluator, name, timed(name, getattr(evaluator, name)))
    request = request_from_args(build_parser().parse_args(["plan", *question]))
    start = time.perf_counter()
    plan(request)
    total = time.perf_counter() - start
    print(f"plan() {total:.3f} s: shardscope plan {' '.join(question)}")
    for name, spent in seconds.most_common():
        print(f"  {name:<25} {spent:7.3f} s  {calls[name]:6d} calls  {spent / calls[name] * 1e3:6.2f} ms each")
    print(f"  {'the search itself':<25} {total - sum(seconds.values()):7.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
