"""Model states per rank (parameters, gradients, optimizer state) and the buffers a strategy adds, per engine.

Each engine's rules live in their own module: `paper_states` (the ZeRO paper's accounting, as shardscope's teaching
strategies allocate it), `torch_states` (DistributedDataParallel, ZeroRedundancyOptimizer, FSDP2) and
`deepspeed_states` (DeepSpeed's own estimators). Besides the states, each says what is gathered and which unsharded
gradients are in flight at the moments of backward that `memory` compares. The in-flight terms were read off
measured peaks of real gloo runs (`shardscope validate`), each naming the mechanism it stands for.
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
    walks_block_backward: bool = False
    """Whether the top block's backward is seen at its MLP's backward and at its reduce-scatter (FSDP2) rather than
    as one coarse moment."""
    top_reduce_scatter_bytes: int = 0
    """At the top block's reduce-scatter: the reduce-scatter input and output shard (NCCL), and under gloo the
    input's clone less the block's gathered parameters, resharded by then (see `torch_states._fully_sharded`)."""
    gloo_clone_moments: bool = False
    """Whether the bottom block's and the root's reduce-scatters are moments of their own: gloo's reduce-scatter
    holds a clone of its whole input besides it (see `torch_states._fully_sharded`)."""
    root_reduce_scatter_bytes: int = 0
    """At the root's reduce-scatter (gloo): the gathered root, and the root's input with gloo's clone of it."""
    root_landed_grads_bytes: int = 0
    """Every block's gradient shard, landed when the root reduce-scatters."""
    bottom_block_moment: bool = False
    """Whether the bottom block's backward (the last block to run it) is a moment of its own for this engine."""
    bottom_buffers_bytes: int = 0
    """Gathered parameters and communication buffers while the bottom block runs backward."""
    bottom_landed_grads_bytes: int = 0
    """Gradients of the blocks above that have landed (sharded) when the bottom block runs backward."""
    bottom_grads_bytes: int = 0
    """Unsharded gradients in flight while the bottom block runs backward (beyond the landed ones)."""
    bottom_reduce_scatter_bytes: int = 0
    """At the bottom block's reduce-scatter (gloo): the root and the block gathered, its reduce-scatter input and
    gloo's clone of it."""
    after_backward_buffers_bytes: int = 0
    """Buffers of the reduce-scatters that run after backward (the teaching ZeRO-1), with every gradient whole; 0 when
    the strategy has none."""
    recompute_grads_bytes: int = 0
    """Under checkpointing, the top block's own gradients, made while its recomputed activations are still whole
    (measured for DDP; the sharded engines hand each unit's gradients on as they land)."""
    forward_staging_bytes: int = 0
    """The last all-gather's flat output, held until the loss runs (FSDP2 without resharding after forward)."""
    first_block_buffers_bytes: int = 0
    """Gathered while the first block runs forward, with the next block prefetched and both all-gathers' flat outputs
    held (FSDP2 without resharding after forward); 0 when not a moment of its own."""
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
    'optimizer+params', the parameter and gradient shards) live in host memory and are updated there."""
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
