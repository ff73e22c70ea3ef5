"""The measured step's memory tracker on one process: lives on the main thread's op clock, and its rule for frees
that another thread reports late (gloo's reduce-scatter clone; see runtime/tracker.py)."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
from shardscope.runtime.tracker import MemoryTracker  # noqa: E402

MIB = 1 << 20


def _floats(num_bytes: int) -> torch.Tensor:
    return torch.ones(num_bytes // 4)


def test_a_storage_another_thread_frees_late_is_freed_after_its_last_use() -> None:
    """The clone case, forced: the main thread uses a buffer, drops it, allocates another; a helper thread holds the
    last reference and drops it only after that allocation. Counted when the report came, the peak would be both
    buffers (2 MiB); by the rule it is one (the rank did not need the first any more)."""
    handed: list[torch.Tensor] = []
    allocated, dropped = threading.Event(), threading.Event()

    def helper() -> None:
        allocated.wait(timeout=10)
        handed.clear()  # the last reference goes away on this thread
        dropped.set()

    thread = threading.Thread(target=helper)
    thread.start()
    with MemoryTracker() as tracker:
        first = _floats(MIB)
        first.mul_(2)  # its last use on the main thread
        handed.append(first)
        del first
        second = _floats(MIB)
        after_second = tracker.tick
        allocated.set()
        dropped.wait(timeout=10)
        second.add_(1)
    thread.join()
    assert tracker.peak_bytes == MIB
    assert tracker.high_water == {"forward": MIB}
    assert tracker.live_by_label_at(after_second) == {"forward": MIB}  # what the step reads at forward's end


def test_main_thread_frees_count_where_they_happen() -> None:
    with MemoryTracker() as tracker:
        first = _floats(MIB)
        second = _floats(MIB)  # both live here: the peak
        del first
        tracker.phase = "backward"
        third = _floats(MIB // 2)
        live_now = tracker.live_by_label()
        del second, third
    assert tracker.peak_bytes == 2 * MIB
    assert live_now == {"forward": MIB, "backward": MIB // 2}
    assert tracker.peak_by_final_label() == {"forward": 2 * MIB}


def test_registered_storages_relabels_and_resizes() -> None:
    """A registered buffer that grows in place (FSDP2's gathered parameters) counts at its size at every op; a
    relabel moves bytes between labels from that op on, and the peak's composition uses the final labels."""
    buffer = torch.empty(0)
    grads = _floats(MIB)
    tracker = MemoryTracker()
    tracker.register([buffer], "buffers", resizable=True)
    tracker.register([grads], "backward")
    with tracker:
        buffer.untyped_storage().resize_(MIB)
        _floats(4).add_(1)  # an op: the resize is seen at the end of it
        tracker.relabel([grads], "gradients")
        buffer.untyped_storage().resize_(0)
        _floats(4).add_(1)
    assert tracker.peak_bytes == 2 * MIB + 4
    assert tracker.high_water["buffers"] == MIB
    assert tracker.high_water["gradients"] == MIB
    assert tracker.peak_by_final_label() == {"buffers": MIB, "gradients": MIB, "forward": 4}
