"""From traces of a model cut to a and a + 1 identical blocks, the trace of the whole model, exactly.

What one more identical block adds is the same whatever the depth: its parameters, gradients and optimizer state,
its saved activations, its collectives and FLOPs. So every quantity of a depth-n trace is affine in n, and the
difference of two consecutive depths is the per-block step: X(n) = X(b) + (n - b) * (X(b) - X(a)), b = a + 1.

The peak needs one more idea, because it is a maximum over the moments of the step, and moments move with depth
("backward: layers.3" of a 6-block model is "backward: layers.7" of a 10-block one). A moment inside a block is
named by the block's place in the order the phase runs them (forward 0..n-1, backward n-1..0), counted from the
nearer end: ("first", s) for the block the phase runs s-th, ("last", e) for the one it runs e-th from the end; the
middle block of an odd depth is both. FSDP2 makes the two blocks at each end special (the first gathers without a
prefetch, the last has no next block to prefetch, reduce-scatter buffers are kept one block), so from the third
block in, a moment's bytes are affine in its place: the largest of the blocks in between is at one of the two
places 2 from an end. Each named moment is extrapolated on its own and the whole model's peak is the largest. This
needs a >= 5 (a middle block 2 from both ends in the shallow trace); measured: depths 3 and 4 get an 8-block
tiny-llama's buffers wrong by one block, 5 and 6 give a 10-block one byte for byte (tests/trace/test_extrapolate.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from shardscope.core.result import CollectiveRow, MemoryBreakdown
from shardscope.trace.result import FlopCount, ModuleRow, TraceResult

if TYPE_CHECKING:
    from shardscope.trace.tracker import Moment

# The caching allocator's reserved bytes are not affine in depth: blocks pack into 2 and 20 MiB segments and cached
# blocks are reused by best fit, so one more block can add a segment or none (tests/trace/test_extrapolate.py).
RESERVED_NOT_EXTRAPOLATED = (
    "reserved_peak_bytes: not extrapolated (the allocator's segments do not grow by the same bytes per block); "
    "trace every block (--traced-blocks 0) to get it"
)

MomentKey = tuple[str, str, int]  # (phase, "first" | "last" | "at <where>", place)


@dataclass(frozen=True, slots=True)
class DepthTrace:
    """A trace of the model cut to `blocks` blocks, with the peak of every moment of its measured step."""

    blocks: int
    block_prefix: str
    """Block i is the unit named f"{block_prefix}{i}" (e.g. 'layers.')."""
    result: TraceResult
    moments: tuple[Moment, ...]


def _block_index(where: str, prefix: str, blocks: int) -> int | None:
    if not where.startswith(prefix) or not where[len(prefix) :].isdigit():
        return None
    index = int(where[len(prefix) :])
    return index if index < blocks else None


def _keys(moment: Moment, prefix: str, blocks: int) -> list[MomentKey]:
    """The depth-independent names of a moment (two for the middle block of an odd depth)."""
    index = _block_index(moment.where, prefix, blocks)
    if index is None:
        return [(moment.phase, "at " + moment.where, 0)]
    ran = blocks - 1 - index if moment.phase == "backward" else index  # blocks the phase ran before this one
    left = blocks - 1 - ran
    keys: list[MomentKey] = []
    if ran <= left:
        keys.append((moment.phase, "first", ran))
    if left <= ran:
        keys.append((moment.phase, "last", left))
    return keys


def _where(key: MomentKey, prefix: str, blocks: int) -> str:
    phase, anchor, place = key
    if anchor.startswith("at "):
        return anchor[3:]
    ran = place if anchor == "first" else blocks - 1 - place
    return f"{prefix}{blocks - 1 - ran if phase == 'backward' else ran}"


def _by_key(trace: DepthTrace) -> dict[MomentKey, Moment]:
    return {key: moment for moment in trace.moments for key in _keys(moment, trace.block_prefix, trace.blocks)}


def _line(a: int, b: int, steps: int) -> int:
    return b + steps * (b - a)


def _extend_dict(a: dict[str, int], b: dict[str, int], steps: int) -> dict[str, int]:
    return {name: _line(a.get(name, 0), value, steps) for name, value in b.items()}


def _ledger(a: Iterable[CollectiveRow], b: Iterable[CollectiveRow], steps: int) -> tuple[CollectiveRow, ...]:
    def key(row: CollectiveRow) -> tuple[str, str, int, int]:
        return row.phase, row.op, row.group_size, row.payload_bytes

    counts_a = {key(row): row.count for row in a}
    rows = [replace(row, count=_line(counts_a.get(key(row), 0), row.count, steps)) for row in b]
    return tuple(row for row in rows if row.count > 0)


def _modules(trace: DepthTrace, blocks: int) -> tuple[ModuleRow, ...]:
    """The deeper model's units: the traced first and last blocks at the ends, the second one in between."""
    prefix, rows = trace.block_prefix, trace.result.per_module
    named = {row.name: row for row in rows}
    inner = named[f"{prefix}1"]
    result: list[ModuleRow] = []
    for row in rows:
        index = _block_index(row.name, prefix, trace.blocks)
        if index is None:
            result.append(row)
        elif index == 0:
            result.append(row)
            result += [replace(inner, name=f"{prefix}{i}") for i in range(1, blocks - 1)]
        elif index == trace.blocks - 1:
            result.append(replace(row, name=f"{prefix}{blocks - 1}"))
    return tuple(result)


