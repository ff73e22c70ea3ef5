"""How a strategy splits parameter elements across ranks: flat buffers, per-tensor dim-0 shards, whole tensors.

Three rules, one per engine family:
- flat: one flat buffer padded to a multiple of the shard degree, each rank holding ceil(P / D) elements (the ZeRO
  paper's partitioning, and shardscope's teaching strategies).
- per-tensor dim-0: FSDP2's `fully_shard` shards every parameter on dim 0 into chunks of ceil(rows / D) rows, padding
  each to that size, so every rank allocates the padded chunk while the last ranks' real rows are fewer.
- whole tensors: torch's ZeroRedundancyOptimizer assigns whole parameters, largest first, to the rank with the fewest
  elements so far, so shards are uneven.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cache

from shardscope.core.params import ParamLayout, ParamTensor


def ceil_div(numerator: int, denominator: int) -> int:
    """Integer ceiling of numerator / denominator."""
    return -(-numerator // denominator)


def flat_shard_numel(total_numel: int, degree: int) -> int:
    """Elements each rank holds of a flat buffer padded to a multiple of the shard degree."""
    return ceil_div(total_numel, degree)


def _dim0_chunk(tensor: ParamTensor, degree: int) -> tuple[int, int]:
    """(rows per chunk, elements per row) of a tensor sharded on dim 0."""
    rows = tensor.shape[0]
    row_numel = tensor.numel // rows if rows else 0
    return ceil_div(rows, degree), row_numel


@dataclass(frozen=True, slots=True, kw_only=True)
class Dim0Shards:
    """FSDP2 per-parameter sharding of a whole model for one rank."""

    padded_numel: int
    """Elements the rank allocates for its shards (padding included): the same on every rank."""
    local_numel: int
    """Elements of real (unpadded) rows the rank owns; what the optimizer's moments are sized by."""
    tensors_with_rows: int
    """Parameter tensors of which this rank owns at least one row."""
    largest_local_numel: int
    """Elements of the rank's largest shard (real rows): the size of a single-tensor optimizer's temporaries."""


@cache
def dim0_shards(layout: ParamLayout, degree: int, rank: int) -> Dim0Shards:
    """Per-parameter dim-0 shards of every tensor in the layout for one rank."""
    padded = local = owned = largest = 0
    for tensors, repeat in ((layout.root, 1), (layout.block, layout.num_blocks)):
        for tensor in tensors:
            chunk_rows, row_numel = _dim0_chunk(tensor, degree)
            rows_here = max(0, min(chunk_rows, tensor.shape[0] - rank * chunk_rows))
            padded += repeat * chunk_rows * row_numel
            local += repeat * rows_here * row_numel
            owned += repeat * (rows_here > 0)
            largest = max(largest, rows_here * row_numel)
    return Dim0Shards(padded_numel=padded, local_numel=local, tensors_with_rows=owned, largest_local_numel=largest)


def dim0_unit_padded_numel(tensors: tuple[ParamTensor, ...], degree: int) -> int:
    """Elements of one unit once gathered with its dim-0 padding (the all-gather output)."""
    total = 0
    for tensor in tensors:
        chunk_rows, row_numel = _dim0_chunk(tensor, degree)
        total += chunk_rows * row_numel * degree
    return total


@cache
def dim0_unit_sizes(layout: ParamLayout, degree: int) -> tuple[int, int]:
    """Gathered (padded) elements of the root unit and of one block."""
    return dim0_unit_padded_numel(layout.root, degree), dim0_unit_padded_numel(layout.block, degree)


@dataclass(frozen=True, slots=True, kw_only=True)
class WholeTensorShards:
    """ZeroRedundancyOptimizer's assignment of whole parameters to ranks."""

    numel_per_rank: tuple[int, ...]
    """Elements assigned to each rank."""
    tensors_per_rank: tuple[int, ...]
    """Parameter tensors assigned to each rank."""
    largest_per_rank: tuple[int, ...]
    """Elements of the largest tensor assigned to each rank (0 for a rank with none)."""


