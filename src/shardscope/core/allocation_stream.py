"""The reserved peak without torch: an allocation stream equivalent to a step's real one, replayed through the
caching allocator model (core.allocator).

What `torch.cuda.max_memory_reserved()` reports depends on the order and sizes of the tensors a step allocates, not
only on how many bytes are live at its peak: freed blocks stay cached, a block serves only its own stream, and a
request no cached block fits asks for a new segment. So the core derives the stream tensor by tensor, as the trace
records it (`shardscope trace`): FSDP2's per-parameter sharded weights; per unit, the all-gather's input and output
on the all-gather stream and the unsharded weights copied out of it; each block's activations op by op
(core.allocation_stream_ops, sized by core.activations); the loss's logits and log-softmax; in backward each unit's
unsharded gradients, its reduce-scatter input and its gradient shard on the reduce-scatter stream; Adam's exp_avg
and exp_avg_sq, made at the first step. Two steps are replayed, as the trace does; the reserved peak is the second's
(the allocator holds what the first reserved). Engines other than FSDP2 (core.allocation_stream_moments) are replayed
from their moments, category by category, at the sizes of their tensors.

Every block is replayed. A shortcut that replays a few blocks and extrapolates is not exact: reserved(n) grows by
the same bytes per block over long runs of depths and then jumps where the moment that sets the reserved peak
changes (llama-3-8b on 8 ranks under full checkpointing: +274 MiB per block, then +4,282 MiB from 24 to 25 blocks,
where the loss's 4 GiB log-softmax no longer fits a cached block), so it is not used.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

from shardscope.choices import checkpoints_block
from shardscope.core.activations import ActivationEstimate
from shardscope.core.allocation_stream_moments import moments_events
from shardscope.core.allocation_stream_ops import RELEASE, BlockOps, block_ops
from shardscope.core.allocator import FREE, Event, replay
from shardscope.core.engines import rules_for
from shardscope.core.model_states import ModelStates, dtype_bytes, optimizer_moments, step_tensor_bytes
from shardscope.core.params import ParamLayout, ParamTensor, rank_layout
from shardscope.core.rank_share import rank_share, sizes_of
from shardscope.core.result import MemoryEstimate
from shardscope.core.sharding import dim0_unit_padded_numel
from shardscope.specs import Scenario

ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM = 1, 2  # FSDP2's streams besides the default one (as trace.tracker)
INDEX_BYTES = 8  # token ids and targets are int64
STEPS = 2  # the trace replays two steps and reports the second


class Stream:
    """An allocation stream being written: handles are given out in order."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._next = 0

    def alloc(self, nbytes: int, stream: int = 0) -> int:
        handle = self._next
        self._next += 1
        self.events.append((handle, nbytes, stream) if stream else (handle, nbytes))
        return handle

    def free(self, *handles: int) -> None:
        for handle in handles:
            self.events.append((handle, FREE))


def _shard_numel(tensor: ParamTensor, degree: int) -> int:
    return dim0_unit_padded_numel((tensor,), degree) // degree


