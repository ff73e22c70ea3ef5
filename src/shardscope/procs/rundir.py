"""Run directories under one per-user directory, named after the launcher that made them, so a launcher killed
with SIGKILL (which runs no cleanup) leaves a directory the next start recognises as stale and removes."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

PREFIX = "run-"


def runs_root() -> Path:
    """<temp dir>/shardscope-<uid>: private to this user (mode 0700), created on first use."""
    root = Path(tempfile.gettempdir()) / f"shardscope-{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    info = root.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{root} is not a directory owned by this user; remove it or set TMPDIR")
    return root


def _start_ticks(pid: int) -> str:
    """When process pid started, in clock ticks since boot ('' if it is gone): a pid can be reused, this not."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat_line.rpartition(")")[2].split()[19]  # field 22, counted after the command name


def _owner_tag(pid: int) -> str:
    return f"{pid}.{_start_ticks(pid)}"


def _is_stale(directory: Path) -> bool:
    """The launcher named in the directory is no longer running."""
    tag = directory.name[len(PREFIX) :].partition("-")[0]
    pid, _, started = tag.partition(".")
    if not pid.isdigit():
        return False
    return _owner_tag(int(pid)) != f"{pid}.{started}"


def remove_stale(root: Path) -> list[Path]:
    """Remove the run directories whose launcher is dead; returns them."""
    removed = []
    for directory in root.glob(f"{PREFIX}*"):
        if directory.is_dir() and _is_stale(directory):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed


@contextlib.contextmanager
def run_directory() -> Iterator[Path]:
    """A fresh run directory for this launcher, removed afterwards, and the per-user root with it when no other run
    is left in it (nothing stays in the temp dir); stale ones of dead launchers go first."""
    root = runs_root()
    remove_stale(root)
    prefix = f"{PREFIX}{_owner_tag(os.getpid())}-"
    try:
        directory = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    except FileNotFoundError:  # another launcher, the last out, removed the empty root in between: make it again
        directory = Path(tempfile.mkdtemp(prefix=prefix, dir=runs_root()))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        with contextlib.suppress(OSError):  # another run's directory (live, or stale for the next start) keeps it
            root.rmdir()
