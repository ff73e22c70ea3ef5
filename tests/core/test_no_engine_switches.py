"""No code outside the registries switches on an engine's or a strategy's name (issue 16): what differs between
engines is a method of their rules object (shardscope.core.engines), what differs between strategies is a property
of their preset (shardscope.mesh)."""

from __future__ import annotations

import re
from pathlib import Path

import shardscope

PACKAGE = Path(shardscope.__file__).resolve().parent
# Where engine and strategy names are allowed to decide something: the vocabulary, the core's rules registry, and the
# run's registry, which picks the implementation (a teaching strategy or one of torch's engines) that runs a preset.
REGISTRIES = ("choices.py", "mesh.py", "specs.py", "core/engines/", "runtime/steps.py")
STRATEGY_WORDS = r"\"(?:ddp|zero1|zero2|zero3|fsdp|hsdp)\""
ENGINE_WORDS = r"\"(?:paper|pytorch|deepspeed|teaching)\""
SWITCHES = (
    re.compile(r"\bengine\s*(?:==|!=|\bin\b|\bnot in\b)"),
    re.compile(rf"(?:==|!=)\s*(?:{STRATEGY_WORDS}|{ENGINE_WORDS})"),
    re.compile(rf"(?:{STRATEGY_WORDS}|{ENGINE_WORDS})\s*(?:==|!=|\bin\b|\bnot in\b)"),
    re.compile(rf"(?<!for)\s[\w.]+\s+(?:not\s+)?in\s*\(\s*{STRATEGY_WORDS}"),  # a membership test, not a for loop
    re.compile(r"canonical_name\s*(?:==|!=|\bin\b|\bnot in\b)"),
)


def switches_in(text: str) -> list[str]:
    """The lines of `text` that switch on an engine's or a strategy's name."""
    return [line.strip() for line in text.splitlines() if any(pattern.search(line) for pattern in SWITCHES)]


def test_no_engine_or_strategy_switch_outside_the_registries() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(REGISTRIES):
            continue
        found += [f"{relative}: {line}" for line in switches_in(path.read_text())]
    assert not found, "switches on an engine or strategy name:\n" + "\n".join(found)


def test_the_check_sees_the_switches_it_forbids() -> None:
    forbidden = [
        'if scenario.strategy.engine == "pytorch":',
        'if strategy.engine != "paper" or x:',
        'return strategy.canonical_name in ("ddp", "zero1")',
        'if name == "hsdp":',
        'offload = "optimizer" if name in ("ddp", "zero1", "zero2") else offload',
        'if "deepspeed" == engine:',
    ]
    allowed = [
        "engine = rules_for(scenario)",
        'label = f"{name}({group})"',
        'names = ["ddp", "zero1"]',
        'for name in ("ddp", "zero1"):',
    ]
    assert switches_in("\n".join(forbidden)) == forbidden
    assert switches_in("\n".join(allowed)) == []
