"""The caching allocator model against the rules of c10/cuda/CUDACachingAllocator.cpp, one small stream per rule."""

from __future__ import annotations

import pytest

from shardscope.core.allocator import (
    FREE,
    AllocatorConfig,
    CachingAllocator,
    events_from_memory_trace,
    replay,
    round_size,
    segment_size,
)

KiB, MiB = 1 << 10, 1 << 20
EXPANDABLE = AllocatorConfig(expandable_segments=True)


def test_requests_round_up_to_512_bytes() -> None:
    """round_size: at least kMinBlockSize (512), else the next multiple of 512."""
    assert [round_size(n) for n in (1, 511, 512, 513, 1024, 1025)] == [512, 512, 512, 1024, 1024, 1536]
    allocator = CachingAllocator()
    allocator.malloc(1, 1)
    assert allocator.allocated_bytes == 512


def test_zero_bytes_allocate_nothing() -> None:
    """A 0-byte request takes no block (and its free is a no-op)."""
    assert replay([(1, 0), (1, FREE)]) == replay([])


def test_segment_sizes_by_request() -> None:
    """get_allocation_size: 2 MiB for small requests (<= 1 MiB), 20 MiB for large ones under 10 MiB, else rounded
    up to 2 MiB."""
    assert segment_size(512) == 2 * MiB
    assert segment_size(1 * MiB) == 2 * MiB
    assert segment_size(1 * MiB + 512) == 20 * MiB
    assert segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB
    assert segment_size(10 * MiB + 512) == 12 * MiB
    assert replay([(1, 1 * MiB + 512)]).reserved_peak_bytes == 20 * MiB
    assert replay([(1, 11 * MiB)]).reserved_peak_bytes == 12 * MiB


def test_small_and_large_pools_do_not_share_blocks() -> None:
    """get_pool: requests of at most 1 MiB use the small pool, larger ones the large pool; a free large block does
    not serve a small request."""
    peaks = replay([(1, 4 * MiB), (1, FREE), (2, 1 * MiB)])
    assert peaks.reserved_peak_bytes == 20 * MiB + 2 * MiB


def test_small_pool_splits_any_remainder_of_512_bytes() -> None:
    """should_split, small pool: split when the remainder is >= 512 bytes, so small requests pack a 2 MiB segment."""
    stream = [(handle, 512) for handle in range(4096)]  # 4096 x 512 B = 2 MiB exactly
    assert replay(stream).reserved_peak_bytes == 2 * MiB
    assert replay([*stream, (4096, 512)]).reserved_peak_bytes == 4 * MiB


def test_large_pool_splits_only_a_remainder_over_1_mib() -> None:
    """should_split, large pool: split only when the remainder is > 1 MiB (kSmallSize); otherwise the whole block
    is handed out and counted as allocated."""
    split = CachingAllocator()
    split.malloc(1, 12 * MiB)
    split.free(1)
    split.malloc(2, 10 * MiB + 512)  # remainder 2 MiB - 512: split off and cached
    assert split.allocated_bytes == 10 * MiB + 512
    whole = CachingAllocator()
    whole.malloc(1, 12 * MiB)
    whole.free(1)
    whole.malloc(2, 11 * MiB)  # remainder exactly 1 MiB: not split
    assert whole.allocated_bytes == 12 * MiB
    whole.malloc(3, 2 * MiB)  # nothing cached: a new 20 MiB segment
    assert whole.reserved_bytes == 32 * MiB


def test_remainder_of_a_split_serves_the_next_request() -> None:
    """alloc_found_block: the request takes the front of the block; the rest stays cached for later requests."""
    allocator = CachingAllocator()
    allocator.malloc(1, 3 * MiB)
    allocator.malloc(2, 5 * MiB)  # from the 17 MiB left of the first 20 MiB segment
    allocator.malloc(3, 12 * MiB)  # 12 MiB left: exactly fits
    assert allocator.reserved_bytes == 20 * MiB
    assert allocator.allocated_bytes == 20 * MiB


def test_best_fit_takes_the_smallest_free_block_that_fits() -> None:
    """get_free_block: the smallest cached block of the pool that fits, not the first or the largest."""
    allocator = CachingAllocator()
    for handle, size in ((1, 12 * MiB), (2, 16 * MiB), (3, 14 * MiB)):
        allocator.malloc(handle, size)
    for handle in (1, 2, 3):
        allocator.free(handle)
    allocator.malloc(4, 13 * MiB)  # the 14 MiB block: 1 MiB remainder, not split
    assert allocator.allocated_bytes == 14 * MiB
    allocator.malloc(5, 15 * MiB)  # 16 MiB block
    allocator.malloc(6, 12 * MiB)  # 12 MiB block
    assert allocator.reserved_bytes == (12 + 16 + 14) * MiB


