"""The 'pytorch' engine: what DistributedDataParallel (ddp), ZeroRedundancyOptimizer over DDP (zero1) and FSDP2
`fully_shard` (zero2, zero3, hsdp; see `fsdp2`) allocate and send.

Mixed precision keeps fp32 parameters (autocast computes in 16 bits for DDP; a MixedPrecisionPolicy for FSDP2, whose
reduce dtype is fp32, torchtitan's default), Adam keeps a 4-byte step per parameter tensor, DDP keeps one bucket copy
of the gradients (unless gradient_as_bucket_view: its reducer allocates it once, before the first backward, and reuses
it); ZeroRedundancyOptimizer gives whole tensors to ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import NamedTuple

from shardscope.choices import EngineName
from shardscope.core.activations import INDEX_BYTES, ActivationEstimate
from shardscope.core.comm_events import (
    DDP_FIRST_BUCKET_BYTES,
    CommEvent,
    Place,
    event,
    gradient_reductions,
    per_tensor_broadcasts,
    size_buckets,
)
from shardscope.core.engines.base import (
    Moment,
    RankMemory,
    RulesDefaults,
    TimePlace,
    shared_memory,
)
from shardscope.core.engines.fsdp2 import fsdp2_memory, fsdp2_states, single_tensor_step_bytes
from shardscope.core.engines.fsdp2_pipeline import (
    fsdp2_pipeline_events,
    fsdp2_pipeline_moments,
    fsdp2_pipeline_rows,
)
from shardscope.core.engines.pipeline_load import PipelineCalls, PipelineLoad, StageRows
from shardscope.core.kept import kept
from shardscope.core.model_states import (
    KEPT_STATES_LIMIT,
    ModelStates,
    dtype_bytes,
    offload,
    optimizer_moments,
    step_tensor_bytes,
)
from shardscope.core.params import ParamLayout, head_numel, rank_facts, rank_layout
from shardscope.core.pipeline import PipelineStage
from shardscope.core.rank_share import rank_share
from shardscope.core.result import CollectiveRow
from shardscope.core.sharded_calls import sharded_events
from shardscope.core.sharding import dim0_unit_sizes, flat_shard_numel, whole_tensor_shards
from shardscope.presets.hardware import HardwareProfile
from shardscope.specs import Scenario

# DistributedDataParallel.__init__ broadcasts rank 0's module states in 250 MiB buckets (its broadcast_bucket_size).
DDP_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


def runs_on_ddp(scenario: Scenario) -> bool:
    """ddp and zero1 run on DistributedDataParallel (zero1 under ZeroRedundancyOptimizer); the stages that shard
    gradients on FSDP2's fully_shard."""
    return scenario.strategy.stage <= 1


