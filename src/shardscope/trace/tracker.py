"""A dispatch mode that follows every tensor storage rank 0 allocates, by category, and every collective it sends.

Each storage gets a category when it first appears: by the op that made it (FSDP's all-gather and reduce-scatter
staging are `buffers`) or else by the phase (forward and loss -> activations, backward/optimizer -> temporary). Known
tensors are re-labelled exactly at phase ends (parameters, gradients, optimizer state), and storages FSDP2 resizes
in place (gathered parameters) are `buffers`. Bytes are storage bytes, deduplicated by storage, as the runtime
counts live tensors.

The fake process group allocates nothing inside a collective; a real backend may. `backend` (the scenario's
ClusterSpec.backend) names whose buffers are replayed: "nccl" (the real target, the default) has none this counts,
"gloo" (validate's cases, compared with gloo runs) holds a copy of every reduce-scatter's input for the length of the
call (see _BACKEND_COPIES).

The storages are followed by shardscope.measure.tracker's storage tracker, the one real runs measure with, on a
clock of one tick per change: every tick of the measuring window is a moment's snapshot. Beside the totals the
recorder keeps the ordered stream of allocations and frees it saw (`events`, in the form shardscope.core.allocator
replays), so the caching allocator's reserved bytes can be computed for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardscope.core.allocator import FREE, Event
from shardscope.core.result import CollectiveRow, MemoryBreakdown
from shardscope.measure.ledger import CollectiveLedger
from shardscope.measure.storage import holds_dtensor, local_tensor
from shardscope.measure.tracker import Life, StorageTracker

TRACKED = ("parameters", "gradients", "optimizer_state", "activations", "buffers", "temporary")
# Setup (materialising the sharded model) is not tracked op by op: fake tensors keep full-size copies of the meta
# parameters there that a real rank never holds; the parameters are labelled explicitly once setup is done.
_PHASE_CATEGORY = {
    "setup": "",
    "forward": "activations",
    # The loss is part of forward: what it saves for backward (cross entropy's fp32 log-softmax) is an activation,
    # as the runtime counts it. In bf16-mixed that is twice the 16-bit logits it replaces.
    "loss": "activations",
    "backward": "temporary",
    "optimizer": "temporary",
}
_RECORD_ENTER = torch.ops.profiler._record_function_enter_new.default
_RECORD_EXIT = torch.ops.profiler._record_function_exit._RecordFunction
# FSDP2 (and replicate, built on it) names its steps with record_function("FSDP::..."); what it allocates there is
# communication staging and gathered parameters (buffers), except the casts of a module's inputs and outputs.
_NOT_BUFFERS = ("cast_forward", "inputs_to_device", "root_pre_forward")
_GRADIENT_OUTPUT_OPS = {torch.ops.c10d._reduce_scatter_base_.default}
# wait_tensor(Tensor(a) tensor) -> Tensor(a) returns the tensor it waited on, as the real kernel does; its fake
# kernel returns a new storage, which would count a functional collective's output twice. Under fake tensors DTensor
# calls it after each of its collectives (torch.distributed._functional_collectives._maybe_wrap_tensor, when
# _are_we_tracing(); a real rank wraps the output instead, allocating nothing).
_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
# The CUDA streams FSDP2 allocates on besides the default one (torch/distributed/fsdp/_fully_shard/
# _fsdp_collectives.py): an all-gather's input and output are made on its copy-in stream (implicit prefetching in
# forward and before backward, the only unshards shardscope's steps make); a reduce-scatter's output on the
# reduce-scatter stream (its input on the default stream). The caching allocator serves each stream from its own
# blocks (core.allocator), so the stream of each allocation decides what is reserved; all else is stream 0.
ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM = 1, 2
_STREAM_OF_ARGUMENTS = {
    torch.ops.c10d._allgather_base_.default: ((0, 1), ALL_GATHER_STREAM),
    torch.ops.c10d._reduce_scatter_base_.default: ((0,), REDUCE_SCATTER_STREAM),
}
# What a backend copies inside a collective, for the length of the call: op -> index of the argument it copies.
# ProcessGroupGloo::_reduce_scatter_base calls reduce_scatter_tensor_coalesced, which clones its whole (unsharded)
# input, all-reduces the clone on a worker thread and at wait() copies this rank's chunk out of it (torch 2.13,
# torch/csrc/distributed/c10d/ProcessGroupGloo.cpp); the measured run holds the clone until that copy-out
# (runtime/tracker.py). NCCL reduce-scatters straight into the output: nothing.
# Not replayed: gloo's all-gather stages its output in a flat tensor on its worker thread, which the measured run's
# tracker (a dispatch mode of the main thread) does not see either.
_BACKEND_COPIES: dict[str, dict[Any, int]] = {
    "nccl": {},
    "gloo": {
        torch.ops.c10d._reduce_scatter_base_.default: 1,
        torch.ops.c10d.reduce_scatter_tensor_coalesced_.default: 1,
    },
}
BACKENDS = tuple(_BACKEND_COPIES)


@dataclass(slots=True)
class Moment:
    """The largest live total seen while rank 0 was at one place of the step (phase and unit), and each category's
    largest size there: kept per place, so a trace of a few blocks can be extrapolated place by place."""

    phase: str
    where: str
    total_bytes: int = -1
    at_peak: dict[str, int] = field(default_factory=dict)
    maxima: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TRACKED, 0))


class StepRecorder(StorageTracker, TorchDispatchMode):
    """Live bytes by category, the peak and when it happened, and the collective ledger, per phase."""

    def __init__(self, backend: str = "nccl") -> None:
        if backend not in _BACKEND_COPIES:
            raise ValueError(f"StepRecorder backend={backend!r}: expected one of {', '.join(BACKENDS)}")
        StorageTracker.__init__(self)
        TorchDispatchMode.__init__(self)
        self.backend = backend
        self._copies = _BACKEND_COPIES[backend]
        self.phase = "setup"
        self.where = "setup"
        self.recording = False
        self._scopes: list[bool] = []
        self._unrecorded = 0  # depth of `unrecorded()` blocks
        self._places: list[tuple[str, str] | None] = []  # per closed tick: (phase, where) while recording
        self._window_tick = 0
        self._moments: tuple[int, dict[tuple[str, str], Moment]] | None = None  # (tick, moments) of the last sweep
        self.collectives = CollectiveLedger()  # the table only: it is never entered as a mode of its own
        self.saved_activations = 0
        self.events: list[Event] = []
        """Every allocation (life id, bytes[, CUDA stream]) and free (life id, FREE) seen, in order, from the
        start."""
        self._allocated_at: dict[int, int] = {}  # life id -> index of its allocation in events
        self.window_event = 0
        """Index in `events` where the measured step starts."""

    def start_window(self) -> None:
        """Start measuring (the steady-state step): collectives, and the peak of every moment, from now on."""
        self.collectives.rows = []
        self.saved_activations = 0
        self.window_event = len(self.events)
        self.recording = True
        self._window_tick = self.tick
        self._snapshot()

    def end_forward(self, loss: torch.Tensor) -> None:
        """Forward and loss are done (their outputs dropped): what is still alive in `activations` is what autograd
        saved for backward, the category's figure (less the loss itself, as the runtime counts it). Not the largest
        size seen in forward: with checkpointing, a block's recomputable intermediates live only while it runs."""
        if not self.recording:
            return
        saved = self.live["activations"]
        life = self.life_of(local_tensor(loss).untyped_storage())
        if life is not None and life.label == "activations":
            saved -= life.nbytes
        self.saved_activations = max(self.saved_activations, saved)

    @contextmanager
    def unrecorded(self) -> Iterator[None]:
        """Ops run inside are neither counted nor sent: what they make is metadata a real rank does not hold at
        this moment (DTensor's shape propagation, trace.compat.dtensor_shape_propagation)."""
        self._unrecorded += 1
        try:
            yield
        finally:
            self._unrecorded -= 1

    @property
    def live(self) -> dict[str, int]:
        """Bytes live now, by category."""
        return {**dict.fromkeys(TRACKED, 0), **self.live_by_label()}

    @property
    def moments(self) -> dict[tuple[str, str], Moment]:
        """The window's moments, by place, in the order rank 0 first reached them."""
        if self._moments is None or self._moments[0] != self.tick:
            self._moments = (self.tick, self._sweep_moments())
        return self._moments[1]

    def _sweep_moments(self) -> dict[tuple[str, str], Moment]:
        found: dict[tuple[str, str], Moment] = {}
        for tick, totals, total in self.totals_by_tick():
            place = self._places[tick]
            if place is None or tick < self._window_tick:
                continue
            moment = found.get(place)
            if moment is None:
                moment = found[place] = Moment(phase=place[0], where=place[1])
            maxima = moment.maxima
            for category in TRACKED:
                size = totals.get(category, 0)
                if size > maxima[category]:
                    maxima[category] = size
            if total > moment.total_bytes:
                moment.total_bytes = total
                moment.at_peak = {category: totals.get(category, 0) for category in TRACKED}
        return found

    @property
    def peak(self) -> Moment:
        """The moment of the window with the most bytes live."""
        return max(self.moments.values(), key=lambda moment: moment.total_bytes)

    @property
    def max_by_category(self) -> dict[str, int]:
        """Each category's largest size in the window."""
        moments = self.moments.values()
        return {category: max(moment.maxima[category] for moment in moments) for category in TRACKED}

    def breakdown(self) -> MemoryBreakdown:
        """The window's per-rank memory: each category's largest size, the saved activations and the peak."""
        maxima = self.max_by_category
        return MemoryBreakdown(
            parameters_bytes=maxima["parameters"],
            gradients_bytes=maxima["gradients"],
            optimizer_state_bytes=maxima["optimizer_state"],
            activations_bytes=self.saved_activations,
            buffers_bytes=maxima["buffers"],
            temporary_bytes=maxima["temporary"],
            peak_bytes=self.peak.total_bytes,
        )

    # --- storage bookkeeping -------------------------------------------------------------------------------
    def _snapshot(self) -> None:
        """Close a tick: what is live now is one snapshot of the current moment (while recording)."""
        self._places.append((self.phase, self.where) if self.recording else None)
        self.next_tick()

    def _add(self, storage: torch.UntypedStorage, category: str) -> Life | None:
        """Follow a storage not seen yet under a category, as a snapshot of its own; None when it is known."""
        if self.life_of(storage) is not None:
            return None
        life = self.track(storage, category)
        self._snapshot()
        return life

    def on_alloc(self, life: Life) -> None:
        self._allocated_at[life.ident] = len(self.events)
        self.events.append((life.ident, life.nbytes))

    def on_free(self, life: Life) -> None:
        self.events.append((life.ident, FREE))
        self._allocated_at.pop(life.ident, None)

    def label(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Put these tensors' storages in a category (adding any not seen yet)."""
        for tensor in tensors:
            storage = local_tensor(tensor).untyped_storage()
            life = self.life_of(storage)
            if life is None:
                self._add(storage, category)
            else:
                self.relabel_life(life, category)
        self._snapshot()

    def on_resize(self, storage: torch.UntypedStorage, old_bytes: int, new_bytes: int) -> None:
        """FSDP2 (re)allocated or freed a gathered parameter in place."""
        life = self.life_of(storage)
        if life is None:
            self._add(storage, "buffers")
            return
        self.events.append((life.ident, FREE))
        self._allocated_at[life.ident] = len(self.events)
        self.events.append((life.ident, new_bytes))
        self.resize(life, new_bytes)
        self.relabel_life(life, "buffers")
        self._snapshot()

    # --- the dispatch hook ---------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if holds_dtensor(args) or holds_dtensor(kwargs):
            return NotImplemented  # let DTensor desugar it into local ops and collectives, then see those
        if self._unrecorded:
            return func(*args, **kwargs)
        if func is _WAIT_TENSOR:
            return args[0]
        if func is _RECORD_ENTER:
            name = str(args[0])
            inherited = bool(self._scopes) and self._scopes[-1]
            fsdp = name.startswith("FSDP::")
            self._scopes.append(not any(part in name for part in _NOT_BUFFERS) if fsdp else inherited)
        elif func is _RECORD_EXIT and self._scopes:
            self._scopes.pop()
        if self.recording:  # the loss is part of forward, as a run's ledger counts it (loss parallel's all-reduces)
            self.collectives.record(func, args, "forward" if self.phase == "loss" else self.phase)
        out = func(*args, **kwargs)
        in_fsdp = bool(self._scopes) and self._scopes[-1]
        category = "buffers" if in_fsdp and self.phase != "setup" else _PHASE_CATEGORY[self.phase]
        if not category:
            return out
        flat, _ = tree_flatten(out)
        for item in flat:
            if isinstance(item, torch.Tensor):  # a mode sees DTensor ops first: count the local shard's storage
                self._add(local_tensor(item).untyped_storage(), category)
        if func in _GRADIENT_OUTPUT_OPS:
            self.label([args[0]], "gradients")
        if func in _STREAM_OF_ARGUMENTS:
            positions, stream = _STREAM_OF_ARGUMENTS[func]
            self._on_stream([args[position] for position in positions], stream)
        if func in self._copies:
            # Bytes the backend holds only while this collective runs: counted at this moment, then gone.
            copied, _ = tree_flatten(args[self._copies[func]])
            size = sum(t.numel() * t.element_size() for t in copied if isinstance(t, torch.Tensor))
            self.hold_for_tick(size, "buffers")
            self._snapshot()
        return out

    def _on_stream(self, tensors: list[Any], stream: int) -> None:
        """Mark where these tensors' storages were allocated as on a CUDA stream of FSDP2's."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                life = self.life_of(local_tensor(tensor).untyped_storage())
                index = None if life is None else self._allocated_at.get(life.ident)
                if life is not None and index is not None:
                    self.events[index] = (life.ident, self.events[index][1], stream)

    def ledger(self) -> tuple[CollectiveRow, ...]:
        """The collectives of the measuring window, merged."""
        return self.collectives.merged()
