"""Traces that test modules share for the whole session (the `shared_trace` fixture, tests/conftest.py): each request
replayed once, and the ones the modules read by default replayed side by side.

A trace is deterministic and its result frozen, so tests in different modules that replay the same request (up to its
time limit, which bounds the replay and changes nothing it finds) read one result. A trace's subprocess keeps one core
busy while the test waits on it, so a module registers the requests its default tests read when it is imported
(`register`); the first time a test asks for one of them, every registered request of a module with a selected test
using the fixture replays, as many at once as this process may use cores. A request registered by no module (a case
under -m long) replays alone."""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardscope.trace.request import TraceRequest
    from shardscope.trace.result import TraceResult

REGISTERED: dict[str, list[TraceRequest]] = {}
"""Module name -> the trace requests its default tests read."""


def register(module: str, requests: Iterable[TraceRequest]) -> None:
    """Hand a module's default traces to the session's shared replays (module: the test module's __name__)."""
    REGISTERED[module] = list(requests)


def _key(request: TraceRequest) -> TraceRequest:
    """The request up to its time limit."""
    return replace(request, time_limit_s=1.0)


class SharedTraces:
    """run_in_subprocess, once per request for the whole session."""

    def __init__(self, together: Iterable[TraceRequest] = ()) -> None:
        self._together = {_key(request): request for request in together}
        self._results: dict[TraceRequest, TraceResult] = {}

    def __call__(self, request: TraceRequest) -> TraceResult:
        """The request's trace (TraceError as run_in_subprocess raises it). When it is one of the requests replayed
        together, those not replayed yet replay beside it, for the tests that read them later; one that fails is
        replayed again, and fails, in the test that asks for it."""
        from shardscope.trace.runner import run_in_subprocess

        key = _key(request)
        wanted = self._together if key in self._together else {key: request}
        missing = {each: wanted[each] for each in wanted if each not in self._results}
        running: dict[TraceRequest, Future[TraceResult]] = {}
        if missing:
            with ThreadPoolExecutor(max_workers=min(len(missing), len(os.sched_getaffinity(0)))) as pool:
                running = {each: pool.submit(run_in_subprocess, missing[each]) for each in missing}
            self._results.update((each, done.result()) for each, done in running.items() if done.exception() is None)
        if key not in self._results:
            return running[key].result()  # raises the request's own TraceError
        return self._results[key]
