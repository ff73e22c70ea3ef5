"""`shardscope validate --quick` (the CI matrix): every number within its target, in all three layers."""

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from shardscope.core.result import MemoryBreakdown
from shardscope.validate.cases import ValidationCase, quick_matrix
from shardscope.validate.compare import compare_case


# Under -m long (a minute of 5 cases x predict, trace and run): by default test_model_parallel_validate.py runs one case
# through `shardscope validate` end to end (rows, schema, exact categories), tests/distributed/test_strategies.py
# runs every strategy under both engines for real, and tests/trace/test_checkpointing_modes.py holds a zero3 trace to
# its gloo run byte for byte.
@pytest.mark.slow
@pytest.mark.long
@pytest.mark.distributed
def test_quick_validation_is_within_targets(matches_schema: Callable[[dict[str, Any]], None]) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    # One run: the measured peak is deterministic (runtime/tracker.py places gloo's late frees by a fixed rule).
    result = subprocess.run(
        [sys.executable, "-m", "shardscope", "validate", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    document = json.loads(result.stdout)
    assert document["schema"] == "shardscope.validate/v1"
    matches_schema(document)
    rows = document["rows"]
    assert len(rows) == 6 * len(quick_matrix())
    assert all(row["ok"] for row in rows)
    exact = [row for row in rows if row["category"] in ("parameters", "gradients", "optimizer_state", "ledger_payload")]
    assert exact and all(row["predicted_bytes"] == row["measured_bytes"] for row in exact)
    traced = [row for row in exact if row["traced_bytes"] is not None]
    assert traced and all(row["traced_bytes"] == row["measured_bytes"] for row in traced)


def test_a_row_outside_its_target_fails() -> None:
    case = ValidationCase(model="tiny-gpt2", strategy="zero3", engine="pytorch", world_size=2)
    measured = MemoryBreakdown(
        parameters_bytes=100, gradients_bytes=100, optimizer_state_bytes=200, activations_bytes=1000, peak_bytes=2000
    )
    off_by_one = MemoryBreakdown(
        parameters_bytes=101, gradients_bytes=100, optimizer_state_bytes=200, activations_bytes=1040, peak_bytes=2090
    )
    rows = {row.quantity: row for row in compare_case(case, off_by_one, (), 0.0, measured, (), 2030, measured, (), 0.0)}
    assert not rows["parameters"].ok  # one byte off an exact quantity
    assert rows["gradients"].ok
    assert rows["activations"].ok  # 4% of the measurement, target 5%
    assert not rows["peak"].ok  # the trace is 1.5% off, target 1%
    assert rows["peak"].error == pytest.approx(0.045)
