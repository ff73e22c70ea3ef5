"""What every engine's rules object answers, and the moments of a step that all engines share.

An engine is whose rules apply to a strategy: what a rank holds by category, the moments of the step whose live bytes
`memory` compares (the peak is the largest), the collectives it issues, and its own time terms. Each engine is one
object that follows `EngineRules`; `shardscope.core.engines` holds the registry. The moments shared by every engine:
- end of forward: weights, optimizer state, every saved activation, the gathered units and the loss's spike;
- start of backward: the same with the gradients of the log-softmax instead of the forward spike;
- top block's backward: the head's activations freed, its gradients and the top block's in flight (under
  checkpointing also the block's recomputed activations and, where measured, its own gradients);
- between the top two blocks: the top block's activations freed, two blocks gathered, their gradients in flight;
- optimizer step: weights, gradients, optimizer state and the step's workspace.
An engine adds moments of its own where its mechanism makes one (see its module).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Protocol

from shardscope.choices import EngineName
from shardscope.core.activations import ActivationEstimate, estimate_activations
from shardscope.core.comm_events import CommEvent
from shardscope.core.engines.pipeline_load import PipelineCalls, PipelineLoad, StageRows
from shardscope.core.model_states import ModelStates, dtype_bytes
from shardscope.core.pipeline import PipelineStage
from shardscope.core.rank_share import rank_share
from shardscope.core.result import CollectiveRow
from shardscope.presets.hardware import HardwareProfile
from shardscope.specs import Scenario

LOSS_GRAD_BYTES = 4  # the scalar gradient of the loss

NO_ACTIVATIONS = ActivationEstimate(
    saved_bytes=0,
    block_bytes=0,
    stored_block_bytes=0,
    recompute_bytes=0,
    logits_bytes=0,
    loss_forward_spike_bytes=0,
    loss_backward_spike_bytes=0,
    head_bytes=0,
    head_gradient_bytes=0,
    hidden_bytes=0,
)


class LiveBytes(NamedTuple):
    """Bytes live at one moment, by category (a named tuple: a 70B planner sweep builds millions of these)."""

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    buffers: int = 0
    temporary: int = 0
    """Workspace and transient tensors: the loss's spikes, activation gradients, the optimizer's temporaries."""

    @property
    def total(self) -> int:
        """Every category together."""
        return sum(self)


as_live_bytes = partial(tuple.__new__, LiveBytes)  # a LiveBytes from a tuple of six, without NamedTuple's checks
Moment = tuple[str, LiveBytes]
"""A named moment of the step and what is live then."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankMemory:
    """One rank's memory under an engine: what it holds, its activations, and the moments to compare."""

    states: ModelStates
    activations: ActivationEstimate
    moments: tuple[Moment, ...]
    """In the order the step reaches them; the peak is the first of the largest."""


TimePlace = tuple[str, int]
"""(kind of compute task, stage): ('forward', s), ('backward', s), or ('optimizer', -1) for the step."""


