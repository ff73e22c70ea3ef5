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
        first_life = recorder.life_of(first.untyped_storage())
        del first
        third = torch.empty(3)
    assert [size for _key, size in recorder.events] == [4000, 80, FREE, 12]
    assert first_life is not None
    assert recorder.events[0] == (first_life.ident, 4000)  # a handle per storage's life
    assert recorder.events[2] == (first_life.ident, FREE)
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
    life = recorder.life_of(storage)
    assert life is not None
    key = life.ident
    assert recorder.events == [(key, 1024), (key, FREE), (key, 0), (key, FREE), (key, 1024)]


def test_fsdp2_collective_buffers_are_allocated_on_their_streams() -> None:
    """An all-gather's input and output are made on FSDP2's copy-in stream, a reduce-scatter's output on its stream
    (its input on the default one): the caching allocator keeps each stream's blocks apart."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardscope.trace.tracker import ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        recorder = StepRecorder()
        recorder.phase = "backward"
        with recorder:
            shard, gathered = torch.empty(8), torch.empty(16)
            dist.all_gather_into_tensor(gathered, shard)
            gradients, reduced = torch.empty(16), torch.empty(8)
            dist.reduce_scatter_tensor(reduced, gradients)
        streams = [event[2] if len(event) == 3 else 0 for event in recorder.events if event[1] != FREE]
        assert streams == [ALL_GATHER_STREAM, ALL_GATHER_STREAM, 0, REDUCE_SCATTER_STREAM]
        del shard, gathered, gradients, reduced
    finally:
        dist.destroy_process_group()


def test_a_waited_collective_output_is_counted_once() -> None:
    """wait_tensor returns the tensor it waited on (its schema aliases the two, and the real kernel does so); the
    fake kernel's new storage would count a functional collective's output twice until the first is freed."""
    from shardscope.trace.compat import fake_tensor_mode

    recorder = StepRecorder()
    recorder.phase = "forward"
    with fake_tensor_mode(), recorder:
        reduced = torch.empty(2048)
        waited = torch.ops._c10d_functional.wait_tensor(reduced)
        assert waited is reduced
        assert recorder.live["activations"] == 2048 * 4
    assert [size for _key, size in recorder.events] == [2048 * 4]


def test_what_runs_unrecorded_is_not_counted() -> None:
    """DTensor's shape propagation runs inside `unrecorded` (trace.compat.dtensor_shape_propagation)."""
    recorder = StepRecorder()
    recorder.phase = "forward"
    with recorder:
        kept = torch.empty(100)
        with recorder.unrecorded():
            shape_only = torch.empty(1000)
        assert recorder.live["activations"] == 400
    assert [size for _key, size in recorder.events] == [400]
    del kept, shape_only
