"""Spawn N worker processes on this machine and supervise them until they finish or the deadline passes.

Each worker runs in its own session (so its whole process group can be killed) and dies with the launcher
(PR_SET_PDEATHSIG). The first rank that raises or exits ends the run at once, with a message naming it and its error;
a run past its deadline ends naming the rank that stopped earliest. Whatever happens, every worker is killed and
reaped before this returns. A taken rendezvous port is retried with a fresh one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shardscope.runtime.config import MAX_LOCAL_WORLD_SIZE, RunConfig, RunError

PORT_ATTEMPTS = 3
POLL_S = 0.05


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (the worker retries if someone takes it meanwhile)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _kill_all(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # the worker and anything it started
            except (ProcessLookupError, PermissionError):
                process.kill()
    for process in processes:
        process.wait()


def _spawn(configs: Sequence[RunConfig], run_dir: Path, port: int) -> list[subprocess.Popen[bytes]]:
    config = configs[0]
    suite = run_dir / "suite.json"
    suite.write_text(json.dumps([dataclasses.asdict(c) for c in configs]))
    processes = []
    for rank in range(config.world_size):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(config.world_size),
            LOCAL_WORLD_SIZE=str(config.world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            SHARDSCOPE_LAUNCHER_PID=str(os.getpid()),
            PYTHONUNBUFFERED="1",
        )
        log = (run_dir / f"rank{rank}.log").open("wb")
        command = [sys.executable, "-m", "shardscope.runtime.worker", "--suite", str(suite), "--run-dir", str(run_dir)]
        processes.append(
            subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        )
        log.close()
    return processes


def _failed_at(run_dir: Path, rank: int) -> float:
    """When a rank wrote its error report (ranks that died without one sort first: exit and kill are immediate)."""
    try:
        return (run_dir / f"rank{rank}.error").stat().st_mtime
    except OSError:
        return 0.0


def _failure(rank: int, code: int, run_dir: Path) -> str:
    report = _read(run_dir / f"rank{rank}.error")
    if report:
        return report.splitlines()[0]
    log = _read(run_dir / f"rank{rank}.log").strip().splitlines()
    tail = f"; last output: {log[-1]}" if log else ""
    return f"exited with code {code} without an error report{tail}"


def _supervise(
    timeout_s: float, run_dir: Path, processes: list[subprocess.Popen[bytes]], progress: Callable[[str], None] | None
) -> None:
    deadline = time.monotonic() + timeout_s
    shown = ""
    while True:
        codes = [process.poll() for process in processes]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:  # the first to fail is the cause; peers then fail on the broken connection
            time.sleep(POLL_S)
            failed = [rank for rank, code in enumerate(p.poll() for p in processes) if code not in (None, 0)]
            first = min(failed, key=lambda rank: _failed_at(run_dir, rank))
            raise RunError(f"rank {first} failed: {_failure(first, processes[first].returncode, run_dir)}")
        if all(code == 0 for code in codes):
            return
        stage = _read(run_dir / "rank0.status").partition("|")[0]
        if progress and stage and stage != shown:
            progress(stage)
            shown = stage
        if time.monotonic() > deadline:
            stages = {
                rank: _read(run_dir / f"rank{rank}.status") or "starting|0"
                for rank, code in enumerate(codes)
                if code is None
            }
            stuck = min(stages, key=lambda rank: _stage_order(stages[rank]))
            others = ", ".join(f"rank {r} at '{_describe(s)}'" for r, s in stages.items() if r != stuck)
            raise RunError(
                f"run did not finish within {timeout_s:g}s: rank {stuck} hung at "
                f"'{_describe(stages[stuck])}'" + (f" ({others} waiting)" if others else "")
            )
        time.sleep(POLL_S)


def _stage_order(status: str) -> tuple[int, int]:
    """How far a rank got: collectives entered (ranks waiting inside one have entered one more than a rank that
    hangs outside), then its stage."""
    order = ["starting", "rendezvous", "setup", "step", "parity", "done"]
    stage, _, calls = status.partition("|")
    words = [word for word in stage.split() if word in order]
    return (int(calls or 0), order.index(words[-1]) if words else 0)


def _describe(status: str) -> str:
    stage, _, calls = status.partition("|")
    return f"{stage}, after {calls or 0} collectives"


def launch(
    configs: Sequence[RunConfig], progress: Callable[[str], None] | None = None, run_dir: Path | None = None
) -> list[dict[str, Any]]:
    """Run configs one after another on the same world_size local processes; returns rank 0's result per config
    (raises RunError naming the failed rank). The deadline is the sum of the configs' timeouts."""
    if len({(c.world_size, c.backend, c.rendezvous) for c in configs}) != 1:
        raise RunError("configs launched together must share world_size, backend and rendezvous")
    if configs[0].world_size > MAX_LOCAL_WORLD_SIZE:
        raise RunError(
            f"world_size={configs[0].world_size} is more local processes than this launcher starts "
            f"(at most {MAX_LOCAL_WORLD_SIZE}); use torchrun for more (docs/cluster.md)"
        )
    timeout_s = sum(config.timeout_s for config in configs)
    with tempfile.TemporaryDirectory(prefix="shardscope-run-") as scratch:
        base = run_dir or Path(scratch)
        for attempt in range(PORT_ATTEMPTS):
            attempt_dir = base / f"attempt{attempt}"
            attempt_dir.mkdir(parents=True, exist_ok=True)
            processes = _spawn(configs, attempt_dir, free_port())
            try:
                _supervise(timeout_s, attempt_dir, processes, progress)
            except RunError as error:
                if "address already in use" in str(error).lower() and attempt + 1 < PORT_ATTEMPTS:
                    continue
                raise
            finally:
                _kill_all(processes)
            results: list[dict[str, Any]] = json.loads((attempt_dir / "result.json").read_text())
            return results
    raise RunError("no free rendezvous port after retries")
