"""Expert parallelism from collectives: each MoE layer's experts split over an expert group, tokens sent to them.

A rank of an expert group of `ep` ranks keeps num_experts / ep experts of every MoE layer (the router, attention and
norms stay whole). Its MoE layer, for its own tokens:
1. routes them: the router's top-k experts per token and their renormalised weights, as the reference MoE does;
2. sorts the k copies of its tokens by expert (so by the rank that holds the expert) and swaps with every rank of the
   group how many rows each sends to each expert (an all-to-all of num_experts counts);
3. dispatches: one all-to-all sends every row to the rank holding its expert (gloo runs all_to_all_single on CPU);
4. runs each local expert on the rows it received, from every rank of the group;
5. combines: the reverse all-to-all brings every output back to the rank its token came from, which weights the k
   outputs of each token and adds them up.
Backward sends the gradients through the same two all-to-alls in reverse (`_AllToAll`, whose conjugate is itself
with the splits swapped). Routing is dropless: no capacity, no token dropped (core/expert_parallel.py predicts it).
Under the model's capacity rule (expert_routing.py) steps 2 and 3 send a buffer of fixed size instead: every expert's
capacity rows of each of the rank's sequences, padded, so no counts are swapped and every rank sends and receives
num_experts / ep x sequences x capacity rows to and from each rank of the group.

expert_data_parallel.py trains a model so inside each teaching data-parallel strategy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardscope.expert_routing import capacity_rows, combine, dispatch, route
from shardscope.reference_models import MoE


class _AllToAll(torch.autograd.Function):
    """Rows of `x` sent by `send_splits` to the group's ranks, rows received by `recv_splits`; backward sends the
    gradients back the same way with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _AllToAll.apply(grad, ctx.recv, ctx.send, ctx.group), None, None, None


class ExpertParallelMoE(nn.Module):
    """One MoE layer on one rank of an expert group: the whole router, its num_experts / ep experts."""

    def __init__(self, moe: MoE, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group, self.ep, index = group, dist.get_world_size(group), dist.get_rank(group)
        self.top_k, self.num_experts = moe.top_k, len(moe.experts)
        self.local = self.num_experts // self.ep
        self.expert_capacity = moe.expert_capacity
        self.router = moe.router
        self.experts = nn.ModuleList(moe.experts[index * self.local : (index + 1) * self.local])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = route(self.router, tokens, self.top_k)
        capacity = self.expert_capacity(x.shape[1])
        if capacity:
            return self._capacity_forward(x, tokens, weights, chosen, capacity)
        # 2. the tokens x k rows in expert order, and the row counts the group swaps
        order = chosen.reshape(-1).argsort(stable=True)
        counts = torch.bincount(chosen.reshape(-1), minlength=self.num_experts)
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)
        send = counts.view(self.ep, self.local).sum(dim=1).tolist()
        recv = received_counts.view(self.ep, self.local).sum(dim=1).tolist()
        # 3. dispatch
        received = _AllToAll.apply(tokens[order // self.top_k], send, recv, self.group)
        # 4. the local experts, each on its rows from every rank (sender-major, then expert by expert)
        expert_of_row = torch.arange(self.local, device=x.device).repeat(self.ep)
        expert_of_row = expert_of_row.repeat_interleave(received_counts)
        out = torch.zeros_like(received)
        for index, expert in enumerate(self.experts):  # even on no rows: every expert then has a gradient
            rows = (expert_of_row == index).nonzero(as_tuple=True)[0]
            out = out.index_add(0, rows, expert(received[rows]).to(out.dtype))
        # 5. combine: the outputs back home, weighted, k per token summed
        back = _AllToAll.apply(out, recv, send, self.group)
        weighted = back * weights.reshape(-1)[order, None]
        return torch.zeros_like(tokens).index_add(0, order // self.top_k, weighted.to(tokens.dtype)).view_as(x)

    def _capacity_forward(
        self, x: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, capacity: int
    ) -> torch.Tensor:
        """The capacity rule's layer: the expert-major buffer (experts x sequences x capacity rows) split evenly over
        the group, each local expert run on its rows from every rank, the outputs sent back and combined."""
        sequences = x.shape[0]
        rows = capacity_rows(chosen.view(sequences, x.shape[1], self.top_k), self.num_experts, capacity)
        buffer = dispatch(tokens, rows, self.num_experts * sequences * capacity, self.top_k)
        even = [self.local * sequences * capacity] * self.ep
        received = _AllToAll.apply(buffer, even, even, self.group).view(self.ep, self.local, sequences * capacity, -1)
        outputs = [expert(received[:, index].reshape(-1, x.shape[-1])) for index, expert in enumerate(self.experts)]
        # back to sender-major: (ep, local, sequences x capacity, hidden)
        out = torch.stack([each.view(self.ep, -1, x.shape[-1]) for each in outputs], dim=1)
        out = out.to(tokens.dtype).reshape(-1, x.shape[-1])
        back = _AllToAll.apply(out, even, even, self.group)
        return combine(back, rows, weights).view_as(x)


def expert_groups(ep: int, shard_group: int = 0) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's expert group: ep consecutive ranks, the innermost of dp_shard as torchtitan's dp_shard_in_ep;
    the ranks of its shard group holding the same experts: one per expert group). Shard groups are `shard_group`
    consecutive ranks (hsdp's; 0: the world). Every rank creates every group, in order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    shard = shard_group or world
    if world % shard or shard % ep:
        raise ValueError(f"ep({ep}) must divide the shard group({shard}), which must divide the world size({world})")
    mine: dict[str, dist.ProcessGroup] = {}
    for kind, lists in (
        ("experts", [list(range(start, start + ep)) for start in range(0, world, ep)]),
        (
            "data",
            [list(range(first + index, first + shard, ep)) for first in range(0, world, shard) for index in range(ep)],
        ),
    ):
        for ranks in lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group
    return mine["experts"], mine["data"]


def whole_experts(params: dict[str, torch.Tensor], expert_group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Every parameter under the reference model's names, each local expert gathered over the expert group (the
    rank at index i of the group holds experts i * local to (i + 1) * local - 1). Called on every rank."""
    out, ep = {}, dist.get_world_size(expert_group)
    local_experts = {name.split(".experts.")[1].split(".")[0] for name in params if ".experts." in name}
    for name, param in params.items():
        if ".experts." not in name:
            out[name] = param.detach().clone()
            continue
        head, rest = name.split(".experts.")
        local, tail = rest.split(".", 1)
        pieces = [torch.empty_like(param) for _ in range(ep)]
        dist.all_gather(pieces, param.detach().contiguous(), group=expert_group)
        for owner, piece in enumerate(pieces):
            out[f"{head}.experts.{owner * len(local_experts) + int(local)}.{tail}"] = piece
    return out
