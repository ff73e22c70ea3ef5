"""Context parallelism as ring attention over send/recv (Ring Attention with Blockwise Transformers for
Near-Infinite Context), with the zig-zag split that balances the causal mask.

The sequence is cut into 2 x cp chunks and rank i keeps chunks i and 2cp-1-i (The Llama 3 Herd of Models,
Section 3.3.2): under a causal mask an early chunk sees few keys and a late one many, so every rank gets the same
work. Everything outside attention is per token, so each rank runs the model on its own tokens alone (at their true
positions, for RoPE); attention needs every earlier key. The ranks pass their K and V round a ring: at each of cp
steps a rank attends its queries to the block it holds, while sending that block on to the next rank and receiving
the previous rank's. The blocks' partial outputs are merged with their log-sum-exp, as in flash attention
(FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness, Section 3.1). Backward passes K and V
round again, recomputes each block's probabilities from the saved log-sum-exp, and passes dK and dV round with
them, so each block's gradient is summed over every rank whose queries saw it and ends, after cp passes, at the
rank that owns the block.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist

from shardscope.reference_models import Block, TransformerLM

SEQ_DIM_OF_HEADS = 2  # q, k and v are (batch, heads, seq, head_dim) inside attention


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The true positions of the tokens cp rank `cp_rank` holds: chunks cp_rank and 2*cp_size-1-cp_rank."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"2 x cp({cp_size}) must divide the sequence length({seq_len})")
    chunk = seq_len // (2 * cp_size)
    late = 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk), torch.arange(late * chunk, (late + 1) * chunk)]
    )


def _hidden_keys(q: torch.Tensor, group: dist.ProcessGroup, step: int) -> torch.Tensor:
    """The causal mask, by true position, of this rank's queries against the block it holds at `step` of the ring
    (rank - step's K and V): True where the key comes after the query. With the zig-zag split, both query chunks
    see all of an earlier rank's early chunk and nothing of its late one, and only the late query chunk sees a later
    rank's block, all of it: every block but the rank's own is half work, half hidden, on every rank. (A faster
    kernel would skip the hidden halves; here the mask shows them.)"""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    seq_len = q.shape[SEQ_DIM_OF_HEADS] * size
    mine = zigzag_positions(seq_len, size, rank).to(q.device)
    theirs = zigzag_positions(seq_len, size, (rank - step) % size).to(q.device)
    return theirs[None, :] > mine[:, None]


def _start_ring_pass(tensor: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, list[Any]]:
    """Send tensor to the next rank of the ring and receive the previous rank's into a new buffer (not yet
    arrived: wait on the returned requests)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % size), group),
        dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - 1) % size), group),
    ]
    return received, dist.batch_isend_irecv(ops)


def _finish(requests: list[Any]) -> None:
    for request in requests:
        request.wait()
    requests.clear()  # a gloo Work holds the tensor it sent or received until it is dropped


