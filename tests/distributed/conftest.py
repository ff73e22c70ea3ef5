"""Shared helpers for the real-run tests: every launch has a hard deadline (RunConfig.timeout_s); runs several modules
register (shared_launch.py) go in one launch per world size."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from shardscope.runtime import RunResult


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains text (a test's unique run directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next((line for line in (entry / "status").read_text().splitlines() if line.startswith("State")), "")
        except OSError:
            continue
        if text in cmdline and "zombie" not in state:
            found.append(int(entry.name))
    return found


@pytest.fixture
def leftover() -> Callable[[str], list[int]]:
    """processes_mentioning, as a fixture."""
    return processes_mentioning


@pytest.fixture(scope="session")
def shared_runs(request: pytest.FixtureRequest) -> dict[str, dict[str, RunResult]]:
    """Module name -> its registered runs' results (shared_launch.py): one launch per world size for every module
    with a selected test that uses this fixture. Results are frozen dataclasses, read-only to the tests."""
    from shared_launch import REGISTERED

    from shardscope.runtime import run_suite

    wanted = {item.module.__name__ for item in request.session.items if "shared_runs" in item.fixturenames}
    runs = [
        (module, name, config)
        for module in REGISTERED
        if module in wanted
        for name, config in REGISTERED[module].items()
    ]
    found: dict[str, dict[str, RunResult]] = {module: {} for module in wanted}
    for world in sorted({config.world_size for _, _, config in runs}):
        launch = [run for run in runs if run[2].world_size == world]
        for (module, name, _), result in zip(launch, run_suite([run[2] for run in launch]), strict=True):
            found[module][name] = result
    return found
