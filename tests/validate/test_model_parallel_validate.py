"""Issue 19's cases of the validation matrix: tensor, sequence and context parallelism, predicted and really run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from shardscope.cli import main
from shardscope.core.result import CollectiveRow
from shardscope.validate.cases import (
    ValidationCase,
    every_case,
    expert_parallel_matrix,
    full_matrix,
    model_parallel_matrix,
    pipeline_matrix,
)
from shardscope.validate.compare import ledger_differences, point_to_point_bytes, step_payload_bytes


def test_the_data_parallel_matrix_keeps_its_cases_and_labels() -> None:
    cases = full_matrix()
    assert len(cases) == 216  # docs/accuracy.md's 216 cases: their labels name their rows
    assert not any(case.splits_model for case in cases)
    assert cases[0].label == "tiny-gpt2 ddp paper w2 fp32"
    assert cases[-1].label == "tiny-moe hsdp pytorch w4 bf16-mixed ckpt"
    assert cases[-1].to_json()["parallelism"] == {
        "dp_replicate": 2,
        "dp_shard": 2,
        "cp": 1,
        "tp": 1,
        "pp": 1,
        "ep": 1,
    }
    assert every_case()[: len(cases)] == cases


def test_the_model_parallel_cases_name_their_mesh() -> None:
    cases = model_parallel_matrix()
    assert all(case.splits_model for case in cases)
    labels = {case.label for case in cases}
    assert "tiny-llama ddp paper w4 tp2 cp2 sp bf16-mixed" in labels
    assert "tiny-gpt2 fsdp paper w4 tp2 bf16-mixed" in labels
    three_d = [case for case in cases if case.world_size == 8]
    assert {case.label for case in three_d} == {
        "tiny-llama ddp paper w8 tp2 cp2 sp fp32",
        "tiny-llama fsdp paper w8 tp2 cp2 sp fp32",
    }
    assert three_d[0].to_json()["parallelism"] == {
        "dp_replicate": 2,
        "dp_shard": 1,
        "cp": 2,
        "tp": 2,
        "pp": 1,
        "ep": 1,
    }
    assert three_d[0].to_json()["sequence_parallel"] is True
    assert len(model_parallel_matrix(three_d=False)) == len(cases) - 2


def test_cases_no_run_engine_implements_say_why() -> None:
    runnable = [case for case in model_parallel_matrix() if not case.not_runnable()]
    # the teaching grid runs every data-parallel strategy under tp and cp; torch's DTensor plan composes with FSDP2
    # only (runtime/config.py MODEL_PARALLEL_STAGES), with the teaching ring for cp, and refuses gpt2's fused c_attn
    pairs = {(case.strategy, case.engine) for case in runnable}
    assert pairs == {("ddp", "paper"), ("fsdp", "paper"), ("fsdp", "pytorch")}
    assert len(runnable) == 42
    torch_ddp = ValidationCase(model="tiny-llama", strategy="ddp", engine="pytorch", world_size=4, tp=2)
    assert "engine pytorch runs tensor and context parallelism with zero2, zero3, fsdp" in torch_ddp.not_runnable()
    torch_cp = ValidationCase(model="tiny-gpt2", strategy="fsdp", engine="pytorch", world_size=4, tp=2, cp=2)
    assert "fused c_attn" in torch_cp.not_runnable()
    torch_ring = ValidationCase(model="tiny-llama", strategy="fsdp", engine="pytorch", world_size=4, cp=2)
    assert torch_ring.not_runnable() == ""
    assert ValidationCase(model="tiny-llama", strategy="fsdp", engine="paper", world_size=4).not_runnable() == ""


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tp": 3}, "tp(3) * cp(1) must divide world_size(4)"),
        ({"sequence_parallel": True}, "sequence_parallel=True needs tensor parallelism"),
        ({"strategy": "hsdp", "tp": 2}, "hsdp needs 4 data-parallel ranks or more"),
        ({"ep": 3}, "ep(3) must divide the 4 data-parallel ranks"),
    ],
)
def test_a_bad_case_names_its_values(fields: dict[str, Any], message: str) -> None:
    from shardscope.specs import SpecError

    with pytest.raises(SpecError, match=re.escape(message)):
        ValidationCase(**{"model": "tiny-llama", "strategy": "ddp", "engine": "paper", "world_size": 4, **fields})


def _row(phase: str, op: str, payload: int, count: int) -> CollectiveRow:
    return CollectiveRow(phase=phase, op=op, group_size=2, payload_bytes=payload, count=count)


def test_the_ledger_is_compared_call_for_call_send_and_recv_included() -> None:
    predicted = (
        _row("setup", "broadcast", 64, 3),
        _row("backward", "all_gather", 100, 2),
        _row("backward", "all_reduce", 50, 1),
        _row("forward", "send", 30, 4),
        _row("forward", "recv", 30, 4),
    )
    # the same totals (250 B of collectives, 240 B point to point) in other calls: the payload rows agree, the
    # calls do not, send and recv as well as the collectives
    measured = (
        _row("setup", "broadcast", 64, 3),
        _row("backward", "all_gather", 100, 1),
        _row("backward", "all_reduce", 50, 3),
        _row("forward", "send", 60, 2),
        _row("forward", "recv", 30, 4),
    )
    assert step_payload_bytes(predicted) == step_payload_bytes(measured) == 250
    assert point_to_point_bytes(predicted) == point_to_point_bytes(measured) == 240
    assert ledger_differences(predicted, measured) == (
        "backward all_gather of 100 B over 2 ranks: predicted 2, measured 1",
        "backward all_reduce of 50 B over 2 ranks: predicted 1, measured 3",
        "forward send of 30 B over 2 ranks: predicted 4, measured 0",
        "forward send of 60 B over 2 ranks: predicted 0, measured 2",
    )
    assert ledger_differences(predicted, predicted) == ()


def test_send_and_recv_have_a_payload_row_of_their_own() -> None:
    from shardscope.core.result import MemoryBreakdown
    from shardscope.validate.compare import compare_case

    case = ValidationCase(model="tiny-llama", strategy="fsdp", engine="pytorch", world_size=2, cp=2)
    memory = MemoryBreakdown(
        parameters_bytes=100, gradients_bytes=100, optimizer_state_bytes=200, activations_bytes=1000, peak_bytes=2000
    )
    ring = (_row("forward", "send", 30, 4), _row("forward", "recv", 30, 4), _row("backward", "all_reduce", 50, 1))
    short = (_row("forward", "send", 30, 3), _row("forward", "recv", 30, 4), _row("backward", "all_reduce", 50, 1))
    rows = {row.quantity: row for row in compare_case(case, memory, ring, 0.0, None, None, None, memory, short, 0.0)}
    assert (rows["point_to_point_payload"].predicted, rows["point_to_point_payload"].measured) == (240, 210)
    assert not rows["point_to_point_payload"].ok  # one send missing from the run
    assert rows["ledger_payload"].predicted == rows["ledger_payload"].measured == 50
    no_ring = compare_case(case, memory, ring[2:], 0.0, None, None, None, memory, ring[2:], 0.0)
    assert "point_to_point_payload" not in {row.quantity for row in no_ring}  # only cases with a ring have it


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "3"], "--tp '3' is not in the matrix; allowed: 1, 2"),
        (["--quick", "--tp", "2"], "--tp '2' is not in the matrix; allowed: 1"),
        (["--tp", "1", "--sequence-parallel"], "no validation case is left after the filters"),
        (["--tp", "0"], "'0' must be at least 1"),
        (["--precisions", "fp8"], "--precisions 'fp8' is not in the matrix; allowed: fp32, bf16-mixed"),
    ],
)
def test_bad_model_parallel_filters_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    assert main(["validate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.distributed
def test_one_tensor_parallel_case_through_validate(matches_schema: Callable[[dict[str, Any]], None]) -> None:
    # tiny-gpt2, dp 2 x tp 2 on 4 gloo ranks, paper engine (the teaching grid): about 20 s on 2 cores
    argv = ["--models", "tiny-gpt2", "--tp", "2", "--cp", "1", "--no-sequence-parallel", "--precisions", "fp32"]
    result = subprocess.run(
        [sys.executable, "-m", "shardscope", "validate", *argv, "--strategies", "ddp", "--engines", "paper", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    document = json.loads(result.stdout)
    matches_schema(document)
    rows = {row["category"]: row for row in document["rows"]}
    assert len(document["rows"]) == 6 and "not_run" not in document
    case = document["rows"][0]["case"]
    assert case["parallelism"]["tp"] == 2 and case["parallelism"]["dp_replicate"] == 2
    assert case["sequence_parallel"] is False
    for category in ("parameters", "gradients", "optimizer_state", "ledger_payload"):
        assert rows[category]["predicted_bytes"] == rows[category]["measured_bytes"], category
    # each tp rank holds half of every split weight and all of the replicated norms and biases: fewer bytes than
    # the whole model's fp32 parameters, more than half of them
    from shardscope.core.params import count_parameters
    from shardscope.presets import model_preset

    whole = 4 * count_parameters(model_preset("tiny-gpt2"))
    assert whole / 2 < rows["parameters"]["measured_bytes"] < whole
    for category in ("activations", "peak"):
        assert rows[category]["error"] <= 0.05, rows[category]
    assert all(row["ok"] for row in document["rows"])


def test_the_pipeline_and_expert_parallel_cases_run() -> None:
    cases = pipeline_matrix() + expert_parallel_matrix()
    assert [case.label for case in cases] == [
        "tiny-llama ddp paper w4 pp2 1f1b m4 fp32",
        "tiny-llama-8 ddp paper w4 pp4 gpipe m4 fp32",
        "tiny-llama-8 ddp paper w4 pp4 1f1b m4 fp32",
        "tiny-llama-8 ddp paper w4 pp4 interleaved-1f1b m4 fp32",
        "tiny-llama ddp paper w4 tp2 pp2 1f1b m4 sp fp32",
        "tiny-llama zero3 paper w4 pp2 1f1b m4 fp32",
        "tiny-llama zero1 paper w8 tp2 pp2 1f1b m4 sp fp32",
        "tiny-llama zero3 paper w8 tp2 pp2 1f1b m4 sp fp32",
        "tiny-llama fsdp pytorch w4 pp2 1f1b m4 fp32",
        "tiny-llama fsdp pytorch w4 pp2 gpipe m4 fp32",
        "tiny-moe fsdp paper w4 ep2 fp32",
        "tiny-moe fsdp paper w4 ep2 capacity 1.25 fp32",
        "tiny-moe fsdp pytorch w2 capacity 1.25 fp32",
    ]
    assert all(case.not_runnable() == "" for case in cases)
    assert every_case()[-len(cases) :] == cases
    experts = cases[-3]
    assert experts.to_json()["parallelism"] == {"dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 1, "pp": 1, "ep": 2}
    assert experts.scenario().strategy.ep == 2
    assert cases[-1].to_json()["capacity_factor"] == cases[-1].scenario().model.capacity_factor == 1.25
    assert cases[0].to_json()["parallelism"] == {"dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 2, "ep": 1}
    assert cases[3].scenario().strategy.pipeline_stages == 8
    ring = ValidationCase(model="tiny-llama", strategy="fsdp", engine="paper", world_size=4, pp=2, cp=2, grad_accum=4)
    assert "runs without cp" in ring.not_runnable()
