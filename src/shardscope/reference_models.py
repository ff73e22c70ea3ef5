"""Reference decoder-only transformers built from a `ModelSpec`: gpt2-style, llama-style and mixture-of-experts.

Parameter names, shapes and creation order follow `shardscope.core.params` exactly, so the core's count, the
fake-tensor trace and a real run all talk about the same tensors. No dropout, so a run is deterministic and parity
with a single process can be checked to 1e-10 in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    set_checkpoint_early_stop,
)

from shardscope.choices import checkpoints_block
from shardscope.expert_routing import capacity_rows, combine, dispatch, route
from shardscope.specs import ModelSpec, TrainingSpec

INIT_STD = 0.02  # GPT-2's initializer_range
ROPE_THETA = 10_000.0  # RoFormer: Enhanced Transformer with Rotary Position Embedding
NORM_EPS = 1e-5

# What every block needs besides its input, computed once per forward and shared by all blocks:
# (causal mask, rope cos, rope sin); cos and sin are None for gpt2.
Context = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
# The input projections of one input, in order: (x, linears) -> each linear's output.
Projection = Callable[[torch.Tensor, list[nn.Linear]], list[torch.Tensor]]


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (Root Mean Square Layer Normalization)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, NORM_EPS)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, kind: str) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v over (batch, heads, seq, head_dim); k and v may have fewer heads (GQA).

    'eager' materialises the score matrix and takes the softmax in the activation dtype; 'sdpa' calls torch's fused
    kernel, which on a CPU or GPU keeps no score matrix for backward.
    """
    repeat = q.shape[1] // k.shape[1]
    if kind == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=repeat > 1)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def each_linear(x: torch.Tensor, linears: list[nn.Linear]) -> list[torch.Tensor]:
    """Each linear applied to x: the input projections of attention and of the MLP. Tensor parallelism swaps in
    its region entry (tp_ops.region_entry), which enters once for all the projections of one input."""
    return [linear(x) for linear in linears]


def _ops(*names: str) -> frozenset[Any]:
    """The aten, c10d-functional and higher-order op overloads named 'namespace.op.overload' that this torch has."""
    found = []
    for name in names:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, overload):
            found.append(getattr(packet, overload))
    return frozenset(found)


# torchtitan's selective op AC (torchtitan/distributed/activation_checkpoint.py, `SelectiveAC` and
# `_get_default_save_ops`, at commit c5d93d109 of 2026-06-15): save the outputs of the compute-intensive ops of
# torch's partitioner (`get_default_op_list`: mm, bmm, addmm, the fused attentions), of the other SDPA kernels, of max
# and linear, of topk, and of the reduce-scatter and all-to-all; recompute every second mm (or linear) and all the
# rest. flash attention's CPU kernel is listed too: it is the kernel an sdpa call runs on a CPU (a real gloo run and
# the trace's fake tensors), where a GPU runs the flash or efficient one torchtitan saves.
MM_OPS = _ops("aten.mm.default", "aten.linear.default")
OP_SAVE_LIST = MM_OPS | _ops(
    "aten.bmm.default",
    "aten.addmm.default",
    "aten._scaled_mm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._flash_attention_forward.default",
    "aten._efficient_attention_forward.default",
    "aten.max.default",
    "aten.topk.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_to_all_single.default",
)


def op_policy_context(recompute_shapes: frozenset[tuple[int, ...]] = frozenset()) -> Any:
    """A fresh pair of selective-checkpoint contexts for one checkpointed block: torchtitan's policy, which counts
    the mms of forward and of recomputation apart and recomputes the even ones (the 2nd, 4th...). An mm whose weight
    has one of `recompute_shapes` (in, out) is recomputed and not counted: torchtitan's default
    `force_recompute_mm_shapes_by_fqns` names the MoE router's gate."""
    mm_counts = {False: 0, True: 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in MM_OPS:
            weight = tuple(args[1].shape)
            if (weight[::-1] if func == torch.ops.aten.linear.default else weight) in recompute_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            mm_counts[ctx.is_recompute] += 1
        if func in OP_SAVE_LIST and not (func in MM_OPS and mm_counts[ctx.is_recompute] % 2 == 0):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)  # type: ignore[no-untyped-call]


