"""`shardscope report --pp`: the pipeline's schedule (stages by time, the bubble) and memory per pipeline rank, with
the numbers of `estimate --pp --time` and the estimate's `per_stage`."""

from __future__ import annotations

import re
from html import escape
from pathlib import Path

import pytest

from shardscope.cli import main
from shardscope.core.memory import estimate_memory
from shardscope.core.timeline import estimate_time
from shardscope.presets import gpu_preset, model_preset
from shardscope.presets.hardware import default_profile
from shardscope.report.content import build
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec
from shardscope.units import format_bytes

PIPELINE_CHARTS = ("memory", "communication", "pipeline-schedule", "memory-per-stage")


def pipeline() -> Scenario:
    """llama-3-8b, 2048 tokens, fsdp over 4 GPUs x pp 4 (1F1B, 8 micro-batches) on 16 H100s."""
    return Scenario(
        model=model_preset("llama-3-8b"),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=16),
        training=TrainingSpec(sequence_length=2048, grad_accum_steps=8),
        strategy=Strategy(name="fsdp", pp=4),
    )


def test_the_content_carries_every_rank_of_the_pipeline() -> None:
    data = build([pipeline()])
    estimate = estimate_time(pipeline(), default_profile(gpu_preset("h100-80gb")))
    assert data.timeline is None and data.pipeline is not None
    assert data.pipeline.step_time_s == estimate.step_time_s
    row = data.rows[0]
    assert row.timing is not None and row.timing.step_time_s == estimate.step_time_s
    assert row.ledger == estimate.ledger  # the pipeline rank that finishes last: its sends to the next stage
    assert [len(actions) for actions in data.pipeline.actions] == [16] * 4
    assert dict(data.scenario_lines)["mesh"].startswith("pp 4 x dp_replicate 1 x dp_shard 4")
    share = (estimate.step_time_s - estimate.compute_time_s) / estimate.step_time_s  # bubble and exposed comm
    said = f"{share:.0%} of its {estimate.step_time_s:.3f} s step is beyond the last pipeline rank's compute"
    assert said in " ".join(data.observations)
    assert "a pipeline's step is simulated whole: every pipeline rank, every micro-batch" in data.assumptions


def test_the_page_shows_the_schedule_and_memory_per_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page, png = tmp_path / "pipeline.html", tmp_path / "png"
    argv = ["report", "--model", "llama-3-8b", "--gpus", "16", "--strategy", "fsdp", "--pp", "4", "--grad-accum", "8"]
    assert main([*argv, "-o", str(page), "--png", str(png)]) == 0
    assert f"wrote {page}" in capsys.readouterr().out
    html = page.read_text(encoding="utf-8")
    for name in PIPELINE_CHARTS:
        assert re.search(rf'<figure class="chart" id="{name}"><svg', html), name
        assert (png / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 'id="memory-over-time"' not in html  # the one-rank memory curve does not hold for a pipeline
    assert "Pipeline: 4 ranks, 1f1b, 8 micro-batches" in html
    assert "pipeline rank 0 finishes last" in html and "idle 30.7% of their time" in html
    assert "27.3% with equal stages and free messages" in html  # (p - 1)/(m + p - 1) = 3/11
    memory = estimate_memory(pipeline())
    for entry in memory.per_stage:  # each pipeline rank's row: its stages, micro-batches in flight and peak
        cells = [escape(" & ".join(entry.stages)), str(entry.layers), str(entry.in_flight[0])]
        cells.append(format_bytes(entry.per_rank.peak_bytes, "GiB"))
        assert re.search(r"<td>" + r"</td>.*?<td>".join(map(re.escape, cells)) + "</td>", html), cells
    assert [entry.in_flight for entry in memory.per_stage] == [(4,), (3,), (2,), (1,)]
    assert "embed+layers 0-7" in html and "layers 25-31+head" in html
