"""Shared requests for the planner tests."""

from __future__ import annotations

import pytest

from shardscope.planner import PlanRequest
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import GpuSpec, TrainingSpec
from shardscope.units import GIB


@pytest.fixture(scope="session")
def big_request() -> PlanRequest:
    """The issue's question: llama-3-70b on H100s at 4096 tokens, a 4M-token batch, up to 1024 GPUs."""
    return PlanRequest(
        model=model_preset("llama-3-70b"),
        gpu=gpu_preset("h100-80gb"),
        training=TrainingSpec(sequence_length=4096),
        global_batch_tokens=4_000_000,
    )


@pytest.fixture(scope="session")
def small_request() -> PlanRequest:
    """A space small enough to search exhaustively: llama-3-8b on 40 GiB GPUs, up to 16 of them."""
    gpu = GpuSpec(id="a100-40gb-like", name="40 GiB GPU", memory_bytes=40 * GIB, peak_flops_per_s=(("bf16", 312e12),))
    return PlanRequest(
        model=model_preset("llama-3-8b"),
        gpu=gpu,
        training=TrainingSpec(sequence_length=2048),
        global_batch_tokens=128 * 2048,
        max_gpus=16,
        max_micro_batch=4,
        top=3,
    )