def extrapolate(shallow: DepthTrace, deep: DepthTrace, blocks: int) -> TraceResult:
    """The trace of the model with `blocks` blocks, from traces of deep.blocks - 1 and deep.blocks blocks."""
    if deep.blocks != shallow.blocks + 1 or shallow.blocks < 5 or blocks < deep.blocks:
        raise ValueError(f"extrapolate: needs depths a >= 5 and a + 1 <= {blocks}; got {shallow.blocks}, {deep.blocks}")
    steps = blocks - deep.blocks
    a, b = _by_key(shallow), _by_key(deep)
    totals: dict[MomentKey, int] = {}
    at_peak: dict[MomentKey, dict[str, int]] = {}
    maxima: dict[str, int] = {}
    for key, moment in b.items():
        earlier = a.get(key, moment)  # a moment only the deeper trace has is taken as it is
        totals[key] = _line(earlier.total_bytes, moment.total_bytes, steps)
        at_peak[key] = _extend_dict(earlier.at_peak, moment.at_peak, steps)
        for category, size in _extend_dict(earlier.maxima, moment.maxima, steps).items():
            maxima[category] = max(maxima.get(category, 0), size)
    peak_key = max(totals, key=lambda key: totals[key])
    result_a, result_b = shallow.result, deep.result
    per_rank = MemoryBreakdown(
        parameters_bytes=maxima["parameters"],
        gradients_bytes=maxima["gradients"],
        optimizer_state_bytes=maxima["optimizer_state"],
        activations_bytes=_line(result_a.per_rank.activations_bytes, result_b.per_rank.activations_bytes, steps),
        buffers_bytes=maxima["buffers"],
        temporary_bytes=maxima["temporary"],
        peak_bytes=totals[peak_key],
    )
    flops_a, flops_b = result_a.flops, result_b.flops
    flops = FlopCount(
        forward_flops=_line(flops_a.forward_flops, flops_b.forward_flops, steps),
        backward_flops=_line(flops_a.backward_flops, flops_b.backward_flops, steps),
        optimizer_flops=_line(flops_a.optimizer_flops, flops_b.optimizer_flops, steps),
        attention_formula_flops=_line(flops_a.attention_formula_flops, flops_b.attention_formula_flops, steps),
    )
    note = f"extrapolated to {blocks} blocks from traces of {shallow.blocks} and {deep.blocks} (--traced-blocks 0: all)"
    return replace(
        result_b,
        per_rank=per_rank,
        peak_moment=f"{peak_key[0]}: {_where(peak_key, deep.block_prefix, blocks)}",
        peak_by_category=tuple(at_peak[peak_key].items()),
        ledger=_ledger(result_a.ledger, result_b.ledger, steps),
        flops=flops,
        per_module=_modules(deep, blocks),
        notes=(*result_b.notes, note, RESERVED_NOT_EXTRAPOLATED),
        traced_blocks=(shallow.blocks, deep.blocks),
        reserved_peak_bytes=None,
    )
