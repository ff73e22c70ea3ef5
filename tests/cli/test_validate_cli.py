"""`shardscope validate`: bad requests are one line and exit 2, before anything runs."""

from __future__ import annotations

import pytest

from shardscope.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "cuda", "--world-sizes", "2"], "--device cuda needs 2 GPUs (one per rank)"),
        (["--models", "nope"], "--models 'nope' is not in the matrix; allowed: tiny-gpt2, tiny-llama, tiny-moe"),
        (["--models", ""], "--models '' is empty"),
        (["--quick", "--world-sizes", "4"], "--world-sizes '4' is not in the matrix; allowed: 2"),
        (["--device", "tpu"], "invalid choice: 'tpu'"),
    ],
)
def test_bad_requests_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    import torch

    if argv[:2] == ["--device", "cuda"] and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    assert main(["validate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_cuda_case_reads_as_nccl() -> None:
    from shardscope.validate.cases import full_matrix

    cases = full_matrix("cuda")
    assert {case.scenario().cluster.backend for case in cases} == {"nccl"}
    assert {case.scenario().cluster.backend for case in full_matrix()} == {"gloo"}
    assert all(case.label.endswith(" cuda") for case in cases)
