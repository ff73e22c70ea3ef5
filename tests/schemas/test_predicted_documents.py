"""Real outputs of `estimate`, `plan` and `validate`'s document, and a written hardware profile, against their
checked-in JSON Schemas; a renamed key anywhere in them fails."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from shardscope.cli import main
from shardscope.core.result import MemoryBreakdown
from shardscope.presets import gpu_preset
from shardscope.presets.hardware import FamilyOpCost, HostOverheads, InterconnectSpec, OpCost, default_profile
from shardscope.presets.profile_toml import profile_to_toml
from shardscope.schemas import load_schema
from shardscope.validate.cases import ValidationCase
from shardscope.validate.compare import compare_case
from shardscope.validate.runner import CaseResult, validation_document

Matches = Callable[[dict[str, Any]], None]  # the matches_schema fixture (tests/conftest.py)
RejectsRenamed = Callable[[dict[str, Any]], int]  # the rejects_renamed_keys fixture

ESTIMATES = [
    ["--model", "llama-3-70b", "--gpus", "64", "--strategy", "all"],
    [
        "--model",
        "tiny-gpt2",
        "--seq-len",
        "64",
        "--gpus",
        "16",
        "--strategy",
        "ddp,hsdp",
        "--shard-group",
        "4",
        "--time",
    ],
    ["--model", "mixtral-8x7b", "--gpus", "8", "--strategy", "zero3", "--offload", "optimizer+params", "--time"],
    ["--model", "llama-3-8b", "--gpus", "8", "--engine", "deepspeed", "--checkpointing", "full", "--strategy", "zero2"],
    ["--params", "7B", "--gpus", "8", "--strategy", "zero1"],
    ["--model", "llama-3-8b", "--gpus", "8", "--checkpointing", "op", "--strategy", "zero3", "--time"],
    ["--model", "gpt2", "--gpus", "8", "--checkpointing", "every:3", "--strategy", "fsdp"],
    # a pipeline: per_stage and the parallelism object's schedule (issue 20)
    ["--model", "llama-3-8b", "--gpus", "32", "--tp", "2", "--pp", "4", "--grad-accum", "8", "--time"],
    ["--model", "llama-3-8b", "--gpus", "16", "--pp", "4", "--pp-schedule", "interleaved-1f1b", "--grad-accum", "8"],
]
PLANS = [
    [
        "--model",
        "tiny-llama",
        "--seq-len",
        "4096",
        "--global-batch-tokens",
        "64K",
        "--max-gpus",
        "16",
        "--price-per-gpu-hour",
        "2.5",
    ],
    ["--model", "llama-3-70b", "--seq-len", "4096", "--global-batch-tokens", "4M", "--strategy", "ddp,zero3"],
    ["--model", "llama-3-8b", "--gpu", "a100-40gb", "--seq-len", "8192", "--min-gpus", "--max-gpus", "64"],
]


def _printed(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    main([*argv, "--json"])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("argv", ESTIMATES, ids=lambda argv: " ".join(argv[:6]))
def test_estimate_follows_its_schema(
    argv: list[str], capsys: pytest.CaptureFixture[str], rejects_renamed_keys: RejectsRenamed
) -> None:
    document = _printed(capsys, "estimate", *argv)
    assert document["schema"] == "shardscope.estimate/v1"
    assert rejects_renamed_keys(document) >= 8  # the document, model, cluster, gpu, training, ...


def test_estimate_time_comes_whole(capsys: pytest.CaptureFixture[str], matches_schema: Matches) -> None:
    document = _printed(capsys, "estimate", *ESTIMATES[1])
    del document["strategies"][0]["mfu"]
    with pytest.raises(jsonschema.ValidationError, match="'mfu' is a dependency of 'step_time_s'"):
        matches_schema(document)


@pytest.mark.parametrize("argv", PLANS, ids=lambda argv: " ".join(argv[:2]))
def test_plan_follows_its_schema(
    argv: list[str], capsys: pytest.CaptureFixture[str], rejects_renamed_keys: RejectsRenamed
) -> None:
    document = _printed(capsys, "plan", *argv)
    assert document["plans"] or document["rejected"]
    assert rejects_renamed_keys(document) >= 10


def test_a_wrong_degree_is_named(capsys: pytest.CaptureFixture[str], matches_schema: Matches) -> None:
    document = _printed(capsys, "plan", *PLANS[1])
    assert document["rejected"] and document["rejected"][0]["closest"]["parallelism"]["dp_shard"] >= 1
    document["plans"][0]["parallelism"]["tp"] = 0
    with pytest.raises(jsonschema.ValidationError, match="0 is less than the minimum of 1"):
        matches_schema(document)


def test_validation_document_follows_its_schema(rejects_renamed_keys: RejectsRenamed) -> None:
    case = ValidationCase(model="tiny-llama", strategy="hsdp", engine="teaching", world_size=4)
    measured = MemoryBreakdown(parameters_bytes=100, gradients_bytes=100, optimizer_state_bytes=200, peak_bytes=900)
    rows = compare_case(case, measured, (), 0.01, None, None, None, measured, (), 0.012)
    document = validation_document([CaseResult(case=case, rows=rows, notes=("trace: not run",))])
    document = json.loads(json.dumps(document))
    assert {row["category"] for row in document["rows"]} >= {"peak", "step_time_s"}
    assert document["rows"][0]["case"]["parallelism"]["dp_replicate"] == 2
    assert rejects_renamed_keys(document) >= 4


def _profile_dict() -> dict:
    """A profile with every optional table filled, written by shardscope.presets and read back by TOML."""
    profile = dataclasses.replace(
        default_profile(gpu_preset("a100-80gb")),
        name='cluster \u2603 "quoted"',
        inter_node=InterconnectSpec(id="measured", name="ib", bandwidth_bytes_per_s=2.5e10, latency_s=5e-6),
        op_costs=(OpCost(op="reduce_scatter", call_latency_s=3.2e-4, bandwidth_bytes_per_s=6e8),),
        host_overheads=HostOverheads(
            family_op_costs=(FamilyOpCost(family="llama", kernel_overhead_s=1e-5, backward_op_overhead_s=2e-5),)
        ),
    )
    return tomllib.loads(profile_to_toml(profile))


def test_written_hardware_profile_follows_its_schema(rejects_renamed_keys: RejectsRenamed) -> None:
    data = _profile_dict()
    assert data["schema"] == "shardscope.hardware/v2"
    assert rejects_renamed_keys(data) >= 8


def test_hand_written_profile_follows_its_schema_and_a_misspelt_key_fails(
    matches_schema: Matches,
) -> None:
    text = """schema = "shardscope.hardware/v2"
    [compute]
    efficiency = 0.3
    [network]
    intra_node = "nvlink4"
    inter_node = {bandwidth_bytes_per_s = 2.5e10, latency_s = 5e-6}
    """
    matches_schema(tomllib.loads(text))
    with pytest.raises(jsonschema.ValidationError, match="'efficency' was unexpected"):
        matches_schema(tomllib.loads(text.replace("efficiency", "efficency")))
    with pytest.raises(jsonschema.ValidationError, match="'intra_node' is a required property"):
        matches_schema(tomllib.loads(text.replace('intra_node = "nvlink4"', "")))


def test_hardware_schema_holds_every_field_the_writer_writes() -> None:
    properties = load_schema("shardscope.hardware/v2")["properties"]
    data = _profile_dict()
    for table in ("compute", "framework", "host_overheads", "network"):
        assert set(data[table]) <= set(properties[table]["properties"]), table