class PyTorchRules(RulesDefaults):
    """torch's own engines."""

    name: EngineName = "pytorch"
    summary = "what DDP, ZeroRedundancyOptimizer and FSDP2 fully_shard allocate (fp32 weights when mixed)"
    fused_optimizer = False
    torch_engines = True
    parameters_sharded_from_stage = 2  # zero2 is fully_shard(reshard_after_forward=False): sharded at rest

    def rank_memory(self, scenario: Scenario, rank: int) -> RankMemory:
        if not runs_on_ddp(scenario):
            return fsdp2_memory(scenario, rank)
        return shared_memory(scenario, self.rank_states(scenario, rank))

    def rank_states(self, scenario: Scenario, rank: int) -> ModelStates:
        if not runs_on_ddp(scenario):
            return fsdp2_states(scenario, rank)
        return _offloaded_replicated(scenario, rank)

    def floor_states(self, scenario: Scenario) -> ModelStates:
        """ZeroRedundancyOptimizer's busiest rank is known only from the greedy assignment of every tensor, which a
        planner sweep would make at every GPU count: the floor takes the least its optimizer share can be instead, the
        largest tensor or an even share of the elements, whichever is more, in one tensor (the busiest rank holds at
        least the average, and at least the rank that took the largest tensor)."""
        if scenario.strategy.stage != 1 or not scenario.model.has_shape or not runs_on_ddp(scenario):
            return super().floor_states(scenario)
        layout = rank_layout(scenario)
        least = max(layout.largest_tensor_numel, flat_shard_numel(layout.total_numel, scenario.state_ranks))
        return offload(scenario, _replicated(scenario, 0, OptimizerShare(least, 1, 0)))

    def busiest_rank(self, scenario: Scenario) -> int:
        """ZeroRedundancyOptimizer's uneven assignment of whole tensors makes one rank the busiest."""
        if not self.optimizer_shard_numels(scenario):
            return 0
        return _most_loaded_rank(rank_layout(scenario), scenario.state_ranks)

    def optimizer_shard_numels(self, scenario: Scenario) -> tuple[int, ...] | None:
        """ZeroRedundancyOptimizer gives whole tensors to ranks, so ranks hold different amounts."""
        if scenario.strategy.stage != 1 or not scenario.model.has_shape:
            return None
        return whole_tensor_shards(rank_layout(scenario), scenario.state_ranks).numel_per_rank

    def param_comm_bytes(self, scenario: Scenario) -> int:
        """DDP and ZeroRedundancyOptimizer under autocast keep fp32 parameters; FSDP2's MixedPrecisionPolicy
        (param_dtype=bf16) gathers 16-bit."""
        training = scenario.training
        if training.is_mixed and runs_on_ddp(scenario):
            return 4
        return dtype_bytes(training.precision)

    def grad_comm_bytes(self, scenario: Scenario) -> int:
        """DDP reduces the fp32 gradients of fp32 parameters; FSDP2 reduces in fp32 (reduce_dtype)."""
        return 4 if scenario.training.is_mixed else dtype_bytes(scenario.training.precision)

    def gradient_buckets(self, scenario: Scenario) -> tuple[tuple[int, int], ...]:
        """torch DDP's Reducer (`_compute_bucket_assignment_by_size`): parameters in reverse, a bucket closed once it
        holds at least the limit: 1 MiB for the first bucket, then bucket_bytes."""
        element = self.grad_comm_bytes(scenario)
        limits = [DDP_FIRST_BUCKET_BYTES, scenario.strategy.bucket_bytes]
        return size_buckets(rank_layout(scenario), element, limits)

    def step_events(self, scenario: Scenario) -> list[CommEvent]:
        """DDP all-reduces its buckets as they fill (zero1 too, then ZeroRedundancyOptimizer.step broadcasts every
        tensor from the rank that updated it, one call per tensor: parameters_as_bucket_view=False, torch's
        default); FSDP2 gathers and reduce-scatters per unit, regathering the root for backward."""
        layout = rank_layout(scenario)
        grad, param = self.grad_comm_bytes(scenario), self.param_comm_bytes(scenario)
        if not runs_on_ddp(scenario):
            gathered = dim0_unit_sizes(layout, scenario.shard_degree)  # FSDP2 pads each tensor's dim 0 to the degree
            return sharded_events(scenario, gathered, param, grad, regather_root=True)
        buckets = self.gradient_buckets(scenario)
        events = gradient_reductions(scenario, buckets, grad, all_reduce=True, after_whole_backward=False)
        if scenario.strategy.stage == 0:
            return events
        world = scenario.state_ranks
        after_step: Place = (scenario.training.grad_accum_steps - 1, -1, "after_step")
        for tensor in layout.tensors():
            label = f"broadcast {tensor.name}"
            events.append(event("optimizer", "broadcast", world, tensor.numel * param, "world", after_step, label))
        return events

    def setup_rows(self, scenario: Scenario) -> list[CollectiveRow]:
        """DistributedDataParallel checks parameter shapes (`_verify_param_shape_across_processes`: an all-gather of
        each rank's int64 tensor count, then a broadcast of every tensor's sizes and strides as int64) and broadcasts
        its module states coalesced into 250 MiB buckets (`_sync_module_states`; torch/csrc/utils/tensor_flatten.cpp
        `take_tensors` closes a bucket once it reaches the limit). FSDP2 does not broadcast: the runs broadcast each
        parameter tensor from rank 0 before sharding."""
        stored = 4 if scenario.training.is_mixed else dtype_bytes(scenario.training.precision)
        if not runs_on_ddp(scenario):
            return per_tensor_broadcasts(scenario, stored)
        world = scenario.state_ranks
        tensors = rank_layout(scenario).tensors()
        metadata = 8 * sum(2 * len(t.shape) for t in tensors)
        rows = [
            CollectiveRow(phase="setup", op="all_gather", group_size=world, payload_bytes=8 * world, count=1),
            CollectiveRow(phase="setup", op="broadcast", group_size=world, payload_bytes=metadata, count=1),
        ]
        size = 0
        for tensor in tensors:
            size += tensor.numel * stored
            if size >= DDP_BROADCAST_BUCKET_BYTES:
                rows.append(CollectiveRow(phase="setup", op="broadcast", group_size=world, payload_bytes=size, count=1))
                size = 0
        if size:
            rows.append(CollectiveRow(phase="setup", op="broadcast", group_size=world, payload_bytes=size, count=1))
        return rows

    def framework_s(self, scenario: Scenario, profile: HardwareProfile) -> dict[TimePlace, float]:
        """torch DDP's per-step bookkeeping with the first backward stage (the head's), where its reducer's autograd
        hooks start (benchmarks/bench_time_phases.py measures it there); FSDP2's per-unit bookkeeping, half with the
        unit's forward and half with its backward."""
        if runs_on_ddp(scenario):
            return {("backward", scenario.model.num_layers + 1): profile.ddp_step_overhead_s}
        half = profile.fsdp_unit_overhead_s / 2
        extra: dict[TimePlace, float] = {("forward", 0): half, ("backward", 0): half}  # the root unit
        for stage in range(1, scenario.model.num_layers + 1):
            extra[("forward", stage)] = extra[("backward", stage)] = half
        return extra

    def optimizer_tensors(self, scenario: Scenario) -> int:
        """DDP every parameter; ZeroRedundancyOptimizer about 1/world of them; FSDP2 every parameter, as a DTensor
        shard."""
        tensors = rank_layout(scenario).tensor_count
        return -(-tensors // scenario.state_ranks) if scenario.strategy.stage == 1 else tensors

    def optimizer_overhead_s(self, scenario: Scenario, profile: HardwareProfile, shard_tensors: int) -> float:
        """FSDP2's per-tensor work around the step; ZeroRedundancyOptimizer's over every tensor."""
        if not runs_on_ddp(scenario):
            return shard_tensors * profile.host_terms.fsdp_optimizer_tensor_overhead_s
        if scenario.strategy.stage == 1:
            return rank_layout(scenario).tensor_count * profile.host_terms.zero_tensor_overhead_s
        return 0.0

    def is_async(self, scenario: Scenario, event: CommEvent) -> bool:
        """DDP's Reducer all-reduces its buckets with async_op=True from backward (zero1's too); FSDP2's own
        overlap is part of its per-unit term. Tensor parallelism's reductions are DTensor's, not the Reducer's."""
        return runs_on_ddp(scenario) and event.trigger == "after_backward" and event.group == "world"

    def pipeline_stage_activations(self, scenario: Scenario, acts: ActivationEstimate, stage: PipelineStage) -> int:
        """As torch's PipelineStage holds them (tests/trace/test_pipeline_trace.py replays it): the stage's blocks'
        share of every block's saved tensors; the tensors every block shares (RoPE's tables) and the loss's total
        weight, which each stage with blocks makes for itself; the head's on the last stage. The stage also caches
        its output until that micro-batch's backward (`fwd_cache` in torch/distributed/pipelining/stage.py, torch
        2.13): the hidden states, or the logits on the last stage. A stage after the first saves its input as its
        first block's, but that input is the receive buffer, counted in buffers. Token ids and targets are held for
        the whole step (`pipeline_step_activations`)."""
        ids = _token_ids_bytes(scenario)
        blocks = acts.stored_blocks_bytes * stage.layers // scenario.model.num_layers
        shared = acts.saved_bytes - acts.stored_blocks_bytes - acts.head_bytes - 2 * ids if stage.layers else 0
        output = acts.logits_bytes if stage.head else acts.hidden_bytes
        received = 0 if stage.embedding else acts.hidden_bytes
        return blocks + shared + output - received + (acts.head_bytes if stage.head else 0)

    def pipeline_moments(self, scenario: Scenario, load: PipelineLoad) -> list[Moment]:
        """FSDP2 inside torch's pipelining keeps units gathered and gradients unsharded between micro-batches
        (core.engines.fsdp2_pipeline); DDP is not run inside a pipeline, so it keeps the shared rule."""
        if runs_on_ddp(scenario):
            return super().pipeline_moments(scenario, load)
        return fsdp2_pipeline_moments(scenario, load)

    def pipeline_data_parallel_rows(
        self, scenario: Scenario, load: PipelineCalls, rows_of: StageRows
    ) -> list[CollectiveRow]:
        """FSDP2 inside torch's pipelining gathers a unit only where it is not still gathered and reduce-scatters
        once per step (core.engines.fsdp2_pipeline)."""
        if runs_on_ddp(scenario):
            return super().pipeline_data_parallel_rows(scenario, load, rows_of)
        return fsdp2_pipeline_rows(scenario, load, rows_of)

    def pipeline_step_events(
        self, scenario: Scenario, load: PipelineCalls, events: tuple[CommEvent, ...], micro_batches: Sequence[int]
    ) -> tuple[CommEvent, ...]:
        """The calls `pipeline_data_parallel_rows` counts, where torch issues them (core.engines.fsdp2_pipeline)."""
        if runs_on_ddp(scenario):
            return super().pipeline_step_events(scenario, load, events, micro_batches)
        return fsdp2_pipeline_events(scenario, load, events, micro_batches)

    def pipeline_step_activations(self, scenario: Scenario, stages: tuple[PipelineStage, ...]) -> int:
        """The schedule's `step` takes every micro-batch's token ids (first stage) and targets (last stage) at once
        and splits them into views, so they are held for the whole step."""
        held = sum(stage.embedding for stage in stages) + sum(stage.head for stage in stages)
        return held * _token_ids_bytes(scenario) * scenario.training.grad_accum_steps


@cache
def _most_loaded_rank(layout: ParamLayout, ranks: int) -> int:
    """The first rank holding the most optimizer elements under ZeroRedundancyOptimizer (a planner search asks at
    every point it estimates; the assignment of thousands of ranks is scanned once)."""
    sizes = whole_tensor_shards(layout, ranks).numel_per_rank
    return sizes.index(max(sizes))


def _token_ids_bytes(scenario: Scenario) -> int:
    """One micro-batch's token ids (or targets) on one rank: int64 per token of the rank's share."""
    return scenario.training.tokens_per_micro_batch // rank_share(scenario).cp * INDEX_BYTES


_STATES_CACHE: dict[tuple[object, ...], ModelStates] = {}


def _offloaded_replicated(scenario: Scenario, rank: int) -> ModelStates:
    """`_replicated` after `offload`, kept by what the two read: the model, the precision and optimizer, tp and ep, the
    stage, the state ranks and shard degree, the bucket view, offload and the rank (tests/planner/test_speed_caches.py
    holds the kept value to a fresh one)."""
    training, strategy = scenario.training, scenario.strategy
    key = (
        scenario.model,
        training.precision,
        training.optimizer,
        strategy.tp,
        strategy.ep,
        strategy.stage,
        scenario.state_ranks,
        scenario.shard_degree,
        strategy.gradient_as_bucket_view,
        strategy.offload,
        rank,
    )
    return kept(_STATES_CACHE, key, lambda: offload(scenario, _replicated(scenario, rank)), KEPT_STATES_LIMIT)


class OptimizerShare(NamedTuple):
    """What ZeroRedundancyOptimizer gives one rank: its elements, its tensors and the largest of them."""

    numel: int
    tensors: int
    largest: int


def _replicated(scenario: Scenario, rank: int, share: OptimizerShare | None = None) -> ModelStates:
    """DistributedDataParallel, alone (ddp) or under ZeroRedundancyOptimizer (zero1, `rank`'s share of its
    assignment unless `share` is given)."""
    training, strategy = scenario.training, scenario.strategy
    total, layout = rank_facts(scenario)
    stored = 4 if training.is_mixed else dtype_bytes(training.precision)  # mixed keeps fp32 weights
    moments = optimizer_moments(training.optimizer)
    if strategy.stage == 0:
        optimizer_numel, optimizer_tensors = total, layout.tensor_count if layout else 1
        largest = layout.largest_tensor_numel if layout else total
    elif share is not None:
        optimizer_numel, optimizer_tensors, largest = share
    elif layout is not None:
        shards = whole_tensor_shards(layout, scenario.state_ranks)
        optimizer_numel, optimizer_tensors = shards.numel_per_rank[rank], shards.tensors_per_rank[rank]
        largest = shards.largest_per_rank[rank]
    else:  # a bare parameter count: an even split is the best available assumption
        optimizer_numel = largest = flat_shard_numel(total, scenario.shard_degree)
        optimizer_tensors = 1
    bucket = 0 if strategy.gradient_as_bucket_view else total * stored
    head = head_numel(layout) * stored if layout else 0
    block = layout.block_numel * stored if layout else 0
    return ModelStates(
        parameters_bytes=total * stored,
        gradients_bytes=total * stored,
        optimizer_state_bytes=optimizer_numel * moments * stored
        + optimizer_tensors * step_tensor_bytes(training.optimizer),
        persistent_buffers_bytes=bucket,
        backward_grads_bytes=head,
        boundary_grads_bytes=head + block,
        recompute_grads_bytes=block,
        autocast=training.is_mixed,
        # Autocast's 16-bit weight copies are saved for backward: the activations count them (without a shape,
        # which has no activations, they are counted here).
        forward_temporary_bytes=total * dtype_bytes(training.precision) if training.is_mixed and not layout else 0,
        optimizer_temporary_bytes=single_tensor_step_bytes(training.optimizer, largest * stored),
    )
