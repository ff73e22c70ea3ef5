"""Mixed precision keeps the ZeRO paper's 2 + 2 + 12 bytes per parameter; checkpointing (every mode), eager attention
and MoE train to parity under zero3. One launch for all of them."""

from __future__ import annotations

import math

import pytest

from shardscope.core.params import param_layout
from shardscope.presets import model_preset
from shardscope.runtime import RunConfig, RunResult
from shared_launch import register

pytestmark = pytest.mark.distributed

CONFIGS = {
    "mixed-zero1": RunConfig.from_options(strategy="zero1", precision="bf16-mixed", steps=2, timeout_s=60),
    "mixed-zero3": RunConfig.from_options(strategy="zero3", precision="bf16-mixed", steps=2, timeout_s=60),
    "moe-full-eager": RunConfig.from_options(
        model="tiny-moe", strategy="zero3", checkpointing="full", attention="eager", steps=2, timeout_s=60
    ),
    "moe-eager": RunConfig.from_options(model="tiny-moe", strategy="zero3", attention="eager", steps=2, timeout_s=60),
    "llama-selective": RunConfig.from_options(
        model="tiny-llama", strategy="zero2", checkpointing="selective", steps=2, timeout_s=60
    ),
    "llama-op": RunConfig.from_options(model="tiny-llama", strategy="zero3", checkpointing="op", steps=2, timeout_s=60),
    "gpt2-every-2": RunConfig.from_options(strategy="zero3", checkpointing="every:2", steps=2, timeout_s=60),
    "torch-mixed-fsdp": RunConfig.from_options(
        strategy="zero3", engine="pytorch", precision="bf16-mixed", steps=2, timeout_s=60
    ),
}


register(__name__, CONFIGS)


@pytest.fixture(scope="module")
def results(shared_runs: dict[str, dict[str, RunResult]]) -> dict[str, RunResult]:
    """All of them, launched with the other modules' runs of their world size (shared_launch.py)."""
    return shared_runs[__name__]


def units(model: str) -> list[int]:
    layout = param_layout(model_preset(model))
    return [layout.root_numel] + [layout.block_numel] * layout.num_blocks


def test_mixed_precision_is_two_two_twelve(results: dict[str, RunResult]) -> None:
    numels = units("tiny-gpt2")
    padded = sum(math.ceil(n / 2) * 2 for n in numels)
    shard = sum(math.ceil(n / 2) for n in numels)
    zero1, zero3 = results["mixed-zero1"].per_rank[0], results["mixed-zero3"].per_rank[0]
    # 16-bit parameters and gradients; fp32 master, two fp32 moments, and a 4-byte step per flat shard
    assert (zero1.parameters_bytes, zero1.gradients_bytes) == (2 * padded, 2 * padded)
    assert zero1.optimizer_state_bytes == 12 * shard + 4 * len(numels)
    assert (zero3.parameters_bytes, zero3.gradients_bytes) == (2 * shard, 2 * shard)
    assert zero3.optimizer_state_bytes == 12 * shard + 4 * len(numels)
    for name in ("mixed-zero1", "mixed-zero3", "torch-mixed-fsdp"):
        assert results[name].parity.ok, results[name].parity  # against fp32 training: bf16 rounding only


@pytest.mark.parametrize("name", ["moe-full-eager", "llama-selective", "llama-op", "gpt2-every-2"])
def test_checkpointing_and_moe_keep_parity(results: dict[str, RunResult], name: str) -> None:
    assert results[name].parity.max_abs_diff <= 1e-10, results[name].parity


def test_full_checkpointing_keeps_fewer_activations(results: dict[str, RunResult]) -> None:
    kept = results["moe-full-eager"].per_rank[0].activations_bytes
    plain = results["moe-eager"].per_rank[0].activations_bytes
    print(f"moe activations: full checkpointing {kept} bytes, none {plain} bytes")
    assert 0 < kept < plain / 2
