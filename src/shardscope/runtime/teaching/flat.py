"""Flat buffers, the building block of the teaching strategies (the ZeRO paper's layout made real).

A unit (the root: embeddings, final norm and head; or one transformer block) keeps its parameters in one flat
buffer padded to a multiple of the shard degree D, so rank r owns elements [r*s, (r+1)*s) with s = ceil(P/D).
The parameters become views into the buffer, so the model runs unchanged while collectives move whole buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardscope.runtime.trainer import is_mixed, make_optimizer
from shardscope.specs import TrainingSpec


@dataclass
class Unit:
    """One FSDP-style unit: the module whose forward uses the parameters, and the parameters in creation order."""

    name: str
    module: nn.Module
    names: list[str]
    params: list[nn.Parameter]

    @property
    def numel(self) -> int:
        """Parameters in the unit."""
        return sum(p.numel() for p in self.params)


def model_units(model: nn.Module) -> list[Unit]:
    """The root unit (everything outside `layers`; none on a pipeline stage that holds only blocks) then one unit
    per block, like core.params.ParamLayout."""
    root_names, root_params = [], []
    for name, param in model.named_parameters():
        if not name.startswith("layers."):
            root_names.append(name)
            root_params.append(param)
    units = [Unit("root", model, root_names, root_params)] if root_params else []
    for index, block in enumerate(model.layers):  # type: ignore[arg-type]
        names, params = zip(*block.named_parameters(), strict=True)
        units.append(Unit(f"layers.{index}", block, [f"layers.{index}.{n}" for n in names], list(params)))
    return units


def units_and_groups(
    module: nn.Module,
    group: dist.ProcessGroup | None,
    units: list[Unit] | None = None,
    unit_groups: list[dist.ProcessGroup | None] | None = None,
) -> tuple[list[Unit], list[dist.ProcessGroup | None]]:
    """The units a strategy keeps (`model_units` unless given) and the group each is averaged or sharded over: its
    own where `unit_groups` names one (expert parallelism's experts, over the ranks holding the same experts), else
    the strategy's `group`."""
    units = model_units(module) if units is None else units
    own = [None] * len(units) if unit_groups is None else unit_groups
    return units, [group if unit_group is None else unit_group for unit_group in own]


class FlatLayout:
    """Where each parameter of a unit sits in its padded flat buffer, and which slice is rank r's shard."""

    def __init__(self, unit: Unit, shard_degree: int) -> None:
        self.unit = unit
        self.shard_degree = shard_degree
        self.shard_numel = math.ceil(unit.numel / shard_degree)
        self.padded_numel = self.shard_numel * shard_degree

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """One padded flat tensor holding tensors (shaped like the unit's parameters) end to end."""
        flat = torch.zeros(self.padded_numel, dtype=tensors[0].dtype, device=tensors[0].device)
        offset = 0
        for tensor in tensors:
            flat[offset : offset + tensor.numel()].copy_(tensor.detach().reshape(-1))
            offset += tensor.numel()
        return flat

    def point_params_at(self, flat: torch.Tensor) -> None:
        """Make every parameter of the unit a view into flat (which must be whole, not a shard)."""
        offset = 0
        for param in self.unit.params:
            param.data = flat[offset : offset + param.numel()].view(param.shape)
            offset += param.numel()

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of flat shaped like each parameter (e.g. a flat gradient buffer as per-parameter .grad)."""
        offset, out = 0, []
        for param in self.unit.params:
            out.append(flat[offset : offset + param.numel()].view(param.shape))
            offset += param.numel()
        return out

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank's slice of a whole flat buffer."""
        return flat[rank * self.shard_numel : (rank + 1) * self.shard_numel]


class ShardOptimizer:
    """The optimizer over a rank's shards: in place on the shards, or on an fp32 master copy under mixed precision
    (16-bit parameters and gradients, fp32 master weights and moments: the ZeRO paper's 2 + 2 + 12 bytes)."""

    def __init__(self, param_shards: list[torch.Tensor], training: TrainingSpec) -> None:
        self.param_shards = param_shards
        self.mixed = is_mixed(training)
        self.leaves = [shard.detach().float().clone() if self.mixed else shard for shard in param_shards]
        self.optimizer = make_optimizer(self.leaves, training)

    def step(self, grad_shards: list[torch.Tensor]) -> None:
        """One update from the (already averaged) gradient shards; writes the result back into the param shards."""
        for leaf, grad in zip(self.leaves, grad_shards, strict=True):
            leaf.grad = grad.float() if self.mixed else grad
        self.optimizer.step()
        for leaf, shard in zip(self.leaves, self.param_shards, strict=True):
            leaf.grad = None
            if self.mixed:
                with torch.no_grad():
                    shard.copy_(leaf)

    def state(self) -> list[torch.Tensor]:
        """Moments, step counters, and the master copy under mixed precision."""
        held = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return held + (self.leaves if self.mixed else [])
