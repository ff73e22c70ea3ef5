"""The collective calls of a step, one `CommEvent` each, and the builders the engines make their steps from.

What to communicate is kept apart from when (picotron's habit): events are listed in program order, each tagged with
the compute stage it waits for (`CommEvent.trigger`, `CommEvent.stage`); `core.timeline` decides when they run, and
`core.network` what they cost. Which builder a strategy uses, with which sizes and dtypes, is its engine's rule
(`shardscope.core.engines`).

Payload convention (all layers agree): all_reduce and broadcast carry the buffer's bytes; all_gather and
reduce_scatter carry the UNSHARDED (gathered, pre-scatter) buffer's bytes; host transfers carry the bytes one rank
copies.

Compute stages of one micro-batch, in forward order: 0 = embeddings, 1..L = the transformer blocks, L+1 = final norm,
output head and loss. Backward visits them in reverse.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import repeat
from operator import attrgetter

from shardscope.choices import CommGroup, LedgerGroup, Trigger
from shardscope.core.params import ParamLayout, ParamTensor, rank_layout
from shardscope.core.result import CollectiveRow
from shardscope.core.sharding import flat_shard_numel
from shardscope.specs import Scenario

# torch DDP's first gradient bucket is 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES); later ones bucket_bytes.
DDP_FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class CommEvent:
    """One collective call or host copy, placed relative to the compute stage it serves."""

    row: CollectiveRow
    """What moves (count 1)."""
    group: CommGroup
    """'world' (every rank holding the same tensor-parallel slice, strided by tp), 'shard' (an hsdp shard group),
    'replica' (ranks holding the same shard, strided by the shard group x tp), 'experts' (ranks holding the same
    experts, one per expert group, strided by ep x tp), 'tp' (consecutive ranks), 'cp' (strided
    by tp), or 'host' (a copy between this GPU and its host)."""
    micro_batch: int
    """The micro-batch it belongs to (the last one for optimizer-phase events)."""
    stage: int
    """The compute stage it waits for or feeds (see the module docstring); -1 for the optimizer step."""
    trigger: Trigger
    """'before_forward' / 'before_backward' (must finish before that stage runs), 'after_backward' (may start once
    that stage's backward is done), 'after_step' (after the optimizer step), 'during_forward' / 'during_recompute' /
    'during_backward' (inside that stage's compute, between its matmuls: tensor and context parallelism's calls)."""
    label: str
    """A name for the trace, e.g. 'all_gather block 3'."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Unit:
    """An FSDP unit: the tensors it gathers and the stages that use them."""

    name: str
    tensors: tuple[ParamTensor, ...]
    first_stage: int
    """The first stage in forward that uses it (the stage its forward all-gather precedes)."""
    last_stage: int
    """The last stage in forward that uses it (its first stage in backward)."""


Place = tuple[int, int, Trigger]
"""(micro-batch, stage, trigger) of an event."""


def stage_of(tensor_name: str, num_blocks: int) -> int:
    """The compute stage whose forward uses a parameter tensor."""
    if tensor_name.startswith("layers."):
        return 1 + int(tensor_name.split(".")[1])
    return 0 if tensor_name.startswith("embed") else num_blocks + 1


@lru_cache(maxsize=64)  # a layout hashes by identity: one per model and rank share
def fsdp_units(layout: ParamLayout) -> tuple[Unit, ...]:
    """FSDP wrapping: the root unit (embeddings, final norm, head) and one unit per block, in forward order."""
    root = Unit(name="root", tensors=layout.root, first_stage=0, last_stage=layout.num_blocks + 1)
    blocks = tuple(
        Unit(name=f"block {index}", tensors=layout.block, first_stage=index + 1, last_stage=index + 1)
        for index in range(layout.num_blocks)
    )
    return (root, *blocks)


def size_buckets(layout: ParamLayout, element: int, limits: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Buckets filled walking the parameters in reverse, each closed once it holds at least its limit (the last
    limit repeats): (bytes, stage whose backward completes the bucket)."""
    buckets: list[tuple[int, int]] = []
    size, ready_stage = 0, layout.num_blocks + 1
    for tensor in reversed(layout.tensors()):
        size += tensor.numel * element
        ready_stage = min(ready_stage, stage_of(tensor.name, layout.num_blocks))
        if size >= limits[min(len(buckets), len(limits) - 1)]:
            buckets.append((size, ready_stage))
            size, ready_stage = 0, layout.num_blocks + 1
    if size:
        buckets.append((size, ready_stage))
    return tuple(buckets)


LEDGER_GROUP: dict[CommGroup, LedgerGroup] = {
    "world": "dp",
    "shard": "dp",
    "replica": "dp",
    "experts": "dp",
    "host": "host",
    "tp": "tp",
    "cp": "cp",
    "ep": "ep",
}
"""The mesh dimension of the ledger row of an event on each group: the data-parallel groups are one dimension."""


@lru_cache(maxsize=4096)
def call_row(phase: str, op: str, group: LedgerGroup, size: int, payload: int) -> CollectiveRow:
    """One call's ledger row, shared by every event of that shape (a 70B step has hundreds of identical ones)."""
    return CollectiveRow(phase=phase, op=op, group=group, group_size=size, payload_bytes=payload, count=1)


def event(phase: str, op: str, size: int, payload: int, group: CommGroup, at: Place, label: str) -> CommEvent:
    """One call of `op` on a group of `size` ranks at `at`."""
    micro_batch, stage, trigger = at
    return new_event(call_row(phase, op, LEDGER_GROUP[group], size, payload), group, micro_batch, stage, trigger, label)


_SET_ROW, _SET_GROUP, _SET_MICRO_BATCH, _SET_STAGE, _SET_TRIGGER, _SET_LABEL = (
    getattr(CommEvent, name).__set__ for name in ("row", "group", "micro_batch", "stage", "trigger", "label")
)


def new_event(
    row: CollectiveRow, group: CommGroup, micro_batch: int, stage: int, trigger: Trigger, label: str
) -> CommEvent:
    """`CommEvent(row=row, group=group, ...)` at under half the cost: its slots filled directly instead of through
    the frozen dataclass's `__init__` (an `object.__setattr__` looked up per field). A 70B step has a thousand calls
    and the planner builds thousands of steps, so making them was most of its bounds' time."""
    call: CommEvent = object.__new__(CommEvent)
    _SET_ROW(call, row)
    _SET_GROUP(call, group)
    _SET_MICRO_BATCH(call, micro_batch)
    _SET_STAGE(call, stage)
    _SET_TRIGGER(call, trigger)
    _SET_LABEL(call, label)
    return call


def new_events(
    rows: Sequence[CollectiveRow],
    groups: Sequence[CommGroup],
    micro_batches: Iterable[int],
    stages: Sequence[int],
    triggers: Sequence[Trigger],
    labels: Sequence[str],
) -> list[CommEvent]:
    """`new_event` of each call, its fields given column by column (`micro_batches` may repeat one number), each
    column filled by the slot's setter mapped over the calls: no Python call per call, a quarter cheaper than
    `new_event` (a sharded 405B step copies hundreds of calls per micro-batch)."""
    calls: list[CommEvent] = list(map(_NEW, repeat(CommEvent, len(rows))))
    for setter, column in (
        (_SET_ROW, rows),
        (_SET_GROUP, groups),
        (_SET_MICRO_BATCH, micro_batches),
        (_SET_STAGE, stages),
        (_SET_TRIGGER, triggers),
        (_SET_LABEL, labels),
    ):
        deque(map(setter, calls, column), 0)
    return calls


_NEW = object.__new__
_ROW = attrgetter("row")
_GROUP = attrgetter("group")
_STAGE, _TRIGGER, _LABEL = attrgetter("stage"), attrgetter("trigger"), attrgetter("label")

CallKey = tuple[int, str]
"""What a call sends, as `call_keys` gives it."""


def call_keys(events: Sequence[CommEvent]) -> list[CallKey]:
    """Per call, a key equal for calls that send the same: the identity of its row (calls of one shape share one
    row, `call_row`) and its group. Made without a Python loop per call, so a step's thousand calls are counted or
    priced by their few distinct shapes cheaply."""
    return list(zip(map(id, map(_ROW, events)), map(_GROUP, events), strict=True))


def gradient_reductions(
    scenario: Scenario,
    buckets: Sequence[tuple[int, int]],
    element: int,
    all_reduce: bool,
    after_whole_backward: bool,
    group: CommGroup = "world",
    ranks: int = 0,
) -> list[CommEvent]:
    """Gradient buckets reduced over the world as they fill in backward (or all after the whole backward): an
    all-reduce of each (DDP), or a reduce-scatter of each padded to the world size in elements (ZeRO-1/2). Only the
    last micro-batch reduces, except under ZeRO-2, which keeps only a gradient shard and so reduces every one.
    `group` of `ranks` ranks replaces the world (expert parallelism's experts, core.expert_parallel)."""
    world, steps = ranks or scenario.state_ranks, scenario.training.grad_accum_steps
    reduced = range(steps) if scenario.strategy.stage == 2 else range(steps - 1, steps)
    op = "all_reduce" if all_reduce else "reduce_scatter"
    events = []
    for micro_batch in reduced:
        for index, (size, stage) in enumerate(buckets):
            padded = flat_shard_numel(size // element, world) * world * element
            at: Place = (micro_batch, 0 if after_whole_backward else stage, "after_backward")
            events.append(
                event("backward", op, world, size if all_reduce else padded, group, at, f"{op} bucket {index}")
            )
    return events


def step_gathers(
    scenario: Scenario, pieces: Sequence[tuple[int, str]], element: int, group: CommGroup = "world", ranks: int = 0
) -> list[CommEvent]:
    """After the optimizer step, each updated piece's shards all-gathered over the world (or `group` of `ranks`
    ranks), padded to its size."""
    world = ranks or scenario.state_ranks
    after_step: Place = (scenario.training.grad_accum_steps - 1, -1, "after_step")
    return [
        event(
            "optimizer",
            "all_gather",
            world,
            flat_shard_numel(numel, world) * world * element,
            group,
            after_step,
            f"all_gather {name}",
        )
        for numel, name in pieces
    ]


def every_micro_batch(first: Sequence[CommEvent], micro_batches: int) -> list[CommEvent]:
    """The calls of micro-batch 0 (`first`), then the same calls of every later one, only their number differing:
    copied, not built again (a 405B pipeline rank's step has thousands of calls, and the planner simulates hundreds
    of steps)."""
    events = list(first)
    columns = (list(map(_ROW, first)), list(map(_GROUP, first)))
    places = (list(map(_STAGE, first)), list(map(_TRIGGER, first)), list(map(_LABEL, first)))
    for micro_batch in range(1, micro_batches):
        events += new_events(*columns, repeat(micro_batch), *places)
    return events


def optimizer_offload_events(scenario: Scenario, grad_bytes: int, param_bytes: int) -> list[CommEvent]:
    """ZeRO-Offload ("ZeRO-Offload: Democratizing Billion-Scale Model Training"): the reduced gradient shard goes to
    the host, the CPU optimizer steps, and the updated parameter shard comes back."""
    shard_numel = flat_shard_numel(rank_layout(scenario).total_numel, scenario.parallelism.dp_shard)
    last = scenario.training.grad_accum_steps - 1
    return [
        event(
            "backward",
            "device_to_host",
            1,
            shard_numel * grad_bytes,
            "host",
            (last, 0, "after_backward"),
            "d2h gradients",
        ),
        event(
            "optimizer",
            "host_to_device",
            1,
            shard_numel * param_bytes,
            "host",
            (last, -1, "after_step"),
            "h2d parameters",
        ),
    ]


def per_tensor_broadcasts(scenario: Scenario, element: int) -> list[CollectiveRow]:
    """Every parameter tensor broadcast from rank 0, one call each (the setup of every engine but torch's DDP)."""
    world = scenario.state_ranks
    return [
        CollectiveRow(phase="setup", op="broadcast", group_size=world, payload_bytes=t.numel * element, count=1)
        for t in rank_layout(scenario).tensors()
    ]