def _block_probabilities(
    q: torch.Tensor, k: torch.Tensor, hidden: torch.Tensor, lse: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax numerators exp(q k^T / sqrt(d) - lse) of one block with the keys `hidden` from each query set to 0,
    and the block's own log-sum-exp (used when lse is None). A query that sees no key of the block gets zeros."""
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    scores = scores.masked_fill(hidden, float("-inf"))
    block_lse = scores.logsumexp(dim=-1)
    # backward subtracts the saved (fp32) log-sum-exp in the scores' dtype, so its probabilities stay 16-bit
    subtract = block_lse.nan_to_num(neginf=0.0) if lse is None else lse.to(scores.dtype)
    return (scores - subtract[..., None]).exp(), block_lse


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    """The log-sum-exp's dtype: fp32, or q's when q is wider (fp64)."""
    return torch.promote_types(q.dtype, torch.float32)


def _heads_for_queries(kv: torch.Tensor, repeat: int) -> torch.Tensor:
    """Grouped-query attention: each K/V head serves `repeat` query heads."""
    return kv.repeat_interleave(repeat, dim=1) if repeat > 1 else kv


def _fold_heads(grad: torch.Tensor, repeat: int) -> torch.Tensor:
    """The gradient of _heads_for_queries: sum over the query heads that shared a K/V head."""
    return grad.reshape(grad.shape[0], -1, repeat, *grad.shape[2:]).sum(dim=2) if repeat > 1 else grad


class _RingAttention(torch.autograd.Function):
    """Causal attention of this rank's zig-zag queries to every rank's keys and values. The output is laid out
    token-major, (batch, seq, heads, head_dim) in memory, as the fused kernels lay theirs out: the output
    projection reads it as (batch, seq, hidden) without a copy, and that one tensor is what both save."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        size, repeat = dist.get_world_size(group), q.shape[1] // k.shape[1]
        batch, heads, rows, head_dim = q.shape
        out = q.new_zeros(batch, rows, heads, head_dim).transpose(1, 2)
        # The running log-sum-exp, and the one saved for backward, stay in fp32 (fp64 under fp64) whatever the
        # compute dtype, as torch's ring attention keeps them: its flash kernels return the log-sum-exp in fp32 and
        # _SDPAMerger merges the blocks in fp32 (torch/distributed/tensor/experimental/_context_parallel/
        # _attention.py, convert_to_f32).
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=_lse_dtype(q), device=q.device)
        kv = torch.stack([k, v])
        for step in range(size):
            if step < size - 1:  # the next block travels while this one is computed
                next_kv, requests = _start_ring_pass(kv, group)
            keys, values = (_heads_for_queries(t, repeat) for t in kv)
            probs, block_lse = _block_probabilities(q, keys, _hidden_keys(q, group, step), None)
            block_lse = block_lse.to(lse.dtype)
            merged = torch.logaddexp(lse, block_lse)  # step 0 is the rank's own block: every query sees itself
            # the blocks' weights are cast to the output's dtype, so the weighted block output stays 16-bit
            old_weight, block_weight = ((x - merged).exp().to(out.dtype)[..., None] for x in (lse, block_lse))
            out.mul_(old_weight).add_((probs @ values) * block_weight)
            lse = merged
            if step < size - 1:
                _finish(requests)
                kv = next_kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        size, repeat, scale = dist.get_world_size(group), q.shape[1] // k.shape[1], 1.0 / math.sqrt(q.shape[-1])
        delta = (grad_out * out).sum(dim=-1, keepdim=True)  # rowsum(dO * O), FlashAttention's D
        grad_q = torch.zeros_like(q)
        kv, grad_kv = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=k.dtype, device=k.device)
        for step in range(size):
            if step < size - 1:
                next_kv, requests = _start_ring_pass(kv, group)
            keys, values = (_heads_for_queries(t, repeat) for t in kv)
            probs, _ = _block_probabilities(q, keys, _hidden_keys(q, group, step), lse)
            grad_scores = probs * (grad_out @ values.transpose(-2, -1) - delta)
            grad_q += (grad_scores @ keys) * scale
            grad_keys = (grad_scores.transpose(-2, -1) @ q) * scale
            grad_values = probs.transpose(-2, -1) @ grad_out
            grad_kv = grad_kv + torch.stack([_fold_heads(grad_keys, repeat), _fold_heads(grad_values, repeat)])
            if step < size - 1:
                _finish(requests)
                kv = next_kv
            # the block's gradient follows the block; the last pass brings each block's gradient home
            grad_kv, grad_requests = _start_ring_pass(grad_kv, group)
            _finish(grad_requests)
        return grad_q, grad_kv[0], grad_kv[1], None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, kind: str, *, group: dist.ProcessGroup
) -> torch.Tensor:
    """reference_models.attention_core's signature; the causal mask comes from the zig-zag positions instead."""
    del mask, kind
    out: torch.Tensor = cast(Any, _RingAttention).apply(q, k, v, group)
    return out


def use_ring_attention(model: TransformerLM, group: dist.ProcessGroup) -> None:
    """Make every block's attention a ring over the cp group."""
    for block in model.layers:
        assert isinstance(block, Block)
        block.attn.core = partial(ring_attention, group=group)