class Attention(nn.Module):
    """Multi-head (gpt2: fused c_attn) or grouped-query (llama: q/k/v/o projections with RoPE) causal attention."""

    def __init__(self, spec: ModelSpec, kind: str, selective: bool) -> None:
        super().__init__()
        self.gpt2 = spec.family == "gpt2"
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.kind, self.selective = kind, selective
        self.core: Callable[..., torch.Tensor] = attention_core  # context parallelism swaps in ring attention
        self.project: Projection = each_linear
        hidden, q_width, kv_width = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        if self.gpt2:
            self.c_attn = nn.Linear(hidden, 3 * hidden)
            self.c_proj = nn.Linear(hidden, hidden)
        else:
            self.q_proj = nn.Linear(hidden, q_width, bias=spec.attention_bias)
            self.k_proj = nn.Linear(hidden, kv_width, bias=spec.attention_bias)
            self.v_proj = nn.Linear(hidden, kv_width, bias=spec.attention_bias)
            self.o_proj = nn.Linear(q_width, hidden, bias=False)

    def forward(self, x: torch.Tensor, context: Context) -> torch.Tensor:
        mask, cos, sin = context
        if self.gpt2:
            q, k, v = self.project(x, [self.c_attn])[0].chunk(3, dim=-1)
        else:
            q, k, v = self.project(x, [self.q_proj, self.k_proj, self.v_proj])
        batch, seq = q.shape[:2]  # seq is every token's, also when sequence parallelism splits x
        q = q.view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        if cos is not None and sin is not None:
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if self.selective:  # recompute only the attention core in backward (Reducing Activation Recomputation ...)
            out = checkpoint(self.core, q, k, v, mask, self.kind, use_reentrant=False)
        else:
            out = self.core(q, k, v, mask, self.kind)
        out = out.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim)
        return self.c_proj(out) if self.gpt2 else self.o_proj(out)