@cache
def _numels_largest_first(layout: ParamLayout) -> tuple[int, ...]:
    """Every tensor's elements, largest first (a stable sort: equal tensors keep their creation order)."""
    return tuple(sorted((tensor.numel for tensor in layout.tensors()), reverse=True))


@cache
def whole_tensor_shards(layout: ParamLayout, world_size: int) -> WholeTensorShards:
    """Greedy largest-first assignment, ties to the lowest rank (ZeroRedundancyOptimizer._partition_parameters)."""
    numels = _numels_largest_first(layout)
    # Every rank starts empty and an empty rank is the smallest (the lowest first), so the greedy rule gives the
    # non-empty tensors to ranks 0, 1, ... in turn; only the tensors beyond the world size need the heap (a planner
    # sweep asks for thousands of ranks). Each rank given one of the first tensors holds one at least as large as
    # any still to come (largest first), and a rank given none gets only empty tensors, so every rank's largest is
    # settled here.
    first = min(world_size, len(numels) - numels.count(0))
    sizes = [*numels[:first], *(0,) * (world_size - first)]
    counts = [1] * first + [0] * (world_size - first)
    largest = tuple(sizes)
    rest = numels[first:]
    if rest:
        # (elements so far, rank) as one integer, the elements above the rank's bits: ordered as the pair (the
        # smallest, ties to the lowest rank) and compared at C speed; each step grows the smallest rank in place.
        shift = world_size.bit_length()
        rank_bits = (1 << shift) - 1
        heap = [size << shift | rank for rank, size in enumerate(sizes)]
        heapq.heapify(heap)
        replace = heapq.heapreplace
        for numel in rest:
            smallest = heap[0]
            counts[smallest & rank_bits] += 1
            replace(heap, smallest + (numel << shift))
        for key in heap:
            sizes[key & rank_bits] = key >> shift
    return WholeTensorShards(numel_per_rank=tuple(sizes), tensors_per_rank=tuple(counts), largest_per_rank=largest)


@cache
def largest_module_numel(layout: ParamLayout) -> int:
    """Parameters of the largest single module (its own tensors, not its children's): DeepSpeed's 'largest layer'."""
    modules: dict[str, int] = {}
    for tensor in layout.root + layout.block:
        module = tensor.name.rsplit(".", 1)[0]
        modules[module] = modules.get(module, 0) + tensor.numel
    return max(modules.values())


@dataclass(frozen=True, slots=True, kw_only=True)
class FlatUnits:
    """The teaching strategies' flat buffers (one per unit, each padded to a multiple of the shard degree)."""

    count: int
    """Flat buffers: the root and one per block (one for a bare parameter count)."""
    shard_numel: int
    """Elements a rank holds of all buffers: the sum of ceil(P_u / D)."""
    padded_numel: int
    """Elements of all whole buffers, padding included: the sum of ceil(P_u / D) * D."""
    largest_shard_numel: int
    """The largest single shard (what one optimizer step works on at once)."""
    root_padded_numel: int
    """The whole root buffer."""
    block_padded_numel: int
    """One whole block buffer."""


@cache
def flat_units(layout: ParamLayout | int, degree: int) -> FlatUnits:
    """Flat buffers of a layout (or of a bare parameter count, as one buffer) sharded over `degree` ranks."""
    if isinstance(layout, int):
        shard = ceil_div(layout, degree)
        return FlatUnits(
            count=1,
            shard_numel=shard,
            padded_numel=shard * degree,
            largest_shard_numel=shard,
            root_padded_numel=shard * degree,
            block_padded_numel=0,
        )
    root, block = ceil_div(layout.root_numel, degree), ceil_div(layout.block_numel, degree)
    blocks = layout.num_blocks
    return FlatUnits(
        count=(1 if root else 0) + blocks,  # a pipeline rank may hold no root (core.params.StageModel) or no block
        shard_numel=root + blocks * block,
        padded_numel=(root + blocks * block) * degree,
        largest_shard_numel=max(root, block if blocks else 0),
        root_padded_numel=root * degree,
        block_padded_numel=block * degree,
    )
