"""The communication operators of tensor and sequence parallelism, as autograd functions over a process group.

Tensor parallelism (Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism,
Section 3) needs two conjugate operators around each attention and MLP: `f` enters the parallel region (identity
forward, all-reduce backward: every rank's partial input gradient is summed) and `g` leaves it (all-reduce
forward: the row-parallel partial outputs are summed; identity backward).

Sequence parallelism (Reducing Activation Recomputation in Large Transformer Models, Section 4.2) replaces them
with a conjugate pair along the sequence dim: entering all-gathers the rank's seq/tp tokens (reduce-scatter
backward), leaving reduce-scatters the partial outputs so each rank keeps seq/tp tokens (all-gather backward).
Same bytes on the wire as one all-reduce, but the norms and the residual stream hold only seq/tp tokens. As in
Megatron-LM (and the paper's Table 2), the entry is one operator with the column-parallel linears behind it, so
that they save only the rank's seq/tp tokens for their weight gradients and all-gather them again in backward.

Tensors are (batch, seq, hidden); SEQ_DIM is the one sequence parallelism splits.
"""

from __future__ import annotations

from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardscope.reference_models import Projection, each_linear
from shardscope.runtime.collectives import all_gather_single, reduce_scatter_single

SEQ_DIM = 1


def all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's tokens, in rank order along the sequence dim (no autograd)."""
    local = x.movedim(SEQ_DIM, 0).contiguous()  # the collectives gather along dim 0
    whole = torch.empty((dist.get_world_size(group) * local.shape[0], *local.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(whole, local, group=group)
    return whole.movedim(0, SEQ_DIM)


def reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ranks of x, of which this rank keeps its 1/size of the tokens (no autograd)."""
    whole = x.movedim(SEQ_DIM, 0).contiguous()
    mine = torch.empty((whole.shape[0] // dist.get_world_size(group), *whole.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(mine, whole, group=group)
    return mine.movedim(0, SEQ_DIM)


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ranks of x, as a new tensor (no autograd)."""
    total = x.clone()
    dist.all_reduce(total, group=group)
    return total


class _CopyToParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce_sum(grad, ctx.group), None


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatheredLinears(torch.autograd.Function):
    """Sequence parallelism's entry with the column-parallel linears behind it (Megatron-LM's linear with sequence
    parallelism): forward all-gathers the rank's tokens and multiplies the whole sequence by each weight, saving
    only the rank's tokens; backward all-gathers them again for the weight gradients and reduce-scatters the
    input's gradient. Biases are added outside."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, *weights: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.save_for_backward(x, *weights)
        whole = all_gather_sequence(x, group).contiguous()  # (batch, seq, hidden), as the linears' outputs are read
        return tuple(F.linear(whole, weight) for weight in weights)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        grad_whole = grads[0] @ weights[0]
        for grad, weight in zip(grads[1:], weights[1:], strict=True):
            grad_whole += grad @ weight
        grad_x = reduce_scatter_sequence(grad_whole, ctx.group)
        del grad_whole  # before the input is gathered again: the two whole-sequence tensors never live together
        whole = all_gather_sequence(x, ctx.group).flatten(0, -2)
        return grad_x, None, *(grad.flatten(0, -2).T @ whole for grad in grads)


class _ScatterSequence(torch.autograd.Function):
    """Sequence parallelism's exit: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_gather_sequence(grad, ctx.group), None


def copy_to_parallel(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """f: enter a tensor-parallel region with the whole input on every rank."""
    out: torch.Tensor = cast(Any, _CopyToParallel).apply(x, group)
    return out


def reduce_from_parallel(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """g: leave a tensor-parallel region by summing the ranks' partial outputs."""
    out: torch.Tensor = cast(Any, _ReduceFromParallel).apply(x, group)
    return out


def gathered_linears(x: torch.Tensor, linears: list[nn.Linear], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Enter a tensor-parallel region from seq/tp tokens: each column-parallel linear of the whole sequence, from
    one all-gather."""
    outs = cast(Any, _GatheredLinears).apply(x, group, *(linear.weight for linear in linears))
    return [out if linear.bias is None else out + linear.bias for out, linear in zip(outs, linears, strict=True)]


def copied_linears(x: torch.Tensor, linears: list[nn.Linear], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Enter a tensor-parallel region with the whole input (f), then each column-parallel linear."""
    return each_linear(copy_to_parallel(x, group), linears)


def region_entry(group: dist.ProcessGroup, sequence_parallel: bool) -> Projection:
    """The projections that enter a tensor-parallel region of this group (reference_models.Projection)."""
    return partial(gathered_linears if sequence_parallel else copied_linears, group=group)


def scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Leave a tensor-parallel region into seq/tp tokens: sum the partial outputs, keep this rank's tokens."""
    out: torch.Tensor = cast(Any, _ScatterSequence).apply(x, group)
    return out