def test_best_fit_ties_go_to_the_lower_address() -> None:
    """BlockComparatorSize: blocks of equal size are ordered by address, so the lower one is taken."""
    allocator = CachingAllocator()
    allocator.malloc(1, 12 * MiB)
    allocator.malloc(2, 12 * MiB)
    allocator.free(2)
    allocator.free(1)
    allocator.malloc(3, 12 * MiB)
    assert allocator._live[3] == 0  # the first segment's address


def test_freed_blocks_are_reused_not_reallocated() -> None:
    """free puts the block in the cache; a later request of a size it fits reuses it without a new segment."""
    stream = []
    for step in range(10):
        stream += [(step, 30 * MiB), (step, FREE)]
    peaks = replay(stream)
    assert peaks.reserved_peak_bytes == 30 * MiB
    assert peaks.allocated_peak_bytes == 30 * MiB


def test_freed_neighbours_merge() -> None:
    """free_block / try_merge_blocks: a freed block merges with free neighbours of its segment, so the whole
    segment can serve a request as large as itself again."""
    allocator = CachingAllocator()
    allocator.malloc(1, 5 * MiB)
    allocator.malloc(2, 5 * MiB)  # from the same 20 MiB segment
    allocator.free(1)
    allocator.free(2)  # merges with block 1 before it and the 10 MiB remainder after it
    allocator.malloc(3, 20 * MiB)
    assert allocator.reserved_bytes == 20 * MiB


def test_blocks_of_different_segments_do_not_merge() -> None:
    """try_merge_blocks joins only neighbours in one segment: two freed 12 MiB segments do not make a 24 MiB block."""
    peaks = replay([(1, 12 * MiB), (2, 12 * MiB), (1, FREE), (2, FREE), (3, 24 * MiB)])
    assert peaks.reserved_peak_bytes == 48 * MiB


def test_max_split_size_keeps_oversize_blocks_whole() -> None:
    """max_split_size: a request under it takes no cached block of at least that size; an oversize request takes an
    oversize block only when the block is less than 20 MiB (kLargeBuffer) larger."""
    limited = AllocatorConfig(max_split_size_bytes=64 * MiB)
    assert replay([(1, 100 * MiB), (1, FREE), (2, 30 * MiB)], limited).reserved_peak_bytes == 130 * MiB
    assert replay([(1, 100 * MiB), (1, FREE), (2, 30 * MiB)]).reserved_peak_bytes == 100 * MiB
    assert replay([(1, 100 * MiB), (1, FREE), (2, 90 * MiB)], limited).reserved_peak_bytes == 100 * MiB
    assert replay([(1, 100 * MiB), (1, FREE), (2, 70 * MiB)], limited).reserved_peak_bytes == 170 * MiB
    with pytest.raises(ValueError, match="max_split_size_bytes=1048576"):
        AllocatorConfig(max_split_size_bytes=1 * MiB)


def test_expandable_segments_grow_by_pages() -> None:
    """expandable_segments: the pool's one segment maps 20 MiB pages (large pool) or 2 MiB pages (small pool), just
    enough for the request, instead of a segment per request."""
    assert replay([(1, 21 * MiB)], EXPANDABLE).reserved_peak_bytes == 40 * MiB
    assert replay([(1, 3 * MiB)], EXPANDABLE).reserved_peak_bytes == 20 * MiB
    assert replay([(1, 512)], EXPANDABLE).reserved_peak_bytes == 2 * MiB
    # The default allocator's 12 MiB + 12 MiB segments; expandable: 20 MiB, then one more page for the rest.
    assert replay([(1, 12 * MiB), (2, 12 * MiB)]).reserved_peak_bytes == 24 * MiB
    assert replay([(1, 12 * MiB), (2, 12 * MiB)], EXPANDABLE).reserved_peak_bytes == 40 * MiB


def test_expandable_segments_extend_a_free_block_at_the_end() -> None:
    """try_allocate_expandable_block: a free block at the end of the mapped part is extended by just the pages
    missing, and freed blocks of the segment merge into one."""
    stream = [(1, 12 * MiB), (2, 12 * MiB), (1, FREE), (2, FREE), (3, 50 * MiB)]
    assert replay(stream, EXPANDABLE).reserved_peak_bytes == 60 * MiB
    assert replay(stream).reserved_peak_bytes == 24 * MiB + 50 * MiB


