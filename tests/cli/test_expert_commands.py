"""`--ep` on timeline and report: the same step as `estimate --ep --time`, with the expert all-to-alls in its ledger,
its Chrome trace and its page (trace refuses it in one line: tests/adversarial/bad_inputs.py); report's and plan's
searches over expert parallel degrees, and what they compare an expert-parallel plan with."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import shardscope.cli.report as report_cli
from shardscope.cli import main
from shardscope.core.timeline import estimate_time
from shardscope.planner import PlanRequest, plan
from shardscope.presets import gpu_preset, model_preset
from shardscope.report.content import _siblings
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec

MIXTRAL = ["--model", "mixtral-8x7b", "--gpus", "16", "--strategy", "fsdp", "--ep", "2"]


def mixtral_ep2(strategy: str = "fsdp") -> Scenario:
    """What MIXTRAL describes: `strategy` with the experts split over 2 GPUs, 16 H100s, the default batch."""
    return Scenario(
        model=model_preset("mixtral-8x7b"),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=16),
        training=TrainingSpec(),
        strategy=Strategy(name=strategy, ep=2),
    )


def test_timeline_prices_the_expert_all_to_alls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expected = estimate_time(mixtral_ep2())
    out = tmp_path / "trace.json"
    assert main(["timeline", *MIXTRAL, "--trace", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("mixtral-8x7b, fsdp+ep2 (pytorch) on 16 ranks")
    assert f"step time           {expected.step_time_s * 1e3:10.3f} ms" in printed
    dispatches = [line for line in printed.splitlines() if re.match(r"\s*(forward|backward)\s+all_to_all\s+ep 2", line)]
    sent = {(row.phase, row.count) for row in expected.ledger if row.op == "all_to_all" and row.group_size == 2}
    assert len(dispatches) == len(sent) == 3  # the counts swap, then dispatch and combine, forward and backward
    names = {event["name"] for event in json.loads(out.read_text())["traceEvents"]}
    assert any("all_to_all" in name for name in names)

    assert main(["timeline", *MIXTRAL, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["step_time_s"] == expected.step_time_s
    ledger = document["communication"]["ledger"]
    assert {(row["phase"], row["count"]) for row in ledger if row["op"] == "all_to_all"} == sent


def test_report_shows_the_expert_parallel_strategies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "experts.html"
    assert main(["report", *MIXTRAL[:4], "--ep", "2", "-o", str(page)]) == 0
    assert f"wrote {page}" in capsys.readouterr().out
    html = page.read_text(encoding="utf-8")
    for label in ("ddp+ep2", "zero1+ep2", "zero2+ep2", "zero3+ep2", "hsdp(8)+ep2"):  # every strategy compared
        assert label in html, label
    assert re.search(r'<figure class="chart" id="communication"><svg', html)
    assert "all-to-all" in html  # the communication chart's legend
    row = re.search(r"zero3\+ep2 \(chosen\)</td>(.*?)</tr>", html, re.S)
    assert row is not None
    assert f"<td>{estimate_time(mixtral_ep2('zero3')).step_time_s:.3f}</td>" in row.group(1)


def test_report_plans_with_the_experts_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--ep N plans expert parallelism of N ways, as --pp N plans pipelines of N stages; without it, report plans over
    the degrees plan searches by default (the request is read as report makes it, the page not drawn)."""
    page = tmp_path / "planned.html"
    argv = ["report", "--model", "tiny-moe", "--gpus", "4", "--seq-len", "64", "--global-batch-tokens", "2K"]
    assert main([*argv, "--ep", "2", "-o", str(page)]) == 0
    found = re.search(r"<td>([a-z0-9()+]+) \(chosen\)</td>", page.read_text(encoding="utf-8"))
    assert found is not None and found.group(1).endswith("+ep2")
    asked: list[PlanRequest] = []
    monkeypatch.setattr(report_cli, "plan", lambda request: asked.append(request) or plan(request))
    monkeypatch.setattr(report_cli, "write_report_or_fail", lambda *args, **kwargs: page)
    assert main(["report", "--model", "mixtral-8x7b", "--gpus", "16", "--global-batch-tokens", "128K"]) == 0
    capsys.readouterr()
    assert [request.expert_parallel for request in asked] == [(1, 2, 4, 8)]


def test_the_comparison_leaves_out_a_family_that_cannot_take_the_split() -> None:
    # zero3+tp2+ep8 on 32 GPUs: hsdp within a node has shard groups of 4 data-parallel ranks, which ep 8 cannot borrow
    chosen = Scenario(
        model=model_preset("mixtral-8x7b"),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=32),
        training=TrainingSpec(),
        strategy=Strategy(name="zero3", tp=2, ep=8),
    )
    compared = [scenario.strategy.label for scenario in _siblings(chosen)]
    assert compared == ["ddp+tp2+ep8", "zero1+tp2+ep8", "zero2+tp2+ep8", "zero3+tp2+ep8"]


def test_plan_advises_hsdp_only_where_its_groups_hold_the_experts(capsys: pytest.CaptureFixture[str]) -> None:
    # 16 GPUs on 2 nodes: a zero3+ep8 plan's advice weighs hsdp within a node, whose shard groups (4 ranks under
    # tp 2) cannot lend ep 8 its GPUs; the plan used to fail with "ep 8 must divide dp_shard 4" (exit 2)
    argv = ["plan", "--model", "mixtral-8x7b", "--max-gpus", "16", "--global-batch-tokens", "128K", "--json"]
    assert main(argv) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert any(entry["parallelism"]["ep"] == 8 for entry in plans)
