"""The dependency direction of DESIGN.md, read from the source with `ast`:
units -> specs -> presets -> core -> planner -> report -> cli, with trace and runtime (torch) beside core.

Every import counts, a function-level one too (a lazy import is still a dependency), and so does what it loads on
the way: importing `a.b.c` runs `a/__init__.py` and `a/b/__init__.py`. A rule holds for everything a module reaches,
so a lower layer that starts importing upwards fails the rule of every layer above it, with the chain in the message.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import shardscope

PACKAGE = Path(shardscope.__file__).parent
# the torch side (runtime, trace, calibrate, the reference models, the measuring and process packages) and the CLI
ABOVE_CORE = (
    "torch",
    "shardscope.runtime",
    "shardscope.reference_models",
    "shardscope.trace",
    "shardscope.calibrate",
    "shardscope.measure",
    "shardscope.procs",
    "shardscope.cli",
)
ABOVE_PLANNER = ("shardscope.report", "shardscope.validate", "shardscope.lesson")
# layer (module prefix) -> the modules it must not reach, directly or through another module
RULES: dict[str, tuple[str, ...]] = {
    "shardscope.units": ("shardscope.", "torch"),
    "shardscope.specs": ("shardscope.presets", "shardscope.core", "shardscope.planner", *ABOVE_CORE, *ABOVE_PLANNER),
    "shardscope.strategy": ("shardscope.presets", "shardscope.core", "shardscope.planner", *ABOVE_CORE, *ABOVE_PLANNER),
    "shardscope.presets": ("shardscope.core", "shardscope.planner", *ABOVE_CORE, *ABOVE_PLANNER),
    "shardscope.core": ("shardscope.planner", *ABOVE_CORE, *ABOVE_PLANNER),
    "shardscope.planner": (*ABOVE_CORE, *ABOVE_PLANNER),
}
# Replay shares the measuring code and the reference models with real runs, never the runtime or the code that
# launches ranks (DESIGN.md, issue 16 item 4); the measuring and process packages stand on their own.
LAUNCHER = ("shardscope.procs.launcher", "shardscope.procs.functions")
TORCH_SIDE_RULES: dict[str, tuple[str, ...]] = {
    "shardscope.trace": ("shardscope.runtime", *LAUNCHER, "shardscope.cli", "shardscope.planner", *ABOVE_PLANNER),
    "shardscope.measure": ("shardscope.runtime", "shardscope.procs", "shardscope.trace", "shardscope.cli"),
    "shardscope.procs": ("torch", "shardscope.runtime", "shardscope.measure", "shardscope.trace", "shardscope.cli"),
    "shardscope.reference_models": ("shardscope.runtime", "shardscope.trace", "shardscope.procs", "shardscope.cli"),
    "shardscope.ring_attention": ("shardscope.runtime", "shardscope.trace", "shardscope.procs", "shardscope.cli"),
}


def module_name(path: Path) -> str:
    """'shardscope.core.memory' for .../shardscope/core/memory.py, 'shardscope.core' for its __init__.py."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def _with_parents(name: str) -> set[str]:
    """What `import name` runs: the module and every package above it."""
    parts = name.split(".")
    return {".".join(parts[:end]) for end in range(1, len(parts) + 1)}


@cache
def direct_imports(module: str) -> frozenset[str]:
    """The modules one module imports anywhere in its code, with the packages that loads."""
    path = modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            found.add(source)
            # `from package import module` imports the module
            found.update(f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in modules())
    return frozenset(name for imported in found for name in _with_parents(imported))


def reached(module: str) -> dict[str, list[str]]:
    """Every module that loading `module` runs, its packages' `__init__` included, with the chain of imports."""
    chains = {loaded: [loaded] for loaded in _with_parents(module)}
    queue = [name for name in chains if name in modules()]
    while queue:
        current = queue.pop()
        for imported in sorted(direct_imports(current)):
            if imported not in chains:
                chains[imported] = [*chains[current], imported]
                if imported in modules():
                    queue.append(imported)
    return chains


def _matches(name: str, prefix: str) -> bool:
    return name.startswith(prefix) if prefix.endswith(".") else name == prefix or name.startswith(prefix + ".")


def violations(rules: dict[str, tuple[str, ...]]) -> list[str]:
    """'module reaches forbidden via a -> b -> c' for every module of a ruled layer."""
    found = []
    for layer, forbidden in rules.items():
        for module in sorted(name for name in modules() if _matches(name, layer)):
            for target, chain in reached(module).items():
                if not _matches(target, layer) and any(_matches(target, prefix) for prefix in forbidden):
                    found.append(f"{module} reaches {target} via {' -> '.join(chain)}")
    return found


def test_layers_import_only_downwards() -> None:
    found = violations(RULES)
    assert not found, "\n".join(found)


def test_the_torch_side_keeps_replay_apart_from_launching() -> None:
    found = violations(TORCH_SIDE_RULES)
    assert not found, "\n".join(found)


def test_the_checker_sees_lazy_imports_and_packages() -> None:
    # importing runtime.steps runs runtime/__init__.py, which imports runtime.api and so the launcher; lesson imports
    # the runtime inside a function
    assert "shardscope.procs.launcher" in reached("shardscope.runtime.steps")
    assert "shardscope.presets" in direct_imports("shardscope.core.timeline")
    assert any("shardscope.runtime" in chain for chain in violations({"shardscope.lesson": ("shardscope.runtime",)}))
    assert len(modules()) > 50
