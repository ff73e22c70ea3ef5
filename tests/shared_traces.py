"""Traces that test modules share for the whole session (the `shared_trace` fixture, tests/trace/conftest.py): each
request replayed once, and those a module will read replayed side by side.

A trace is deterministic and its result frozen, so tests in different modules that replay the same request (up to its
time limit, which bounds the replay and changes nothing it finds) read one result. A trace's subprocess keeps one core
busy while the test waits on it, so a test that asks for a trace can name the others its module reads (`together`):
those not replayed yet run at the same time, as many at once as this process may use cores."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardscope.trace.request import TraceRequest
    from shardscope.trace.result import TraceResult


def _key(request: TraceRequest) -> TraceRequest:
    """The request up to its time limit."""
    return replace(request, time_limit_s=1.0)


class SharedTraces:
    """run_in_subprocess, once per request for the whole session."""

    def __init__(self) -> None:
        self._results: dict[TraceRequest, TraceResult] = {}

    def __call__(self, request: TraceRequest, *together: TraceRequest) -> TraceResult:
        """The request's trace (TraceError as run_in_subprocess raises it). `together`: the requests the module reads
        by default; when the request is one of them, those not replayed yet replay beside it, for the tests that read
        them next (one that fails is replayed again, and fails, in the test that asks for it). A request outside them
        (a case under -m long) replays alone."""
        from shardscope.trace.runner import run_in_subprocess

        wanted = {_key(each): each for each in together}
        if _key(request) not in wanted:
            wanted = {_key(request): request}
        missing = {key: each for key, each in wanted.items() if key not in self._results}
        running: dict[TraceRequest, Future[TraceResult]] = {}
        if missing:
            with ThreadPoolExecutor(max_workers=min(len(missing), len(os.sched_getaffinity(0)))) as pool:
                running = {key: pool.submit(run_in_subprocess, each) for key, each in missing.items()}
            self._results.update((key, done.result()) for key, done in running.items() if done.exception() is None)
        if _key(request) not in self._results:
            return running[_key(request)].result()  # raises the request's own TraceError
        return self._results[_key(request)]
