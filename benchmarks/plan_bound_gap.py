"""How close the planner's bounds come to the steps it simulates, per family and offload: the search simulates every
plan whose bound it cannot rule out, so where a bound is loose, many plans get simulated (issue 20: ranking by cost
is slow because costs are nearly flat across GPU counts and only the bounds tell the plans apart).

For each plan one `bench_plan.py` question simulated, the ratio of its tight bound (compute bound plus the
communication floor, `planner/timing.py`; for a pipeline its ranks' floors) and of its cheap bound to its simulated
step; a ratio near 1 means the bound is tight. Prints one row per (family, offload): plans simulated, median and
lowest ratio of each bound.

Run: .venv/bin/python benchmarks/plan_bound_gap.py [--question cost]
It runs the search's memory pass and ranking (`planner.search._Search`) and reads their evaluator; plan() also ranks a
second time for its "why the model is split" lines, so it simulates a few more plans than counted here.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from bench_plan import QUESTIONS
from shardscope.cli import build_parser
from shardscope.cli.plan import request_from_args
from shardscope.planner.search import _Search
from shardscope.planner.shape_order import fitting_with_pipelines
from shardscope.planner.space import batch_shapes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", choices=list(QUESTIONS), default="cost")
    options = parser.parse_args(argv)
    request = request_from_args(build_parser().parse_args(["plan", *QUESTIONS[options.question]]))
    search = _Search(request, None)
    search.rank(fitting_with_pipelines(search, batch_shapes(request)))
    evaluator = search.evaluator
    ratios: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for scenario, timing in evaluator._timing.items():
        step = timing.step_time_s
        tight = evaluator.tight_bound_s(scenario) / step
        cheap = evaluator.lower_bound_s(scenario) / step
        ratios[(scenario.strategy.canonical_name, scenario.strategy.offload)].append((tight, cheap))
    print(f"question {options.question}: {sum(map(len, ratios.values()))} plans simulated")
    print(f"{'family':<12} {'offload':<17} {'plans':>5}  tight/step median (lowest)  cheap/step median (lowest)")
    for (family, offload), found in sorted(ratios.items()):
        tight, cheap = [pair[0] for pair in found], [pair[1] for pair in found]
        print(
            f"{family:<12} {offload:<17} {len(found):>5}  {statistics.median(tight):>10.3f} ({min(tight):.3f})"
            f"{'':>14}{statistics.median(cheap):>10.3f} ({min(cheap):.3f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
