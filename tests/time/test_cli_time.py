"""`shardscope timeline` and the hardware options, called as main(argv)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardscope.cli import main

BASE = ["timeline", "--model", "tiny-llama", "--gpus", "2", "--seq-len", "64", "--strategy", "fsdp"]


def test_timeline_prints_a_summary_and_writes_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "trace.json"
    assert main([*BASE, "--trace", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "step time" in printed and "reduce_scatter" in printed
    trace = json.loads(out.read_text())
    memory = [event for event in trace["traceEvents"] if event["name"] == "memory by category (bytes)"]
    assert memory and trace["otherData"]["peak_bytes"] > 0


def test_timeline_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BASE, "--json", "--inter-node", "ib-hdr", "--algorithm", "tree"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["step_time_s"] > 0 and data["communication"]["ledger"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--inter-node", "carrier-pigeon"], "unknown interconnect"),
        (["--intra-node-bandwidth", "0"], "more than 0"),
        (["--efficiency", "0"], "efficiency"),
        (["--hardware", "/nonexistent/profile.toml"], "cannot read"),
    ],
)
def test_bad_hardware_input_is_one_line_and_exit_2(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*BASE, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_unparsable_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[network\n")
    assert main([*BASE, "--hardware", str(bad)]) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_estimate_time_adds_the_time_keys(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--model", "tiny-gpt2", "--gpus", "2", "--seq-len", "64", "--time", "--json"]
    assert main(argv) == 0
    strategies = json.loads(capsys.readouterr().out)["strategies"]
    for entry in strategies:
        assert set(entry["communication"]) == {"ledger", "wire_bytes_per_rank", "time_s", "exposed_time_s"}
        assert entry["step_time_s"] > 0 and entry["tokens_per_s"] > 0 and 0 < entry["mfu"] < 1


def test_estimate_time_needs_a_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7B", "--gpus", "2", "--time"]) == 2
    assert "shape" in capsys.readouterr().err
