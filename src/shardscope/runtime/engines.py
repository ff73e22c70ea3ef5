"""Torch's own engines for the same strategies (engine 'pytorch'), measured exactly like the teaching ones.

ddp: DistributedDataParallel. zero1: DDP plus ZeroRedundancyOptimizer. zero2: FSDP2 `fully_shard` with
reshard_after_forward=False (parameters stay gathered from forward to backward, gradients are sharded). zero3/fsdp:
`fully_shard` with reshard_after_forward=True. hsdp: `fully_shard` on a 2-D (replicate, shard) DeviceMesh. With tp:
DTensor tensor parallelism by the trace's plan (shardscope.trace.tensor_parallel), then `fully_shard` over the
data-parallel axes of the same mesh, built by the trace's make_mesh (tp innermost); with cp, the teaching ring
attention (shardscope.trace.context_parallel) and fully_shard over the data-parallel axes and cp together. Mixed
precision through torch's own policies: autocast for DDP, MixedPrecisionPolicy for FSDP2. The FSDP2 internals read
here (the unsharded all-gather buffers) are private; `_fsdp_buffers` says which torch they need.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardscope.runtime.teaching.flat import model_units
from shardscope.runtime.trainer import (
    Trainer,
    broadcast_module,
    is_mixed,
    make_optimizer,
    optimizer_recipe,
    optimizer_state_tensors,
    param_dtype,
)
from shardscope.specs import Scenario, TrainingSpec


class TorchDDP(Trainer):
    """DistributedDataParallel, optionally with ZeroRedundancyOptimizer (zero1)."""

    def __init__(self, module: nn.Module, training: TrainingSpec, zero1: bool = False) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        self.world_size, self.mixed = dist.get_world_size(), is_mixed(training)
        self.ddp = DistributedDataParallel(module)  # broadcasts rank 0's parameters and buffers
        self.module = self.ddp
        self.raw = module
        params = list(module.parameters())
        if zero1:
            optimizer_class, kwargs = optimizer_recipe(training)
            self.optimizer: torch.optim.Optimizer = ZeroRedundancyOptimizer(params, optimizer_class, **kwargs)
        else:
            self.optimizer = make_optimizer(params, training)
        self.zero1 = zero1

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        if not self.mixed:
            return contextlib.nullcontext()
        device = next(self.raw.parameters()).device.type
        return torch.autocast(device_type=device, dtype=torch.bfloat16)  # type: ignore[return-value]

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def held(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.raw.parameters())
        state = optimizer_state_tensors(self.optimizer.optim if self.zero1 else self.optimizer)  # type: ignore[attr-defined]
        return {
            "parameters": params,
            "gradients": [p.grad for p in params if p.grad is not None],
            "optimizer_state": state,
            "buffers": [],
        }

    def hidden_buffer_bytes(self) -> int:
        """DDP's reducer buckets live in C++; their sizes are read from same-shaped copies the reducer hands out."""
        buckets = self.ddp.reducer._get_zeros_like_grad_buckets()
        return sum(bucket.buffer().numel() * bucket.buffer().element_size() for bucket in buckets)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.raw.named_parameters())


class TorchFSDP2(Trainer):
    """FSDP2 `fully_shard` per block and on the root, on a 1-D mesh (zero2/zero3) or a 2-D mesh (hsdp)."""

    def __init__(
        self, module: nn.Module, training: TrainingSpec, reshard_after_forward: bool, shard_group: int = 0
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.world_size = dist.get_world_size()
        device = next(module.parameters()).device.type
        broadcast_module(module)  # fully_shard assumes every rank starts equal; it does not broadcast
        if shard_group and shard_group != self.world_size:
            mesh = init_device_mesh(
                device, (self.world_size // shard_group, shard_group), mesh_dim_names=("replicate", "shard")
            )
        else:
            mesh = init_device_mesh(device, (self.world_size,), mesh_dim_names=("shard",))
        self._shard(module, training, mesh, reshard_after_forward)

    def _shard(self, module: nn.Module, training: TrainingSpec, mesh: Any, reshard_after_forward: bool) -> None:
        """fully_shard every block and the root over a (data-parallel) mesh, and make the optimizer."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy()
        if is_mixed(training):
            policy = MixedPrecisionPolicy(param_dtype=param_dtype(training), reduce_dtype=torch.float32)
        for block in module.layers:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        self.module = module
        self.optimizer = make_optimizer(list(module.parameters()), training)

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def held(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.module.parameters())
        return {
            "parameters": params,
            "gradients": [p.grad for p in params if p.grad is not None],
            "optimizer_state": optimizer_state_tensors(self.optimizer),
            "buffers": self._fsdp_buffers(),
        }

    def resizable_buffers(self) -> list[torch.Tensor]:
        return self._fsdp_buffers()

    def _fsdp_buffers(self) -> list[torch.Tensor]:
        return fsdp_buffers(self.module)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {name: param.full_tensor() for name, param in self.module.named_parameters()}  # type: ignore[operator]


def fsdp_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The unsharded all-gather outputs FSDP2 resizes in place (private: torch 2.6 to 2.13 FSDPParam)."""
    found: list[torch.Tensor] = []
    for unit in model_units(module):
        state = unit.module._get_fsdp_state()  # type: ignore[operator]
        for group in getattr(state, "_fsdp_param_groups", []) or []:
            for fsdp_param in group.fsdp_params:
                found.extend(getattr(fsdp_param, "all_gather_outputs", []))
    return found


class TorchTensorParallel(TorchFSDP2):
    """torchtitan's llama tensor-parallel plan (the trace's, shardscope.trace.tensor_parallel) over the mesh's tp
    axis and the teaching ring attention over its cp axis (shardscope.trace.context_parallel), then FSDP2 over its
    data-parallel axes and cp; the loss and its backward run under loss_parallel, on the rank's tokens under cp."""

    def __init__(self, module: nn.Module, scenario: Scenario) -> None:
        from shardscope.trace.setup import make_mesh, sharding_mesh, split_model

        self.world_size, self.scenario = dist.get_world_size(), scenario
        strategy = scenario.strategy
        broadcast_module(module)  # distribute_tensor keeps each rank's own slice of what it holds: start equal
        self.mesh = make_mesh(scenario, next(module.parameters()).device.type)
        self.split = split_model(module, self.mesh, scenario)[1]
        reshard = strategy.reshard_after_forward and strategy.stage == 3
        self._shard(module, scenario.training, sharding_mesh(self.mesh, scenario), reshard)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from shardscope.trace.tensor_parallel import loss_context

        if self.split is not None:
            inputs, targets = self.split.rank_tokens(inputs, targets)
        with loss_context(self.scenario):
            return super().loss(inputs, targets)

    def backward(self, loss: torch.Tensor) -> None:
        from shardscope.trace.tensor_parallel import loss_context

        with loss_context(self.scenario):
            loss.backward()
