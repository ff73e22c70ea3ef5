"""`trace --memory-snapshot`: the step's allocations as a CUDA memory snapshot that torch's own viewer reads."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from shardscope.cli import main

pytest.importorskip("torch")
from torch.cuda import _memory_viz


def test_snapshot_opens_in_torchs_memory_viz_and_holds_the_reserved_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "step.pickle"
    arguments = ["trace", "--model", "tiny-llama", "--gpus", "4", "--strategy", "fsdp", "--seq-len", "64", "--json"]
    assert main([*arguments, "--memory-snapshot", str(target)]) == 0
    document = json.loads(capsys.readouterr().out)
    snapshot = pickle.loads(target.read_bytes())
    segments = snapshot["segments"]
    # Nothing gives segments back, so what they hold at the end is the reserved peak the trace reports.
    assert sum(segment["total_size"] for segment in segments) == document["per_rank"]["reserved_peak_bytes"]
    assert {segment["stream"] for segment in segments} == {0, 1, 2}  # FSDP2's all-gather and reduce-scatter streams
    summary = _memory_viz.segsum(snapshot)  # raises on any accounting mismatch between segments and blocks
    assert f"segments: {len(segments)}" in summary
    actions = {entry["action"] for entry in snapshot["device_traces"][0]}
    assert actions == {"segment_alloc", "alloc", "free_requested", "free_completed"}
    assert "<html" in _memory_viz.trace_plot(snapshot).lower()


def test_a_snapshot_into_a_missing_folder_is_one_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "--model", "tiny-llama", "--memory-snapshot", "/nonexistent-folder/step.pickle"]) == 2
    assert "folder /nonexistent-folder does not exist" in capsys.readouterr().err
