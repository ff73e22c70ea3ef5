"""What the teaching tensor and context parallelism keep on each rank, checked without launching ranks."""

from __future__ import annotations

import pytest
import torch

from shardscope.core.params import param_layout
from shardscope.presets import model_preset
from shardscope.reference_models import build_model
from shardscope.ring_attention import zigzag_positions
from shardscope.runtime.teaching.tensor_parallel import check_divisible, shard_dim, shard_of, whole_of


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_chunks_cover_the_sequence_once_and_give_every_rank_the_same_causal_work(cp: int) -> None:
    # The Llama 3 Herd of Models, Section 3.3.2: 2 x cp chunks, rank i holding chunks i and 2cp-1-i
    seq_len = 8 * cp
    held = [zigzag_positions(seq_len, cp, rank) for rank in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq_len))
    visible_keys = [int((positions + 1).sum()) for positions in held]  # a query at position p sees p + 1 keys
    assert len(set(visible_keys)) == 1
    for mine in range(cp):  # every other rank's block is half seen, half hidden (context_parallel._hidden_keys)
        for theirs in set(range(cp)) - {mine}:
            seen = held[theirs][None, :] <= held[mine][:, None]
            assert 2 * int(seen.sum()) == seen.numel()
    with pytest.raises(ValueError, match=r"2 x cp\(3\) must divide the sequence length\(8\)"):
        zigzag_positions(8, 3, 0)


@pytest.mark.parametrize(
    ("model", "tp"), [("tiny-llama", 2), ("tiny-gpt2", 2), ("tiny-gpt2", 4)]
)  # tp divides the KV heads
def test_tp_pieces_put_back_together_are_the_parameter_and_have_the_shapes_the_core_predicts(
    model: str, tp: int
) -> None:
    reference = build_model(model_preset(model), dtype=torch.float64)
    predicted = {t.name: t.shape for t in param_layout(model_preset(model), tp).tensors()}  # DTensor's plan
    for name, whole in reference.named_parameters():
        pieces = [shard_of(name, whole, rank, tp) for rank in range(tp)]
        assert torch.equal(whole_of(name, pieces), whole), name
        assert all(piece.shape == predicted[name] for piece in pieces), name
        if shard_dim(name) is None:
            assert all(piece is whole for piece in pieces), name
            replicated = ("norm.weight", "norm.bias", "ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias")
            assert name.endswith((*replicated, "c_proj.bias", "embed_positions.weight")), name
            continue
        assert all(piece.numel() * tp == whole.numel() for piece in pieces), name
    if model == "tiny-gpt2":  # the fused c_attn: rank r's rows are its heads' rows of q, then of k, then of v
        whole = reference.layers[0].attn.c_attn.weight
        hidden = whole.shape[1]
        first = shard_of("layers.0.attn.c_attn.weight", whole, 0, tp)
        width = hidden // tp
        for index in range(3):
            assert torch.equal(
                first[index * width : (index + 1) * width], whole[index * hidden : index * hidden + width]
            )


def test_a_tp_degree_that_does_not_divide_the_heads_is_refused_naming_the_values() -> None:
    with pytest.raises(ValueError, match=r"tp\(3\) must divide num_heads\(4\) of tiny-llama"):
        check_divisible(build_model(model_preset("tiny-llama"), seed=None, device="meta"), 3)