class GeluMLP(nn.Module):
    """gpt2's MLP: c_fc, tanh-approximated GELU, c_proj."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(hidden, ffn)
        self.c_proj = nn.Linear(ffn, hidden)
        self.project: Projection = each_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.project(x, [self.c_fc])[0], approximate="tanh"))


class SwiGLU(nn.Module):
    """llama's MLP: down(silu(gate(x)) * up(x)) (GLU Variants Improve Transformer)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        self.project: Projection = each_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project(x, [self.gate_proj, self.up_proj])
        return self.down_proj(F.silu(gate) * up)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts; the k routing weights are renormalised to sum to 1 (Mixtral of Experts).
    Dropless, or under the spec's capacity rule (expert_routing.py)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.top_k = spec.experts_per_token
        self.expert_capacity = spec.expert_capacity
        self.router = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(spec.hidden_size, spec.ffn_hidden_size) for _ in range(spec.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = route(self.router, tokens, self.top_k)
        capacity = self.expert_capacity(x.shape[1])
        if capacity:
            rows = capacity_rows(chosen.view(*x.shape[:2], self.top_k), len(self.experts), capacity)
            buffer = dispatch(tokens, rows, len(self.experts) * x.shape[0] * capacity, self.top_k)
            outputs = [expert(part) for expert, part in zip(self.experts, buffer.chunk(len(self.experts)), strict=True)]
            return combine(torch.cat(outputs).to(tokens.dtype), rows, weights).view_as(x)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            rows, slot = (chosen == index).nonzero(as_tuple=True)
            if rows.numel():
                routed = expert(tokens[rows]) * weights[rows, slot, None]
                out = out.index_add(0, rows, routed.to(out.dtype))  # autocast computes experts in 16 bits
        return out.view_as(x)


class Block(nn.Module):
    """One pre-norm transformer block; child names match core.params (ln_1/attn/ln_2/mlp or input_norm/...)."""

    def __init__(self, spec: ModelSpec, kind: str, selective: bool) -> None:
        super().__init__()
        self.gpt2 = spec.family == "gpt2"
        hidden = spec.hidden_size
        if self.gpt2:
            self.ln_1 = nn.LayerNorm(hidden, eps=NORM_EPS)
            self.attn = Attention(spec, kind, selective)
            self.ln_2 = nn.LayerNorm(hidden, eps=NORM_EPS)
            self.mlp: nn.Module = GeluMLP(hidden, spec.ffn_hidden_size)
        else:
            self.input_norm = RMSNorm(hidden)
            self.attn = Attention(spec, kind, selective)
            self.post_attention_norm = RMSNorm(hidden)
            if spec.family == "moe":
                self.moe = MoE(spec)
            else:
                self.mlp = SwiGLU(hidden, spec.ffn_hidden_size)

    def forward(self, x: torch.Tensor, context: Context) -> torch.Tensor:
        if self.gpt2:
            x = x + self.attn(self.ln_1(x), context)
            return x + self.mlp(self.ln_2(x))
        x = x + self.attn(self.input_norm(x), context)
        feed_forward = self.moe if hasattr(self, "moe") else self.mlp
        return x + feed_forward(self.post_attention_norm(x))


class TransformerLM(nn.Module):
    """embed_tokens (+ embed_positions), layers, norm, lm_head: the root unit around a list of blocks."""

    def __init__(self, spec: ModelSpec, attention: str = "sdpa", checkpointing: str = "none") -> None:
        super().__init__()
        if not spec.has_shape:
            raise ValueError(f"model {spec.name!r} has only a parameter count, no shape to build")
        self.spec, self.checkpointing = spec, checkpointing
        hidden = spec.hidden_size
        self.embed_tokens = nn.Embedding(spec.vocab_size, hidden)
        if spec.family == "gpt2":
            self.embed_positions = nn.Embedding(spec.max_positions, hidden)
        self.layers = nn.ModuleList(
            Block(spec, attention, checkpointing == "selective") for _ in range(spec.num_layers)
        )
        self.norm: nn.Module = nn.LayerNorm(hidden, eps=NORM_EPS) if spec.family == "gpt2" else RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, spec.vocab_size, bias=False)
        if spec.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _context(self, seq: int, like: torch.Tensor) -> Context:
        mask = torch.ones(seq, seq, dtype=torch.bool, device=like.device).triu(1)
        if self.spec.family == "gpt2":
            return mask, None, None
        exact = torch.float64 if like.dtype == torch.float64 else torch.float32
        half = self.spec.head_dim // 2
        inv_freq = ROPE_THETA ** (-torch.arange(half, dtype=exact, device=like.device) / half)
        angles = torch.outer(torch.arange(seq, dtype=exact, device=like.device), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        return mask, angles.cos().to(like.dtype), angles.sin().to(like.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab)."""
        seq = input_ids.shape[1]
        x = self.embed_tokens(input_ids)
        if self.spec.family == "gpt2":
            x = x + self.embed_positions(torch.arange(seq, device=input_ids.device))
        context = self._context(seq, x)
        for index, block in enumerate(self.layers):
            x = self._run_block(index, block, x, context)
        return self.lm_head(self.norm(x))

    def _run_block(self, index: int, block: Callable[..., torch.Tensor], x: torch.Tensor, context: Context) -> Any:
        """One block under the checkpointing mode: whole ('full', 'every:N'; keep only its input, as in Training
        Deep Nets with Sublinear Memory Cost), by torchtitan's op policy ('op'), or as written."""
        if checkpoints_block(self.checkpointing, index):
            return checkpoint(block, x, context, use_reentrant=False)
        if self.checkpointing == "op":
            router = (self.spec.hidden_size, self.spec.num_experts) if self.spec.family == "moe" else None
            contexts = partial(op_policy_context, frozenset([router] if router else []))
            # torchtitan's wrapper recomputes the whole block (early_stop=False): stopping at the last saved tensor
            # would leave the cached output of the block's last projection unclaimed through its backward. For a
            # block checkpointed whole it changes no byte (traced), so those keep torch's default, as 'full' has.
            with set_checkpoint_early_stop(False):
                return checkpoint(block, x, context, use_reentrant=False, context_fn=contexts)
        return block(x, context)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in at least float32 (float64 stays float64 for parity runs)."""
    wide = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(wide.reshape(-1, wide.shape[-1]), targets.reshape(-1))


def init_weights(model: nn.Module, seed: int) -> None:
    """GPT-2's initialisation from one seed: normal(0, 0.02) weights and embeddings, zero biases, unit norms."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                values = torch.randn(param.shape, generator=generator, dtype=torch.float64) * INIT_STD
                param.copy_(values.to(param.dtype))


def build_model(
    spec: ModelSpec,
    training: TrainingSpec | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = 0,
) -> TransformerLM:
    """The reference module for a spec, on a device (may be 'meta') and in a dtype, initialised from a seed.

    The attention kind and checkpointing mode come from the TrainingSpec. seed=None or the meta device skips
    initialisation (the trace and FSDP fill the values later, or never need them).
    """
    attention = training.attention if training else "sdpa"
    checkpointing = training.checkpointing if training else "none"
    with torch.device(device):
        model = TransformerLM(spec, attention=attention, checkpointing=checkpointing)
    model.to(dtype)
    if seed is not None and torch.device(device).type != "meta":
        init_weights(model, seed)
    return model


def sample_batch(
    spec: ModelSpec, training: TrainingSpec, *, num_sequences: int, step: int = 0, seed: int = 1234
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (input_ids, targets) of shape (num_sequences, sequence_length), the same on every rank.

    A data-parallel run takes the global batch (micro_batch_size * world_size sequences) and gives each rank its
    slice, so a single process on the whole batch is the parity reference.
    """
    if spec.family == "gpt2" and training.sequence_length > spec.max_positions:
        raise ValueError(
            f"sequence_length={training.sequence_length} exceeds {spec.name}'s max_positions={spec.max_positions}"
        )
    generator = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, spec.vocab_size, (num_sequences, training.sequence_length + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
