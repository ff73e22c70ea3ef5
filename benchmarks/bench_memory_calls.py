"""Cost of one memory estimate as the planner asks it: every scenario a plan's search builds (`make_scenario`) and
estimates (`estimate_memory`), recorded from a real plan, then both calls repeated over those scenarios in one
process (the caches warm, as late in a search). Prints the median seconds per call of each.

Run: .venv/bin/python benchmarks/bench_memory_calls.py [--question 405b-16k] [--repeats 5]
Before/after a change, alternate the old tree (`git archive main src | tar -x -C /tmp/old`, PYTHONPATH=/tmp/old/src)
and the new one in one sitting: the machine is shared, so only figures taken side by side compare.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench_plan import QUESTIONS
from shardscope.cli import build_parser
from shardscope.cli.plan import request_from_args
from shardscope.core.memory import estimate_memory
from shardscope.planner import evaluator, plan, search


def recorded_calls(question: str) -> tuple[list[tuple[Any, ...]], list[Any]]:
    """The arguments of every `make_scenario` and the scenario of every `estimate_memory` one plan makes."""
    made: list[tuple[Any, ...]] = []
    estimated: list[Any] = []
    real_make, real_estimate = search.make_scenario, evaluator.estimate_memory

    def make(*args: Any) -> Any:
        made.append(args)
        return real_make(*args)

    def estimate(scenario: Any, rank: int | None = None) -> Any:
        estimated.append(scenario)
        return real_estimate(scenario, rank)

    search.make_scenario, evaluator.estimate_memory = make, estimate  # type: ignore[assignment]
    try:
        plan(request_from_args(build_parser().parse_args(["plan", *QUESTIONS[question]])))
    finally:
        search.make_scenario, evaluator.estimate_memory = real_make, real_estimate  # type: ignore[assignment]
    return made, estimated


def per_call_s(calls: list[Any], run: Any, repeats: int) -> float:
    """The median over `repeats` passes of one pass's seconds divided by its calls."""
    passes = []
    for _ in range(repeats):
        start = time.perf_counter()
        for call in calls:
            run(call)
        passes.append((time.perf_counter() - start) / len(calls))
    return statistics.median(passes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", action="append", choices=sorted(QUESTIONS))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'question':<12} {'calls':>7} {'make_scenario us':>17} {'estimate_memory us':>19}")
    for question in args.question or ["405b-16k"]:
        made, estimated = recorded_calls(question)
        make_s = per_call_s(made, lambda call: search.make_scenario(*call), args.repeats)
        estimate_s = per_call_s(estimated, estimate_memory, args.repeats)
        print(f"{question:<12} {len(estimated):>7} {make_s * 1e6:>17.1f} {estimate_s * 1e6:>19.1f}")


if __name__ == "__main__":
    main()
