"""FLOPs per stage and the compute model."""

from __future__ import annotations

from dataclasses import replace

import pytest
from timecases import scenario

from shardscope.core.compute import ComputeModel, hardware_flops_per_step, model_flops_per_step, stage_flops
from shardscope.presets import model_preset
from shardscope.specs import SpecError


@pytest.mark.parametrize("model", ["gpt2", "gpt2-xl"])
def test_megatron_flops_per_iteration(model: str) -> None:
    # "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Section 5.1: with full
    # recomputation a GPT step costs 96 B s l h^2 (1 + s / 6h + V / 16 l h) FLOPs. Exact for an MLP of 4h.
    case = scenario(model=model, checkpointing="full", sequence_length=1024)
    spec = case.model
    b, s, layers, h, v = 1, 1024, spec.num_layers, spec.hidden_size, spec.vocab_size
    expected = 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    assert hardware_flops_per_step(case) == pytest.approx(expected, rel=1e-12)
    # Without recomputation (what MFU counts) it is 72 B s l h^2 (1 + s / 6h + V / 12 l h) ("Reducing Activation
    # Recomputation in Large Transformer Models", Section 6).
    expected_model = 72 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (12 * layers * h))
    assert model_flops_per_step(case) == pytest.approx(expected_model, rel=1e-12)


def test_six_n_per_token_for_a_large_model() -> None:
    # Kaplan et al., "Scaling Laws for Neural Language Models": training costs about 6 N FLOPs per token when the
    # context term is small; embeddings excluded, head included.
    case = scenario(model="llama-2-70b", sequence_length=512)
    non_embedding = 69_000_000_000
    assert model_flops_per_step(case) / 512 == pytest.approx(6 * non_embedding, rel=0.03)


def test_moe_counts_only_the_routed_experts() -> None:
    model = model_preset("mixtral-8x7b")
    stages = stage_flops(model, scenario(model="mixtral-8x7b").training)
    dense = stage_flops(model_preset("mistral-7b"), scenario(model="mistral-7b").training)
    # two of eight experts: the MLP costs twice a dense one (plus the router)
    assert stages[1].forward_flops > dense[1].forward_flops
    assert stages[1].forward_flops < 2 * dense[1].forward_flops


def test_selective_recompute_is_the_attention_core_only() -> None:
    stages = stage_flops(model_preset("gpt2"), scenario(model="gpt2", checkpointing="selective").training)
    assert stages[1].recompute_flops == 4 * 2048 * 2048 * 768
    assert stages[0].recompute_flops == stages[-1].recompute_flops == 0


def test_op_policy_recomputes_the_unsaved_matmuls() -> None:
    # torchtitan's op policy saves llama's 1st, 3rd, 5th and 7th mm (q, v, gate, down) and recomputes k, o and up;
    # gpt2's linears have biases and run as addmm, which it always saves.
    training = scenario(model="llama-3-8b", checkpointing="op", sequence_length=2048).training
    spec = model_preset("llama-3-8b")
    hidden, kv, ffn = spec.hidden_size, spec.num_kv_heads * spec.head_dim, spec.ffn_hidden_size
    recomputed = 2 * 2048 * (hidden * kv + hidden * hidden + hidden * ffn)
    assert stage_flops(spec, training)[1].recompute_flops == recomputed
    assert stage_flops(model_preset("gpt2"), replace(training, checkpointing="op"))[1].recompute_flops == 0


def test_every_n_recomputes_the_n_th_blocks_whole() -> None:
    # torchtitan's layer AC counts blocks from 1 and checkpoints those it counts at a multiple of N.
    spec = model_preset("gpt2")
    every = stage_flops(spec, scenario(model="gpt2", checkpointing="every:3").training)[1:-1]
    full = stage_flops(spec, scenario(model="gpt2", checkpointing="full").training)[1:-1]
    assert [stage.recompute_flops > 0 for stage in every] == [index % 3 == 2 for index in range(spec.num_layers)]
    assert every[2] == full[2]
    assert stage_flops(spec, scenario(model="gpt2", checkpointing="every:1").training) == stage_flops(
        spec, scenario(model="gpt2", checkpointing="full").training
    )


def test_compute_model_time_and_validation() -> None:
    model = ComputeModel(peak_flops_per_s=1e12, efficiency=0.5, kernel_overhead_s=1e-6)
    assert model.seconds(1e12, 10) == pytest.approx(2.0 + 1e-5)
    with pytest.raises(SpecError, match="efficiency"):
        ComputeModel(peak_flops_per_s=1e12, efficiency=1.5)
    with pytest.raises(SpecError, match="peak"):
        ComputeModel(peak_flops_per_s=0.0)
