"""The torch-free examples (estimate, plan) of README.md and docs/guide.md are what those commands print now.

`benchmarks/readme_examples.py` rewrites every example from its command; this test runs the torch-free ones
in-process and compares. The `run` and `trace` examples are left out here: they need torch and take seconds to
minutes, and their step time and elapsed seconds differ from run to run (the script regenerates them); so is the
guide's `report`, which writes files.
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
DOCUMENT_LINES = {path.name: path.read_text(encoding="utf-8").splitlines() for path in SCRIPT.DOCUMENTS}
TORCH_FREE_EXAMPLES = [
    (name, example)
    for name, lines in DOCUMENT_LINES.items()
    for example in SCRIPT.find_examples(lines)
    if example.subcommand in TORCH_FREE and not example.shell
]
SHELL_EXAMPLES = [
    (name, example)
    for name, lines in DOCUMENT_LINES.items()
    for example in SCRIPT.find_examples(lines)
    if example.subcommand in (*TORCH_FREE, "timeline") and example.shell
]


def test_the_readme_shows_each_command_it_explains() -> None:
    assert {example.subcommand for example in EXAMPLES} == {"estimate", "plan", "run", "trace"}


def test_the_guide_shows_its_examples() -> None:
    guide = [example.subcommand for example in SCRIPT.find_examples(DOCUMENT_LINES["guide.md"])]
    assert guide.count("estimate") == 11 and guide.count("plan") == 5 and guide.count("run") == 4
    assert guide.count("timeline") == 2 and guide.count("report") == 2
    # the guide's loops over schedules, ep degrees and capacity factors, and its two jq over the ledger
    assert len(SHELL_EXAMPLES) == 5


@pytest.mark.parametrize(
    ("document", "example"),
    TORCH_FREE_EXAMPLES,
    ids=[f"{name}: {example.command}" for name, example in TORCH_FREE_EXAMPLES],
)
def test_torch_free_example_is_what_the_command_prints(
    document: str, example: object, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(example.argv) == 0  # type: ignore[attr-defined]
    printed = capsys.readouterr().out
    shown = SCRIPT.block(DOCUMENT_LINES[document], example)
    assert SCRIPT.without_elapsed(printed) == SCRIPT.without_elapsed(shown), (
        f"{document} is out of date: run .venv/bin/python benchmarks/readme_examples.py"
    )


@pytest.mark.parametrize(
    ("document", "example"), SHELL_EXAMPLES, ids=[f"{name}: {example.command}" for name, example in SHELL_EXAMPLES]
)
def test_shell_example_is_what_it_prints(document: str, example: object) -> None:
    printed = SCRIPT.printed(example)  # bash, with `shardscope` this Python's module
    shown = SCRIPT.block(DOCUMENT_LINES[document], example)
    assert printed == shown, f"{document} is out of date: run .venv/bin/python benchmarks/readme_examples.py"
