"""Bad input at the process boundary: `python -m shardscope COMMAND ...` exits 2 with one stderr line. The commands'
own bad-input cases call `shardscope.cli.main` in-process; this holds what the console entry point hands back."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("argv", "message", "timeout_s"),
    [
        (["plan", "--model", "llama-3-8b", "--global-batch-tokens", "lots"], "not a number", 60),
        (["report", "--model", "llama-3-8b", "--strategy", "zero9"], "zero9", 120),
    ],
)
def test_bad_input_exits_2_from_the_process(argv: list[str], message: str, timeout_s: int) -> None:
    """The console entry point's exit status and its one stderr line."""
    result = subprocess.run(
        [sys.executable, "-m", "shardscope", *argv], capture_output=True, text=True, timeout=timeout_s
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
