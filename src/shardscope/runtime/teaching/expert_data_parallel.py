"""Expert parallelism inside the teaching data-parallel strategies (ddp, zero1, zero2, zero3 / FSDP, hsdp), as
torchtitan composes it with FSDP.

The world's D ranks are cut into expert groups of `ep` consecutive ranks (expert_parallel.py): each MoE layer
sends its tokens to the experts over its group with all-to-alls. Every dense weight (root, attention, norms, router) is
treated by the strategy over all D ranks, as it would be alone; the rank's num_experts / ep experts of each layer are a
unit of their own, treated by the same strategy over the D / ep ranks that hold the same experts (one per expert
group): torchtitan's ParallelDims fully_shard()s the experts over dp_shard_mod_ep (pytorch/torchtitan,
torchtitan/distributed/parallel_dims.py, `_build_mesh_with_ep`, at commit 73bb964d8f66f585d977b40fe3de88301cdd03cd).
So a block is two units: its dense weights, then its experts (gathered, under zero3, before its MoE layer runs); the
experts' gradients are all-reduced (ddp) or reduce-scattered (zero1/2/3) over their own ranks, and every gradient is
divided by D (an expert's already sums its expert group's tokens). Under hsdp the experts are sharded over the ranks
of the rank's shard group that hold them (torchtitan's dp_shard_mod_ep inside dp_shard), then averaged across the
replica groups as every unit is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from shardscope.reference_models import TransformerLM
from shardscope.runtime.teaching.expert_parallel import ExpertParallelMoE, expert_groups, whole_experts
from shardscope.runtime.teaching.flat import Unit, model_units
from shardscope.runtime.trainer import SplitInsideDataParallel, Trainer, broadcast_module
from shardscope.specs import TrainingSpec

DataParallel = Callable[[list[Unit], list[dist.ProcessGroup | None]], Trainer]
"""A teaching data-parallel strategy made from the units it keeps and each unit's own group (None: the strategy's)."""


def expert_units(module: TransformerLM) -> list[Unit]:
    """model_units with each block cut in two: the block's dense weights (the block's unit, run by its forward),
    then its experts (a unit of the MoE layer's, run by the MoE layer's forward)."""
    units = []
    for unit in model_units(module):
        if unit.name == "root":
            units.append(unit)
            continue
        pairs = list(zip(unit.names, unit.params, strict=True))
        dense = [(name, param) for name, param in pairs if ".experts." not in name]
        experts = [(name, param) for name, param in pairs if ".experts." in name]
        moe = module.layers[int(unit.name.split(".")[1])].moe  # type: ignore[union-attr]
        for name, owner, members in ((unit.name, unit.module, dense), (f"{unit.name}.experts", moe, experts)):
            names, params = zip(*members, strict=True)
            units.append(Unit(name, owner, list(names), list(params)))  # type: ignore[arg-type]
    return units


class ExpertDataParallel(SplitInsideDataParallel):
    """A mixture-of-experts model trained with expert parallelism inside a teaching data-parallel strategy, which
    `data_parallel` makes; `shard_group` is the strategy's shard group (hsdp's; 0: the world)."""

    def __init__(
        self,
        module: TransformerLM,
        training: TrainingSpec,
        data_parallel: DataParallel,
        *,
        ep: int,
        shard_group: int = 0,
    ) -> None:
        self.module, self.world_size = module, dist.get_world_size()
        self.expert_group, expert_data_group = expert_groups(ep, shard_group)
        broadcast_module(module)  # every rank starts from rank 0's weights and keeps its experts of them
        for block in module.layers:
            block.moe = ExpertParallelMoE(block.moe, self.expert_group)  # type: ignore[union-attr]
        units = expert_units(module)
        self.data = data_parallel(
            units, [expert_data_group if unit.name.endswith(".experts") else None for unit in units]
        )

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return whole_experts(self.data.full_parameters(), self.expert_group)
