"""Data parallelism from collectives: every rank holds the whole model and averages gradients with all-reduce.

`DataParallelNaive` all-reduces each gradient the moment autograd finishes it. `DataParallelBucket` keeps the
gradients of each unit in one flat buffer (the parameters' .grad are views into it, as with DDP's
gradient_as_bucket_view), and all-reduces a unit's buffer asynchronously as soon as its last gradient lands, so
communication overlaps the rest of backward. Given `units` and `unit_groups`, a unit is all-reduced over its own group
(expert parallelism's experts, over the ranks holding them), still divided by the world size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardscope.measure.storage import measured_as
from shardscope.runtime.teaching.flat import FlatLayout, ShardOptimizer, Unit, model_units, units_and_groups
from shardscope.runtime.trainer import Trainer, broadcast_module, make_optimizer, optimizer_state_tensors
from shardscope.specs import TrainingSpec


class DataParallelNaive(Trainer):
    """Broadcast once, then one blocking all-reduce per gradient from an autograd hook."""

    def __init__(self, module: nn.Module, training: TrainingSpec) -> None:
        self.module, self.world_size = module, dist.get_world_size()
        broadcast_module(module)
        for param in module.parameters():
            param.register_post_accumulate_grad_hook(self._all_reduce)
        self.optimizer = make_optimizer(list(module.parameters()), training)

    def _all_reduce(self, param: torch.Tensor) -> None:
        assert param.grad is not None
        dist.all_reduce(param.grad)
        param.grad.div_(self.world_size)

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def held(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.module.parameters())
        return {
            "parameters": params,
            "gradients": [p.grad for p in params if p.grad is not None],
            "optimizer_state": optimizer_state_tensors(self.optimizer),
            "buffers": [],
        }

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_parameters())


def flat_buffers(
    module: nn.Module, units: list[Unit] | None = None
) -> tuple[list[FlatLayout], list[torch.Tensor], list[torch.Tensor]]:
    """One flat parameter and one flat gradient buffer per unit (`model_units` unless given), the parameters and
    their .grad views into them: the gradients live from step to step, zeroed after each (DDP's
    gradient_as_bucket_view)."""
    layouts = [FlatLayout(unit, shard_degree=1) for unit in (model_units(module) if units is None else units)]
    with measured_as("parameters"):
        flat_params = [layout.flatten(layout.unit.params) for layout in layouts]
    with measured_as("gradients"):
        flat_grads = [torch.zeros_like(flat) for flat in flat_params]
    for layout, flat, grads in zip(layouts, flat_params, flat_grads, strict=True):
        layout.point_params_at(flat)
        for param, grad_view in zip(layout.unit.params, layout.views(grads), strict=True):
            param.grad = grad_view  # autograd now accumulates straight into the bucket
    return layouts, flat_params, flat_grads


class FlatBufferTrainer(Trainer):
    """A trainer whose parameters and gradients live in `flat_buffers` and whose ShardOptimizer steps on them."""

    flat_params: list[torch.Tensor]
    flat_grads: list[torch.Tensor]
    optimizer: ShardOptimizer

    def step(self) -> None:
        self.optimizer.step(self.flat_grads)
        for grads in self.flat_grads:
            grads.zero_()

    def held(self) -> dict[str, list[torch.Tensor]]:
        return {
            "parameters": list(self.flat_params),
            "gradients": list(self.flat_grads),
            "optimizer_state": self.optimizer.state(),
            "buffers": [],
        }


class DataParallelBucket(FlatBufferTrainer):
    """Flat parameter and gradient buffers per unit; a unit's gradients are all-reduced as one async call. The ranks
    must start from the same weights (broadcast them first)."""

    def __init__(
        self,
        module: nn.Module,
        training: TrainingSpec,
        *,
        units: list[Unit] | None = None,
        unit_groups: list[dist.ProcessGroup | None] | None = None,
    ) -> None:
        self.module, self.world_size = module, dist.get_world_size()
        units, self.groups = units_and_groups(module, None, units, unit_groups)
        self.layouts, self.flat_params, self.flat_grads = flat_buffers(module, units)
        self.works: list[dist.Work] = []
        for index, layout in enumerate(self.layouts):
            for param in layout.unit.params:
                param.register_post_accumulate_grad_hook(lambda _p, index=index: self._landed(index))
        self.pending = [len(layout.unit.params) for layout in self.layouts]
        self.optimizer = ShardOptimizer(self.flat_params, training)

    def _landed(self, index: int) -> None:
        self.pending[index] -= 1
        if self.pending[index] == 0:  # the unit's bucket is complete: start its all-reduce, don't wait
            work = dist.all_reduce(self.flat_grads[index], group=self.groups[index], async_op=True)
            assert work is not None
            self.works.append(work)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        for work in self.works:
            work.wait()
        self.works.clear()
        self.pending = [len(layout.unit.params) for layout in self.layouts]
        for grads in self.flat_grads:
            grads.div_(self.world_size)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_parameters())
