"""Tensor parallelism, with or without sequence parallelism, from collectives (Megatron-LM, Section 3).

Each attention and MLP becomes a parallel region: its first linears are column-parallel (each rank keeps a slice of
the output features, so of the heads, and needs the whole input), its last linear is row-parallel (each rank keeps
the matching slice of the input features and makes a partial output that the ranks sum). The region is entered by
`f` and left by `g` (tp_ops), and the reference blocks' input projections (`project`) are where it is entered. The
embedding is split over the vocabulary, and so is lm_head, whose logits never get gathered: the cross entropy is
taken over the split vocabulary (Megatron-LM's vocab_parallel_cross_entropy). Norms are replicated.

With sequence parallelism (Reducing Activation Recomputation in Large Transformer Models, Section 4.2) the regions
are entered by an all-gather and left by a reduce-scatter along the sequence, so the norms and the residual stream
hold seq/tp tokens per rank, and the replicated weights (norms, row-parallel biases, position embeddings) see only
their rank's tokens: each one's gradient is summed over tp as soon as backward has made it.

The split is torchtitan's llama plan; an nn.Linear's weight is (out, in), so colwise shards dim 0 and rowwise dim 1,
as DTensor's ColwiseParallel and RowwiseParallel do, and a rank holds the same parameter bytes as under DTensor.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardscope.reference_models import Block, TransformerLM, lm_loss
from shardscope.runtime.teaching.tp_ops import all_reduce_sum, reduce_from_parallel, region_entry, scatter_sequence

COLUMN, ROW = 0, 1  # the weight dim a column- or row-parallel nn.Linear shards (its output or input features)
VOCABULARY = 0  # embed_tokens.weight and lm_head.weight are (vocab, hidden)
SHARD_DIMS = {  # by module name: the dim of its weight the tp ranks split; modules not named are replicated
    "embed_tokens": VOCABULARY,
    "lm_head": VOCABULARY,
    "q_proj": COLUMN,
    "k_proj": COLUMN,
    "v_proj": COLUMN,
    "gate_proj": COLUMN,
    "up_proj": COLUMN,
    "c_attn": COLUMN,  # gpt2's fused q, k, v: split by heads within each of the three
    "c_fc": COLUMN,
    "o_proj": ROW,
    "down_proj": ROW,
    "c_proj": ROW,
}
Region = Callable[[torch.Tensor], torch.Tensor]  # an entry or exit operator with its group bound


def shard_dim(name: str) -> int | None:
    """The dim of parameter `name` that tensor parallelism splits, or None for a replicated one. A row-parallel
    bias is replicated: it is added once, after the partial outputs are summed."""
    module, _, kind = name.rpartition(".")
    dim = SHARD_DIMS.get(module.rpartition(".")[2])
    return None if dim == ROW and kind == "bias" else dim


def shard_of(name: str, whole: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The piece of parameter `name` that tp rank `rank` of `size` holds (the whole tensor if it is replicated)."""
    dim = shard_dim(name)
    if dim is None:
        return whole
    if ".c_attn." in name:
        return whole.reshape(3, size, -1, *whole.shape[1:])[:, rank].flatten(0, 1)
    return whole.chunk(size, dim)[rank]