class EngineRules(Protocol):
    """The rules one engine applies to every data-parallel strategy preset."""

    name: EngineName
    summary: str
    """One line for the assumptions: whose accounting this is."""
    fused_optimizer: bool
    """The optimizer step reads and writes each state once (fused kernels) instead of once per op."""
    torch_engines: bool
    """Its rules are those of torch's own engines, which `trace` replays on fake tensors."""
    parameters_sharded_from_stage: int
    """The lowest ZeRO stage whose parameters stay sharded at rest: 3 by the ZeRO paper, 2 under FSDP2's fully_shard
    (zero2 there is fully_shard with reshard_after_forward=False, which gathers for the step and frees after it)."""
    experts_placed_from_stage: int
    """The lowest ZeRO stage whose states the engine builds with each expert unit sharded over the D / ep ranks
    holding it (core.expert_parallel.expert_flat_units), so core.expert_parallel leaves them as they are; above 3:
    never (they are scaled from the rank's layout)."""
    megatron_tensor_parallel: bool
    """Tensor parallelism runs as Megatron-LM's (the teaching TensorParallelLM), not torch's DTensor plan: the
    column-parallel linears all-gather their input again in backward, the vocab-parallel loss keeps masks
    (core.rank_share)."""

    def rank_memory(self, scenario: Scenario, rank: int) -> RankMemory:
        """What the rank holds and the moments of its step."""
        ...

    def rank_states(self, scenario: Scenario, rank: int) -> ModelStates:
        """What the rank holds (`rank_memory`'s states), without the moments of its step: the part of the memory no
        micro-batch, micro-batch count or checkpointing changes (`core.peak_floor`)."""
        ...

    def busiest_rank(self, scenario: Scenario) -> int:
        """The rank that holds the most."""
        ...

    def floor_states(self, scenario: Scenario) -> ModelStates:
        """States no larger than the busiest rank's in its weights, gradients, optimizer state and persistent buffers
        (what `core.peak_floor` reads), for the floor under its peak: the busiest rank's own where they are cheap to
        find."""
        ...

    def optimizer_shard_numels(self, scenario: Scenario) -> tuple[int, ...] | None:
        """Optimizer elements per rank where ranks hold different amounts; None where every rank holds the same."""
        ...

    def param_comm_bytes(self, scenario: Scenario) -> int:
        """Bytes per element of the parameters the strategy gathers or broadcasts."""
        ...

    def grad_comm_bytes(self, scenario: Scenario) -> int:
        """Bytes per element of the gradients the strategy reduces."""
        ...

    def gradient_buckets(self, scenario: Scenario) -> tuple[tuple[int, int], ...]:
        """Gradient buckets in the order backward fills them: (bytes, stage whose backward completes the bucket)."""
        ...

    def step_events(self, scenario: Scenario) -> list[CommEvent]:
        """The collectives of one step in the order rank 0 issues them, with parameter offload's host copies
        (optimizer offload's are the same for every engine: `core.comm` adds them)."""
        ...

    def setup_rows(self, scenario: Scenario) -> list[CollectiveRow]:
        """The collectives made once before the first step so every rank starts from rank 0's weights."""
        ...

    def framework_s(self, scenario: Scenario, profile: HardwareProfile) -> dict[TimePlace, float]:
        """The engine's own work beside the compute task it runs with, per micro-batch (the step's once)."""
        ...

    def optimizer_tensors(self, scenario: Scenario) -> int:
        """Tensors one rank's optimizer steps over."""
        ...

    def optimizer_overhead_s(self, scenario: Scenario, profile: HardwareProfile, shard_tensors: int) -> float:
        """The engine's own work in the optimizer step beyond the update itself."""
        ...

    def is_async(self, scenario: Scenario, event: CommEvent) -> bool:
        """Issued with async_op=True while backward goes on (its compute is slowed while it is in flight). Reads only
        the event's trigger and group: a step asks once per pair (`core.step_graph.asynchronous_calls`)."""
        ...

    def pipeline_stage_activations(self, scenario: Scenario, acts: ActivationEstimate, stage: PipelineStage) -> int:
        """One micro-batch's activations of one pipeline stage, held while that micro-batch is in flight on it."""
        ...

    def pipeline_step_activations(self, scenario: Scenario, stages: tuple[PipelineStage, ...]) -> int:
        """Activations a pipeline rank holding `stages` keeps for the whole step, whatever is in flight."""
        ...

    def pipeline_moments(self, scenario: Scenario, load: PipelineLoad) -> list[Moment]:
        """The moments of one pipeline rank's step whose live bytes its peak compares."""
        ...

    def pipeline_data_parallel_rows(
        self, scenario: Scenario, load: PipelineCalls, rows_of: StageRows
    ) -> list[CollectiveRow]:
        """A pipeline rank's data-parallel collectives of a step, from those of models of its stages without a
        pipeline over the same micro-batches (`rows_of`) and its schedule's order."""
        ...

    def pipeline_step_events(
        self, scenario: Scenario, load: PipelineCalls, events: tuple[CommEvent, ...], micro_batches: Sequence[int]
    ) -> tuple[CommEvent, ...]:
        """A pipeline rank's data-parallel calls of a step as the time model places them, from those of the model
        of its stages without a pipeline (`events`, the proxy's `step_events`), whose micro-batch k stands for the
        step's micro-batch `micro_batches[k]` (a proxy may run fewer: `core.pipeline_time.rank_placement`): the
        calls `pipeline_data_parallel_rows` counts, numbered as the proxy's."""
        ...


