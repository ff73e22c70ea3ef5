"""What every strategy, ours or torch's, offers the worker: a loss, a backward that syncs gradients, an optimizer
step, and the tensors it holds by DESIGN.md category, so the worker measures them all the same way."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from shardscope.reference_models import lm_loss
from shardscope.specs import TrainingSpec

LEARNING_RATE = 1e-2  # large enough that a wrong update shows up in parity, small enough to stay finite


def optimizer_recipe(training: TrainingSpec) -> tuple[type[torch.optim.Optimizer], dict[str, object]]:
    """The TrainingSpec's optimizer class and its arguments: torch's defaults, single-tensor kernels so every
    layout (flat shards, per-parameter tensors) rounds alike."""
    if training.optimizer == "adamw":
        return torch.optim.AdamW, {"lr": LEARNING_RATE, "foreach": False}
    if training.optimizer == "adam":
        return torch.optim.Adam, {"lr": LEARNING_RATE, "foreach": False}
    momentum = 0.9 if training.optimizer == "sgd-momentum" else 0.0
    return torch.optim.SGD, {"lr": LEARNING_RATE, "momentum": momentum, "foreach": False}


def make_optimizer(params: list[torch.Tensor], training: TrainingSpec) -> torch.optim.Optimizer:
    """The TrainingSpec's optimizer over params."""
    optimizer_class, kwargs = optimizer_recipe(training)
    return optimizer_class(params, **kwargs)  # type: ignore[arg-type]


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in an optimizer's state (moments and step counters)."""
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


def broadcast_module(module: nn.Module, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Copy rank src's parameters to every rank, so ranks that started from different weights agree."""
    with torch.no_grad():
        for param in module.parameters():
            dist.broadcast(param.data, src=src, group=group)


def is_mixed(training: TrainingSpec) -> bool:
    """16-bit compute with an fp32 master copy."""
    return training.precision in ("bf16-mixed", "fp16-mixed")


def param_dtype(training: TrainingSpec) -> torch.dtype:
    """The dtype the model's parameters are stored in on a rank."""
    return {
        "fp64": torch.float64,
        "fp32": torch.float32,
        "bf16-mixed": torch.bfloat16,
        "bf16": torch.bfloat16,
        "fp16-mixed": torch.float16,
    }[training.precision]


class Trainer:
    """One rank's training: subclasses wrap a model and say what they hold."""

    module: nn.Module
    world_size: int
    phase_listener: Callable[[str], None] | None = None
    """Told the phase of each action by a strategy that runs forwards and backwards inside `loss` (a pipeline)."""

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward on this rank's micro-batch."""
        with self.autocast():
            return lm_loss(self.module(inputs), targets)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Torch engines under mixed precision compute in 16 bits here; teaching ones store 16-bit weights."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward and whatever gradient communication the strategy does, finished when this returns."""
        loss.backward()

    def reduce_accumulated(self) -> None:
        """The gradient communication left once the step's last backward has run, called instead of `backward` by a
        pipeline, which runs its micro-batches' backwards itself: none where hooks reduced each backward's."""

    def step(self) -> None:
        """Optimizer update, parameter communication, and clearing the gradients for the next step."""
        raise NotImplementedError

    def held(self) -> dict[str, list[torch.Tensor]]:
        """Tensors held now, by category: parameters, gradients, optimizer_state, buffers."""
        raise NotImplementedError

    def hidden_buffer_bytes(self) -> int:
        """Buffer bytes no Python tensor shows (DDP's C++ buckets); held for the whole run."""
        return 0

    def resizable_buffers(self) -> list[torch.Tensor]:
        """Buffers whose storage grows and shrinks in place (gathered units); measured at every op."""
        return []

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, by name (may communicate; called on every rank)."""
        raise NotImplementedError


class SplitInsideDataParallel(Trainer):
    """A trainer that splits the model itself (its tensors, its experts) and leaves the gradients, the step and what
    is held to the data-parallel strategy `data` it made over the pieces."""

    data: Trainer

    def backward(self, loss: torch.Tensor) -> None:
        self.data.backward(loss)

    def step(self) -> None:
        self.data.step()

    def held(self) -> dict[str, list[torch.Tensor]]:
        return self.data.held()

    def resizable_buffers(self) -> list[torch.Tensor]:
        return self.data.resizable_buffers()
