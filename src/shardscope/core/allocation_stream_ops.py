"""One block's activations as the tensors a step allocates and frees, for the allocation stream
(core.allocation_stream): what forward saves, what it makes and frees on the way, and what backward makes.

The sizes are those core.activations counts (its `Sizes` of one rank's share), laid out op by op as torch's autograd
makes them. For the llama family the forward is the one the trace records on fake tensors (RMSNorm's output and
1/rms, q/k/v, RoPE's temporaries around q and k, the attention output and log-sum-exp, the residual adds, SwiGLU's
four tensors, the output projection's result): `shardscope trace --model llama-3-8b` shows that sequence op by op.
For the other families the block's saved bytes are laid out as its SwiGLU or GELU tensors and residual-width tensors.
Whatever the family, the saved tensors add up to exactly what core.activations says a block keeps under its
checkpointing, so the allocated bytes of the stream are the core's; only how they are cut into tensors is modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardscope.core.activations import ActivationEstimate
from shardscope.core.rank_share import Sizes

Op = tuple[int, int]
"""(local key, bytes) allocates; (local key, -1) frees. Keys are local to one block's list."""
RELEASE = -1


@dataclass(frozen=True, slots=True)
class BlockOps:
    """One block's forward and backward as allocations and frees of local keys."""

    forward: tuple[Op, ...]
    """Forward: what is not freed here is saved for backward."""
    saved: tuple[int, ...]
    """The keys forward leaves alive, in the order made (backward frees them in reverse)."""
    recompute: tuple[int, ...]
    """Sizes backward makes again before its own work (checkpointing), held until the block's backward ends."""
    ffn_bytes: int
    """One tokens x FFN-width tensor (0 where the family has none): the MLP backward's temporaries."""
    hidden_bytes: int
    """One residual-stream tensor: the gradient that flows between blocks."""


def _llama_forward(sizes: Sizes) -> tuple[list[int], list[Op]]:
    """Every tensor a llama block's forward makes, in order, with its frees; returns (sizes of the saved ones in
    order, the ops). Keys are indices into the list of allocations."""
    hidden, query, kv, stat = sizes.boundary, sizes.query, sizes.kv, sizes.boundary_tokens * sizes.stat
    ffn = sizes.tokens * sizes.ffn * sizes.element
    ops: list[Op] = []
    saved: list[int] = []

    def make(size: int, keep: bool = True) -> int:
        key = len(ops)
        ops.append((key, size))
        if keep:
            saved.append(key)
        return key

    def drop(*keys: int) -> None:
        for key in keys:
            ops.append((key, RELEASE))
            saved.remove(key)

    make(sizes.gathered)  # the input norm's output (the projections' input)
    make(stat)
    q = make(query)
    k = make(kv)
    make(kv)  # v
    for width, source in ((query, q), (kv, k)):  # RoPE: x * cos + rotate_half(x) * sin
        product = make(width)
        half = make(width // 2)
        rotated = make(width)
        drop(half)
        scaled = make(width)
        drop(rotated)
        make(width)  # the rotated q or k, saved
        drop(product, scaled, source)
    make(query)  # the attention output
    make(sizes.lse)
    out = make(hidden)  # o_proj
    make(hidden)  # the residual add
    drop(out)
    make(sizes.gathered)  # the post-attention norm
    make(stat)
    for _ in range(4):  # gate, up, SiLU, their product
        make(ffn)
    down = make(hidden)
    make(hidden)  # the block's output
    drop(down)
    return [size for key, size in ops if key in saved and size != RELEASE], ops


def _generic_saved(acts: ActivationEstimate, sizes: Sizes, ffn_count: int) -> list[int]:
    """A block's saved bytes as its FFN-width tensors and residual-width tensors, in forward order."""
    ffn = sizes.tokens * sizes.ffn * sizes.element
    total = acts.block_bytes
    parts: list[int] = []
    rest = total - ffn_count * ffn
    if rest < 0:
        ffn_count, rest = 0, total
    hidden = max(sizes.boundary, 1)
    while rest >= 2 * hidden:
        parts.append(hidden)
        rest -= hidden
    parts.append(rest)
    parts[-1:-1] = [ffn] * ffn_count
    return [size for size in parts if size > 0]


def _keep(full: list[int], stored: int) -> tuple[list[bool], int]:
    """Which tensors of the full forward a block keeps to store `stored` bytes (the last first: the output, then
    what the checkpointing policy saves), and the bytes left to keep as one more tensor."""
    keep = [False] * len(full)
    left = stored
    for index in range(len(full) - 1, -1, -1):
        if full[index] <= left:
            keep[index] = True
            left -= full[index]
    return keep, left


def block_ops(acts: ActivationEstimate, sizes: Sizes, family: str, stored: int, recompute: int) -> BlockOps:
    """A block's ops when it keeps `stored` bytes and its backward makes `recompute` bytes again."""
    ffn = sizes.tokens * sizes.ffn * sizes.element
    if family == "llama":
        saved_sizes, llama_ops = _llama_forward(sizes)
        missing = acts.block_bytes - sum(saved_sizes)
        if missing < 0:
            saved_sizes, llama_ops = _generic_saved(acts, sizes, 4), []
    else:
        saved_sizes, llama_ops, missing = _generic_saved(acts, sizes, 2 if family == "gpt2" else 4), [], 0
    if not llama_ops:
        llama_ops = [(key, size) for key, size in enumerate(saved_sizes)]
    if missing > 0:  # what the core counts beyond this list (autocast's copies, eager attention, shared tables)
        llama_ops.append((len(llama_ops), missing))
        saved_sizes.append(missing)
    alive = _alive_keys(llama_ops)
    keep, left = _keep([size for _key, size in _alive_sizes(llama_ops, alive)], stored)
    kept_keys = {key for (key, _size), kept in zip(_alive_sizes(llama_ops, alive), keep, strict=True) if kept}
    forward = list(llama_ops)
    for key in alive:
        if key not in kept_keys:
            forward.append((key, RELEASE))  # made and dropped in forward (a checkpointed block's intermediates)
    saved = [key for key in alive if key in kept_keys]
    if left > 0:
        extra = len(llama_ops) + 1
        forward.append((extra, left))
        saved.append(extra)
    return BlockOps(
        forward=tuple(forward),
        saved=tuple(saved),
        recompute=tuple(_split(recompute, [size for _key, size in _alive_sizes(llama_ops, alive)], kept_keys, alive)),
        ffn_bytes=ffn,
        hidden_bytes=sizes.boundary,
    )


def _alive_keys(ops: list[Op]) -> list[int]:
    freed = {key for key, size in ops if size == RELEASE}
    return [key for key, size in ops if size != RELEASE and key not in freed]


def _alive_sizes(ops: list[Op], alive: list[int]) -> list[Op]:
    sizes = {key: size for key, size in ops if size != RELEASE}
    return [(key, sizes[key]) for key in alive]


def _split(total: int, sizes: list[int], kept: set[int], alive: list[int]) -> list[int]:
    """`total` bytes as the block's tensors it did not keep, in forward order (the rest as one tensor)."""
    parts: list[int] = []
    for key, size in zip(alive, sizes, strict=True):
        if key in kept or size > total:
            continue
        parts.append(size)
        total -= size
    if total > 0:
        parts.append(total)
    return parts