class RulesDefaults:
    """The answers most engines share; a rules object inherits them and overrides what its mechanism changes."""

    megatron_tensor_parallel = False
    parameters_sharded_from_stage = 3
    experts_placed_from_stage = 4
    rank_states: Callable[[Scenario, int], ModelStates]
    """Every engine's own (`EngineRules.rank_states`)."""

    def busiest_rank(self, scenario: Scenario) -> int:
        """Every rank holds the same: rank 0."""
        return 0

    def floor_states(self, scenario: Scenario) -> ModelStates:
        """The busiest rank's states."""
        return self.rank_states(scenario, self.busiest_rank(scenario))

    def optimizer_shard_numels(self, scenario: Scenario) -> tuple[int, ...] | None:
        """Every rank holds the same."""
        return None

    def param_comm_bytes(self, scenario: Scenario) -> int:
        """Parameters move in the working dtype (16-bit under mixed precision)."""
        return dtype_bytes(scenario.training.precision)

    def grad_comm_bytes(self, scenario: Scenario) -> int:
        """Gradients are reduced in the working dtype (16-bit under mixed precision)."""
        return dtype_bytes(scenario.training.precision)

    def framework_s(self, scenario: Scenario, profile: HardwareProfile) -> dict[TimePlace, float]:
        """No work of the engine's own beyond what the profile's op and collective costs price."""
        return {}

    def optimizer_overhead_s(self, scenario: Scenario, profile: HardwareProfile, shard_tensors: int) -> float:
        """No work of the engine's own in the optimizer step."""
        return 0.0

    def is_async(self, scenario: Scenario, event: CommEvent) -> bool:
        """Every collective blocks."""
        return False

    def pipeline_stage_activations(self, scenario: Scenario, acts: ActivationEstimate, stage: PipelineStage) -> int:
        """As the teaching pipeline (runtime/teaching/pipeline.py) saves them: the stage's blocks' share of every
        block's and the tables they all read (each stage with blocks makes its own), plus the embeddings' part (token
        ids and what the embeddings keep) on the first stage and the head's on the last. A stage that sends its
        output on keeps it (its backward starts there); a stage that receives its input saves the receive buffer
        (counted as a buffer) where one process would save its first block's input (or the final norm's)."""
        blocks = acts.stored_blocks_bytes * stage.layers // scenario.model.num_layers
        shared = acts.shared_bytes if stage.layers else 0
        head = acts.head_bytes
        embedding = acts.saved_bytes - acts.stored_blocks_bytes - acts.shared_bytes - head
        output = 0 if stage.head else acts.hidden_bytes
        received = 0 if stage.embedding else acts.hidden_bytes
        return blocks + shared + (embedding if stage.embedding else 0) + (head if stage.head else 0) + output - received

    def pipeline_step_activations(self, scenario: Scenario, stages: tuple[PipelineStage, ...]) -> int:
        """The teaching pipeline takes each micro-batch's inputs as it runs it: nothing is held for the step."""
        return 0

    def pipeline_data_parallel_rows(
        self, scenario: Scenario, load: PipelineCalls, rows_of: StageRows
    ) -> list[CollectiveRow]:
        """A pipeline changes nothing: each micro-batch makes the collectives the model of the rank's stages makes
        without one."""
        return rows_of(load.stages)

    def pipeline_step_events(
        self, scenario: Scenario, load: PipelineCalls, events: tuple[CommEvent, ...], micro_batches: Sequence[int]
    ) -> tuple[CommEvent, ...]:
        """A pipeline changes nothing: each micro-batch makes the calls of the model of the rank's stages (the very
        tuple given, so a caller can tell by identity)."""
        return events

    def pipeline_moments(self, scenario: Scenario, load: PipelineLoad) -> list[Moment]:
        """Two moments: the schedule's fullest, where every term is at its largest together (the micro-batches in
        flight, the gathered units and gradients in flight of the rank's model as its engine holds them without a
        pipeline, the largest of the loss's spike and a block's backward), and the optimizer step."""
        states = load.states
        gathered = max(states.forward_buffers_bytes, states.backward_buffers_bytes, states.boundary_buffers_bytes)
        in_flight_grads = max(states.backward_grads_bytes, states.boundary_grads_bytes)
        persistent = load.receive_bytes + states.persistent_buffers_bytes
        temporary = load.working_bytes + in_flight_grads + states.forward_temporary_bytes
        held = (states.parameters_bytes, states.gradients_bytes, states.optimizer_state_bytes)
        activations = load.in_flight_bytes + load.step_activations
        steady = as_live_bytes((*held, activations, persistent + gathered, temporary))
        step = as_live_bytes((*held, 0, persistent, states.optimizer_temporary_bytes))
        return [(f"{load.in_flight} micro-batches in flight", steady), ("optimizer step", step)]


