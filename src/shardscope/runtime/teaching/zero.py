"""ZeRO stages 1 and 2 from collectives (ZeRO: Memory Optimizations Toward Training Trillion Parameter Models).

Both keep the whole model in per-unit flat buffers padded to a multiple of the N ranks of their group (the world, or
under tensor parallelism the ranks holding the same slice), and the optimizer only for the rank's shard (ceil(P/N)
elements of each buffer). After the update, an all-gather rebuilds the parameters. The ranks must start from the same
weights (broadcast them first).
Stage 1 keeps full gradients and reduce-scatters them after backward; stage 2 reduce-scatters each unit's gradients
as soon as they are complete and keeps only its own gradient shard (adding to it from the second backward of a
step on: a pipeline's micro-batches, `accumulate_into`). Given `units` and `unit_groups`, a unit is sharded
over its own group (expert parallelism's experts, over the ranks holding them), still divided by the N of `group`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardscope.measure.storage import measured_as
from shardscope.runtime.collectives import all_gather_single, reduce_scatter_single
from shardscope.runtime.teaching.flat import FlatLayout, ShardOptimizer, Unit, units_and_groups
from shardscope.runtime.trainer import Trainer
from shardscope.specs import TrainingSpec


def accumulate_into(own_slice: torch.Tensor, shard: torch.Tensor, divisor: int) -> None:
    """Make the shard's gradient so far ride along in the reduce-scatter that overwrites it: this rank adds it,
    times the divisor of the mean, to its own slice of the flat gradients, so that the reduced and averaged shard
    is the new mean plus the old (no second shard-sized buffer)."""
    own_slice.add_(shard, alpha=divisor)


class _ShardedOptimizerBase(Trainer):
    """Whole parameters in flat buffers, the optimizer on this rank's shard of each, all-gather after the step."""

    def __init__(
        self,
        module: nn.Module,
        training: TrainingSpec,
        group: dist.ProcessGroup | None = None,
        *,
        units: list[Unit] | None = None,
        unit_groups: list[dist.ProcessGroup | None] | None = None,
    ) -> None:
        self.module, self.world_size = module, dist.get_world_size(group)
        units, self.groups = units_and_groups(module, group, units, unit_groups)
        self.layouts = [
            FlatLayout(unit, shard_degree=dist.get_world_size(unit_group))
            for unit, unit_group in zip(units, self.groups, strict=True)
        ]
        self.ranks = [dist.get_rank(unit_group) for unit_group in self.groups]
        with measured_as("parameters"):
            self.flat_params = [layout.flatten(layout.unit.params) for layout in self.layouts]
        for layout, flat in zip(self.layouts, self.flat_params, strict=True):
            layout.point_params_at(flat)
        self.optimizer = ShardOptimizer(
            [self._mine(index, flat) for index, flat in enumerate(self.flat_params)], training
        )
        self._keep_gradients()

    def _keep_gradients(self) -> None:
        """Allocate what the stage keeps of the gradients, and hook where it reduces them."""
        raise NotImplementedError

    def _mine(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of unit `index`'s whole flat buffer `flat`."""
        return self.layouts[index].shard(flat, self.ranks[index])

    def _reduce_scatter(self, index: int, flat_grad: torch.Tensor, out: torch.Tensor) -> None:
        reduce_scatter_single(out, flat_grad, group=self.groups[index])
        out.div_(self.world_size)

    def _all_gather_params(self) -> None:
        for index, flat in enumerate(self.flat_params):
            with measured_as("buffers"):
                mine = self._mine(index, flat).clone()  # a separate send buffer: input must not alias output
            all_gather_single(flat, mine, group=self.groups[index])

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_parameters())


class Zero1(_ShardedOptimizerBase):
    """Stage 1: full gradients in flat buffers; after backward each is reduce-scattered and the rank keeps its
    averaged shard in place."""

    def _keep_gradients(self) -> None:
        with measured_as("gradients"):
            self.flat_grads = [torch.zeros_like(flat) for flat in self.flat_params]
        for layout, grads in zip(self.layouts, self.flat_grads, strict=True):
            for param, grad_view in zip(layout.unit.params, layout.views(grads), strict=True):
                param.grad = grad_view

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.reduce_accumulated()

    def reduce_accumulated(self) -> None:
        for index, (layout, grads) in enumerate(zip(self.layouts, self.flat_grads, strict=True)):
            with measured_as("buffers"):
                reduced = torch.empty(layout.shard_numel, dtype=grads.dtype, device=grads.device)
            self._reduce_scatter(index, grads, reduced)
            self._mine(index, grads).copy_(reduced)

    def step(self) -> None:
        self.optimizer.step([self._mine(index, grads) for index, grads in enumerate(self.flat_grads)])
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

    def _keep_gradients(self) -> None:
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
            accumulate_into(self._mine(index, flat_grad), self.grad_shards[index], self.world_size)
        self._reduce_scatter(index, flat_grad, self.grad_shards[index])
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
