"""ZeRO stages 1 and 2 from collectives (ZeRO: Memory Optimizations Toward Training Trillion Parameter Models).

Both keep the whole model in per-unit flat buffers padded to a multiple of the N ranks of their group (the world, or
under tensor parallelism the ranks holding the same slice), and the optimizer only for the rank's shard (ceil(P/N)
elements of each buffer). After the update, an all-gather rebuilds the parameters. The ranks must start from the same
weights (broadcast them first).
Stage 1 keeps full gradients and reduce-scatters them after backward; stage 2 reduce-scatters each unit's gradients
as soon as they are complete and keeps only its own gradient shard (adding to it from the second backward of a
step on: a pipeline's micro-batches, `accumulate_into`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardscope.measure.storage import measured_as
from shardscope.runtime.collectives import all_gather_single, reduce_scatter_single
from shardscope.runtime.teaching.flat import FlatLayout, ShardOptimizer, model_units
from shardscope.runtime.trainer import Trainer
from shardscope.specs import TrainingSpec


def accumulate_into(own_slice: torch.Tensor, shard: torch.Tensor, divisor: int) -> None:
    """Make the shard's gradient so far ride along in the reduce-scatter that overwrites it: this rank adds it,
    times the divisor of the mean, to its own slice of the flat gradients, so that the reduced and averaged shard
    is the new mean plus the old (no second shard-sized buffer)."""
    own_slice.add_(shard, alpha=divisor)


class _ShardedOptimizerBase(Trainer):
    """Whole parameters in flat buffers, the optimizer on this rank's shard of each, all-gather after the step."""

    def __init__(self, module: nn.Module, training: TrainingSpec, group: dist.ProcessGroup | None = None) -> None:
        self.module, self.group = module, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.layouts = [FlatLayout(unit, shard_degree=self.world_size) for unit in model_units(module)]
        with measured_as("parameters"):
            self.flat_params = [layout.flatten(layout.unit.params) for layout in self.layouts]
        for layout, flat in zip(self.layouts, self.flat_params, strict=True):
            layout.point_params_at(flat)
        shards = [layout.shard(flat, self.rank) for layout, flat in zip(self.layouts, self.flat_params, strict=True)]
        self.optimizer = ShardOptimizer(shards, training)

    def _reduce_scatter(self, flat_grad: torch.Tensor, out: torch.Tensor) -> None:
        reduce_scatter_single(out, flat_grad, group=self.group)
        out.div_(self.world_size)

    def _all_gather_params(self) -> None:
        for layout, flat in zip(self.layouts, self.flat_params, strict=True):
            with measured_as("buffers"):
                mine = layout.shard(flat, self.rank).clone()  # a separate send buffer: input must not alias output
            all_gather_single(flat, mine, group=self.group)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_parameters())


class Zero1(_ShardedOptimizerBase):
    """Stage 1: full gradients in flat buffers; after backward each is reduce-scattered and the rank keeps its
    averaged shard in place."""

    def __init__(self, module: nn.Module, training: TrainingSpec, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(module, training, group)
        with measured_as("gradients"):
            self.flat_grads = [torch.zeros_like(flat) for flat in self.flat_params]
        for layout, grads in zip(self.layouts, self.flat_grads, strict=True):
            for param, grad_view in zip(layout.unit.params, layout.views(grads), strict=True):
                param.grad = grad_view

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.reduce_accumulated()

    def reduce_accumulated(self) -> None:
        for layout, grads in zip(self.layouts, self.flat_grads, strict=True):
            with measured_as("buffers"):
                reduced = torch.empty(layout.shard_numel, dtype=grads.dtype, device=grads.device)
            self._reduce_scatter(grads, reduced)
            layout.shard(grads, self.rank).copy_(reduced)

    def step(self) -> None:
        self.optimizer.step(
            [layout.shard(g, self.rank) for layout, g in zip(self.layouts, self.flat_grads, strict=True)]
        )
        self._all_gather_params()
        for grads in self.flat_grads:
            grads.zero_()

    def held(self) -> dict[str, list[torch.Tensor]]:
        return {
            "parameters": list(self.flat_params),
            "gradients": list(self.flat_grads),
            "optimizer_state": self.optimizer.state(),
            "buffers": [],
        }


class Zero2(_ShardedOptimizerBase):
    """Stage 2: when a unit's last gradient lands, flatten its gradients, reduce-scatter them into the rank's
    persistent gradient shard, and drop the full gradients."""

    def __init__(self, module: nn.Module, training: TrainingSpec, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(module, training, group)
        with measured_as("gradients"):
            self.grad_shards = [
                torch.zeros(layout.shard_numel, dtype=flat.dtype, device=flat.device)
                for layout, flat in zip(self.layouts, self.flat_params, strict=True)
            ]
        self.pending = [len(layout.unit.params) for layout in self.layouts]
        self.reduced = [False] * len(self.layouts)  # the unit's shard holds a gradient of this step already
        for index, layout in enumerate(self.layouts):
            for param in layout.unit.params:
                param.register_post_accumulate_grad_hook(lambda _p, index=index: self._landed(index))

    def _landed(self, index: int) -> None:
        self.pending[index] -= 1
        if self.pending[index]:
            return
        layout = self.layouts[index]
        with measured_as("buffers"):
            flat_grad = layout.flatten([p.grad for p in layout.unit.params])  # type: ignore[misc]
        for param in layout.unit.params:
            param.grad = None
        if self.reduced[index]:
            accumulate_into(layout.shard(flat_grad, self.rank), self.grad_shards[index], self.world_size)
        self._reduce_scatter(flat_grad, self.grad_shards[index])
        self.pending[index], self.reduced[index] = len(layout.unit.params), True

    def step(self) -> None:
        self.optimizer.step(self.grad_shards)
        self._all_gather_params()
        self.reduced = [False] * len(self.layouts)

    def held(self) -> dict[str, list[torch.Tensor]]:
        return {
            "parameters": list(self.flat_params),
            "gradients": list(self.grad_shards),
            "optimizer_state": self.optimizer.state(),
            "buffers": [],
        }