def activations_for(scenario: Scenario, autocast: bool, regathers_in_backward: bool = False) -> ActivationEstimate:
    """The activations of one micro-batch on one rank (none without a shape); `autocast` saves the 16-bit weight
    copies too; `regathers_in_backward`: sequence parallelism as Megatron-LM runs it (core.rank_share)."""
    model = scenario.model
    if not model.has_shape:
        return NO_ACTIVATIONS
    share = rank_share(scenario, regathers_in_backward)
    return estimate_activations(model, scenario.training, autocast, scenario.cluster.gpu_kernels, share)


def gradients_in_base(scenario: Scenario, states: ModelStates) -> bool:
    """Whether the gradients are live from forward on: flat buffers kept between steps, or accumulation."""
    return states.gradients_persist or scenario.training.grad_accum_steps > 1


def held(states: ModelStates, with_gradients: bool) -> LiveBytes:
    """What lives through the whole step: weights, optimizer state, persistent buffers, and the gradients when they
    persist."""
    gradients = states.gradients_bytes if with_gradients else 0
    return as_live_bytes(
        (states.parameters_bytes, gradients, states.optimizer_state_bytes, 0, states.persistent_buffers_bytes, 0)
    )


def plus(
    live: LiveBytes,
    *,
    parameters: int = 0,
    gradients: int = 0,
    optimizer_state: int = 0,
    activations: int = 0,
    buffers: int = 0,
    temporary: int = 0,
) -> LiveBytes:
    """`live` with bytes added to the named categories (spelt out: a planner sweep builds millions of these)."""
    p, g, o, a, b, t = live
    return as_live_bytes(
        (p + parameters, g + gradients, o + optimizer_state, a + activations, b + buffers, t + temporary)
    )


def shared_moments(
    scenario: Scenario, states: ModelStates, acts: ActivationEstimate, top_block: LiveBytes | None = None
) -> list[Moment]:
    """The moments every engine has (see the module docstring); `top_block` replaces the coarse top block's
    backward where an engine follows it more closely."""
    # Each moment as (parameters, gradients, optimizer state, activations, buffers, temporary); built as plain tuples
    # because a planner sweep builds millions of them.
    params, optimizer, persistent = (
        states.parameters_bytes,
        states.optimizer_state_bytes,
        states.persistent_buffers_bytes,
    )
    grads = states.gradients_bytes if gradients_in_base(scenario, states) else 0
    after_head = acts.saved_bytes - acts.head_bytes
    forward_buffers = persistent + states.forward_buffers_bytes
    forward_end = as_live_bytes(
        (
            params,
            grads,
            optimizer,
            acts.saved_bytes,
            forward_buffers,
            states.forward_temporary_bytes + acts.loss_forward_spike_bytes,
        )
    )
    backward_start = as_live_bytes(
        (params, grads, optimizer, acts.saved_bytes, forward_buffers, acts.loss_backward_spike_bytes + LOSS_GRAD_BYTES)
    )
    top = top_block
    if top is None:  # the coarse top block's backward, built only where the engine follows none of its own
        top = as_live_bytes(
            (
                params,
                grads + states.backward_grads_bytes + (states.recompute_grads_bytes if acts.recompute_bytes else 0),
                optimizer,
                after_head + acts.recompute_bytes,
                persistent + states.backward_buffers_bytes,
                acts.head_gradient_bytes + acts.hidden_bytes + LOSS_GRAD_BYTES,
            )
        )
    boundary = as_live_bytes(
        (
            params,
            grads + states.boundary_grads_bytes,
            optimizer,
            after_head - acts.stored_block_bytes,
            persistent + states.boundary_buffers_bytes,
            0,
        )
    )
    step = as_live_bytes((params, states.gradients_bytes, optimizer, 0, persistent, states.optimizer_temporary_bytes))
    return [
        ("end of forward", forward_end),
        ("start of backward", backward_start),
        ("top block's backward", top),
        ("between blocks in backward", boundary),
        ("optimizer step", step),
    ]


def shared_memory(
    scenario: Scenario, states: ModelStates, *extra: Moment, regathers_in_backward: bool = False
) -> RankMemory:
    """A rank's memory for an engine whose moments are the shared ones, with `extra` after them."""
    acts = activations_for(scenario, states.autocast, regathers_in_backward)
    return RankMemory(states=states, activations=acts, moments=(*shared_moments(scenario, states, acts), *extra))


def peak_of(moments: Sequence[Moment]) -> Moment:
    """The first of the largest moments (the totals listed, then the first index of their largest: no Python call
    per moment, and a planner sweep asks this for every scenario it weighs)."""
    totals = [sum(live) for _, live in moments]
    return moments[totals.index(max(totals))]
