"""Model states per rank (parameters, gradients, optimizer state) and the buffers a strategy adds, per engine.

- 'paper': "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (Rajbhandari et al.), Section 3 and
  Figure 1: mixed-precision Adam holds 2 + 2 + K bytes per parameter with K = 12 (fp32 master, momentum, variance);
  stage 1 shards the K bytes, stage 2 also the gradients, stage 3 also the parameters, each over N ranks. Flat
  buffers are padded to a multiple of N, as shardscope's teaching strategies allocate them.
- 'pytorch': what DistributedDataParallel, ZeroRedundancyOptimizer and FSDP2 `fully_shard` allocate: mixed
  precision keeps fp32 parameters (autocast or a MixedPrecisionPolicy computes in 16 bits), Adam keeps a scalar step
  tensor per parameter, DDP keeps a bucket copy of the gradients, FSDP2 pads every parameter's dim 0.
- 'deepspeed': DeepSpeed's own estimators (estimate_zero2_model_states_mem_needs and
  estimate_zero3_model_states_mem_needs in deepspeed.runtime.zero): 4 bytes per parameter for 16-bit weights and
  gradients plus 16 per sharded parameter, the largest layer gathered at 4 bytes per parameter under ZeRO-3, and
  host memory times an additional buffer factor of 1.5 under offload.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardscope.core.params import ParamLayout, model_facts
from shardscope.core.sharding import (
    dim0_shards,
    dim0_unit_sizes,
    flat_shard_numel,
    largest_module_numel,
    whole_tensor_shards,
)
from shardscope.specs import Scenario

STEP_TENSOR_BYTES = 4  # torch's Adam keeps `step` as a float32 scalar tensor per parameter tensor
DEEPSPEED_BUFFER_FACTOR = 1.5  # additional_buffer_factor in DeepSpeed's estimators


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelStates:
    """What one rank holds for the model itself under a strategy, before activations."""

    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    persistent_buffers_bytes: int
    """Buffers that live through the whole step (DDP's gradient buckets)."""
    forward_buffers_bytes: int
    """Gathered parameters live at the busiest moment of forward."""
    backward_buffers_bytes: int
    """Gathered parameters and unsharded gradients live at the busiest moment of backward."""
    forward_temporary_bytes: int
    """Autocast's 16-bit weight copies, cached for the whole forward."""
    optimizer_temporary_bytes: int
    """Workspace of the optimizer step."""
    gradients_persist: bool
    """Gradients stay allocated between steps (flat buffers), so they are live during forward too."""
    host_bytes: int
    """Host memory for this rank under offload."""


def _moments(optimizer: str) -> int:
    return {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}[optimizer]


def _dtype_bytes(precision: str) -> int:
    """Bytes of the stored weights and gradients when the engine keeps them in the working dtype."""
    return {"fp32": 4, "fp64": 8}.get(precision, 2)


def _paper(scenario: Scenario, total: int, layout: ParamLayout | None) -> ModelStates:
    training, strategy = scenario.training, scenario.strategy
    weight = _dtype_bytes(training.precision)
    master = 4 if training.is_mixed else 0
    moment = 4 if training.is_mixed else weight
    optimizer_per_param = master + _moments(training.optimizer) * moment
    shard = flat_shard_numel(total, scenario.shard_degree)
    stage = strategy.stage
    parameters = (shard if stage >= 3 else total) * weight
    gradients = (shard if stage >= 2 else total) * weight
    optimizer_numel = shard if stage >= 1 else total
    optimizer_state = optimizer_numel * optimizer_per_param
    unit = layout.largest_unit_numel if layout else 0
    forward_buffers = unit * weight if stage >= 3 else 0
    backward_buffers = 2 * unit * weight if stage >= 3 else 0
    # The step works one flat buffer (or, unsharded, one parameter tensor) at a time: Adam's denominator, and the
    # fp32 copy of the gradient under mixed precision.
    if stage >= 3 and layout is not None:
        step_numel = flat_shard_numel(unit, scenario.shard_degree)
    elif stage >= 1 or layout is None:
        step_numel = optimizer_numel
    else:
        step_numel = layout.largest_tensor_numel
    temporary = step_numel * (moment + (4 if training.is_mixed else 0)) if _moments(training.optimizer) else 0
    return _offload(
        scenario,
        ModelStates(
            parameters_bytes=parameters,
            gradients_bytes=gradients,
            optimizer_state_bytes=optimizer_state,
            persistent_buffers_bytes=0,
            forward_buffers_bytes=forward_buffers,
            backward_buffers_bytes=backward_buffers,
            forward_temporary_bytes=0,
            optimizer_temporary_bytes=temporary,
            gradients_persist=True,
            host_bytes=0,
        ),
    )


def _pytorch(scenario: Scenario, rank: int, total: int, layout: ParamLayout | None) -> ModelStates:
    training, strategy = scenario.training, scenario.strategy
    stored = 2 if training.precision == "bf16" else _dtype_bytes(training.precision)  # mixed keeps fp32 weights
    compute = _dtype_bytes(training.precision)
    moments = _moments(training.optimizer)
    step_bytes = STEP_TENSOR_BYTES if training.optimizer in ("adam", "adamw") else 0
    if strategy.stage <= 1:
        return _offload(scenario, _pytorch_replicated(scenario, rank, total, layout, stored, compute, step_bytes))
    degree = scenario.shard_degree
    if layout is None:  # a bare parameter count: one flat shard, no unit sizes to gather
        padded = local = flat_shard_numel(total, degree)
        tensors_with_rows, root_unit, block_unit, num_blocks = 1, 0, 0, 0
    else:
        shards = dim0_shards(layout, degree, rank)
        padded, local, tensors_with_rows = shards.padded_numel, shards.local_numel, shards.tensors_with_rows
        root_unit, block_unit = dim0_unit_sizes(layout, degree)
        num_blocks = layout.num_blocks
    largest_unit = max(root_unit, block_unit)
    if strategy.reshard_after_forward and strategy.name != "zero2":
        forward_buffers = 2 * largest_unit * compute  # the unit computing and the prefetched next one
    else:
        forward_buffers = (root_unit + num_blocks * block_unit) * compute  # everything stays gathered
    # Backward: the gathered unit and its prefetched neighbour, plus the unit's unsharded gradient and the
    # reduce-scatter input it is copied into.
    backward_buffers = max(forward_buffers, 2 * largest_unit * compute) + 2 * largest_unit * compute
    return _offload(
        scenario,
        ModelStates(
            parameters_bytes=padded * stored,
            gradients_bytes=padded * stored,
            optimizer_state_bytes=local * moments * stored + tensors_with_rows * step_bytes,
            persistent_buffers_bytes=0,
            forward_buffers_bytes=forward_buffers,
            backward_buffers_bytes=backward_buffers,
            forward_temporary_bytes=0,
            optimizer_temporary_bytes=local * stored if moments else 0,
            gradients_persist=False,
            host_bytes=0,
        ),
    )


def _pytorch_replicated(
    scenario: Scenario, rank: int, total: int, layout: ParamLayout | None, stored: int, compute: int, step_bytes: int
) -> ModelStates:
    """DistributedDataParallel, alone (ddp) or with ZeroRedundancyOptimizer (zero1)."""
    training, strategy = scenario.training, scenario.strategy
    moments = _moments(training.optimizer)
    if strategy.stage == 0:
        optimizer_numel, optimizer_tensors = total, layout.tensor_count if layout else 1
    elif layout is not None:
        shards = whole_tensor_shards(layout, scenario.cluster.world_size)
        optimizer_numel, optimizer_tensors = shards.numel_per_rank[rank], shards.tensors_per_rank[rank]
    else:  # a bare parameter count: an even split is the best available assumption
        optimizer_numel, optimizer_tensors = flat_shard_numel(total, scenario.shard_degree), 1
    bucket = 0 if strategy.gradient_as_bucket_view else total * stored
    autocast_cache = (layout.matrix_numel if layout else total) * compute if training.is_mixed else 0
    return ModelStates(
        parameters_bytes=total * stored,
        gradients_bytes=total * stored,
        optimizer_state_bytes=optimizer_numel * moments * stored + optimizer_tensors * step_bytes,
        persistent_buffers_bytes=bucket,
        forward_buffers_bytes=0,
        backward_buffers_bytes=0,
        forward_temporary_bytes=autocast_cache,
        optimizer_temporary_bytes=optimizer_numel * stored if moments else 0,
        gradients_persist=False,
        host_bytes=0,
    )


def _deepspeed(scenario: Scenario, total: int, layout: ParamLayout | None) -> ModelStates:
    training, strategy, cluster = scenario.training, scenario.strategy, scenario.cluster
    weight = _dtype_bytes(training.precision)
    fp32_grads = 4 if training.is_mixed else 0
    master = 4 if training.is_mixed else 0
    moment = 4 if training.is_mixed else weight
    shard = flat_shard_numel(total, scenario.shard_degree) if scenario.strategy.stage else total
    largest = largest_module_numel(layout) if layout else 0
    optimizer_state = shard * (master + _moments(training.optimizer) * moment)
    stage = strategy.stage
    if stage < 3:
        # DeepSpeed's estimator counts full 16-bit weights and gradients for stages 1 and 2 (4 bytes per parameter).
        parameters, gradients, buffers = total * weight, total * weight + shard * fp32_grads, 0
    else:
        parameters, gradients, buffers = shard * weight, shard * fp32_grads, 2 * largest * weight
    host = 0
    per_node = cluster.ranks_per_node
    if strategy.offload != "none":
        if stage < 3:
            host_per_node = total * max(4 * cluster.world_size, 16) * DEEPSPEED_BUFFER_FACTOR
            gradients, optimizer_state = 0, 0
        elif strategy.offload == "optimizer":
            host_per_node = total * 16 / cluster.num_nodes * DEEPSPEED_BUFFER_FACTOR
            gradients, optimizer_state = 0, 0
        else:
            host_per_node = total * 18 / cluster.num_nodes * DEEPSPEED_BUFFER_FACTOR
            parameters, gradients, optimizer_state = 0, 0, 0
        host = int(host_per_node) // per_node
    return ModelStates(
        parameters_bytes=parameters,
        gradients_bytes=gradients,
        optimizer_state_bytes=optimizer_state,
        persistent_buffers_bytes=0,
        forward_buffers_bytes=buffers,
        backward_buffers_bytes=buffers,
        forward_temporary_bytes=0,
        optimizer_temporary_bytes=0,
        gradients_persist=True,
        host_bytes=host,
    )


def _offload(scenario: Scenario, states: ModelStates) -> ModelStates:
    """ZeRO-Offload ("ZeRO-Offload: Democratizing Billion-Scale Model Training"): the optimizer state (and, with
    'optimizer+params', the parameter and gradient shards) live in host memory and are updated there."""
    offload = scenario.strategy.offload
    if offload == "none":
        return states
    moved = replace(
        states, optimizer_state_bytes=0, optimizer_temporary_bytes=0, host_bytes=states.optimizer_state_bytes
    )
    if offload == "optimizer":
        return moved
    return replace(
        moved,
        parameters_bytes=0,
        gradients_bytes=0,
        host_bytes=moved.host_bytes + states.parameters_bytes + states.gradients_bytes,
    )


def model_states(scenario: Scenario, rank: int) -> ModelStates:
    """Model states of one rank under the scenario's strategy and engine."""
    model = scenario.model
    total, layout = model_facts(model)
    engine = scenario.strategy.engine
    if engine == "paper":
        return _paper(scenario, total, layout)
    if engine == "deepspeed":
        return _deepspeed(scenario, total, layout)
    return _pytorch(scenario, rank, total, layout)
