"""The 'deepspeed' engine: DeepSpeed's own estimators, estimate_zero2_model_states_mem_needs and
estimate_zero3_model_states_mem_needs (deepspeed.runtime.zero).

4 bytes per parameter for 16-bit weights and gradients plus 16 per sharded parameter (fp32 master, momentum,
variance and an fp32 gradient partition), the largest layer gathered at 4 bytes per parameter under ZeRO-3, and host
memory times an additional buffer factor of 1.5 under offload. DeepSpeed's estimator treats stage 1 like stage 2.
"""

from __future__ import annotations

from shardscope.core.model_states import ModelStates, dtype_bytes, optimizer_moments
from shardscope.core.params import model_facts
from shardscope.core.sharding import flat_shard_numel, largest_module_numel
from shardscope.specs import Scenario

DEEPSPEED_BUFFER_FACTOR = 1.5  # additional_buffer_factor in DeepSpeed's estimators


def deepspeed_states(scenario: Scenario) -> ModelStates:
    """Model states of one rank (every rank holds the same) and host memory under offload."""
    training, strategy, cluster = scenario.training, scenario.strategy, scenario.cluster
    total, layout = model_facts(scenario.model)
    weight = dtype_bytes(training.precision)
    fp32_grads = 4 if training.is_mixed else 0
    master = 4 if training.is_mixed else 0
    moment = 4 if training.is_mixed else weight
    stage = strategy.stage
    shard = flat_shard_numel(total, scenario.shard_degree) if stage else total
    largest = largest_module_numel(layout) if layout else 0
    optimizer_state = shard * (master + optimizer_moments(training.optimizer) * moment)
    if stage < 3:
        # The estimator counts full 16-bit weights and gradients for stages 1 and 2 (4 bytes per parameter).
        parameters, gradients, gathered = total * weight, total * weight + shard * fp32_grads, 0
    else:
        parameters, gradients, gathered = shard * weight, shard * fp32_grads, 2 * largest * weight
    host = 0
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
        host = int(host_per_node) // cluster.ranks_per_node
    return ModelStates(
        parameters_bytes=parameters,
        gradients_bytes=gradients,
        optimizer_state_bytes=optimizer_state,
        forward_buffers_bytes=gathered,
        backward_buffers_bytes=gathered,
        boundary_buffers_bytes=gathered,
        gradients_persist=True,
        host_bytes=host,
    )
