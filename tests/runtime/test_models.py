"""The reference modules build exactly the tensors core.params predicts, and train."""

from __future__ import annotations

import pytest
import torch

from shardscope.core.params import count_parameters, param_layout
from shardscope.presets import model_preset, model_preset_names
from shardscope.reference_models import build_model, lm_loss, sample_batch
from shardscope.specs import TrainingSpec

SHAPED = [name for name in model_preset_names() if model_preset(name).has_shape]


@pytest.mark.parametrize("name", SHAPED)
def test_layout_matches_core_on_meta(name: str) -> None:
    spec = model_preset(name)
    model = build_model(spec, device="meta")
    built = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    expected = [(t.name, t.shape) for t in param_layout(spec).tensors()]
    assert built == expected
    assert sum(p.numel() for p in model.parameters()) == count_parameters(spec)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-moe"])
@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_attention_kinds_and_checkpointing_agree(name: str, checkpointing: str) -> None:
    spec = model_preset(name)
    grads = {}
    for attention in ("eager", "sdpa"):
        training = TrainingSpec(
            sequence_length=16, micro_batch_size=2, precision="fp64", attention=attention, checkpointing=checkpointing
        )
        model = build_model(spec, training, dtype=torch.float64, seed=3)
        inputs, targets = sample_batch(spec, training, num_sequences=2)
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        grads[attention] = torch.cat([p.grad.flatten() for p in model.parameters()])
        assert loss.dtype == torch.float64 and torch.isfinite(loss)
    assert torch.allclose(grads["eager"], grads["sdpa"], atol=1e-12, rtol=0)


def test_tied_head_shares_the_embedding() -> None:
    model = build_model(model_preset("tiny-gpt2"))
    assert model.lm_head.weight is model.embed_tokens.weight


def test_seeds_differ_and_batches_are_deterministic() -> None:
    spec = model_preset("tiny-llama")
    a, b = build_model(spec, seed=0), build_model(spec, seed=1)
    assert not torch.equal(a.layers[0].attn.q_proj.weight, b.layers[0].attn.q_proj.weight)
    training = TrainingSpec(sequence_length=8)
    first, second = sample_batch(spec, training, num_sequences=4), sample_batch(spec, training, num_sequences=4)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1][:, :-1], first[0][:, 1:])


def test_gpt2_sequence_longer_than_positions_is_refused() -> None:
    with pytest.raises(ValueError, match="max_positions"):
        sample_batch(model_preset("tiny-gpt2"), TrainingSpec(sequence_length=65), num_sequences=1)
