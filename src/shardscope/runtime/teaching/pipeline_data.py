"""The data-parallel side of a teaching pipeline rank: the strategy that holds, reduces and updates the rank's
parameters over the ranks of its pipeline rank holding the same tp slice (the grid's data group), made of the
teaching strategies as for a whole model.

Gradients accumulate over the step's micro-batches. ddp and ZeRO-1 keep whole flat gradient buffers and reduce them
once, after the last backward (DDP's no_sync on the others). ZeRO-2, ZeRO-3 and HSDP reduce-scatter each unit's
gradients after every micro-batch's backward and add them to the rank's shard. Under ZeRO-3 and HSDP the root unit
(the embeddings, or the final norm and head) is gathered once a step and stays whole until its last backward: the
micro-batches in flight on the rank share it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from shardscope.runtime.teaching.ddp import FlatBufferTrainer, flat_buffers
from shardscope.runtime.teaching.flat import ShardOptimizer
from shardscope.runtime.teaching.fsdp import FullyShardedTeaching, hsdp_groups
from shardscope.runtime.teaching.pipeline import PipelineGrid
from shardscope.runtime.teaching.zero import Zero1, Zero2
from shardscope.runtime.trainer import Trainer
from shardscope.specs import Scenario, TrainingSpec

DataParallel = Callable[[nn.Module, PipelineGrid], Trainer]


class AccumulatingDDP(FlatBufferTrainer):
    """ddp on a pipeline rank: the parameters and gradients in flat per-unit buffers, the gradients all-reduced unit
    by unit once the last backward has run (blocks last to first, then the root: DDP's bucket order)."""

    def __init__(self, module: nn.Module, training: TrainingSpec, group: dist.ProcessGroup) -> None:
        self.module, self.group, self.world_size = module, group, dist.get_world_size(group)
        self.layouts, self.flat_params, self.flat_grads = flat_buffers(module)
        self.optimizer = ShardOptimizer(self.flat_params, training)

    def reduce_accumulated(self) -> None:
        if self.world_size == 1:
            return
        has_root = self.layouts[0].unit.name == "root"
        for grads in [*self.flat_grads[1:][::-1], self.flat_grads[0]] if has_root else self.flat_grads[::-1]:
            dist.all_reduce(grads, group=self.group)
            grads.div_(self.world_size)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_parameters())


def pipeline_data_parallel(scenario: Scenario) -> DataParallel:
    """The teaching strategy of the scenario's name over a pipeline rank's data group."""
    strategy, training = scenario.strategy, scenario.training

    def fully_sharded(module: nn.Module, grid: PipelineGrid) -> Trainer:
        shard, replica = hsdp_groups(strategy.shard_group, grid.data_ranks) if strategy.shard_group else (None, None)
        return FullyShardedTeaching(module, training, shard or grid.data_group, replica, root_held_for_step=True)

    strategies: dict[str, DataParallel] = {
        "ddp": lambda module, grid: AccumulatingDDP(module, training, grid.data_group),
        "zero1": lambda module, grid: Zero1(module, training, grid.data_group),
        "zero2": lambda module, grid: Zero2(module, training, grid.data_group),
        "zero3": fully_sharded,
        "hsdp": fully_sharded,
    }
    return strategies[strategy.canonical_name]
