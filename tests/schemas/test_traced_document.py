"""A real `trace --json` (tiny-gpt2 on 2 fake ranks, seconds) against the checked-in trace schema."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from shardscope.cli import main

RejectsRenamed = Callable[[dict[str, Any]], int]  # the rejects_renamed_keys fixture (tests/conftest.py)

pytest.importorskip("torch")


def test_trace_follows_its_schema(capsys: pytest.CaptureFixture[str], rejects_renamed_keys: RejectsRenamed) -> None:
    argv = ["trace", "--model", "tiny-gpt2", "--gpus", "2", "--strategy", "zero3", "--seq-len", "32", "--json"]
    assert main([*argv, "--time-limit", "120"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["schema"] == "shardscope.trace/v1"
    assert document["parallelism"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "pp": 1, "ep": 1}
    assert document["per_rank"]["ledger"] and document["per_module"]
    assert rejects_renamed_keys(document) >= 7  # document, per_rank, ledger row, flops, ...
