"""Reports written once per session: a comparison of strategies and a plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardscope.planner import PlanRequest, PlanResult, plan
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec


def comparison_scenarios() -> list[Scenario]:
    """llama-3-8b on 16 H100s (two nodes), 4096 tokens: every strategy, hsdp inside a node."""
    cluster = ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=16)
    training = TrainingSpec(sequence_length=4096, grad_accum_steps=2)
    names = [("ddp", 0), ("zero1", 0), ("zero2", 0), ("zero3", 0), ("hsdp", 8)]
    return [
        Scenario(
            model=model_preset("llama-3-8b"),
            cluster=cluster,
            training=training,
            strategy=Strategy(name=name, shard_group=group),
        )
        for name, group in names
    ]


@pytest.fixture(scope="session")
def comparison_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from shardscope.report import write_report

    folder = tmp_path_factory.mktemp("comparison")
    page = write_report(comparison_scenarios(), folder / "report.html", png_dir=folder / "png")
    return page, folder / "png"


@pytest.fixture(scope="session")
def planned() -> PlanResult:
    """llama-3-70b on up to 256 H100s, 1M tokens a step: the best plan shards over tp 2 (its siblings keep it), with
    2 micro-batches a step; ddp, zero1, zero2 and hsdp do not fit. (A 4M-token batch, 8 micro-batches, made the same
    page three times slower to draw: its timeline and allocator replay grow with the micro-batches.)"""
    request = PlanRequest(
        model=model_preset("llama-3-70b"),
        gpu=gpu_preset("h100-80gb"),
        training=TrainingSpec(sequence_length=4096),
        global_batch_tokens=1_000_000,
        max_gpus=256,
    )
    return plan(request)


@pytest.fixture(scope="session")
def plan_report(tmp_path_factory: pytest.TempPathFactory, planned: PlanResult) -> Path:
    from shardscope.report import write_report

    return write_report(planned, tmp_path_factory.mktemp("plan") / "plan.html")
