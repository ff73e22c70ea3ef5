"""The fast step time agrees with the full simulation, and each failure mode appears where its numbers say so."""

from __future__ import annotations

import dataclasses

import pytest

from shardscope.core.memory import estimate_memory
from shardscope.core.timeline import estimate_time
from shardscope.planner import PlanRequest, plan_timing
from shardscope.planner.failure import diagnose
from shardscope.presets import gpu_preset, model_preset
from shardscope.presets.hardware import default_profile, interconnect_preset
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec


def _scenario(
    strategy: str,
    gpus: int = 16,
    accum: int = 1,
    checkpointing: str = "full",
    offload: str = "none",
    model: str = "llama-3-8b",
    micro_batch: int = 1,
    seq: int = 4096,
) -> Scenario:
    return Scenario(
        model=model_preset(model),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=gpus),
        training=TrainingSpec(
            micro_batch_size=micro_batch, sequence_length=seq, grad_accum_steps=accum, checkpointing=checkpointing
        ),
        strategy=Strategy(name=strategy, offload=offload, shard_group=8 if strategy == "hsdp" else 0),
    )


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "hsdp"])
def test_extended_step_time_matches_the_full_simulation(strategy: str) -> None:
    scenario = _scenario(strategy, accum=7, model="llama-2-7b")
    hardware = default_profile(scenario.cluster.gpu)
    fast = plan_timing(scenario, hardware)
    full = estimate_time(scenario, hardware)
    assert fast.simulated_micro_batches == 2
    assert fast.step_time_s == pytest.approx(full.step_time_s, rel=0.01)
    assert fast.compute_time_s == pytest.approx(full.compute_time_s, rel=1e-6)
    assert fast.wire_bytes_per_rank == pytest.approx(full.wire_bytes_per_rank, rel=1e-6)
    assert fast.tokens_per_s == pytest.approx(full.tokens_per_s, rel=0.01)


def _kinds(scenario: Scenario, request_changes: dict[str, object] | None = None) -> list[str]:
    hardware = default_profile(scenario.cluster.gpu)
    request = PlanRequest(
        model=scenario.model,
        gpu=scenario.cluster.gpu,
        training=TrainingSpec(sequence_length=4096),
        global_batch_tokens=4096 * 64,
    )
    if request_changes:
        request = dataclasses.replace(request, **request_changes)  # type: ignore[arg-type]
    risks = diagnose(
        scenario,
        estimate_memory(scenario),
        plan_timing(scenario, hardware),
        request,
        estimate_memory,
        lambda other: plan_timing(other, hardware),
    )
    return [risk.kind for risk in risks]


def test_activations_dominate_without_checkpointing() -> None:
    kinds = _kinds(_scenario("zero3", gpus=64, checkpointing="none", micro_batch=1))
    assert kinds[0] == "activations-dominate"


def test_zero3_across_nodes_on_a_slow_network_points_to_hsdp() -> None:
    scenario = _scenario("zero3", gpus=64, seq=1024)
    slow = dataclasses.replace(default_profile(scenario.cluster.gpu), inter_node=interconnect_preset("ethernet-100g"))
    risks = diagnose(
        scenario,
        estimate_memory(scenario),
        plan_timing(scenario, slow),
        PlanRequest(
            model=scenario.model,
            gpu=scenario.cluster.gpu,
            training=TrainingSpec(sequence_length=1024),
            global_batch_tokens=65536,
        ),
        estimate_memory,
        lambda other: plan_timing(other, slow),
    )
    assert risks[0].kind == "zero3-cross-node"
    assert "hsdp with shard group 8" in risks[0].message


def test_zero1_uneven_shard_on_many_ranks() -> None:
    # llama-3-8b has 291 tensors: on 256 ranks whole-tensor assignment is far from even.
    assert "zero1-uneven-shard" in _kinds(_scenario("zero1", gpus=256))


def test_offload_reports_host_memory() -> None:
    kinds = _kinds(_scenario("zero3", offload="optimizer+params"), {"host_memory_bytes": 64 * 2**30})
    assert kinds[0] == "offload-host"


def test_logits_spike_with_a_large_vocabulary() -> None:
    # llama-3's 128k vocabulary at micro-batch 8: the fp32 logits are gigabytes at the loss.
    assert "logits-spike" in _kinds(_scenario("zero3", gpus=64, micro_batch=8))


def test_compute_bound_when_nothing_is_close() -> None:
    assert _kinds(_scenario("zero3", gpus=8, model="tiny-llama", seq=256)) == ["compute-bound"]
