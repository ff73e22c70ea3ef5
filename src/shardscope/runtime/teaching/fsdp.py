"""ZeRO stage 3 (= FSDP full shard) and HSDP from collectives.

Each unit keeps only its shard of a padded flat buffer. Before the unit runs forward, its shards are all-gathered into
a whole buffer that the parameters view; after forward the buffer's storage is freed (resized to 0), so tensors
autograd saved still point at it, and it is gathered again into the same storage just before the unit's backward.
When the unit's last gradient lands, its gradients are reduce-scattered into the rank's gradient shard and the
whole buffer is freed. The root unit (embeddings, final norm, head) stays gathered from the start of forward to the
end of backward, because both ends of the model use it (on a pipeline rank, `root_held_for_step`, from the step's
first forward to its last backward: the micro-batches in flight there share it). From the second backward of a step
on (a pipeline's micro-batches), a unit's reduced gradients are added to its shard. HSDP does the same inside groups
of `shard_group` ranks and all-reduces the gradient shards across the groups.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardscope.measure.storage import measured_as
from shardscope.runtime.collectives import all_gather_single, reduce_scatter_single
from shardscope.runtime.teaching.flat import FlatLayout, ShardOptimizer, Unit, units_and_groups
from shardscope.runtime.teaching.zero import accumulate_into
from shardscope.runtime.trainer import Trainer
from shardscope.specs import TrainingSpec


def hsdp_groups(
    shard_group: int, data_groups: list[list[int]]
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(this rank's shard group, its replica group) inside its data group: shard groups are consecutive ranks of
    the data group, replicas share an index in them; (None, None) when one shard group is the whole data group, so
    the caller shards over that. `data_groups` are every data group's ranks (the world alone, or under tensor
    parallelism one per tp slice): every rank creates every group, in the same order, as torch.distributed requires."""
    rank = dist.get_rank()
    mine_shard: Any = None
    mine_replica: Any = None
    if all(len(ranks) == shard_group for ranks in data_groups):
        return None, None
    for ranks in data_groups:
        for start in range(0, len(ranks), shard_group):
            group = dist.new_group(ranks[start : start + shard_group])
            if rank in ranks[start : start + shard_group]:
                mine_shard = group
    for ranks in data_groups:
        for index in range(shard_group):
            group = dist.new_group(ranks[index::shard_group])
            if rank in ranks[index::shard_group]:
                mine_replica = group
    return mine_shard, mine_replica


