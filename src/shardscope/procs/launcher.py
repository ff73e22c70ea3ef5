"""Start N local ranks of a module entry point and supervise them until they finish or the deadline passes.

Each rank runs `python -m MODULE ARGS` in its own session (so its whole process group can be killed), with the
environment torchrun gives (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) and the launcher's pid, so it can die
with the launcher (rank.die_with_parent). The first rank that raises or exits ends the launch at once, with a
message naming it and its error; a launch past its deadline ends naming the rank that hung (procs.hang: the one
that stopped reporting, or got least far) or saying it cannot be told apart. Whatever
happens, every rank is killed and reaped before this returns. A taken rendezvous port is retried with a fresh one.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from shardscope.procs.hang import RankReport, blame
from shardscope.procs.rank import LAUNCHER_PID_ENV, error_path, log_path, status_path

MAX_LOCAL_WORLD_SIZE = 8  # gloo processes this machine can hold at once
PORT_ATTEMPTS = 3
POLL_S = 0.05


class RunError(RuntimeError):
    """A launch failed: a rank raised, exited or hung. The message names the rank and its error."""


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (a taken one is retried: `run_ranks`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check_world_size(world_size: int) -> None:
    """RunError unless 1 <= world_size <= MAX_LOCAL_WORLD_SIZE."""
    if not 1 <= world_size <= MAX_LOCAL_WORLD_SIZE:
        raise RunError(
            f"world_size={world_size} must be between 1 and {MAX_LOCAL_WORLD_SIZE} local processes; "
            "use torchrun for more (docs/cluster.md)"
        )


def check_timeout(timeout_s: float, name: str = "timeout_s") -> None:
    """RunError unless timeout_s is a positive, finite number of seconds (nan and inf would never end a hang)."""
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise RunError(f"{name} {timeout_s} must be a positive, finite number of seconds")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@contextlib.contextmanager
def ctrl_c_between_polls() -> Iterator[Callable[[], bool]]:
    """While ranks run, Ctrl-C (SIGINT) only marks that it came; the supervision loop asks and raises
    KeyboardInterrupt between polls, and leaving the block raises it if the loop never asked. Raised wherever the
    signal lands, it could land inside Popen.poll between taking and releasing Popen's wait lock, and the reaping that
    follows (Popen.wait) would wait for that lock forever. Outside the main thread, signals are left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    pressed: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: pressed.append(signum))
    try:
        yield lambda: bool(pressed)
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt


def kill_all(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGKILL every rank's process group (the rank and anything it started), then reap them all."""
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                process.kill()
    for process in processes:
        process.wait()


def _spawn(
    processes: list[subprocess.Popen[bytes]],
    module: str,
    args: Sequence[str],
    world_size: int,
    run_dir: Path,
    port: int,
) -> None:
    """Start the ranks, appending each to processes as it starts (so a failure half way still reaps them)."""
    for rank in range(world_size):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            **{LAUNCHER_PID_ENV: str(os.getpid())},
        )
        with log_path(run_dir, rank).open("wb") as log:
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, *args],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )


def _failed_at(run_dir: Path, rank: int) -> float:
    """When a rank wrote its error report (ranks that died without one sort first: exit and kill are immediate)."""
    try:
        return error_path(run_dir, rank).stat().st_mtime
    except OSError:
        return 0.0


def _failure(rank: int, code: int, run_dir: Path) -> str:
    report = _read(error_path(run_dir, rank))
    if report:
        return report.splitlines()[0]
    log = _read(log_path(run_dir, rank)).strip().splitlines()
    tail = f"; last output: {log[-1]}" if log else ""
    return f"exited with code {code} without an error report{tail}"


def _report(run_dir: Path, rank: int) -> RankReport:
    path = status_path(run_dir, rank)
    try:
        reported_at: float | None = path.stat().st_mtime
    except OSError:
        reported_at = None
    return RankReport(status=_read(path) or "starting|0", reported_at=reported_at)


def _timed_out(timeout_s: float, run_dir: Path, codes: list[int | None]) -> RunError:
    reports = {rank: _report(run_dir, rank) for rank, code in enumerate(codes) if code is None}
    return RunError(f"did not finish within {timeout_s:g}s: {blame(reports)}")


def supervise(
    processes: Sequence[subprocess.Popen[bytes]],
    run_dir: Path,
    timeout_s: float,
    progress: Callable[[str], None] | None = None,
    interrupted: Callable[[], bool] = lambda: False,
) -> None:
    """Wait until every rank exits 0; RunError naming the first rank that failed, or the stuck one at the deadline;
    KeyboardInterrupt as soon as interrupted() says Ctrl-C came. progress, if given, gets rank 0's stage whenever
    it changes."""
    deadline = time.monotonic() + timeout_s
    shown = ""
    while True:
        if interrupted():
            raise KeyboardInterrupt
        codes = [process.poll() for process in processes]
        if any(code not in (None, 0) for code in codes):  # the first to fail is the cause; peers then fail on the
            time.sleep(POLL_S)  # broken connection, so let their reports land before choosing
            failed = [rank for rank, process in enumerate(processes) if process.poll() not in (None, 0)]
            first = min(failed, key=lambda rank: _failed_at(run_dir, rank))
            raise RunError(f"rank {first} failed: {_failure(first, processes[first].returncode, run_dir)}")
        if all(code == 0 for code in codes):
            return
        stage = _read(status_path(run_dir, 0)).partition("|")[0]
        if progress and stage and stage != shown:
            progress(stage)
            shown = stage
        if time.monotonic() > deadline:
            raise _timed_out(timeout_s, run_dir, codes)
        time.sleep(POLL_S)


def run_ranks(
    module: str,
    args: Callable[[Path], Sequence[str]],
    *,
    world_size: int,
    timeout_s: float,
    run_dir: Path,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Run `python -m module args(attempt_dir)` on world_size local ranks until all exit 0; returns the attempt's
    directory (where the ranks wrote their results). Every rank is reaped before this returns or raises."""
    check_world_size(world_size)
    check_timeout(timeout_s)
    for attempt in range(PORT_ATTEMPTS):
        attempt_dir = run_dir / f"attempt{attempt}"
        attempt_dir.mkdir(parents=True, exist_ok=True)
        processes: list[subprocess.Popen[bytes]] = []
        with ctrl_c_between_polls() as interrupted:
            try:
                _spawn(processes, module, args(attempt_dir), world_size, attempt_dir, free_port())
                supervise(processes, attempt_dir, timeout_s, progress, interrupted)
            except RunError as error:
                if "address already in use" in str(error).lower() and attempt + 1 < PORT_ATTEMPTS:
                    continue
                raise
            finally:
                kill_all(processes)
        return attempt_dir
    raise RunError("no free rendezvous port after retries")
