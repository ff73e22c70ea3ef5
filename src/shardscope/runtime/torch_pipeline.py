"""torch.distributed.pipelining on real ranks (engine 'pytorch' with pp above 1), built as the trace replays it.

The stages, their FSDP2 sharding over the data-parallel axes and the schedule (ScheduleGPipe, Schedule1F1B or
ScheduleInterleaved1F1B) come from shardscope.trace.pipeline, so a run and a replay build the same thing; here the
stages are cut from a real model whose weights every rank takes from rank 0 first. The schedule runs every forward
and backward of the step's micro-batches inside `loss` (torch splits the rank's batch into them), reduces the
gradients over the data-parallel ranks after the last backward and divides them by the number of micro-batches
(scale_grads), so the step trains as one process on the whole batch does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardscope.core.pipeline import rank_stages
from shardscope.reference_models import TransformerLM
from shardscope.runtime.engines import TorchFSDP2, fsdp_buffers
from shardscope.runtime.trainer import broadcast_module, make_optimizer
from shardscope.specs import Scenario


class TorchPipeline(TorchFSDP2):
    """One pipeline rank's stages of torch's pipelining, each sharded with fully_shard over its data-parallel ranks
    (pp is the outermost mesh axis: rank r is pipeline rank r // (world / pp))."""

    def __init__(self, module: TransformerLM, scenario: Scenario) -> None:
        from shardscope.trace.pipeline import (
            cut_stage,
            data_parallel_mesh,
            make_schedule,
            pipeline_mesh,
            shard_stages,
        )
        from shardscope.trace.pipeline_hooks import watch_messages

        self.world_size, self.scenario = dist.get_world_size(), scenario
        broadcast_module(module)  # fully_shard does not broadcast: every rank starts from rank 0's weights
        device = next(module.parameters()).device
        self.mesh = pipeline_mesh(scenario, device.type)
        pp_rank = dist.get_rank() // (self.world_size // scenario.strategy.pp)
        self.stages = rank_stages(scenario, pp_rank)
        modules = [cut_stage(module, stage, stage.first_layer) for stage in self.stages]
        shard_stages(modules, scenario, data_parallel_mesh(self.mesh, scenario))
        self.module = nn.ModuleList(modules)
        self.optimizer = make_optimizer(list(self.module.parameters()), scenario.training)
        self.torch_stages, self.schedule = make_schedule(
            scenario, self.stages, modules, device, self.mesh.get_group("pp")
        )
        self.message_phases: dict[int, str] = {}
        for stage in self.torch_stages:
            watch_messages(stage, self.message_phases)
            self._tell_phases(stage)
        self.first = any(stage.embedding for stage in self.stages)
        self.last = any(stage.head for stage in self.stages)

    def _tell_phases(self, stage: Any) -> None:
        """Tell the run's measurement whether each action is a forward or a backward, as it starts."""
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

        def forward_one_chunk(*args: Any, **kwargs: Any) -> Any:
            if self.phase_listener is not None:
                self.phase_listener("forward")
            return forward(*args, **kwargs)

        def backward_one_chunk(*args: Any, **kwargs: Any) -> Any:
            if self.phase_listener is not None:
                self.phase_listener("backward")
            return backward(*args, **kwargs)

        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Run the step's schedule; returns the mean of the micro-batches' losses on the last stage (zero
        elsewhere)."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.first else ()
        self.schedule.step(*args, target=targets if self.last else None, losses=losses, return_outputs=False)
        if not losses:
            return torch.zeros((), dtype=torch.float64)
        return torch.stack([loss.detach() for loss in losses]).mean()

    def backward(self, loss: torch.Tensor) -> None:
        """The schedule ran every backward and reduced the gradients in `loss`."""

    def _fsdp_buffers(self) -> list[torch.Tensor]:
        return [buffer for module in self.module for buffer in fsdp_buffers(module)]

    def held(self) -> dict[str, list[torch.Tensor]]:
        from shardscope.trace.pipeline_hooks import receive_buffers

        held = super().held()
        held["buffers"] = [*held["buffers"], *receive_buffers(self.torch_stages)]
        return held

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the whole model by name: each pipeline rank's own, gathered over its data-parallel
        ranks, then to all."""
        own: dict[str, torch.Tensor] = {}
        for stage, module in zip(self.stages, self.module, strict=True):
            for name, param in module.named_parameters():
                whole = param.full_tensor().detach().clone()  # type: ignore[operator]
                if name.startswith("layers."):
                    _, local, rest = name.split(".", 2)
                    name = f"layers.{stage.first_layer + int(local)}.{rest}"
                own[name] = whole
        first_of_its_group = dist.get_rank() % (self.world_size // self.scenario.strategy.pp) == 0
        everyone: list[dict[str, torch.Tensor]] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(everyone, own if first_of_its_group else {})
        return {name: tensor for piece in everyone for name, tensor in piece.items()}
