"""How much calibrate's noise moves the time model's predictions: calibrate this machine several times in a row and
print the spread of each profile term and of the predicted step times of bench_time.py's rows.

Usage: python benchmarks/bench_calibrate_spread.py [--calibrations 5] [--models tiny-gpt2,tiny-llama]
No training runs: each calibration takes about 20 s. For every term it also prints its share of the prediction noise:
the spread of the predicted step times when only that term takes each calibration's value and every other term
keeps its median (a collective op's term is its call latency and bandwidth together, chosen by the op's price at
256 KiB, the payload size of the tiny presets' units). Spreads are (max - min) / median over the calibrations.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

from bench_time import ENGINES, STRATEGIES, load_average, scenario_for
from shardscope.calibrate import calibrate
from shardscope.calibrate.collectives import _op_seconds
from shardscope.core.timeline import estimate_time
from shardscope.presets.hardware import HOST_FIELDS, HardwareProfile, OpCost
from shardscope.specs import Scenario

# the scalar terms calibrate measures, of the profile and of its host extension; the ops and the llama family's
# per-op costs are handled apart
PROFILE_TERMS = (
    "matmul_flops_per_s",
    "kernel_overhead_s",
    "backward_op_overhead_s",
    "optimizer_tensor_overhead_s",
    "memory_bandwidth_bytes_per_s",
    "ddp_step_overhead_s",
    "fsdp_unit_overhead_s",
)
ALL_TERMS = (*PROFILE_TERMS, *HOST_FIELDS)


def _term(profile: HardwareProfile, term: str) -> float:
    """A scalar term of the profile or of its host extension."""
    return float(getattr(profile.host_terms if term in HOST_FIELDS else profile, term))


def _with_terms(profile: HardwareProfile, terms: dict[str, float]) -> HardwareProfile:
    """The profile with these scalar terms replaced, wherever each lives."""
    host = {term: value for term, value in terms.items() if term in HOST_FIELDS}
    rest = {term: value for term, value in terms.items() if term not in HOST_FIELDS}
    return dataclasses.replace(profile, host_overheads=dataclasses.replace(profile.host_terms, **host), **rest)


PROBE_BYTES = 256 * 1024


def spread(values: list[float]) -> float:
    """(max - min) / median; 0 where the median is 0."""
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle else 0.0


def _median_op(profiles: list[HardwareProfile], op: str) -> OpCost:
    costs = [cost for profile in profiles for cost in profile.op_costs if cost.op == op]
    ranked = sorted(costs, key=lambda cost: _op_seconds(cost, PROBE_BYTES, 2))
    return ranked[len(ranked) // 2]


def _with_op(profile: HardwareProfile, cost: OpCost) -> HardwareProfile:
    return dataclasses.replace(profile, op_costs=tuple(cost if c.op == cost.op else c for c in profile.op_costs))


def median_profile(profiles: list[HardwareProfile]) -> HardwareProfile:
    """Every scalar term at its median, every op at its median price, the llama costs of the median calibration."""
    scalars = {term: statistics.median(_term(p, term) for p in profiles) for term in ALL_TERMS}
    base = _with_terms(profiles[len(profiles) // 2], scalars)
    for cost in base.op_costs:
        base = _with_op(base, _median_op(profiles, cost.op))
    return base


def variants(profiles: list[HardwareProfile], base: HardwareProfile) -> dict[str, list[HardwareProfile]]:
    """Per term, the median profile with only that term taken from each calibration in turn."""
    by_term = {term: [_with_terms(base, {term: _term(p, term)}) for p in profiles] for term in ALL_TERMS}
    for cost in base.op_costs:
        by_term[f"network.ops.{cost.op}"] = [_with_op(base, p.op_cost(cost.op) or cost) for p in profiles]
    by_term["compute.families"] = [
        dataclasses.replace(
            base, host_overheads=dataclasses.replace(base.host_terms, family_op_costs=p.host_terms.family_op_costs)
        )
        for p in profiles
    ]
    return by_term


def row_spreads(scenarios: dict[str, Scenario], profiles: list[HardwareProfile]) -> dict[str, float]:
    return {
        name: spread([estimate_time(scenario, profile).step_time_s for profile in profiles])
        for name, scenario in scenarios.items()
    }


def term_values(profiles: list[HardwareProfile], term: str) -> tuple[str, list[float]]:
    """A term's label and its value in each calibration (an op by its price at PROBE_BYTES)."""
    if term.startswith("network.ops."):
        op = term.rsplit(".", 1)[1]
        return f"{term} @256K s", [_op_seconds(cost, PROBE_BYTES, 2) for p in profiles if (cost := p.op_cost(op))]
    if term == "compute.families":
        return "llama forward op s", [p.op_overheads("llama")[0] for p in profiles]
    return term, [_term(p, term) for p in profiles]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibrations", type=int, default=5)
    parser.add_argument("--models", default="tiny-gpt2,tiny-llama")
    args = parser.parse_args()
    if args.calibrations < 2:
        print("error: --calibrations must be 2 or more", file=sys.stderr)
        return 2
    started = time.monotonic()
    print(f"load average at start: {load_average()}", flush=True)
    profiles = []
    for index in range(args.calibrations):
        profiles.append(calibrate(world_size=2).profile)
        print(f"calibration {index + 1} of {args.calibrations} done", flush=True)
    scenarios = {
        f"{model} {strategy} {name}": scenario_for(model, strategy, engine)
        for model in args.models.split(",")
        for strategy in STRATEGIES
        for name, engine in ENGINES
    }
    base = median_profile(profiles)
    print(f"\n{'term':<34} {'median':>12} {'spread':>7}  {'prediction spread (mean, max over rows)':>40}")
    shares = {term: row_spreads(scenarios, changed) for term, changed in variants(profiles, base).items()}
    for term, rows in sorted(shares.items(), key=lambda item: -statistics.fmean(item[1].values())):
        label, values = term_values(profiles, term)
        print(
            f"{label:<34} {statistics.median(values):12.4g} {spread(values):7.0%}  "
            f"{statistics.fmean(rows.values()):33.0%} {max(rows.values()):6.0%}"
        )
    print(f"\n{'row':<28} {'predicted ms (median)':>21} {'spread':>7}")
    for name, scenario in scenarios.items():
        predictions = [estimate_time(scenario, profile).step_time_s for profile in profiles]
        print(f"{name:<28} {statistics.median(predictions) * 1e3:21.2f} {spread(predictions):7.0%}")
    print(f"\nload average at end: {load_average()}")
    print(f"wall time {(time.monotonic() - started) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
