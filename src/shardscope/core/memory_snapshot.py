"""A step's allocations as a CUDA memory snapshot: what torch.cuda.memory._snapshot() returns, made from a stream.

The stream (the trace's, shardscope.trace.tracker) is replayed through the caching allocator model with every action
logged as torch logs it (segment_alloc or, with expandable segments, segment_map; alloc; free_requested and
free_completed, with addresses, requested sizes and streams), and the final state of its segments and blocks is
listed as torch lists it. Pickled, it opens in PyTorch's memory visualizer (https://pytorch.org/memory_viz) and in
torch.cuda._memory_viz. There are no stack frames: the stream has no Python context.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shardscope.core.allocator import (
    _NONE,
    _SMALL,
    FREE,
    AllocatorConfig,
    CachingAllocator,
    Event,
)


class RecordingAllocator(CachingAllocator):
    """The caching allocator model, keeping torch's device trace of what it does."""

    def __init__(self, config: AllocatorConfig | None = None, device_bytes: int | None = None) -> None:
        super().__init__(config, device_bytes)
        self.history: list[dict[str, Any]] = []
        self._requested: dict[int, tuple[int, int]] = {}  # block address -> (requested bytes, stream)

    def _log(self, action: str, address: int, size: int, stream: int) -> None:
        entry = {"action": action, "addr": address, "size": size, "stream": stream}
        self.history.append({**entry, "time_us": len(self.history), "frames": [], "compile_context": "N/A"})

    def malloc(self, handle: int, nbytes: int, stream: int = 0) -> None:
        reserved = self.reserved_bytes
        super().malloc(handle, nbytes, stream)
        if nbytes <= 0:
            return
        address = self._live[handle]
        grown = self.reserved_bytes - reserved
        if grown:
            pool = self._pool[address]
            end = self._mapped_end[pool] if self.config.expandable_segments else self._next_address
            self._log("segment_map" if self.config.expandable_segments else "segment_alloc", end - grown, grown, stream)
        self._requested[address] = (nbytes, stream)
        self._log("alloc", address, nbytes, stream)

    def free(self, handle: int) -> None:
        address = self._live.get(handle, _NONE)
        if address != _NONE:
            nbytes, stream = self._requested.pop(address)
            self._log("free_requested", address, nbytes, stream)
            self._log("free_completed", address, nbytes, stream)
        super().free(handle)

    def segments(self) -> list[dict[str, Any]]:
        """Every segment now, with its blocks in address order, as torch.cuda.memory._snapshot()['segments']."""
        live = set(self._live.values())
        found = []
        for start in sorted(address for address, before in self._prev.items() if before == _NONE):
            stream, pool = self._pool[start]
            blocks: list[dict[str, Any]] = []
            address = start
            while address != _NONE:
                active = address in live
                requested = self._requested[address][0] if active else 0
                state = "active_allocated" if active else "inactive"
                blocks.append(
                    {"address": address, "size": self._size[address], "requested_size": requested, "state": state}
                )
                address = self._next[address]
            allocated = sum(int(block["size"]) for block in blocks if block["state"] == "active_allocated")
            found.append(
                {
                    "device": 0,
                    "address": start,
                    "total_size": sum(int(block["size"]) for block in blocks),
                    "allocated_size": allocated,
                    "active_size": allocated,
                    "requested_size": sum(int(block["requested_size"]) for block in blocks),
                    "stream": stream,
                    "segment_type": "small" if pool == _SMALL else "large",
                    "segment_pool_id": (0, 0),
                    "is_expandable": self.config.expandable_segments,
                    "frames": [],
                    "blocks": [{**block, "frames": []} for block in blocks],
                }
            )
        return found


def memory_snapshot(
    events: Iterable[Event], config: AllocatorConfig | None = None, device_bytes: int | None = None
) -> dict[str, Any]:
    """torch.cuda.memory._snapshot()'s dictionary for a stream of (handle, nbytes[, stream]) and (handle, FREE)."""
    allocator = RecordingAllocator(config, device_bytes)
    for event in events:
        if event[1] == FREE:
            allocator.free(event[0])
        else:
            allocator.malloc(*event)
    settings = allocator.config
    return {
        "segments": allocator.segments(),
        "device_traces": [allocator.history],
        "allocator_settings": {
            "expandable_segments": settings.expandable_segments,
            "max_split_size": -1 if settings.max_split_size_bytes is None else settings.max_split_size_bytes,
        },
        "external_annotations": [],
    }
