"""The worker under torchrun (what docs/cluster.md tells users to run): 2 CPU ranks on gloo, one document out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shardscope.core.comm import run_ledger
from shardscope.core.memory import estimate_memory
from shardscope.core.result import CollectiveRow
from shardscope.validate.cases import ValidationCase

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
WORKER = ["-m", "shardscope.runtime.worker", "--steps", "2", "--precision", "fp32", "--timeout-s", "90"]


def torchrun(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """torchrun with its temporary files (torch elastic's torchelastic_* log folder, which it does not remove) in
    the test's own folder."""
    env = {k: v for k, v in os.environ.items() if k != "SHARDSCOPE_LAUNCHER_PID"} | {"TMPDIR": str(tmp_path)}
    return subprocess.run([*TORCHRUN, *WORKER, *args], capture_output=True, text=True, timeout=150, env=env)


@pytest.mark.distributed
def test_torchrun_writes_the_run_document_and_matches_the_prediction(
    tmp_path: Path, matches_schema: Callable[[dict[str, Any]], None]
) -> None:
    flags = ["--model", "tiny-gpt2", "--strategy", "zero3", "--engine", "pytorch", "--run-dir", str(tmp_path)]
    done = torchrun(flags, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "shardscope: zero3 (pytorch) on 2 ranks" in done.stdout
    document = json.loads((tmp_path / "run.json").read_text())
    assert document["schema"] == "shardscope.run/v1" and document["world_size"] == 2
    assert document["parity"]["ok"]
    matches_schema(document)
    scenario = ValidationCase(model="tiny-gpt2", strategy="zero3", engine="pytorch", world_size=2).scenario()
    predicted = estimate_memory(scenario, rank=0).per_rank
    measured = document["per_rank"][0]
    for field in ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes"):
        assert measured[field] == getattr(predicted, field), field
    measured_ledger = [CollectiveRow(**row) for row in document["ledger"]]
    assert sorted(map(repr, measured_ledger)) == sorted(map(repr, run_ledger(scenario)))


@pytest.mark.distributed
def test_bad_flags_under_torchrun_are_one_line_per_rank(tmp_path: Path) -> None:
    done = torchrun(["--model", "nope", "--run-dir", str(tmp_path)], tmp_path)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("shardscope worker rank")]
    # torchrun stops the other rank when the first one fails, so it may not get to print its line.
    assert 1 <= len(lines) <= 2 and all("unknown model preset 'nope'" in line for line in lines)
    assert not (tmp_path / "run.json").exists()
