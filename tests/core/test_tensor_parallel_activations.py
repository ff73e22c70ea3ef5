"""Activations and FLOPs of one rank under tensor, sequence and context parallelism, against hand-computed bytes."""

from __future__ import annotations

import pytest

from shardscope.core.activations import ActivationEstimate, estimate_activations
from shardscope.core.compute import compute_model, model_flops_per_step, rank_stage_flops, stage_flops
from shardscope.core.engines import rules_for
from shardscope.core.kernels import stage_seconds
from shardscope.core.rank_share import WHOLE, RankShare, rank_share, ring_attention_backward_bytes, sizes_of
from shardscope.presets import gpu_preset, model_preset
from shardscope.presets.hardware import default_profile
from shardscope.specs import ClusterSpec, ModelSpec, Overheads, Scenario, Strategy, TrainingSpec

NO_OVERHEAD = Overheads(context_bytes=0, allocator_headroom=0.0)

# The 22B GPT of "Reducing Activation Recomputation in Large Transformer Models" (Korthikanti et al. 2022), Table 3:
# a = 64 heads, h = 6144, s = 2048, t = 8; the vocabulary padded to 51,200 as Megatron-LM pads it.
MEGATRON_22B = ModelSpec(
    name="megatron-22b",
    family="gpt2",
    hidden_size=6144,
    num_layers=48,
    num_heads=64,
    num_kv_heads=64,
    head_dim=96,
    ffn_hidden_size=4 * 6144,
    vocab_size=51200,
    max_positions=2048,
    tie_embeddings=True,
    source="Reducing Activation Recomputation in Large Transformer Models, Table 3 (22B)",
)


def scenario(
    model: ModelSpec,
    engine: str,
    tp: int = 1,
    cp: int = 1,
    sequence_parallel: bool | None = None,
    **training: object,
) -> Scenario:
    return Scenario(
        model=model,
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=tp * cp, gpus_per_node=8),
        training=TrainingSpec(**training),  # type: ignore[arg-type]
        strategy=Strategy(name="fsdp", engine=engine, tp=tp, cp=cp, sequence_parallel=sequence_parallel),
        overheads=NO_OVERHEAD,
    )


def rank_activations(case: Scenario) -> ActivationEstimate:
    return rules_for(case).rank_memory(case, 0).activations


