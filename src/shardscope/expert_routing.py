"""How an MoE layer's tokens reach its experts: top-k routing, and the capacity rule's fixed-size buffers.

The reference MoE (reference_models.MoE) and the teaching expert parallelism (runtime/teaching/expert_parallel.py)
route through these functions, so one process and many ranks compute the same thing.

Under the capacity rule (ModelSpec.capacity_factor > 0, "GShard: Scaling Giant Models with Conditional Computation
and Automatic Sharding", a local group being one sequence) every expert takes C = ModelSpec.expert_capacity(seq) rows
of every sequence. The routed copies of a sequence claim rows in priority order: every token's first choice before
any second choice, and within a choice by position; copies past their expert's C rows are dropped (they add nothing
to their token's output; the token keeps its residual stream). The experts then run on a buffer of fixed shape,
expert-major: experts x sequences x C rows, zeros where fewer copies came, so its size and the all-to-alls that move
it do not depend on the routing. Every op here has an output shape known from the input shapes alone, so fake tensors
(`shardscope trace`) can replay it.
"""

from __future__ import annotations

import torch
from torch import nn


def route(router: nn.Linear, tokens: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) of each token's top-k choices: the router's softmax, renormalised over the k chosen
    ("Mixtral of Experts")."""
    probs = torch.softmax(router(tokens), dim=-1)
    weights, chosen = probs.topk(top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), chosen


def capacity_rows(chosen: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Each routed copy's row in the expert-major buffer, flat in the order of `chosen`'s elements (token by token,
    choice by choice): expert x sequences x capacity + sequence x capacity + its place in its expert's queue, or the
    buffer's size (one past its last row) when the copy is dropped. `chosen`: (sequences, positions, top-k)."""
    with torch.no_grad():
        sequences, positions, top_k = chosen.shape
        # priority order: choice-major within a sequence, then position; a queue per (sequence, expert)
        queue = torch.arange(sequences, device=chosen.device)[:, None, None] * num_experts + chosen.transpose(1, 2)
        queue = queue.reshape(-1)
        order = queue.argsort(stable=True)
        counts = torch.zeros(sequences * num_experts, dtype=torch.long, device=chosen.device)
        counts.scatter_add_(0, queue, torch.ones_like(queue))
        starts = counts.cumsum(0) - counts
        place = torch.empty_like(queue).scatter_(0, order, torch.arange(queue.numel(), device=chosen.device))
        place = place - starts[queue]
        expert, sequence = queue % num_experts, queue // num_experts
        size = num_experts * sequences * capacity
        rows = (expert * sequences + sequence) * capacity + place
        rows = torch.where(place < capacity, rows, size)
        return rows.view(sequences, top_k, positions).transpose(1, 2).reshape(-1)


def dispatch(tokens: torch.Tensor, rows: torch.Tensor, size: int, top_k: int) -> torch.Tensor:
    """The buffer of `size` rows the experts run on: row r holds the token whose routed copy claimed it, zeros where
    none did. `tokens`: (tokens, hidden); `rows`: capacity_rows' (one per routed copy)."""
    with torch.no_grad():
        count = tokens.shape[0]
        token_of_row = torch.full((size + 1,), count, dtype=torch.long, device=tokens.device)
        copies = torch.arange(rows.numel(), device=tokens.device) // top_k
        token_of_row.scatter_(0, rows, copies)  # the dropped ones all land on the extra row, which is cut off
        token_of_row = token_of_row[:size].clone()
    padded = torch.cat((tokens, tokens.new_zeros(1, tokens.shape[1])))
    return padded.index_select(0, token_of_row)


def combine(outputs: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's output: its routed copies' expert outputs read back from the buffer (`outputs`, as dispatch laid
    it out), weighted and summed; a dropped copy adds nothing. `weights`: (tokens, top-k)."""
    padded = torch.cat((outputs, outputs.new_zeros(1, outputs.shape[1])))
    weighted = padded.index_select(0, rows) * weights.reshape(-1, 1)
    return weighted.view(*weights.shape, -1).sum(dim=1)
