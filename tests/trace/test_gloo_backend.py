"""The trace's recorder replays what a backend holds inside a collective: nothing for nccl, a copy of every
reduce-scatter's input for gloo (ProcessGroupGloo::reduce_scatter_tensor_coalesced clones it)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from shardscope.trace.compat import init_fake_process_group  # noqa: E402
from shardscope.trace.tracker import StepRecorder  # noqa: E402


def _reduce_scatter_peak(backend: str) -> tuple[int, dict[str, int]]:
    """The recorder's peak around one reduce-scatter of 8,000 B into 4,000 B (two ranks of the trace's fake process
    group, which moves no data and allocates nothing)."""
    gradients, output = torch.ones(2000), torch.empty(1000)
    recorder = StepRecorder(backend=backend)
    with recorder:
        recorder.label([gradients, output], "temporary")
        recorder.phase, recorder.where = "backward", "layers.0"
        recorder.start_window()
        dist.reduce_scatter_single(output=output, input=gradients)  # what FSDP2 calls
    return recorder.peak.total_bytes, recorder.peak.at_peak


def test_gloo_replays_the_reduce_scatter_clone_and_nccl_does_not() -> None:
    init_fake_process_group(2)
    try:
        nccl_peak, _ = _reduce_scatter_peak("nccl")
        gloo_peak, at_peak = _reduce_scatter_peak("gloo")
    finally:
        dist.destroy_process_group()
    assert nccl_peak == 12_000
    assert gloo_peak == nccl_peak + 8000
    assert at_peak["buffers"] == 8000


def test_an_unknown_backend_is_named() -> None:
    with pytest.raises(ValueError, match=r"backend='mpi'.*nccl, gloo"):
        StepRecorder(backend="mpi")
