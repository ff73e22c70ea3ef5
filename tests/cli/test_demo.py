from pathlib import Path

import pytest

from shardscope.cli import main


def test_demo_predicts_and_writes_the_report(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    report = tmp_path / "report.html"
    assert main(["demo", "--no-run", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "llama-3-8b" in out and "zero3" in out and "peak" in out
    assert str(report.resolve()) in out
    assert report.read_text().startswith("<!DOCTYPE html>") or "<html" in report.read_text()[:200]
