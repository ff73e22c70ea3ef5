"""The 3-D mesh, dp 2 x cp 2 x tp 2 on 8 gloo ranks: the teaching tensor, sequence and context parallelism ends where
one process ends, element for element, in float64 after 3 AdamW steps (DESIGN.md: parity in float64 within 1e-10).

8 ranks on a few cores take a minute or two, so these tests are long and run only when asked for:
`pytest -m long tests/distributed/test_three_d_mesh.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_tensor_context_parallel import STEPS, parity_rank, ring_passes

from shardscope.core.params import param_layout
from shardscope.presets import model_preset
from shardscope.procs.functions import run_function

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.long]
WORLD, TP, CP = 8, 2, 2


def test_three_d_mesh_matches_one_process_rank_by_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # the parity helper of the 4-rank tests, on 8 ranks: each rank's slices, the tp-gathered whole model and the
    # losses against one process, the shapes the core predicts for a tp rank, and ring attention's sends and receives
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    case = ("tiny-llama", TP, CP, True)
    reports = run_function(parity_rank, WORLD, {"cases": [case]}, timeout_s=240)
    predicted_shapes = {t.name: list(t.shape) for t in param_layout(model_preset("tiny-llama"), TP).tensors()}
    for rank in range(WORLD):
        report = reports[rank]["cases"][0]
        assert report["max_abs_diff"] <= 1e-10, (rank, report)
        assert report["max_abs_diff_whole"] <= 1e-10, (rank, report)
        assert report["loss_diff"] <= 1e-10, (rank, report)
        assert report["shapes"] == predicted_shapes, rank
        assert sorted(report["point_to_point"]) == ring_passes("tiny-llama", TP, CP), rank


def _run(strategy: str) -> dict[str, object]:
    """`shardscope run` on the 3-D mesh in float64 (the run checks parity against one process itself)."""
    argv = ["--model", "tiny-llama", "--strategy", strategy, "--engine", "paper", "--world-size", str(WORLD)]
    argv += ["--tp", str(TP), "--cp", str(CP), "--steps", str(STEPS), "--precision", "fp64", "--json"]
    result = subprocess.run(
        [sys.executable, "-m", "shardscope", "run", *argv, "--timeout", "240"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    document: dict[str, object] = json.loads(result.stdout)
    return document


def test_run_on_the_three_d_mesh_matches_one_process() -> None:
    document = _run("ddp")
    assert document["parallelism"] == {"dp_replicate": 2, "dp_shard": 1, "cp": 2, "tp": 2, "pp": 1, "ep": 1}
    assert document["sequence_parallel"] is True
    parity = document["parity"]
    assert isinstance(parity, dict) and parity["ok"] and parity["max_abs_diff"] <= 1e-10, parity


def test_fsdp_on_the_three_d_mesh_matches_one_process() -> None:
    document = _run("fsdp")
    assert document["parallelism"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2, "pp": 1, "ep": 1}
    parity = document["parity"]
    assert isinstance(parity, dict) and parity["ok"] and parity["max_abs_diff"] <= 1e-10, parity