def test_expandable_segments_split_any_remainder_of_512_bytes() -> None:
    """should_split with expandable segments: the large pool too splits any remainder of >= 512 bytes."""
    allocator = CachingAllocator(EXPANDABLE)
    allocator.malloc(1, 19 * MiB + 512)
    assert allocator.allocated_bytes == 19 * MiB + 512
    allocator.malloc(2, 2 * MiB)  # 512 B short of the free end block: one more page
    assert allocator.reserved_bytes == 40 * MiB


def test_expandable_best_fit_prefers_a_block_that_cannot_grow() -> None:
    """get_free_block with expandable segments: the free block at the end counts as large as it can grow, so another
    free block that fits goes first even when the end block is smaller."""
    allocator = CachingAllocator(EXPANDABLE)
    allocator.malloc(1, 8 * MiB)
    allocator.malloc(2, 6 * MiB)  # the 20 MiB page: [0, 8) [8, 14), a free 6 MiB end block
    hole = allocator._live[1]
    allocator.free(1)  # an 8 MiB hole at the start
    allocator.malloc(3, 5 * MiB)  # the end block is the closer fit by size, yet the hole is taken
    assert allocator._live[3] == hole
    assert allocator.reserved_bytes == 20 * MiB


def test_peaks_count_from_the_window_start() -> None:
    """replay's window: peaks restart (reset_peak_memory_stats) at window_start, the allocator keeping its cache."""
    stream = [(1, 40 * MiB), (1, FREE), (2, 30 * MiB), (2, FREE)]
    whole = replay(stream)
    window = replay(stream, window_start=2)
    assert (whole.allocated_peak_bytes, whole.reserved_peak_bytes) == (40 * MiB, 40 * MiB)
    assert (window.allocated_peak_bytes, window.reserved_peak_bytes) == (30 * MiB, 40 * MiB)


@pytest.mark.parametrize("config", [AllocatorConfig(), EXPANDABLE], ids=["segments", "expandable"])
def test_random_streams_keep_the_books(config: AllocatorConfig) -> None:
    """Bookkeeping: blocks tile the reserved bytes exactly, live blocks add up to allocated, and once everything is
    freed each segment (or each pool's mapped part) is one free block again."""
    import random

    rng = random.Random(7)
    allocator = CachingAllocator(config)
    live: list[int] = []
    for handle in range(3000):
        if live and rng.random() < 0.45:
            allocator.free(live.pop(rng.randrange(len(live))))
        else:
            allocator.malloc(handle, rng.choice((rng.randrange(1, 4 * KiB), rng.randrange(1, 3 * MiB), 24 * MiB)))
            live.append(handle)
        assert sum(allocator._size.values()) == allocator.reserved_bytes
        assert sum(allocator._size[address] for address in allocator._live.values()) == allocator.allocated_bytes
    for handle in live:
        allocator.free(handle)
    assert allocator.allocated_bytes == 0
    assert all(allocator._prev[a] == -1 and allocator._next[a] == -1 for a in allocator._size)


def test_torch_memory_trace_becomes_a_stream() -> None:
    """A recorded device trace: alloc (on its stream) and free_completed are the stream (handles are addresses), the
    allocator's own segment actions and free_requested are left out."""
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 2 * MiB, "stream": 0},
        {"action": "alloc", "addr": 0, "size": 100, "stream": 0},
        {"action": "free_requested", "addr": 0, "size": 100, "stream": 0},
        {"action": "free_completed", "addr": 0, "size": 100, "stream": 0},
        {"action": "alloc", "addr": 0, "size": 200, "stream": 7},
    ]
    assert events_from_memory_trace(trace) == [(0, 100, 0), (0, FREE), (0, 200, 7)]


def test_a_block_serves_only_its_own_stream() -> None:
    """The pools' free blocks are ordered by stream first (BlockComparatorSize): a block freed on one stream is not
    handed to a request on another, which gets a segment of its own."""
    allocator = CachingAllocator()
    allocator.malloc(1, 30 * MiB, stream=0)
    allocator.free(1)
    allocator.malloc(2, 30 * MiB, stream=5)
    assert allocator.peaks().reserved_peak_bytes == 60 * MiB
    allocator.malloc(3, 30 * MiB, stream=0)  # the cached block of stream 0 serves it
    assert allocator.peaks().reserved_peak_bytes == 60 * MiB
