"""A model of PyTorch's CUDA caching allocator: what `torch.cuda.max_memory_reserved()` reports for a stream of
allocations and frees, beside `max_memory_allocated()`.

The rules are those of c10/cuda/CUDACachingAllocator.cpp (pytorch/pytorch, read at commit
001074d25084fdb87a799823e395a50f5ec044d3; DeviceCachingAllocator's malloc, round_size, get_pool,
get_allocation_size, get_free_block, should_split, alloc_found_block, free_block, try_merge_blocks and, for
expandable segments, find_expandable_block, map_block and try_allocate_expandable_block):

- a request is rounded up to a multiple of 512 bytes (kMinBlockSize; roundup_power2_divisions is off by default);
- requests of at most 1 MiB (kSmallSize) go to the small pool, larger ones to the large pool;
- a request no cached block fits gets a new segment (cudaMalloc): 2 MiB for the small pool (kSmallBuffer), 20 MiB
  for large requests under 10 MiB (kLargeBuffer, kMinLargeAlloc), else the request rounded up to 2 MiB (kRoundLarge);
- the cached block chosen is the smallest free one of the pool that fits, ties to the lower address (best fit);
- the chosen block is split when what remains is at least 512 bytes (small pool) or more than 1 MiB (large pool,
  and only for requests under max_split_size); otherwise the whole block is handed out and counted as allocated;
- a freed block is cached and merged with free neighbours of its segment; segments are never given back here;
- max_split_size (unlimited by default): a request under it takes no cached block of that size or more, and a
  request of at least that size takes no cached block 20 MiB or more larger than itself;
- expandable_segments: one segment per pool whose mapped part grows in pages of 2 MiB (small pool) or 20 MiB
  (large pool) at its end, by just what the request needs beyond a free block at the end; any remainder of 512
  bytes or more is split off; best fit counts the free block at the end as unboundedly large (it can grow), so
  any other free block that fits goes first.

Streams: a block serves only the stream it was allocated on (the pools' free blocks are ordered by stream first),
so FSDP2's all-gather and reduce-scatter streams keep their own blocks and segments; with expandable segments each
stream has its own pair. Replaying torch's own recorded streams of an H200 run (tests/data/gpu) with their streams
gives its max_memory_reserved() to the byte (tests/core/test_allocator_gpu_streams.py); without them, 10% less.

Near the device's limit (device_bytes): a cudaMalloc that does not fit first gives back every cached segment none
of whose blocks is in use, then retries (malloc's release_cached_blocks), so what is reserved stays lower there.

Not modelled: recordStream's deferred frees (the recorded streams place each free where it completed), CUDA graph
pools, release_available_cached_blocks (it frees only blocks above max_split_size, and only when one is set), and
giving back pages of expandable segments near the limit.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

MIN_BLOCK_BYTES = 512
SMALL_REQUEST_BYTES = 1 << 20
SMALL_SEGMENT_BYTES = 2 << 20
LARGE_SEGMENT_BYTES = 20 << 20
MIN_LARGE_ALLOC_BYTES = 10 << 20
LARGE_ROUNDING_BYTES = 2 << 20

FREE = -1
"""The size of an event that frees its handle: (handle, FREE). Any other event (handle, nbytes) allocates."""

Event = tuple[int, int] | tuple[int, int, int]
"""(handle, nbytes) or (handle, nbytes, stream): allocate nbytes on the stream (0 when not given); nbytes FREE frees."""

_SMALL, _LARGE = 0, 1
_NONE = -1
# A free block is kept in its pool's sorted list as one integer, size above address, so that bisect finds the
# smallest block that fits and, among equal sizes, the lowest address.
_ADDRESS_BITS = 64  # wide enough that cudaMallocs retried near the limit never run out of addresses
_ADDRESS_MASK = (1 << _ADDRESS_BITS) - 1
_EXPANDABLE_SPACING = 1 << 42  # expandable segments: where the k-th (stream, pool) one starts, (k + 1) times this


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocatorConfig:
    """The PYTORCH_CUDA_ALLOC_CONF options the model follows."""

    expandable_segments: bool = False
    """expandable_segments:True: one growing segment per pool instead of a segment per cudaMalloc."""
    max_split_size_bytes: int | None = None
    """max_split_size_mb (in bytes here): cached blocks this large are not split; None is unlimited (the default)."""

    def __post_init__(self) -> None:
        if self.max_split_size_bytes is not None and self.max_split_size_bytes <= LARGE_SEGMENT_BYTES:
            raise ValueError(
                f"AllocatorConfig.max_split_size_bytes={self.max_split_size_bytes}: must be more than 20 MiB "
                f"({LARGE_SEGMENT_BYTES}), as PyTorch requires of max_split_size_mb, or None"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocatorPeaks:
    """What torch.cuda.max_memory_allocated() and max_memory_reserved() would say after a stream."""

    allocated_peak_bytes: int
    """Most bytes in blocks handed out at once (rounded sizes, unsplit remainders included)."""
    reserved_peak_bytes: int
    """Most bytes the allocator held from the device at once (segments, or mapped pages)."""


def round_size(nbytes: int) -> int:
    """The block size a request of nbytes gets: a multiple of 512 bytes, at least 512."""
    return max(MIN_BLOCK_BYTES, -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def segment_size(size: int) -> int:
    """The cudaMalloc size a rounded request no cached block fits asks for."""
    if size <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-size // LARGE_ROUNDING_BYTES) * LARGE_ROUNDING_BYTES


class CachingAllocator:
    """One device's caching allocator. Blocks are named by address; handles are the caller's. A pool is a (stream,
    small or large) pair: a free block serves only its own pool."""

    def __init__(self, config: AllocatorConfig | None = None, device_bytes: int | None = None) -> None:
        self.config = config or AllocatorConfig()
        self.device_bytes = device_bytes
        """What cudaMalloc can give in all (the GPU's memory less what lives outside the allocator); None: no end."""
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.allocated_peak_bytes = 0
        self.reserved_peak_bytes = 0
        self._size: dict[int, int] = {}  # every block, free or handed out
        self._prev: dict[int, int] = {}  # neighbours in the segment, _NONE at its ends
        self._next: dict[int, int] = {}
        self._pool: dict[int, tuple[int, int]] = {}
        self._free: set[int] = set()
        self._free_segments: set[int] = set()  # free blocks that are a whole segment: what a release gives back
        self._free_keys: dict[tuple[int, int], list[int]] = {}
        self._live: dict[int, int] = {}  # handle -> block address
        self._next_address = 0
        self._mapped_end: dict[tuple[int, int], int] = {}  # expandable: where each pool's mapped part ends
        self._last: dict[tuple[int, int], int] = {}  # expandable: the block at the end of each pool's mapped part

    # --- the two calls -------------------------------------------------------------------------------------
    def malloc(self, handle: int, nbytes: int, stream: int = 0) -> None:
        """Allocate nbytes under handle on a stream (torch allocates nothing for 0 bytes)."""
        if nbytes <= 0:
            return
        size = round_size(nbytes)
        pool = (stream, _SMALL if size <= SMALL_REQUEST_BYTES else _LARGE)
        if pool not in self._free_keys:
            self._free_keys[pool] = []
            self._mapped_end[pool] = (len(self._free_keys)) * _EXPANDABLE_SPACING
            self._last[pool] = _NONE
        address = self._take_cached(pool, size)
        if address == _NONE:
            address = self._grow(pool, size) if self.config.expandable_segments else self._new_segment(pool, size)
        block = self._size[address]
        if self._should_split(pool, block, size):
            self._split(address, size)
            block = size
        self._live[handle] = address
        self.allocated_bytes += block
        if self.allocated_bytes > self.allocated_peak_bytes:
            self.allocated_peak_bytes = self.allocated_bytes

    def free(self, handle: int) -> None:
        """Give back what handle holds to the cache (an unknown handle, e.g. a 0-byte one, is ignored)."""
        address = self._live.pop(handle, _NONE)
        if address == _NONE:
            return
        self.allocated_bytes -= self._size[address]
        before = self._prev[address]
        if before != _NONE and before in self._free:
            self._unfree(before)
            address = self._absorb_next(before)
        after = self._next[address]
        if after != _NONE and after in self._free:
            self._unfree(after)
            self._absorb_next(address)
        self._cache(address)

    def reset_peaks(self) -> None:
        """As torch.cuda.reset_peak_memory_stats(): peaks restart from what is held now."""
        self.allocated_peak_bytes = self.allocated_bytes
        self.reserved_peak_bytes = self.reserved_bytes

    def peaks(self) -> AllocatorPeaks:
        """The peaks since the start or the last reset_peaks()."""
        return AllocatorPeaks(
            allocated_peak_bytes=self.allocated_peak_bytes, reserved_peak_bytes=self.reserved_peak_bytes
        )

    # --- the rules ---------------------------------------------------------------------------------------
    def _take_cached(self, pool: tuple[int, int], size: int) -> int:
        """get_free_block: the best-fitting free block of the pool, out of the cache; _NONE when none may serve."""
        keys = self._free_keys[pool]
        index = bisect_left(keys, size << _ADDRESS_BITS)
        if index == len(keys):
            return _NONE
        address = keys[index] & _ADDRESS_MASK
        if self.config.expandable_segments and address == self._last[pool] and index + 1 < len(keys):
            index += 1  # the end block can grow without bound: any other block that fits is a closer fit
            address = keys[index] & _ADDRESS_MASK
        block = keys[index] >> _ADDRESS_BITS
        limit = self.config.max_split_size_bytes
        if limit is not None:
            if size < limit <= block:
                return _NONE  # an oversize block is not split for a request under the limit
            if size >= limit and block >= size + LARGE_SEGMENT_BYTES:
                return _NONE  # an oversize request takes an oversize block only within 20 MiB of its size
        del keys[index]
        self._free.discard(address)
        self._free_segments.discard(address)
        return address

    def _should_split(self, pool: tuple[int, int], block: int, size: int) -> bool:
        remaining = block - size
        if pool[1] == _SMALL or self.config.expandable_segments:
            return remaining >= MIN_BLOCK_BYTES
        limit = self.config.max_split_size_bytes
        return (limit is None or size < limit) and remaining > SMALL_REQUEST_BYTES

    def _new_segment(self, pool: tuple[int, int], size: int) -> int:
        """cudaMalloc a segment for a request no cached block serves; the whole segment is one block. When the device
        has no room for it, every cached segment no block of which is in use is given back first and the cudaMalloc
        retried (malloc's release_cached_blocks); if there is still no room the model goes on past the device, as if
        it were larger (torch would raise out of memory: the peaks then say by how much)."""
        length = segment_size(size)
        if self.device_bytes is not None and self.reserved_bytes + length > self.device_bytes:
            self._release_free_segments()
        address = self._next_address
        self._next_address += length
        self._add_block(address, length, pool, _NONE, _NONE)
        self._reserve(length)
        return address

    def _release_free_segments(self) -> None:
        """cudaFree every segment that is one free block (release_cached_blocks; not done for expandable segments)."""
        if self.config.expandable_segments:
            return
        for address in list(self._free_segments):
            self._unfree(address)
            self.reserved_bytes -= self._size.pop(address)
            del self._prev[address], self._next[address], self._pool[address]

    def _grow(self, pool: tuple[int, int], size: int) -> int:
        """Map pages at the end of the pool's expandable segment, joined to a free block there, until size fits."""
        page = SMALL_SEGMENT_BYTES if pool[1] == _SMALL else LARGE_SEGMENT_BYTES
        last = self._last[pool]
        have = 0
        if last != _NONE and last in self._free:
            self._unfree(last)
            have = self._size[last]
        added = -(-max(size - have, 0) // page) * page
        end = self._mapped_end[pool]
        self._mapped_end[pool] = end + added
        self._reserve(added)
        if have:
            self._size[last] += added
            return last
        self._add_block(end, added, pool, last, _NONE)
        if last != _NONE:
            self._next[last] = end
        self._last[pool] = end
        return end

    def _split(self, address: int, size: int) -> None:
        """The front `size` bytes stay with the block; the rest becomes a free block after it."""
        rest = address + size
        after = self._next[address]
        pool = self._pool[address]
        self._add_block(rest, self._size[address] - size, pool, address, after)
        self._size[address] = size
        self._next[address] = rest
        if after != _NONE:
            self._prev[after] = rest
        if self._last[pool] == address and self.config.expandable_segments:
            self._last[pool] = rest
        self._cache(rest)

    # --- bookkeeping -------------------------------------------------------------------------------------
    def _add_block(self, address: int, size: int, pool: tuple[int, int], before: int, after: int) -> None:
        if address > _ADDRESS_MASK:
            raise OverflowError(f"CachingAllocator: address {address} beyond the model's {_ADDRESS_BITS}-bit space")
        self._size[address] = size
        self._pool[address] = pool
        self._prev[address] = before
        self._next[address] = after

    def _absorb_next(self, address: int) -> int:
        """Merge the block after `address` into it (try_merge_blocks); returns address."""
        after = self._next[address]
        self._size[address] += self._size.pop(after)
        beyond = self._next.pop(after)
        self._next[address] = beyond
        if beyond != _NONE:
            self._prev[beyond] = address
        del self._prev[after]
        pool = self._pool.pop(after)
        if self._last[pool] == after:
            self._last[pool] = address
        return address

    def _cache(self, address: int) -> None:
        self._free.add(address)
        if self._prev[address] == _NONE and self._next[address] == _NONE:
            self._free_segments.add(address)
        insort(self._free_keys[self._pool[address]], self._size[address] << _ADDRESS_BITS | address)

    def _unfree(self, address: int) -> None:
        keys = self._free_keys[self._pool[address]]
        del keys[bisect_left(keys, self._size[address] << _ADDRESS_BITS | address)]
        self._free.discard(address)
        self._free_segments.discard(address)

    def _reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        if self.reserved_bytes > self.reserved_peak_bytes:
            self.reserved_peak_bytes = self.reserved_bytes


def replay(
    events: Iterable[Event],
    config: AllocatorConfig | None = None,
    window_start: int = 0,
    device_bytes: int | None = None,
) -> AllocatorPeaks:
    """The allocated and reserved peaks of the events from index window_start on, the allocator having served all
    events before it (as reset_peak_memory_stats() before the measured step). Events: (handle, nbytes) allocates,
    (handle, FREE) frees. device_bytes: what cudaMalloc can give (see CachingAllocator)."""
    allocator = CachingAllocator(config, device_bytes)
    malloc, free = allocator.malloc, allocator.free
    index = -1
    for index, event in enumerate(events):
        if index == window_start:
            allocator.reset_peaks()
        if event[1] == FREE:
            free(event[0])
        else:
            malloc(*event)
    if window_start > index:
        allocator.reset_peaks()  # an empty window: what is held at the end
    return allocator.peaks()


def events_from_memory_trace(trace: Iterable[Mapping[str, Any]]) -> list[Event]:
    """The stream of a device trace that torch recorded (torch.cuda.memory._record_memory_history(), then
    torch.cuda.memory._snapshot()["device_traces"][device]): 'alloc' allocates at its address, 'free_completed'
    frees it, each on the stream it names; the allocator's own actions (segments, snapshots) are left out.
    Replayed, it gives what the model says max_memory_allocated() and max_memory_reserved() are for torch's own
    allocation stream."""
    events: list[Event] = []
    for entry in trace:
        action = entry["action"]
        if action == "alloc":
            events.append((entry["addr"], entry["size"], entry["stream"]))
        elif action == "free_completed":
            events.append((entry["addr"], FREE))
    return events