def whole_of(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Parameter `name` put back together from every tp rank's piece, in rank order (the inverse of shard_of)."""
    dim = shard_dim(name)
    if dim is None:
        return pieces[0]
    if ".c_attn." in name:
        return torch.stack([piece.reshape(3, -1, *piece.shape[1:]) for piece in pieces], dim=1).flatten(0, 2)
    return torch.cat(pieces, dim)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + vocab/tp) of the embedding: other tokens look up zeros, and `leave` sums the ranks'
    partial embeddings (and, with sequence parallelism, keeps this rank's tokens)."""

    def __init__(self, weight: torch.Tensor, start: int, leave: Region) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.start, self.leave = start, leave

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        partial_sum = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        return self.leave(partial_sum)


class RowParallelLinear(nn.Module):
    """An nn.Linear keeping a slice of its input features: `leave` sums the partial outputs, then the bias is added
    once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, leave: Region) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.leave = leave

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.leave(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross entropy when this rank holds the logits of vocabulary entries [start, start + width), as
    Megatron-LM's vocab_parallel_cross_entropy: log-sum-exp over the split vocabulary (the max, the exp sums and the
    target's logit all-reduced), saving only the softmax over the rank's slice and where the targets fall in it.
    The gradient is (softmax - one_hot(target)) / tokens on every rank, each over its own slice."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, start: int, group: dist.ProcessGroup
    ) -> torch.Tensor:
        biggest = logits.max(dim=-1).values
        dist.all_reduce(biggest, op=dist.ReduceOp.MAX, group=group)
        local = targets - start
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        rows = torch.arange(len(local), device=local.device)
        target_logit = all_reduce_sum((logits[rows, local] - biggest).masked_fill(outside, 0.0), group)
        softmax = (logits - biggest[:, None]).exp_()
        sum_exp = all_reduce_sum(softmax.sum(dim=-1), group)
        softmax.div_(sum_exp[:, None])
        ctx.save_for_backward(softmax, outside, local)
        return (sum_exp.log_() - target_logit).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, outside, local = ctx.saved_tensors
        target = torch.zeros_like(softmax)  # one_hot(target) over this rank's slice: empty where it is elsewhere
        target[torch.arange(len(local), device=local.device), local] = (~outside).to(softmax.dtype)
        return (softmax - target).mul_(grad).div_(len(local)), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, start: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """Mean cross entropy when this rank holds the logits of vocabulary entries [start, start + logits.shape[-1])."""
    logits = logits.reshape(-1, logits.shape[-1])
    logits = logits if logits.dtype == torch.float64 else logits.float()  # as reference_models.lm_loss
    loss: torch.Tensor = cast(Any, _VocabParallelCrossEntropy).apply(logits, targets.reshape(-1), start, group)
    return loss


def whole_parameters(slices: dict[str, torch.Tensor], group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Every parameter put back together from the slices the ranks of a tp group hold (called on each of them)."""
    out = {}
    for name, piece in slices.items():
        if shard_dim(name) is None:
            out[name] = piece.detach().clone()
            continue
        pieces = [torch.empty_like(piece) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, piece.detach().contiguous(), group=group)
        out[name] = whole_of(name, pieces)
    return out


def check_divisible(model: TransformerLM, size: int) -> None:
    """Refuse a tp degree that does not divide the heads, KV heads, MLP width and vocabulary, naming the values."""
    spec = model.spec
    if spec.family not in ("llama", "gpt2"):
        raise ValueError(f"tensor parallelism is written for the llama and gpt2 families, not {spec.family!r}")
    for what, count in (
        ("num_heads", spec.num_heads),
        ("num_kv_heads", spec.num_kv_heads),
        ("ffn_hidden_size", spec.ffn_hidden_size),
        ("vocab_size", spec.vocab_size),
    ):
        if count % size:
            raise ValueError(f"tp({size}) must divide {what}({count}) of {spec.name}")


class TensorParallelLM:
    """A reference model sharded in place over a tp group; `loss` is its forward with the vocabulary-parallel loss.

    Every rank must hold the same weights before (broadcast them first): each keeps its slice of them."""

    def __init__(self, model: TransformerLM, group: dist.ProcessGroup, sequence_parallel: bool) -> None:
        self.model, self.group, self.sequence_parallel = model, group, sequence_parallel
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        check_divisible(model, self.size)
        self.enter = region_entry(group, sequence_parallel)
        self.leave: Region = partial(scatter_sequence if sequence_parallel else reduce_from_parallel, group=group)
        self.vocab_start = self.rank * model.spec.vocab_size // self.size
        self._shard_linears()
        if self.size > 1:  # one rank with the whole vocabulary keeps the reference embedding and loss, as Megatron-LM
            self._split_vocabulary()
        for block in model.layers:
            assert isinstance(block, Block)
            block.attn.heads //= self.size
            block.attn.kv_heads //= self.size
            block.attn.project = block.mlp.project = self.enter
        if sequence_parallel:  # each rank's replicated weights saw only its tokens: sum their gradients over tp
            for name, param in model.named_parameters():
                if shard_dim(name) is None:  # each backward's own gradient, before it accumulates (micro-batches
                    param.register_hook(self._sum_over_tp)  # of a pipeline) and before any data-parallel hook
        # the model's forward becomes this loss, so hooks on the model (FSDP's gather of the root unit) run with it
        model.forward = self.loss  # type: ignore[method-assign]

    def _split_vocabulary(self) -> None:
        model = self.model
        tied = model.lm_head.weight is model.embed_tokens.weight
        embedding = self._piece("embed_tokens.weight", model.embed_tokens.weight)
        model.add_module("embed_tokens", VocabParallelEmbedding(embedding, self.vocab_start, self.leave))
        head = model.embed_tokens.weight if tied else nn.Parameter(self._piece("lm_head.weight", model.lm_head.weight))
        model.lm_head.weight = head

    def _piece(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        return shard_of(name, whole.detach(), self.rank, self.size).clone()

    def _shard_linears(self) -> None:
        """Column-parallel linears keep their slice in place; row-parallel ones become RowParallelLinear."""
        for name, module in list(self.model.layers.named_modules(prefix="layers")):
            dim = SHARD_DIMS.get(name.rpartition(".")[2])
            if dim == COLUMN:
                for kind, param in list(module.named_parameters()):
                    setattr(module, kind, nn.Parameter(self._piece(f"{name}.{kind}", param)))
            elif dim == ROW:
                assert isinstance(module, nn.Linear)
                bias = None if module.bias is None else module.bias.detach()
                parent, _, child = name.rpartition(".")
                sharded = RowParallelLinear(self._piece(f"{name}.weight", module.weight), bias, self.leave)
                setattr(self.model.get_submodule(parent), child, sharded)

    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss of these tokens, whose true positions in their sequences are `positions` (the
        tokens of a context-parallel rank are two chunks of the sequence, not its start)."""
        model = self.model
        x = self.embed(input_ids, positions)
        mask, cos, sin = model._context(int(positions.max()) + 1, x)
        mask = mask[positions][:, positions]  # causal by true position (ring attention makes its own)
        if cos is not None and sin is not None:
            cos, sin = cos[positions], sin[positions]
        for index, block in enumerate(model.layers):
            x = model._run_block(index, block, x, (mask, cos, sin))  # under the run's checkpointing mode
        return self.head_loss(x, targets)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The embeddings of these tokens (this rank's seq/tp of them under sequence parallelism)."""
        model = self.model
        x: torch.Tensor = model.embed_tokens(input_ids)
        if model.spec.family == "gpt2":
            held = positions.chunk(self.size)[self.rank] if self.sequence_parallel else positions
            x = x + model.embed_positions(held)
        return x

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The final norm, the output head and the mean loss over the split vocabulary."""
        model = self.model
        (logits,) = self.enter(model.norm(x), [model.lm_head])
        if self.size == 1:
            return lm_loss(logits, targets)
        return vocab_parallel_cross_entropy(logits, targets, self.vocab_start, self.group)

    def _sum_over_tp(self, grad: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(grad, group=self.group)
        return grad
