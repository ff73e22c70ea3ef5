"""Step time split by phase (forward with the loss, backward with its communication, optimizer step with its
communication), measured on two local gloo ranks against the time model's timeline on one profile.

Usage: python benchmarks/bench_time_phases.py [--profile profile.toml] [--cases tiny-gpt2:ddp:teaching,...]
Without --profile it calibrates first. Measured = the slowest rank's median over the steps after the first two (a
barrier before each step); predicted = the timeline's spans: forward until the first backward span, backward until
the optimizer step, the rest. Shows which phase bench_time.py's errors come from.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from bench_time import ENGINES, MICRO_BATCH, PRECISION, SEQ_LEN, scenario_for
from shardscope.core.timeline import estimate_time
from shardscope.presets.profile_toml import load_profile
from shardscope.procs.functions import run_function
from shardscope.reference_models import build_model
from shardscope.runtime.config import RunConfig
from shardscope.runtime.steps import make_trainer, model_dtype, rank_batch

DEFAULT_CASES = "tiny-gpt2:ddp:teaching,tiny-gpt2:ddp:pytorch,tiny-gpt2:zero1:teaching,tiny-gpt2:zero2:teaching"
STEPS = 22


def rank_phases(rank: int, world: int, port: int, options: dict[str, Any]) -> dict[str, Any]:
    """One rank: train STEPS steps, time each phase; medians after the first two steps."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    config = RunConfig.from_options(
        model=options["model"],
        strategy=options["strategy"],
        engine=options["engine"],
        world_size=world,
        steps=STEPS,
        precision=PRECISION,
        micro_batch_size=MICRO_BATCH,
        sequence_length=SEQ_LEN,
    )
    module = build_model(config.model_spec, config.training, dtype=model_dtype(config), seed=rank)
    trainer = make_trainer(config, module)
    rows = []
    for step in range(STEPS):
        inputs, targets = rank_batch(config, step, rank, "cpu")
        dist.barrier()
        start = time.perf_counter()
        loss = trainer.loss(inputs, targets)
        forward_end = time.perf_counter()
        trainer.backward(loss)
        backward_end = time.perf_counter()
        trainer.step()
        rows.append((forward_end - start, backward_end - forward_end, time.perf_counter() - backward_end))
    dist.destroy_process_group()
    return {"medians": [statistics.median(column) for column in zip(*rows[2:], strict=True)]}


def predicted_phases(model: str, strategy: str, engine: str, profile: Any) -> list[float]:
    estimate = estimate_time(scenario_for(model, strategy, dict(ENGINES)[engine]), profile)
    schedule = estimate.schedule
    backward_start = min(start for _, _, category, start, _, _ in schedule if category in ("backward", "recompute"))
    optimizer_start = min(start for _, _, category, start, _, _ in schedule if category == "optimizer")
    return [backward_start, optimizer_start - backward_start, estimate.step_time_s - optimizer_start]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="hardware profile; without it, calibrate first")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="model:strategy:engine, comma-separated")
    args = parser.parse_args()
    if args.profile:
        profile = load_profile(args.profile)
    else:
        from shardscope.calibrate import calibrate

        profile = calibrate(world_size=2).profile
    header = f"{'case':<28} {'phase':<9} {'predicted ms':>12} {'measured ms':>11} {'error':>7}"
    print(f"{header}\n{'-' * len(header)}")
    for case in args.cases.split(","):
        model, strategy, engine = case.split(":")
        options = {"model": model, "strategy": strategy, "engine": engine}
        reports = run_function(rank_phases, 2, options, timeout_s=300)
        measured = [max(report["medians"][phase] for report in reports.values()) for phase in range(3)]
        predicted = predicted_phases(model, strategy, engine, profile)
        for name, guess, truth in zip(("forward", "backward", "step"), predicted, measured, strict=True):
            print(f"{case:<28} {name:<9} {guess * 1e3:12.2f} {truth * 1e3:11.2f} {guess / truth - 1:+7.0%}")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
