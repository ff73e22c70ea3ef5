"""`shardscope demo` (what `make demo` runs): an estimate of a built-in default scenario."""

from __future__ import annotations

import argparse
from typing import Any

from shardscope.cli.estimate import render_estimates
from shardscope.core.memory import estimate_memory
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec

DEFAULT_MODEL = "llama-3-8b"
DEFAULT_GPU = "h100-80gb"


def add_parser(subparsers: Any) -> None:
    """Attach `demo` to the CLI."""
    subparsers.add_parser(
        "demo",
        help="the main job on a built-in scenario (what `make demo` runs)",
        description=f"Estimate {DEFAULT_MODEL} on 8 x {DEFAULT_GPU} under every strategy.",
    )


def default_scenarios() -> list[Scenario]:
    """llama-3-8b, 8 x H100 80GB, bf16-mixed AdamW, 4096-token sequences: every strategy under torch's engines."""
    cluster = ClusterSpec(gpu=gpu_preset(DEFAULT_GPU), world_size=8, gpus_per_node=8)
    training = TrainingSpec(micro_batch_size=1, sequence_length=4096, checkpointing="none")
    return [
        Scenario(model=model_preset(DEFAULT_MODEL), cluster=cluster, training=training, strategy=Strategy(name=name))
        for name in ("ddp", "zero1", "zero2", "zero3")
    ]


def run(args: argparse.Namespace) -> int:
    """Print the default estimate."""
    estimates = [estimate_memory(scenario) for scenario in default_scenarios()]
    print("shardscope demo: predicted per-rank memory (shardscope estimate, torch not imported)\n")
    print(render_estimates(estimates, "GiB"))
    return 0