@pytest.mark.parametrize("checkpointing", ["none", "selective"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_paper_engine_reproduces_korthikanti_table_2(checkpointing: str, sequence_parallel: bool) -> None:
    # "Reducing Activation Recomputation in Large Transformer Models" (Korthikanti et al. 2022), Table 2, activation
    # bytes per transformer layer with 16-bit activations:
    #   tensor parallel:                              sbh(10 + 24/t + 5as/(ht))
    #   tensor + sequence parallel:                   sbh(34/t + 5as/(ht))
    #   tensor parallel + selective recomputation:    sbh(10 + 24/t)
    #   tensor + sequence parallel + selective:       sbh(34/t)
    # The 10sbh that tensor parallelism leaves whole are the two LayerNorms' inputs (4sbh), the inputs of the QKV
    # and first MLP linears (4sbh) and the two dropout masks (2sbh); sequence parallelism splits them t ways, and
    # Megatron-LM keeps the QKV and MLP inputs sequence-sharded, all-gathering them again in backward. shardscope's
    # models have no dropout, so, as in tests/core/test_memory.py's single-GPU form, the dropout terms come off:
    # the two 1-byte dropout masks (2sbh, split t ways only with sequence parallelism) and the attention dropout's
    # mask and output (3as^2b/t; selective recomputation has dropped them already). What the paper leaves out is
    # added: each LayerNorm's mean and 1/std per token (2 x 2 bytes x sb per norm, split t ways with sequence
    # parallelism).
    s, b, h, a, t = 2048, 2, 6144, 64, 8
    case = scenario(
        MEGATRON_22B,
        "paper",
        tp=t,
        sequence_parallel=sequence_parallel,
        sequence_length=s,
        micro_batch_size=b,
        attention="eager",
        checkpointing=checkpointing,
        precision="bf16-mixed",
    )
    selective = checkpointing == "selective"
    if sequence_parallel:
        table_2 = s * b * h * 34 // t + (0 if selective else 5 * a * s * s * b // t)
        dropout = 2 * s * b * h // t + (0 if selective else 3 * a * s * s * b // t)
        statistics = 2 * 2 * 2 * s * b // t
    else:
        table_2 = s * b * h * 10 + s * b * h * 24 // t + (0 if selective else 5 * a * s * s * b // t)
        dropout = 2 * s * b * h + (0 if selective else 3 * a * s * s * b // t)
        statistics = 2 * 2 * 2 * s * b
    assert rank_activations(case).stored_block_bytes == table_2 - dropout + statistics


def test_torch_saves_the_gathered_input_of_its_column_parallel_linears() -> None:
    # torch's DTensor ColwiseParallel saves its input for the weight gradient: under sequence parallelism that is
    # the all-gathered, whole-sequence norm output (sbh, 2 bytes), once for q/k/v and once for the MLP's first
    # linear, where Megatron-LM keeps 1/t of it.
    s, b, h, t = 2048, 1, 6144, 8
    common = dict(tp=t, sequence_parallel=True, sequence_length=s, micro_batch_size=b, attention="eager")
    torch_block = rank_activations(scenario(MEGATRON_22B, "pytorch", **common)).block_bytes  # type: ignore[arg-type]
    paper_block = rank_activations(scenario(MEGATRON_22B, "paper", **common)).block_bytes  # type: ignore[arg-type]
    assert torch_block - paper_block == 2 * (2 * s * b * h - 2 * s * b * h // t)


# llama-3-8b at one 2048-token sequence in bf16 on GPUs (the fused RMSNorm saves its input and 1/rms in fp32), with
# sdpa: one block saves two norms, the q/k/v input, q, k, v, the attention output and its log-sum-exp, the MLP input
# and SwiGLU's four tensors.
S, H, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 2048, 4096, 32, 8, 128, 14336, 128256


def llama_block(tokens: int, boundary: int, gathered: int, tp: int, rows: int) -> int:
    """Hand count: norms on `boundary` tokens, the linears' saved inputs on `gathered`, the rest on `tokens`."""
    norms = 2 * (boundary * H * 2 + boundary * 4)
    inputs = 2 * gathered * H * 2
    query = tokens * HEADS // tp * HEAD_DIM * 2
    kv = tokens * KV_HEADS // tp * HEAD_DIM * 2
    lse = HEADS // tp * rows * 4
    return norms + inputs + 2 * query + 2 * kv + lse + 4 * tokens * FFN // tp * 2


def llama(tp: int = 1, cp: int = 1, sequence_parallel: bool = False) -> ActivationEstimate:
    share = RankShare(tp=tp, cp=cp, sequence_parallel=sequence_parallel)
    training = TrainingSpec(sequence_length=S, precision="bf16-mixed")
    return estimate_activations(model_preset("llama-3-8b"), training, gpu_kernels=True, share=share)


def test_whole_share_changes_nothing() -> None:
    model, training = model_preset("llama-3-8b"), TrainingSpec(sequence_length=S)
    assert estimate_activations(model, training) == estimate_activations(model, training, share=WHOLE)
    assert llama().block_bytes == llama_block(S, S, S, 1, S) == 344_211_456
    whole = scenario(model, "pytorch", sequence_length=S)
    assert rank_share(whole, megatron=True) is WHOLE
    assert rank_stage_flops(whole) == stage_flops(model, training)


def test_llama_activations_fall_with_tp_sequence_parallel_and_cp() -> None:
    # tp 4 without sequence parallelism: heads and FFN split four ways, norms and linear inputs whole.
    assert llama(tp=4).block_bytes == llama_block(S, S, S, 4, S) == 136_396_800
    # With sequence parallelism the norms hold 512 tokens; torch's linears still save the 2048-token gathered input.
    assert llama(tp=4, sequence_parallel=True).block_bytes == llama_block(S, S // 4, S, 4, S) == 111_218_688
    # Megatron's regather keeps 1/4 of the linears' inputs too.
    regathered = estimate_activations(
        model_preset("llama-3-8b"),
        TrainingSpec(sequence_length=S, precision="bf16-mixed"),
        gpu_kernels=True,
        share=RankShare(tp=4, sequence_parallel=True, regathers_in_backward=True),
    )
    assert regathered.block_bytes == llama_block(S, S // 4, S // 4, 4, S) == 86_052_864
    # cp 2: every tensor holds 1024 tokens, the log-sum-exp 1024 rows.
    assert llama(cp=2).block_bytes == llama_block(S // 2, S // 2, S // 2, 1, S // 2) == llama().block_bytes // 2


def test_loss_parallel_splits_the_logits_and_the_boundary_gradient_follows_sequence_parallelism() -> None:
    whole, split = llama(), llama(tp=4, cp=2, sequence_parallel=True)
    assert whole.logits_bytes == S * VOCAB * 2
    assert split.logits_bytes == S // 2 * VOCAB // 4 * 2
    assert split.loss_backward_spike_bytes == 2 * (S // 2) * (VOCAB // 4) * 4
    assert split.hidden_bytes == S // 2 // 4 * H * 2  # the residual gradient between blocks: seq/cp/tp tokens
    # The head keeps the final norm (on 256 tokens), lm_head's gathered input (1024 tokens) and the log-softmax.
    assert split.head_bytes == (256 * H * 2 + 256 * 4) + 1024 * H * 2 + 1024 * VOCAB // 4 * 4


def test_ring_attention_saves_no_score_matrix_even_for_eager_attention() -> None:
    # Under context parallelism attention runs as ring attention (torch's context_parallel needs SDPA; the teaching
    # ring, ring_attention.py, saves q, k, v, the output and the log-sum-exp of its own tokens).
    model = model_preset("llama-3-8b")
    eager, sdpa = (TrainingSpec(sequence_length=S, attention=kind) for kind in ("eager", "sdpa"))
    share = RankShare(cp=2)
    assert estimate_activations(model, eager, share=share) == estimate_activations(model, sdpa, share=share)
    assert estimate_activations(model, eager).block_bytes > estimate_activations(model, sdpa).block_bytes


def test_ring_attention_holds_one_kv_pair_and_its_gradients() -> None:
    model, training = model_preset("llama-3-8b"), TrainingSpec(sequence_length=S)
    share = RankShare(cp=4)
    kv_chunk = S // 4 * KV_HEADS * HEAD_DIM * 2
    assert ring_attention_backward_bytes(sizes_of(model, training, share), share) == 4 * kv_chunk
    assert ring_attention_backward_bytes(sizes_of(model, training, WHOLE), WHOLE) == 0


def test_rank_flops_divide_by_tp_and_cp() -> None:
    model = model_preset("llama-3-8b")
    whole = scenario(model, "pytorch", sequence_length=S)
    split = scenario(model, "pytorch", tp=4, cp=2, sequence_length=S)
    # Megatron-LM's count for a llama block: 2 x tokens x its matrices, plus 4 b s^2 (heads x head_dim).
    matrices = H * HEADS * HEAD_DIM + 2 * H * KV_HEADS * HEAD_DIM + HEADS * HEAD_DIM * H + 3 * H * FFN
    block = 2 * S * matrices + 4 * S * S * HEADS * HEAD_DIM
    assert rank_stage_flops(whole)[1].forward_flops == block
    assert rank_stage_flops(split)[1].forward_flops == block / 8
    assert rank_stage_flops(split)[-1].forward_flops == 2 * (S // 2) * (VOCAB // 4) * H
    assert model_flops_per_step(split) == pytest.approx(model_flops_per_step(whole) / 8, rel=1e-12)


def test_per_op_block_time_falls_with_tp() -> None:
    model = model_preset("llama-3-8b")
    whole = scenario(model, "pytorch", sequence_length=S)
    split = scenario(model, "pytorch", tp=4, sequence_length=S)
    profile = default_profile(whole.cluster.gpu)
    whole_forward = stage_seconds(whole, compute_model(whole, profile))[0][1]
    split_forward = stage_seconds(split, compute_model(split, profile))[0][1]
    assert whole_forward / 4 <= split_forward < whole_forward / 2


def test_megatron_vocab_parallel_loss_keeps_a_mask_per_token_and_no_total_weight() -> None:
    # Megatron-LM's vocab-parallel embedding and cross entropy (the teaching TensorParallelLM) each save a one-byte
    # mask per token; the cross entropy saves no 4-byte total weight, and its targets and mask go with its softmax.
    # Its backward holds them while it makes the gradient, with the loss value (4 bytes in fp32) live beside it.
    model, training = model_preset("llama-3-8b"), TrainingSpec(sequence_length=S, precision="fp32")
    torch_loss = estimate_activations(model, training, share=RankShare(tp=4))
    megatron = estimate_activations(model, training, share=RankShare(tp=4, vocab_parallel_loss=True))
    assert megatron.saved_bytes - torch_loss.saved_bytes == 2 * S - 4
    assert megatron.head_bytes - torch_loss.head_bytes == S * (8 + 1)  # the int64 targets and their mask
    assert megatron.loss_backward_spike_bytes - torch_loss.loss_backward_spike_bytes == 4
    assert megatron.head_gradient_bytes == S * VOCAB // 4 * 4  # one fp32 gradient: the one-hot target is freed
    assert megatron.stored_block_bytes == torch_loss.stored_block_bytes  # Table 2's per-layer form is untouched
    assert rank_share(scenario(model, "paper", tp=4), megatron=True).vocab_parallel_loss


def test_the_paper_grid_peaks_in_the_output_heads_backward_when_its_weight_gradient_outweighs_the_logits() -> None:
    # The teaching grid (ddp, tp 2 x cp 2, no sequence parallelism) of tiny-llama (hidden 64, vocabulary 256, untied)
    # at 2 x 32 tokens in fp32: 32 tokens a rank. In lm_head's backward the logits' gradient (32 x 128 fp32), the
    # weight's (128 x 64) and the input's (32 x 64) are live with the loss and its gradient, the loss's saved
    # softmax, targets and masks freed (measured: tests/distributed/test_model_parallel_prediction.py).
    case = Scenario(
        model=model_preset("tiny-llama"),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=4, gpus_per_node=4, backend="gloo"),
        training=TrainingSpec(micro_batch_size=2, sequence_length=32, precision="fp32"),
        strategy=Strategy(name="ddp", engine="paper", tp=2, cp=2, sequence_parallel=False),
        overheads=NO_OVERHEAD,
    )
    memory = rules_for(case).rank_memory(case, 0)
    moments = dict(memory.moments)
    head, start = moments["output head's backward"], moments["start of backward"]
    tokens, vocab, hidden = 32, 128, 64
    assert head.temporary == tokens * vocab * 4 + vocab * hidden * 4 + tokens * hidden * 4 + 4 + 4
    assert start.activations - head.activations == tokens * vocab * 4 + tokens * (8 + 1)
    assert sum(head) > max(sum(live) for name, live in moments.items() if name != "output head's backward")
