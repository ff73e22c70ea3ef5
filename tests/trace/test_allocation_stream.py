"""The recorder's stream of allocations and frees, which the caching allocator model replays."""

from __future__ import annotations

import pytest

from shardscope.core.allocator import FREE, replay

pytest.importorskip("torch")
import torch

from shardscope.trace.tracker import StepRecorder


def test_recorder_keeps_every_allocation_and_free_in_order() -> None:
    recorder = StepRecorder()
    recorder.phase = "forward"
    with recorder:
        first = torch.empty(1000)
        second = torch.empty(10, dtype=torch.float64)
        recorder.start_window()
        first_key = id(first.untyped_storage())
        del first
        third = torch.empty(3)
    assert [size for _key, size in recorder.events] == [4000, 80, FREE, 12]
    assert recorder.events[2] == (first_key, FREE)
    assert recorder.window_event == 2
    peaks = replay(recorder.events, window_start=recorder.window_event)
    assert (peaks.allocated_peak_bytes, peaks.reserved_peak_bytes) == (4096 + 512, 2 << 20)  # held at the window start
    del second, third


def test_a_resized_storage_is_freed_and_allocated_again() -> None:
    """FSDP2 frees and re-gathers parameters by resizing their storage: a free, then an allocation of the new size."""
    recorder = StepRecorder()
    recorder.phase = "forward"
    with recorder:
        tensor = torch.empty(256)
    storage = tensor.untyped_storage()
    recorder.on_resize(storage, 1024, 0)
    recorder.on_resize(storage, 0, 1024)
    key = id(storage)
    assert recorder.events == [(key, 1024), (key, FREE), (key, 0), (key, FREE), (key, 1024)]
