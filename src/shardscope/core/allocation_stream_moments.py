"""An allocation stream from an engine's moments, for the engines whose mechanism core.allocation_stream does not
follow tensor by tensor (DDP, ZeroRedundancyOptimizer, the teaching strategies, DeepSpeed).

The step is walked through the engine's moments in order (core.engines: end of forward, start of backward, the top
block's backward, between blocks, the optimizer step, and the engine's own). Weights and optimizer state are made
per parameter tensor (their shards' sizes in proportion); between two moments each category grows by new tensors
of at most one block's share or shrinks by freeing its newest tensors first, as a stack: what forward saves last,
backward frees first. Two steps are written; the optimizer state is made at the first step's optimizer moment.
"""

from __future__ import annotations

from shardscope.core.allocator import FREE, Event
from shardscope.core.engines import rules_for
from shardscope.core.engines.base import LiveBytes
from shardscope.core.params import rank_facts
from shardscope.specs import Scenario

_STATE_CATEGORIES = ("parameters", "optimizer_state")


def _pieces(total: int, sizes: list[int]) -> list[int]:
    """`total` bytes cut in proportion to `sizes` (the last piece takes the rounding)."""
    whole = sum(sizes)
    if total <= 0 or not whole:
        return []
    pieces = [total * size // whole for size in sizes]
    pieces[-1] += total - sum(pieces)
    return [piece for piece in pieces if piece > 0]


def moments_events(scenario: Scenario) -> tuple[list[Event], int]:
    """The engine's two steps for its busiest rank as a stream: (events, index where the last step starts)."""
    rules = rules_for(scenario)
    memory = rules.rank_memory(scenario, rules.busiest_rank(scenario))
    total, layout = rank_facts(scenario)
    tensor_sizes = [t.numel for t in layout.tensors()] if layout is not None else [total]
    # Activations and workspace grow by residual-stream tensors, the other categories by their largest tensor's
    # share (without a shape: in one piece).
    largest = max(tensor_sizes)
    # With parameters and gradients offloaded the states give no tensor size: the largest moment's bytes stand in
    # (without it a chunk of 1 byte writes a stream of billions of events).
    state_bytes = max(memory.states.gradients_bytes, memory.states.parameters_bytes) or max(
        (sum(live) for _name, live in memory.moments), default=0
    )
    chunks = {
        name: max(1, memory.activations.hidden_bytes)
        if name in ("activations", "temporary") and memory.activations.hidden_bytes
        else max(1, largest * state_bytes // max(1, total))
        for name in LiveBytes._fields
    }
    events: list[Event] = []
    handles = [0]
    held: dict[str, list[tuple[int, int]]] = {name: [] for name in LiveBytes._fields}

    def alloc(category: str, size: int) -> None:
        handle = handles[0]
        handles[0] += 1
        events.append((handle, size))
        held[category].append((handle, size))

    def move(category: str, target: int) -> None:
        stack = held[category]
        current = sum(size for _handle, size in stack)
        while stack and current > target:
            handle, size = stack.pop()
            events.append((handle, FREE))
            current -= size
        while current < target:
            size = min(chunks[category], target - current)
            alloc(category, size)
            current += size

    for piece in _pieces(memory.states.parameters_bytes, tensor_sizes):
        alloc("parameters", piece)
    window = 0
    for step in range(2):
        window = len(events)
        for _name, live in memory.moments:
            for category, size in zip(LiveBytes._fields, live, strict=True):
                if category == "optimizer_state":
                    if not held[category] and size and _name == "optimizer step":
                        for piece in _pieces(size, tensor_sizes * 2):
                            alloc(category, piece)
                    continue
                if category == "parameters":
                    continue
                move(category, size)
        for category in ("activations", "temporary", "buffers"):
            move(category, memory.states.persistent_buffers_bytes if category == "buffers" else 0)
        if not memory.states.gradients_persist:
            move("gradients", 0)
        del step
    return events, window
