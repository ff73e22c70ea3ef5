"""Model states per rank (parameters, gradients, optimizer state) and the buffers a strategy adds.

Every engine (`shardscope.core.engines`) fills one `ModelStates`: what it holds, what is gathered and which unsharded
gradients are in flight at the moments every engine shares (`core.engines.base`). What only one engine's mechanism
makes stays in that engine's module, with the moments it adds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardscope.specs import Scenario

STEP_TENSOR_BYTES = 4  # torch's Adam keeps `step` as a float32 scalar tensor per parameter tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelStates:
    """What one rank holds for the model itself under a strategy, before activations."""

    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    persistent_buffers_bytes: int = 0
    """Buffers that live through the whole step (DDP's gradient buckets)."""
    forward_buffers_bytes: int = 0
    """Gathered parameters when forward ends (the root unit, or everything when nothing reshards)."""
    backward_buffers_bytes: int = 0
    """Gathered parameters while the top block runs backward."""
    boundary_buffers_bytes: int = 0
    """Gathered parameters between the top two blocks' backward (one finishing, the next gathered)."""
    backward_grads_bytes: int = 0
    """Unsharded gradients in flight while the top block runs backward (beyond `gradients_bytes`)."""
    boundary_grads_bytes: int = 0
    """Unsharded gradients in flight between the top two blocks' backward."""
    recompute_grads_bytes: int = 0
    """Under checkpointing, the top block's own gradients, made while its recomputed activations are still whole
    (measured for DDP; the sharded engines hand each unit's gradients on as they land)."""
    forward_temporary_bytes: int = 0
    """Autocast's 16-bit weight copies, cached for the whole forward."""
    optimizer_temporary_bytes: int = 0
    """Workspace of the optimizer step."""
    autocast: bool = False
    """Mixed precision by torch.autocast over fp32 weights (torch's DDP), which saves more for backward."""
    gradients_persist: bool = False
    """Gradients stay allocated between steps (flat buffers), so they are live during forward too."""
    host_bytes: int = 0
    """Host memory for this rank under offload."""


def optimizer_moments(optimizer: str) -> int:
    """Moment tensors per parameter: Adam 2, SGD with momentum 1, SGD 0."""
    return {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}[optimizer]


def step_tensor_bytes(optimizer: str) -> int:
    """Bytes of Adam's step counter per optimizer tensor (0 for SGD)."""
    return STEP_TENSOR_BYTES if optimizer in ("adam", "adamw") else 0


def dtype_bytes(precision: str) -> int:
    """Bytes of one element in the working dtype of a precision (16-bit for the mixed and bf16 modes)."""
    return {"fp32": 4, "fp64": 8}.get(precision, 2)


def offload(scenario: Scenario, states: ModelStates) -> ModelStates:
    """ZeRO-Offload ("ZeRO-Offload: Democratizing Billion-Scale Model Training"): the optimizer state (and, with
    'optimizer+params', the parameter and gradient shards) live in host memory and are updated there. Every engine
    calls it last on its states, so it first puts expert parallelism's shards right (core/expert_parallel.py)."""
    from shardscope.core.expert_parallel import expert_parallel_states  # it builds on this module

    states = expert_parallel_states(scenario, states)
    mode = scenario.strategy.offload
    if mode == "none":
        return states
    moved = replace(
        states, optimizer_state_bytes=0, optimizer_temporary_bytes=0, host_bytes=states.optimizer_state_bytes
    )
    if mode == "optimizer":
        return moved
    return replace(
        moved,
        parameters_bytes=0,
        gradients_bytes=0,
        host_bytes=moved.host_bytes + states.parameters_bytes + states.gradients_bytes,
    )


KEPT_STATES_LIMIT = 4096
"""Entries a states cache holds before it starts over (a planner sweep asks for a few hundred settings)."""
