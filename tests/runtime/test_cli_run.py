"""`shardscope run`: bad input is one line and exit 2; a real run prints the shardscope.run/v1 document."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from shardscope.cli import main
from shardscope.core.result import MemoryBreakdown


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategy", "zero4"], "name='zero4' is not known"),
        (["--world-size", "9"], "--world-size 9 must be between 1 and 8"),
        (["--engine", "deepspeed"], "engine='deepspeed' is not known; allowed: paper, pytorch"),
        (["--dtype", "float16"], "--dtype 'float16' is not known"),
        (
            ["--strategy", "hsdp", "--world-size", "4", "--shard-group", "3"],
            "dp_replicate 1 x dp_shard 3 = 3, not the 4",
        ),
        (["--model", "nope"], "unknown model preset 'nope'"),
        (["--timeout", "nan"], "--timeout nan must be a positive, finite number of seconds"),
        (["--timeout", "inf"], "--timeout inf must be a positive, finite number of seconds"),
        (["--timeout", "0"], "--timeout 0.0 must be a positive, finite number of seconds"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_run_that_cannot_fit_is_refused_before_any_rank_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardscope.runtime import launch
    from shardscope.runtime.config import RunConfig

    def no_launch(*_: object, **__: object) -> None:
        raise AssertionError("a rank was launched")

    monkeypatch.setattr(launch, "run_ranks", no_launch)
    monkeypatch.setattr(RunConfig, "resolved_backend", lambda _: "gloo")  # host memory, even where CUDA is present
    assert main(["run", "--model", "llama-3.1-405b", "--world-size", "2", "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "llama-3.1-405b zero3 (fp64) on 2 ranks needs about 12,373." in err
    assert "GiB available; refused before starting any rank" in err


@pytest.mark.distributed
def test_json_run(capsys: pytest.CaptureFixture[str], rejects_renamed_keys: Callable[[dict[str, Any]], int]) -> None:
    code = main(
        [
            "run",
            "--model",
            "tiny-gpt2",
            "--strategy",
            "zero3",
            "--engine",
            "teaching",
            "--world-size",
            "2",
            "--steps",
            "2",
            "--dtype",
            "float64",
            "--json",
            "--timeout",
            "60",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0
    document = json.loads(captured.out)
    assert document["schema"] == "shardscope.run/v1"
    assert set(document) == {
        "schema",
        "model",
        "strategy",
        "engine",
        "world_size",
        "parallelism",
        "sequence_parallel",
        "per_rank",
        "ledger",
        "parity",
        "step_time_s",
    }
    assert document["model"] == {"name": "tiny-gpt2", "parameters": 120_576}
    assert document["parallelism"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "pp": 1, "ep": 1}
    assert len(document["per_rank"]) == 2
    assert set(document["per_rank"][0]) == set(MemoryBreakdown().to_json())
    assert document["parity"]["ok"] and document["parity"]["max_abs_diff"] <= 1e-10
    assert {"phase", "op", "group", "group_size", "payload_bytes", "count"} == set(document["ledger"][0])
    assert "shardscope run: rank 0 " in captured.err  # progress while it runs
    assert rejects_renamed_keys(document) >= 6  # document, model, per_rank, ledger row, parity, mesh
