"""`shardscope plan`: the JSON schema, the human output, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardscope.cli import main

BASE = ["plan", "--model", "llama-3-8b", "--seq-len", "2048", "--global-batch-tokens", "1M", "--max-gpus", "64"]


def test_json_follows_plan_v1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BASE, "--price-per-gpu-hour", "2.5", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["schema"] == "shardscope.plan/v1"
    assert document["request"]["rank_by"] == "cost"
    assert document["plans"]
    for entry in document["plans"]:
        for field in ("gpus", "micro_batch", "grad_accum", "checkpointing", "offload", "failure_mode"):
            assert field in entry
        for field in ("strategy", "per_rank", "fits", "peak_moment", "step_time_s", "tokens_per_s", "mfu"):
            assert field in entry  # the fields of an estimate and its time
        assert entry["fits"] is True
        assert entry["per_rank"]["peak_bytes"] <= document["request"]["budget_bytes"]
        assert entry["cost_per_million_tokens"] > 0
        assert entry["failure_mode"]["kind"] and entry["failure_mode"]["message"]
    costs = [entry["cost_per_million_tokens"] for entry in document["plans"]]
    assert costs == sorted(costs)


def test_rejected_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "plan",
        "--model",
        "llama-3-70b",
        "--seq-len",
        "4096",
        "--global-batch-tokens",
        "4M",
        "--strategy",
        "ddp,zero3",
        "--tp",
        "1",
        "--cp",
        "1",
    ]
    args.append("--json")
    assert main(args) == 0
    document = json.loads(capsys.readouterr().out)
    (rejected,) = document["rejected"]
    assert rejected["family"] == "ddp"
    assert rejected["category"] == "parameters" and rejected["over_by_bytes"] > 0
    assert {entry["strategy"] for entry in document["plans"]} == {"zero3"}


def test_human_output_has_bars_and_failure_modes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BASE, "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "what each plan runs into next:" in out
    assert out.count("]|") + out.count("]>") >= 6  # a memory bar and a time bar per plan


def test_min_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["plan", "--model", "llama-3-70b", "--gpu", "h100-80gb", "--seq-len", "4096", "--min-gpus", "--json"]) == 0
    )
    document = json.loads(capsys.readouterr().out)
    assert document["fewest_gpus"] == min(entry["gpus"] for entry in document["plans"])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "llama-3-8b"], "--global-batch-tokens is needed"),
        (["--params", "7B", "--global-batch-tokens", "4M"], "needs the model's shape"),
        (["--model", "llama-3-8b", "--global-batch-tokens", "4M", "--strategy", "zero4"], "'zero4' is not known"),
        (["--model", "llama-3-8b", "--global-batch-tokens", "4M", "--rank-by", "cost"], "--price-per-gpu-hour"),
        (["--model", "llama-3-8b", "--global-batch-tokens", "lots"], "not a number"),
        (["--model", "nope", "--global-batch-tokens", "4M"], "unknown model preset"),
        (["--model", "llama-3-8b", "--global-batch-tokens", "4M", "--headroom", "1.5"], "headroom"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    # in-process; tests/cli/test_entry_point.py checks the exit code `python -m shardscope` hands back
    assert main(["plan", *extra]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


BLOCK_TORCH = """
import sys
class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, BlockTorch())
import shardscope.planner
from shardscope.cli import main
argv = ["plan", "--model", "tiny-llama", "--seq-len", "64", "--global-batch-tokens", "64K", "--max-gpus", "16"]
assert main([*argv, "--json"]) == 0
assert "torch" not in sys.modules and "matplotlib" not in sys.modules
"""


def test_planner_starts_without_torch_or_matplotlib() -> None:
    result = subprocess.run([sys.executable, "-c", BLOCK_TORCH], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_nothing_fits_is_an_answer(capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 0 with the rejections: no plan fitting is what the user asked to know, not a failure of the command."""
    args = ["plan", "--model", "llama-3-70b", "--gpu-memory", "1GiB", "--global-batch-tokens", "1M", "--max-gpus", "16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "nothing fits" in out and "families that do not fit anywhere in the space:" in out
    assert main([*args, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["plans"] == [] and {entry["family"] for entry in document["rejected"]} >= {"ddp", "zero3"}


def test_skipped_degrees_are_named_under_the_answer(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "tiny-llama", "--seq-len", "64", "--global-batch-tokens", "64K", "--max-gpus", "16"]
    assert main([*args, "--tp", "1,2,16", "--cp", "1,3"]) == 0
    out = capsys.readouterr().out
    assert "\nnot searched: tp 16 is more than a node's 8 GPUs; cp 3 does not cut the 64-token sequence" in out
    assert main([*args, "--tp", "1,2"]) == 0
    assert "\nnot searched:" not in capsys.readouterr().out


def test_plan_and_estimate_share_their_defaults() -> None:
    """plan's shared flags come from estimate's helpers, so their defaults cannot drift apart (--seq-len was 4096)."""
    from shardscope.cli import build_parser

    plan_args = build_parser("plan").parse_args(["plan", "--model", "gpt2"])
    estimate_args = build_parser("estimate").parse_args(["estimate", "--model", "gpt2"])
    shared = ("seq_len", "precision", "optimizer", "attention", "engine", "context_memory", "allocator_headroom")
    for name in (*shared, "gpu", "gpu_memory", "gpus_per_node"):
        assert getattr(plan_args, name) == getattr(estimate_args, name), name
    assert plan_args.seq_len is None  # 2048, or the model's learned positions when fewer (gpt2: 1024)
