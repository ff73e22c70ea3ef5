"""Shared helpers for the real-run tests: every launch has a hard deadline (RunConfig.timeout_s); the runs several
modules register (tests/shared_launch.py) go in one launch per world size (tests/conftest.py `shared_runs`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest


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
