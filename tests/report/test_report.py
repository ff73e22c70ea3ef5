"""The HTML report: self-contained, with its charts, observations computed from the numbers, and assumptions."""

from __future__ import annotations

import re
import subprocess
import sys
from html import escape
from pathlib import Path

import pytest

from shardscope.cli import main
from shardscope.core.memory import estimate_memory
from shardscope.planner import PlanResult
from shardscope.report.content import build
from shardscope.units import GIB

from .conftest import comparison_scenarios

CHARTS = ("memory", "communication", "memory-over-time", "timeline")


def test_page_is_self_contained(comparison_report: tuple[Path, Path]) -> None:
    html = comparison_report[0].read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>")
    # Nothing is fetched: no external scripts, styles, images or fonts (the SVG namespace is a name, not a fetch).
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", html)
    assert "<link" not in html and "@import" not in html
    assert not re.search(r"url\((?!#)", html)  # only references inside the page (SVG clip paths)


def test_page_has_every_chart_as_inline_svg(comparison_report: tuple[Path, Path]) -> None:
    html = comparison_report[0].read_text(encoding="utf-8")
    for name in CHARTS:
        match = re.search(rf'<figure class="chart" id="{name}">(.*?)</figure>', html, re.S)
        assert match and match.group(1).startswith("<svg"), name


def test_png_files_are_written(comparison_report: tuple[Path, Path]) -> None:
    for name in CHARTS:
        assert (comparison_report[1] / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_observations_are_computed_from_the_numbers() -> None:
    data = build(comparison_scenarios())
    text = " ".join(data.observations)
    # bf16-mixed AdamW: two fp32 moments (8 bytes) against 2-byte weights.
    assert "2 moments in 32-bit floats are 4 times the bf16 weights" in text
    chosen = data.rows[data.chosen].memory
    ratio = chosen.per_rank.activations_bytes / chosen.per_rank.parameters_bytes
    assert f"activations are {ratio:.1f} times parameter memory at sequence length 4096" in text
    ddp = estimate_memory(comparison_scenarios()[0]).per_rank.peak_bytes
    assert f"from {ddp / GIB:,.2f} GiB (ddp)" in text
    assert data.rows[data.chosen].fits
    fastest = min((row for row in data.rows if row.fits and row.timing), key=lambda row: row.timing.step_time_s)  # type: ignore[union-attr]
    assert data.rows[data.chosen] is fastest


def test_plan_report_compares_families_at_the_best_plan(planned: PlanResult, plan_report: Path) -> None:
    data = build(planned)
    best = planned.plans[0].scenario
    assert data.rows[data.chosen].memory.scenario == best
    families = {row.memory.scenario.strategy.canonical_name for row in data.rows}
    assert families == {"ddp", "zero1", "zero2", "zero3", "hsdp"}
    # every sibling keeps the chosen plan's mesh (its tensor and context parallel degrees)
    assert {row.memory.scenario.parallelism.tp for row in data.rows} == {best.parallelism.tp}
    assert all(row.memory.scenario.cluster == best.cluster for row in data.rows)
    html = plan_report.read_text(encoding="utf-8")
    assert "Plans that fit, fastest first" in html and "Families that do not fit" in html
    assert escape(planned.plans[0].failure_mode.message.split(":")[0]) in html  # the page escapes its text


def test_memory_over_time_stays_near_the_predicted_peak() -> None:
    from shardscope.core.memory_curve import memory_curve

    data = build(comparison_scenarios())
    assert data.timeline is not None
    row = data.rows[data.chosen]
    curve = memory_curve(row.memory, data.timeline)
    totals = [sum(values) for values in zip(*curve.bytes_by_category, strict=True)]
    assert curve.times_s == tuple(sorted(curve.times_s))
    assert 0.7 * row.memory.per_rank.peak_bytes <= max(totals) <= 1.3 * row.memory.per_rank.peak_bytes


def test_a_bare_parameter_count_gets_the_memory_chart_only(tmp_path: Path) -> None:
    code = main(["report", "--params", "7B", "--gpus", "8", "-o", str(tmp_path / "r.html")])
    assert code == 0
    html = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert html.count('<figure class="chart"') == 1


def test_cli_writes_a_plan_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "plan.html"
    args = ["report", "--model", "llama-3-8b", "--gpus", "64", "--global-batch-tokens", "1M", "-o", str(target)]
    assert main([*args, "--png", str(tmp_path / "png")]) == 0
    assert f"wrote {target}" in capsys.readouterr().out
    assert len(list((tmp_path / "png").glob("*.png"))) == 4


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "llama-3-8b", "--strategy", "zero9"], "zero9"),
        (["--params", "7B", "--global-batch-tokens", "4M"], "model's shape"),
        (["--model", "llama-3-8b", "--global-batch-tokens", "x"], "not a number"),
        (["--model", "llama-3-8b", "-o", "/proc/no/report.html"], "cannot write the report"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    # in-process; tests/cli/test_entry_point.py checks the exit code `python -m shardscope` hands back
    assert main(["report", *extra]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_importing_the_report_package_does_not_import_matplotlib() -> None:
    code = "import sys, shardscope.report, shardscope.cli; assert 'matplotlib' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
