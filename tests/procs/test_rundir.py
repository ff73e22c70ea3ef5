"""Run directories live under one per-user directory; those of a dead launcher are removed at the next start."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from shardscope.procs.rundir import remove_stale, run_directory, runs_root


@pytest.fixture
def temp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path / f"shardscope-{os.getuid()}"


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_run_directory_is_private_named_after_the_launcher_and_removed(temp_root: Path) -> None:
    with run_directory() as directory:
        assert directory.parent == temp_root == runs_root()
        assert directory.name.startswith(f"run-{os.getpid()}.")
        assert temp_root.stat().st_mode & 0o777 == 0o700
    assert not directory.exists()
    assert not temp_root.exists()  # the last run out leaves nothing in the temp dir


def test_the_root_stays_while_another_run_is_in_it(temp_root: Path) -> None:
    with run_directory() as outer:
        with run_directory() as inner:
            assert inner.parent == outer.parent == temp_root
        assert not inner.exists() and outer.exists()
    assert not temp_root.exists()


def test_stale_directories_of_dead_launchers_go_at_the_next_start(temp_root: Path) -> None:
    temp_root.mkdir(mode=0o700)
    dead = temp_root / f"run-{_dead_pid()}.123-abc"
    (dead / "attempt0").mkdir(parents=True)
    (dead / "attempt0" / "rank0.log").write_text("left by a launcher killed with SIGKILL")
    reused = temp_root / f"run-{os.getpid()}.1-abc"  # this pid, but not this process's start time: pid reused
    reused.mkdir()
    with run_directory() as mine:
        alive = temp_root / mine.name
        assert not dead.exists() and not reused.exists() and alive.exists()
        assert remove_stale(temp_root) == []  # a live launcher's directory stays
    assert not temp_root.exists()


def test_a_root_owned_by_someone_else_is_refused(temp_root: Path) -> None:
    temp_root.symlink_to("/")
    with pytest.raises(PermissionError, match="not a directory owned by this user"):
        runs_root()
