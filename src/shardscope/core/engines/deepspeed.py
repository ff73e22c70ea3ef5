"""The 'deepspeed' engine: DeepSpeed's own estimators as of DeepSpeed 0.19.6 (the release whose source was read),
estimate_zero2_model_states_mem_needs (deepspeed/runtime/zero/stage_1_and_2.py) and
estimate_zero3_model_states_mem_needs (deepspeed/runtime/zero/stage3.py), and what its ZeRO stages send.

ZeRO-1/2 without offload: 2 bytes per parameter for the 16-bit weights plus 18 per sharded parameter (16-bit and
fp32 gradient partitions, fp32 master, momentum and variance), 2P + 18P/N; ZeRO-3: 18 per sharded parameter and the
largest layer gathered at 4 bytes per parameter; host memory times an additional buffer factor of 1.5 under offload.
DeepSpeed's estimator treats stage 1 like stage 2 (releases before 0.19 counted the 16-bit gradients whole: 4P +
16P/N).
ZeRO-1/2 reduce and gather in buckets of 5e8 elements; ZeRO-3 partitions each parameter flat, padded to the degree.
"""

from __future__ import annotations

from shardscope.choices import EngineName
from shardscope.core.comm_events import (
    CommEvent,
    gradient_reductions,
    per_tensor_broadcasts,
    size_buckets,
    step_gathers,
)
from shardscope.core.engines.base import RankMemory, RulesDefaults, shared_memory
from shardscope.core.expert_parallel import expert_parallel_states
from shardscope.core.model_states import ModelStates, dtype_bytes, optimizer_moments
from shardscope.core.params import ParamTensor, rank_facts, rank_layout
from shardscope.core.result import CollectiveRow
from shardscope.core.sharded_calls import sharded_events
from shardscope.core.sharding import ceil_div, flat_shard_numel, largest_module_numel
from shardscope.specs import Scenario

DEEPSPEED_BUFFER_FACTOR = 1.5  # additional_buffer_factor in DeepSpeed's estimators
# DeepSpeed ZeRO-1/2 defaults: reduce_bucket_size and allgather_bucket_size are 5e8 elements (DeepSpeed config docs).
DEEPSPEED_BUCKET_NUMEL = 500_000_000


class DeepSpeedRules(RulesDefaults):
    """DeepSpeed's estimators and ZeRO communication: 16-bit weights and gradients move, every collective blocks."""

    name: EngineName = "deepspeed"
    summary = "DeepSpeed's own estimators (largest layer gathered under ZeRO-3, 1.5x host buffers)"
    fused_optimizer = True  # DeepSpeed's fused Adam reads and writes each state once
    torch_engines = False

    def rank_memory(self, scenario: Scenario, rank: int) -> RankMemory:
        return shared_memory(scenario, self.rank_states(scenario, rank))

    def rank_states(self, scenario: Scenario, rank: int) -> ModelStates:
        """Every rank holds the same."""
        return expert_parallel_states(scenario, _states(scenario))

    def gradient_buckets(self, scenario: Scenario) -> tuple[tuple[int, int], ...]:
        """The 5e8-element reduce bucket, filled walking the parameters in reverse."""
        element = self.grad_comm_bytes(scenario)
        return size_buckets(rank_layout(scenario), element, [DEEPSPEED_BUCKET_NUMEL * element])

    def step_events(self, scenario: Scenario) -> list[CommEvent]:
        """ZeRO-1/2: buckets reduce-scattered as they fill, then the flat partition all-gathered in allgather buckets;
        ZeRO-3: per-unit all-gathers (the root again for backward) and reduce-scatters."""
        stage, layout = scenario.strategy.stage, rank_layout(scenario)
        grad, param = self.grad_comm_bytes(scenario), self.param_comm_bytes(scenario)
        if stage == 3:
            degree = scenario.shard_degree

            def padded(tensors: tuple[ParamTensor, ...]) -> int:
                return sum(ceil_div(tensor.numel, degree) * degree for tensor in tensors)

            gathered = (padded(layout.root), padded(layout.block))
            return sharded_events(scenario, gathered, param, grad, regather_root=True)
        buckets = self.gradient_buckets(scenario)
        events = gradient_reductions(scenario, buckets, grad, all_reduce=stage == 0, after_whole_backward=False)
        if stage == 0:
            return events
        total = layout.total_numel
        pieces = [
            (min(DEEPSPEED_BUCKET_NUMEL, total - start), "parameters")
            for start in range(0, total, DEEPSPEED_BUCKET_NUMEL)
        ]
        return events + step_gathers(scenario, pieces, param)

    def setup_rows(self, scenario: Scenario) -> list[CollectiveRow]:
        """DeepSpeed's `_broadcast_model`: every parameter tensor from rank 0."""
        return per_tensor_broadcasts(scenario, dtype_bytes(scenario.training.precision))

    def optimizer_tensors(self, scenario: Scenario) -> int:
        """Flat partitions, counted as the tensors of the rank's shard."""
        tensors = rank_layout(scenario).tensor_count
        degree = scenario.parallelism.dp_shard
        return tensors if degree == 1 else -(-tensors // degree)


def _states(scenario: Scenario) -> ModelStates:
    """Model states of one rank (every rank holds the same) and host memory under offload."""
    training, strategy, cluster = scenario.training, scenario.strategy, scenario.cluster
    total, layout = rank_facts(scenario)
    weight = dtype_bytes(training.precision)
    fp32_grads = 4 if training.is_mixed else 0
    master = 4 if training.is_mixed else 0
    moment = 4 if training.is_mixed else weight
    stage = strategy.stage
    shard = flat_shard_numel(total, scenario.shard_degree) if stage else total
    largest = largest_module_numel(layout) if layout else 0
    optimizer_state = shard * (master + optimizer_moments(training.optimizer) * moment)
    if stage < 3:
        # The estimator counts whole 16-bit weights and partitioned gradients (16-bit and fp32) for stages 1 and 2.
        parameters, gradients, gathered = total * weight, shard * (weight + fp32_grads), 0
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
