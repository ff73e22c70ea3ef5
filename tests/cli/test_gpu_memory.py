"""--gpu-memory replaces the memory of the --gpu preset (default h100-80gb) and keeps its FLOP/s, memory bandwidth and
links, so a memory size works with the time model in estimate, plan, timeline and report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardscope.cli import main
from shardscope.presets import gpu_record
from shardscope.units import GIB

SCENARIO = ["--model", "gpt2", "--seq-len", "1024", "--gpus", "8"]


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:  # type: ignore[type-arg]
    assert main(list(argv)) == 0
    document: dict = json.loads(capsys.readouterr().out)  # type: ignore[type-arg]
    return document


def test_estimate_time_with_a_memory_size_keeps_the_presets_speeds(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", *SCENARIO, "--strategy", "zero3", "--time", "--json"]
    full = _json(capsys, *args, "--gpu", "a100-80gb")
    capped = _json(capsys, *args, "--gpu", "a100-80gb", "--gpu-memory", "40GiB")
    gpu = capped["cluster"]["gpu"]
    assert gpu["memory_bytes"] == 40 * GIB and gpu["id"] == "a100-80gb" and "(--gpu-memory)" in gpu["name"]
    assert gpu["peak_flops_per_s"] == full["cluster"]["gpu"]["peak_flops_per_s"]
    # the same GPU with less memory: the same step, judged against a smaller capacity
    assert capped["strategies"][0]["step_time_s"] == full["strategies"][0]["step_time_s"] > 0
    assert capped["strategies"][0]["per_rank"] == full["strategies"][0]["per_rank"]


def test_a_memory_size_alone_applies_to_the_default_preset(capsys: pytest.CaptureFixture[str]) -> None:
    document = _json(capsys, "estimate", *SCENARIO, "--strategy", "ddp", "--gpu-memory", "1GiB", "--time", "--json")
    gpu = document["cluster"]["gpu"]
    assert gpu["id"] == "h100-80gb" and gpu["memory_bytes"] == GIB
    assert dict(gpu["peak_flops_per_s"]) == dict(gpu_record("h100-80gb").gpu.peak_flops_per_s)
    assert document["strategies"][0]["fits"] is False and document["strategies"][0]["tokens_per_s"] > 0


def test_timeline_and_plan_take_a_memory_size(capsys: pytest.CaptureFixture[str]) -> None:
    timeline = _json(capsys, "timeline", *SCENARIO, "--strategy", "zero3", "--gpu-memory", "40GiB", "--json")
    assert "(--gpu-memory)" in json.dumps(timeline) and timeline["step_time_s"] > 0
    plan = ["plan", "--model", "gpt2", "--global-batch-tokens", "64K", "--max-gpus", "8", "--gpu-memory", "40GiB"]
    document = _json(capsys, *plan, "--json")
    assert document["plans"] and all(row["step_time_s"] > 0 for row in document["plans"])


def test_report_takes_a_memory_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.html"
    assert main(["report", *SCENARIO, "--strategy", "zero3", "--gpu-memory", "40GiB", "-o", str(out)]) == 0
    assert "memory 40GiB (--gpu-memory)" in out.read_text(encoding="utf-8")
    capsys.readouterr()