class FullyShardedTeaching(Trainer):
    """zero3 over shard_pg (None: the world); hsdp when replica_pg is given, across which the gradient shards are
    averaged. `units` and `unit_groups` replace model_units(module) and shard some units over their own group (expert
    parallelism's experts over the ranks of their shard group holding the same experts, each shard then averaged
    across replica_pg as the others); gradients are divided by the data-parallel size all the same. The ranks must
    start from the same weights (broadcast them first)."""

    def __init__(
        self,
        module: nn.Module,
        training: TrainingSpec,
        shard_pg: dist.ProcessGroup | None = None,
        replica_pg: dist.ProcessGroup | None = None,
        *,
        units: list[Unit] | None = None,
        unit_groups: list[dist.ProcessGroup | None] | None = None,
        root_held_for_step: bool = False,
    ) -> None:
        self.module, self.shard_pg, self.replica_pg = module, shard_pg, replica_pg
        self.replicas = 1 if replica_pg is None else dist.get_world_size(replica_pg)
        self.world_size = dist.get_world_size(shard_pg) * self.replicas
        self.root_held_for_step = root_held_for_step
        units, self.groups = units_and_groups(module, shard_pg, units, unit_groups)
        self.layouts = [
            FlatLayout(unit, shard_degree=dist.get_world_size(group))
            for unit, group in zip(units, self.groups, strict=True)
        ]
        self.shards, self.whole, self.grad_shards = [], [], []
        for layout, group in zip(self.layouts, self.groups, strict=True):
            full = layout.flatten(layout.unit.params)
            with measured_as("parameters"):
                self.shards.append(layout.shard(full, dist.get_rank(group)).clone())
            with measured_as("buffers"):
                whole = torch.empty_like(full)
            layout.point_params_at(whole)
            whole.untyped_storage().resize_(0)
            self.whole.append(whole)
            with measured_as("gradients"):
                self.grad_shards.append(torch.zeros_like(self.shards[-1]))
        self.pending = [len(layout.unit.params) for layout in self.layouts]
        self.in_backward = [False] * len(self.layouts)
        self.reduced = [False] * len(self.layouts)  # the unit's shard holds a gradient of this step already
        for index, layout in enumerate(self.layouts):
            for param in layout.unit.params:
                param.register_post_accumulate_grad_hook(lambda _p, index=index: self._landed(index))
            layout.unit.module.register_forward_pre_hook(lambda _m, _a, index=index: self._gather(index))
            if layout.unit.name != "root":  # blocks free after forward and gather again before their backward
                layout.unit.module.register_forward_hook(
                    lambda _m, _a, out, index=index: self._after_forward(index, out)
                )
        self.optimizer = ShardOptimizer(self.shards, training)

    def _gather(self, index: int) -> None:
        whole = self.whole[index]
        if whole.untyped_storage().nbytes():
            return  # already gathered (the root in backward, or a block recomputed under checkpointing)
        whole.untyped_storage().resize_(whole.numel() * whole.element_size())
        with torch.no_grad():
            all_gather_single(whole, self.shards[index], group=self.groups[index])

    def _free(self, index: int) -> None:
        self.whole[index].untyped_storage().resize_(0)

    def _after_forward(self, index: int, out: torch.Tensor) -> None:
        if self.in_backward[index]:
            return  # a recompute under activation checkpointing: backward needs the parameters next
        self._free(index)
        if out.requires_grad:
            out.register_hook(lambda grad, index=index: self._before_backward(index, grad))

    def _before_backward(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        self.in_backward[index] = True
        self._gather(index)
        return grad

    def _landed(self, index: int) -> None:
        self.pending[index] -= 1
        if self.pending[index]:
            return
        layout = self.layouts[index]
        with measured_as("buffers"):
            flat_grad = layout.flatten([p.grad for p in layout.unit.params])  # type: ignore[misc]
        for param in layout.unit.params:
            param.grad = None
        if layout.unit.name != "root" or not self.root_held_for_step:
            self._free(index)
        group = self.groups[index]
        if self.reduced[index]:  # every replica adds its shard: the all-reduce sums them
            accumulate_into(
                layout.shard(flat_grad, dist.get_rank(group)), self.grad_shards[index], self.world_size // self.replicas
            )
        reduce_scatter_single(self.grad_shards[index], flat_grad, group=group)
        if self.replica_pg is not None:
            dist.all_reduce(self.grad_shards[index], group=self.replica_pg)
        self.grad_shards[index].div_(self.world_size)
        self.pending[index], self.in_backward[index], self.reduced[index] = len(layout.unit.params), False, True

    def reduce_accumulated(self) -> None:
        """A root held for the step is freed once its last backward has run."""
        for index, layout in enumerate(self.layouts):
            if layout.unit.name == "root":
                self._free(index)

    def step(self) -> None:
        self.optimizer.step(self.grad_shards)
        self.reduced = [False] * len(self.layouts)

    def held(self) -> dict[str, list[torch.Tensor]]:
        return {
            "parameters": list(self.shards),
            "gradients": list(self.grad_shards),
            "optimizer_state": self.optimizer.state(),
            "buffers": list(self.whole),
        }

    def resizable_buffers(self) -> list[torch.Tensor]:
        return list(self.whole)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for index, layout in enumerate(self.layouts):
            self._gather(index)
            for name, param in zip(layout.unit.names, layout.unit.params, strict=True):
                out[name] = param.detach().clone()
            self._free(index)
        return out
