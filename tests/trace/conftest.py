"""A trace shared by the test modules that replay the same scenario."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest

from shardscope.trace.request import TraceRequest

if TYPE_CHECKING:
    from shardscope.trace.result import TraceResult


@pytest.fixture(scope="session")
def shared_trace() -> Callable[[TraceRequest], TraceResult]:
    """run_in_subprocess, once per request for the whole session: a trace is deterministic and its result frozen, so
    tests in different modules that replay the same request (up to its time limit, which bounds the replay and changes
    nothing it finds) read one result."""
    from shardscope.trace.runner import run_in_subprocess

    results: dict[TraceRequest, TraceResult] = {}

    def trace(request: TraceRequest) -> TraceResult:
        key = replace(request, time_limit_s=1.0)
        if key not in results:
            results[key] = run_in_subprocess(request)
        return results[key]

    return trace
