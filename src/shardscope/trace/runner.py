"""Run each trace in its own subprocess with a time limit, showing its progress on stderr (no torch here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from shardscope.procs.rank import LAUNCHER_PID_ENV
from shardscope.trace.request import TraceRequest
from shardscope.trace.result import TraceResult, result_from_json
from shardscope.trace.worker import PROGRESS_PREFIX


class TraceError(RuntimeError):
    """A trace could not finish: the message is one line for the user."""


def _pump(stream: object, on_progress: Callable[[str], None], tail: list[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        if line.startswith(PROGRESS_PREFIX):
            on_progress(line[len(PROGRESS_PREFIX) :].rstrip("\n"))
        else:
            tail.append(line.rstrip("\n"))
            del tail[:-20]


def stderr_progress(label: str) -> Callable[[str], None]:
    """Progress on stderr: one rewritten line on a terminal, a line every few seconds otherwise."""
    tty = sys.stderr.isatty()
    started = time.monotonic()
    last = [0.0]

    def show(text: str) -> None:
        now = time.monotonic() - started
        if tty:
            sys.stderr.write(f"\r\x1b[K{label} {now:5.1f}s {text}")
            sys.stderr.flush()
        elif now - last[0] >= 5.0:
            last[0] = now
            sys.stderr.write(f"{label} {now:5.1f}s {text}\n")

    return show


def run_in_subprocess(request: TraceRequest, on_progress: Callable[[str], None] = lambda _text: None) -> TraceResult:
    """Trace one scenario in a fresh Python process; TraceError on a time-out, a crash or a model that fails."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{LAUNCHER_PID_ENV: str(os.getpid())})
    env.setdefault("HF_HUB_OFFLINE", "1")
    process = subprocess.Popen(
        [sys.executable, "-m", "shardscope.trace.worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    tail: list[str] = []
    pump = threading.Thread(target=_pump, args=(process.stderr, on_progress, tail), daemon=True)
    pump.start()
    try:
        output, _ = process.communicate(request.to_json(), timeout=request.time_limit_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise TraceError(
            f"the trace stopped at its time limit of {request.time_limit_s:g} s; raise --time-limit, "
            f"trace fewer blocks (--traced-blocks), or use `shardscope estimate`"
        ) from None
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    pump.join(timeout=5)
    try:
        answer = json.loads(output)
    except json.JSONDecodeError:
        last = next((line for line in reversed(tail) if line.strip()), "no output")
        raise TraceError(f"the trace process ended with code {process.returncode}: {last[:300]}") from None
    if "error" in answer:
        raise TraceError(answer["error"])
    return result_from_json(answer)
