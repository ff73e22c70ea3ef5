"""The allocator model against a real GPU: torch's own recorded allocation streams of three FSDP2 steps on an H200.

Each file in tests/data/gpu is torch.cuda.memory._snapshot()'s device trace of one `benchmarks/gpu_check.py` case
(llama-3-8b cut to 8 blocks, sequence 8192, world 8 over a fake process group, checkpointing none, full and op; the
measurements are benchmarks/results/gpu_check-h200-snapshots.json), reduced to its allocations (requested bytes and
stream) and completed frees. Replayed through core.allocator from the first allocation, they must give what the GPU
reported: torch.cuda.max_memory_allocated() and max_memory_reserved() over the last step, to the byte.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from shardscope.core.allocator import FREE, Event, replay

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu"
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu_check-h200-snapshots.json"


def _measured() -> dict[str, dict[str, int]]:
    return {row["mode"]: row["measured"] for row in json.loads(RESULTS.read_text())["rows"]}


def _stream(mode: str, with_streams: bool = True) -> list[Event]:
    document = json.loads(gzip.decompress((DATA / f"allocator-stream-h200-w8-{mode}.json.gz").read_bytes()))
    assert document["allocator_settings"] == {
        "max_split_size": -1,
        "expandable_segments": False,
        "garbage_collection_threshold": 0.0,
    }
    events: list[Event] = []
    for event in document["events"]:
        if event[0] == "alloc":
            events.append((event[1], event[2], event[3] if with_streams else 0))
        else:
            events.append((event[1], FREE))
    return events


@pytest.mark.parametrize("mode", ["none", "full", "op"])
def test_replayed_h200_stream_gives_the_measured_allocated_and_reserved_peaks(mode: str) -> None:
    measured = _measured()[mode]
    peaks = replay(_stream(mode))  # steady state: no step after the first reserves more, none allocates more
    assert peaks.allocated_peak_bytes == measured["allocated_peak_bytes"]
    assert peaks.reserved_peak_bytes == measured["reserved_peak_bytes"]


def test_without_its_streams_the_replay_reserves_less() -> None:
    # FSDP2's all-gather and reduce-scatter streams keep their own segments: one stream for all undercounts.
    measured = _measured()["none"]["reserved_peak_bytes"]
    assert replay(_stream("none", with_streams=False)).reserved_peak_bytes < 0.95 * measured