class _Fsdp2Step:
    """Writes FSDP2's steps (fully_shard on every block and the root) for one rank into a Stream."""

    def __init__(self, scenario: Scenario, layout: ParamLayout, depth: int, states: ModelStates) -> None:
        training, strategy = scenario.training, scenario.strategy
        self.out = Stream()
        self.depth = depth
        self.layout = layout
        self.degree = scenario.shard_degree
        self.compute = dtype_bytes(training.precision)
        self.stored = 4 if training.is_mixed else self.compute
        self.reduce = 4 if training.is_mixed else self.compute
        self.reshard = strategy.stage == 3 and strategy.reshard_after_forward
        self.on_device = states.parameters_bytes > 0
        self.moments = optimizer_moments(training.optimizer) if states.optimizer_state_bytes else 0
        self.step_bytes = step_tensor_bytes(training.optimizer) if states.optimizer_state_bytes else 0
        self.temporaries = 2 if states.optimizer_temporary_bytes else 0
        self.micro_batches = training.grad_accum_steps
        self.tokens = training.tokens_per_micro_batch // strategy.cp
        share = rank_share(scenario)
        self.acts = _activations(scenario)
        sizes = sizes_of(scenario.model, training, share)
        self.hidden = sizes.boundary
        self.vocab_bytes = self.tokens * (scenario.model.vocab_size // strategy.tp)
        whole, plain = _block_terms(self.acts, training.checkpointing, depth)
        family = scenario.model.family
        kinds = {terms: block_ops(self.acts, sizes, family, *terms) for terms in {whole, plain}}
        checkpointing = training.checkpointing
        self.blocks = [kinds[whole if checkpoints_block(checkpointing, i) else plain] for i in range(depth)]
        self.tied = not any(t.name.startswith("lm_head") for t in layout.root)
        self.root_tensors = layout.root
        self.block_tensors = layout.block
        # the params of every unit in creation order: embeddings, blocks, the rest of the root
        embed = tuple(t for t in layout.root if t.name.startswith("embed"))
        tail = tuple(t for t in layout.root if not t.name.startswith("embed"))
        self.order = [*embed, *(t for _ in range(depth) for t in layout.block), *tail]
        self.unit_shard = {
            "root": sum(_shard_numel(t, self.degree) for t in layout.root),
            "block": sum(_shard_numel(t, self.degree) for t in layout.block),
        }
        self._inputs: tuple[int, ...] = ()
        self._grads: list[int] = []
        self._reduce_input = -1

    # --- FSDP2's unit mechanics -----------------------------------------------------------------------
    def gather(self, unit: str) -> int:
        """The all-gather of a unit: its input (the 16-bit shards) and output on the all-gather stream."""
        shard = self.unit_shard[unit] * self.compute
        staging = self.out.alloc(shard)
        gathered = self.out.alloc(shard * self.degree, ALL_GATHER_STREAM)
        self.out.free(staging)
        return gathered

    def copy_out(self, tensors: tuple[ParamTensor, ...]) -> list[int]:
        """The unsharded parameters copied out of the all-gather output."""
        return [self.out.alloc(t.numel * self.compute) for t in tensors]

    def reduce_scatter(self, unit: str, grads: list[int], first_micro: bool) -> None:
        """The unit's gradients copied into one reduce-dtype input, freed; the shard lands on its own stream."""
        if self._reduce_input >= 0:
            self.out.free(self._reduce_input)
        self._reduce_input = self.out.alloc(self.unit_shard[unit] * self.degree * self.reduce)
        self.out.free(*grads)
        shard = self.out.alloc(self.unit_shard[unit] * self.reduce, REDUCE_SCATTER_STREAM)
        if first_micro:
            self._grads.append(shard)
        else:
            self.out.free(shard)  # accumulated into the gradient already held

    # --- the step ---------------------------------------------------------------------------------------
    def setup(self) -> None:
        if self.on_device:
            for tensor in self.order:
                self.out.alloc(_shard_numel(tensor, self.degree) * self.stored)

    def step(self, first_step: bool) -> None:
        for micro in range(self.micro_batches):
            self.micro_batch(micro == 0)
        self.optimizer(first_step)

    def micro_batch(self, first_micro: bool) -> None:
        out, acts = self.out, self.acts
        inputs = (out.alloc(self.tokens * INDEX_BYTES), out.alloc(self.tokens * INDEX_BYTES))
        out.free(*self._inputs)
        self._inputs = inputs
        previous = self.gather("root")
        root_params = self.copy_out(self.root_tensors)
        shared = max(0, acts.saved_bytes - acts.stored_blocks_bytes - acts.head_bytes - 2 * self.tokens * INDEX_BYTES)
        embedded = out.alloc(self.hidden)
        table = out.alloc(shared)
        block_params: list[list[int]] = []
        saved: list[dict[int, int]] = []
        for index, block in enumerate(self.blocks):
            gathered = self.gather("block")
            params = self.copy_out(self.block_tensors)
            out.free(previous)
            previous = gathered
            saved.append(self.run_forward(block))
            if self.reshard:
                out.free(*params)
                params = []
            block_params.append(params)
            del index
        norm = out.alloc(self.hidden + self.tokens * 4)
        logits = out.alloc(self.vocab_bytes * self.compute)
        if self.reshard:
            out.free(*root_params)
            root_params = []
        out.free(previous)
        widened = out.alloc(self.vocab_bytes * 4) if self.compute != 4 else -1
        log_softmax = out.alloc(self.vocab_bytes * 4)
        if widened >= 0:
            out.free(widened)
        out.free(logits)
        # backward: the loss's gradients, then the head
        loss_grad = out.alloc(self.vocab_bytes * 4)
        softmax_grad = out.alloc(self.vocab_bytes * 4)
        out.free(loss_grad, log_softmax)
        if self.compute != 4:
            cast = out.alloc(self.vocab_bytes * self.compute)
            out.free(softmax_grad)
            softmax_grad = cast
        if self.reshard:
            gathered = self.gather("root")
            root_params = self.copy_out(self.root_tensors)
            out.free(gathered)
        pending = self.gather("block") if self.reshard and self.depth else -1
        head_numel = sum(t.numel for t in self.root_tensors if not t.name.startswith("embed"))
        head_grads = [out.alloc(head_numel * self.compute)] if head_numel else []
        flow = out.alloc(self.hidden)
        out.free(softmax_grad, norm)
        for index in range(self.depth - 1, -1, -1):
            params = block_params[index]
            if self.reshard:
                params = self.copy_out(self.block_tensors)
                out.free(pending)
                pending = self.gather("block") if index else -1
            flow = self.run_backward(self.blocks[index], saved[index], flow)
            grads = self.block_grads()
            out.free(*params)
            self.reduce_scatter("block", grads, first_micro)
        embed_numel = sum(t.numel for t in self.root_tensors if t.name.startswith("embed"))
        head_grads.append(out.alloc(embed_numel * self.compute))
        out.free(flow, embedded, table)
        out.free(*root_params)
        self.reduce_scatter("root", head_grads, first_micro)
        out.free(self._reduce_input)
        self._reduce_input = -1

    def run_forward(self, block: BlockOps) -> dict[int, int]:
        """The block's forward; returns its saved tensors' handles by local key."""
        handles: dict[int, int] = {}
        for key, size in block.forward:
            if size == RELEASE:
                self.out.free(handles.pop(key))
            else:
                handles[key] = self.out.alloc(size)
        return handles

    def run_backward(self, block: BlockOps, saved: dict[int, int], flow: int) -> int:
        """The block's backward: recomputed tensors, then, from the top, each saved tensor freed as its gradient is
        made (FFN-wide gradients two at a time, as SwiGLU's backward holds them) and the weight gradients made.
        Returns the gradient handed to the block below."""
        out = self.out
        recomputed = [out.alloc(size) for size in block.recompute]
        self._pending_grads = [out.alloc(t.numel * self.compute) for t in reversed(self.block_tensors)]
        temporaries: list[int] = []
        for key in reversed(block.saved):
            handle = saved.pop(key)
            size = next(size for k, size in block.forward if k == key and size != RELEASE)
            if size >= block.hidden_bytes and size > 0:
                temporaries.append(out.alloc(size))
                if len(temporaries) > 2:
                    out.free(temporaries.pop(0))
            out.free(handle)
        below = out.alloc(block.hidden_bytes)
        out.free(*temporaries, *recomputed, flow)
        return below

    def block_grads(self) -> list[int]:
        grads, self._pending_grads = self._pending_grads, []
        return grads

    def optimizer(self, first_step: bool) -> None:
        out = self.out
        shards = [_shard_numel(t, self.degree) * self.stored for t in self.order] if self.on_device else []
        if first_step and (self.moments or self.step_bytes):
            for shard in shards:
                if self.step_bytes:
                    out.alloc(self.step_bytes)
                for _ in range(self.moments):
                    out.alloc(shard)
        if self.temporaries:
            previous = -1
            for shard in shards:
                root = out.alloc(shard)
                quotient = out.alloc(shard)
                out.free(root)
                if previous >= 0:
                    out.free(previous)
                previous = quotient
            if previous >= 0:
                out.free(previous)
        out.free(*self._grads)
        self._grads = []


def _block_terms(acts: ActivationEstimate, checkpointing: str, depth: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(stored, recomputed) bytes of a block checkpointed whole and of one that is not, from the top and bottom
    blocks' terms core.activations gives (under 'every:N' one of them may be of each kind)."""
    top, bottom = checkpoints_block(checkpointing, depth - 1), checkpoints_block(checkpointing, 0)
    top_terms = (acts.stored_block_bytes, acts.recompute_bytes)
    if top:
        whole = top_terms
    elif bottom:
        whole = (acts.first_stored_block_bytes, acts.block_bytes)
    else:
        whole = (acts.hidden_bytes, acts.block_bytes)
    if not top:
        plain = top_terms
    elif not bottom:
        plain = (acts.first_stored_block_bytes, 0)
    else:
        plain = (acts.block_bytes, 0)
    return whole, plain


def _activations(scenario: Scenario) -> ActivationEstimate:
    return rules_for(scenario).rank_memory(scenario, 0).activations


def fsdp2_events(scenario: Scenario, depth: int) -> tuple[list[Event], int]:
    """FSDP2's two steps for rank 0 with the model cut to `depth` blocks: (events, index where the last step
    starts)."""
    memory = rules_for(scenario).rank_memory(scenario, 0)
    writer = _Fsdp2Step(scenario, rank_layout(scenario), depth, memory.states)
    writer.setup()
    window = 0
    for step in range(STEPS):
        window = len(writer.out.events)
        writer.step(step == 0)
    return writer.out.events, window


def _runs_per_unit(scenario: Scenario) -> bool:
    """FSDP2's per-unit stream applies: torch's engines, gradients sharded, nothing offloaded (the per-unit stream
    keeps every state on the device), a model with a shape."""
    strategy = scenario.strategy
    return (
        rules_for(scenario).torch_engines
        and strategy.stage >= 2
        and strategy.offload == "none"
        and scenario.model.has_shape
    )


def _device_bytes(scenario: Scenario) -> int:
    return scenario.cluster.gpu.memory_bytes - scenario.overheads.context_bytes


def reserved_at_depth(scenario: Scenario, depth: int) -> tuple[int, int]:
    """(allocated peak, reserved peak) of the full stream with the model cut to `depth` blocks."""
    if _runs_per_unit(scenario):
        events, window = fsdp2_events(scenario, depth)
    else:
        cut = (
            replace(scenario, model=replace(scenario.model, num_layers=depth)) if scenario.model.has_shape else scenario
        )
        events, window = moments_events(cut)
    peaks = replay(events, window_start=window, device_bytes=_device_bytes(scenario))
    return peaks.allocated_peak_bytes, peaks.reserved_peak_bytes


@cache
def allocator_peaks(scenario: Scenario) -> tuple[int, int]:
    """(allocated peak, reserved peak) of the scenario's derived stream for rank 0, every block replayed (cached per
    scenario: a planner asks again for the same candidate)."""
    return reserved_at_depth(scenario, scenario.model.num_layers if scenario.model.has_shape else 0)


def reserved_peak_bytes(scenario: Scenario, memory_estimate: MemoryEstimate | None = None) -> int:
    """What `torch.cuda.max_memory_reserved()` would report for the scenario's busiest rank's steady step: the
    caching allocator's reserved peak for the derived allocation stream (bytes; the framework context is not in it).
    `memory_estimate` (core.memory.estimate_memory's answer) is accepted for the caller's convenience: the stream
    is derived from the scenario's own rules, so it only has to be the same scenario."""
    if memory_estimate is not None and memory_estimate.scenario != scenario:
        raise ValueError("reserved_peak_bytes: memory_estimate is of another scenario")
    return allocator_peaks(scenario)[1]
