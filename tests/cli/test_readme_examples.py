"""README.md's torch-free examples (estimate, plan) are what those commands print now.

`benchmarks/readme_examples.py` rewrites every example from its command; this test runs the torch-free ones
in-process and compares. The `run` and `trace` examples are left out here: they need torch and take seconds to
minutes, and their step time and elapsed seconds differ from run to run (the script regenerates them).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from shardscope.cli import main

REPO = Path(__file__).resolve().parents[2]
TORCH_FREE = ("estimate", "plan")


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_examples", REPO / "benchmarks" / "readme_examples.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


SCRIPT = _script()
LINES = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
EXAMPLES = SCRIPT.find_examples(LINES)


def test_the_readme_shows_each_command_it_explains() -> None:
    assert {example.argv[0] for example in EXAMPLES} == {"estimate", "plan", "run", "trace"}


@pytest.mark.parametrize(
    "example",
    [example for example in EXAMPLES if example.argv[0] in TORCH_FREE],
    ids=lambda example: example.command,
)
def test_torch_free_example_is_what_the_command_prints(example: object, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(example.argv) == 0  # type: ignore[attr-defined]
    printed = capsys.readouterr().out
    shown = SCRIPT.block(LINES, example)
    assert SCRIPT.without_elapsed(printed) == SCRIPT.without_elapsed(shown), (
        "README.md is out of date: run .venv/bin/python benchmarks/readme_examples.py"
    )
