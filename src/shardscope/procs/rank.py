"""The rank's side of a local launch: die with the launcher, report the stage reached, report a failure.

Imported by every rank's entry point before torch, so the request to die with the parent is in place before the
slow imports (a launcher killed meanwhile would otherwise leave the rank running under PID 1).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

LAUNCHER_PID_ENV = "SHARDSCOPE_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1
HEARTBEAT_S = 0.5
"""How often a live rank touches its status file, even while blocked in a collective (its mtime is the last report)."""


def die_with_parent() -> None:
    """prctl(PR_SET_PDEATHSIG, SIGKILL): the kernel ends this process when its parent does (Linux only). If the
    launcher that started us (LAUNCHER_PID_ENV) is already gone, the request came too late: exit now."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher and os.getppid() != int(launcher):
        os._exit(1)


def status_path(run_dir: Path, rank: int) -> Path:
    """Where a rank writes 'stage|collectives entered' for the launcher."""
    return run_dir / f"rank{rank}.status"


def error_path(run_dir: Path, rank: int) -> Path:
    """Where a rank writes its error: the first line is the message, the rest the traceback."""
    return run_dir / f"rank{rank}.error"


def log_path(run_dir: Path, rank: int) -> Path:
    """The rank's standard output and error."""
    return run_dir / f"rank{rank}.log"


class Status:
    """This rank's current stage in a small file the launcher reads (progress, and which rank hung where), and a
    heartbeat thread that touches it every HEARTBEAT_S: a rank stopped or frozen stops beating, one blocked in a
    collective (which releases the GIL) keeps beating, so the launcher can tell them apart (procs.hang)."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = status_path(run_dir, rank)
        self.stage, self.collectives = "starting", 0
        self("starting")
        threading.Thread(target=self._beat, name="shardscope-heartbeat", daemon=True).start()

    def __call__(self, stage: str) -> None:
        self.stage = stage
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(f"{stage}|{self.collectives}")
        partial.replace(self.path)  # the launcher never reads a half-written status

    def _beat(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def collective(self, _started: int) -> None:
        """Count a collective this rank entered (a rank that hangs outside one has started fewer)."""
        self.collectives += 1
        self(self.stage)


def report_failure(run_dir: Path, rank: int, error: BaseException) -> None:
    """Write the error for the launcher (it names the first rank that failed) and one line on stderr."""
    error_path(run_dir, rank).write_text(f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
    print(f"shardscope worker rank {rank}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
