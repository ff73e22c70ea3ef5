"""Activation memory: what autograd saves for backward, op by op, for one rank's micro-batch.

The per-op accounting follows "Reducing Activation Recomputation in Large Transformer Models" (Korthikanti et al.),
which gives sbh(34 + 5as/h) bytes per layer for GPT with 16-bit activations and dropout. shardscope's reference
models have no dropout, so its terms are the paper's without the dropout masks and dropout outputs (34 -> 32 and
5as/h -> 2as/h for gpt2), and the llama family adds SwiGLU's extra projection and RoPE. Fused attention (sdpa, the
kernels of "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness") keeps its output and a
log-sum-exp per row instead of the s x s score matrix. Full checkpointing keeps each block's input and recomputes one
block at a time in backward; selective checkpointing recomputes only the attention core (the paper's Section 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from shardscope.specs import ModelSpec, TrainingSpec

INDEX_BYTES = 8  # token ids and targets are int64


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationEstimate:
    """Activation memory of one micro-batch on one rank."""

    saved_bytes: int
    """Bytes saved for backward at the end of forward, all blocks, embeddings and the loss included."""
    block_bytes: int
    """One block's saved tensors without checkpointing."""
    stored_block_bytes: int
    """What one block keeps under the chosen checkpointing."""
    recompute_bytes: int
    """Extra bytes live in backward while one checkpointed block is recomputed (0 without checkpointing)."""
    logits_bytes: int
    """The logits tensor in the compute dtype (tokens x vocab)."""
    loss_forward_spike_bytes: int
    """Transient bytes at the loss in forward beyond what is saved: the logits and their fp32 copy."""
    loss_backward_spike_bytes: int
    """Transient bytes at the start of backward: gradients of the log-softmax output and input."""


def activation_bytes_per_element(training: TrainingSpec) -> int:
    """Bytes per activation element: the compute dtype."""
    return {"fp32": 4, "fp64": 8}.get(training.precision, 2)


def _stat_bytes(training: TrainingSpec) -> int:
    # Norm statistics (mean, 1/rms) are kept in fp32, or fp64 when computing in fp64.
    return 8 if training.precision == "fp64" else 4


def _attention_core_bytes(model: ModelSpec, training: TrainingSpec, tokens: int) -> tuple[int, int]:
    """Bytes the attention core saves: (inputs q/k/v and outputs kept in any mode, the part selective drops)."""
    element = activation_bytes_per_element(training)
    query_width = model.num_heads * model.head_dim
    kv_width = model.num_kv_heads * model.head_dim
    seq, batch = training.sequence_length, training.micro_batch_size
    if training.attention == "eager":
        # Grouped-query attention repeats k and v to every query head before the matmul (a copy when heads differ).
        kv_saved = 2 * query_width
        scores = batch * model.num_heads * seq * seq * element  # the softmax output, saved once
        return tokens * (query_width + kv_saved) * element, scores
    # Fused kernels save q, k, v (k and v at kv width), the output and a log-sum-exp per row (fp32).
    kept = tokens * (query_width + 2 * kv_width) * element
    dropped = tokens * query_width * element + batch * model.num_heads * seq * _stat_bytes(training)
    return kept, dropped


def _block_bytes(model: ModelSpec, training: TrainingSpec) -> tuple[int, int]:
    """(bytes one block saves, bytes that selective checkpointing does not keep)."""
    element = activation_bytes_per_element(training)
    tokens = training.tokens_per_micro_batch
    hidden = model.hidden_size * tokens * element
    norm = hidden + tokens * _stat_bytes(training)  # a norm saves its input and per-token statistics
    query = tokens * model.num_heads * model.head_dim * element
    attention_kept, attention_dropped = _attention_core_bytes(model, training, tokens)
    # Attention: norm input, projection input, the core, then the output projection's input (a contiguous copy).
    attention = norm + hidden + attention_kept + attention_dropped + query
    if model.family == "gpt2":
        inner = tokens * model.ffn_hidden_size * element
        # GELU MLP: norm input, fc input, GELU input, projection input.
        mlp = norm + hidden + 2 * inner
    elif model.family == "llama":
        inner = tokens * model.ffn_hidden_size * element
        # SwiGLU: norm input, shared gate/up input, gate output (SiLU input), SiLU output, up output, down input.
        mlp = norm + hidden + 4 * inner
    else:
        routed = tokens * model.experts_per_token
        inner = routed * model.ffn_hidden_size * element
        router = tokens * model.num_experts * 4  # router probabilities in fp32
        # MoE (Mixtral of Experts): router, each routed token's gathered input, SwiGLU per expert, weighted output.
        mlp = norm + hidden + router + 2 * routed * model.hidden_size * element + 4 * inner
    return attention + mlp, attention_dropped


@cache
def estimate_activations(model: ModelSpec, training: TrainingSpec) -> ActivationEstimate:
    """Saved activations of one micro-batch; requires a shaped model."""
    element = activation_bytes_per_element(training)
    tokens = training.tokens_per_micro_batch
    block, selective_dropped = _block_bytes(model, training)
    if training.checkpointing == "full":
        stored, recompute = tokens * model.hidden_size * element, block
    elif training.checkpointing == "selective":
        stored, recompute = block - selective_dropped, selective_dropped
    else:
        stored, recompute = block, 0
    loss_element = 8 if training.precision == "fp64" else 4
    logits = tokens * model.vocab_size * element
    # The head: final norm input and statistics, lm_head input, and the log-softmax output the loss keeps.
    head = tokens * model.hidden_size * element * 2 + tokens * _stat_bytes(training)
    log_softmax = tokens * model.vocab_size * loss_element
    ids = 2 * tokens * INDEX_BYTES  # token ids (embedding backward) and targets (the loss)
    saved = model.num_layers * stored + head + log_softmax + ids
    forward_spike = logits + (tokens * model.vocab_size * loss_element if element != loss_element else 0)
    backward_spike = 2 * tokens * model.vocab_size * loss_element
    return ActivationEstimate(
        saved_bytes=saved,
        block_bytes=block,
        stored_block_bytes=stored,
        recompute_bytes=recompute,
        logits_bytes=logits,
        loss_forward_spike_bytes=forward_spike,
        loss_backward_spike_bytes=backward_spike,
    )
