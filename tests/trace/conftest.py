"""The trace tests' refusals checked in this process."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from shardscope.trace.request import TraceRequest


@pytest.fixture
def refused_in_process(monkeypatch: pytest.MonkeyPatch) -> Callable[[TraceRequest], None]:
    """The trace worker's body in this process, for requests the trace refuses before it replays anything: run_trace,
    its error put in one line as the worker does (worker.explain), raised as the TraceError run_in_subprocess raises;
    it also stands in for run_in_subprocess, so `shardscope trace` refuses through it. No subprocess starting torch
    for each refusal (tests/trace/test_trace.py keeps the failures a subprocess reports); a request that reaches the
    fake process group fails the test."""
    from shardscope.trace import engine, pipeline, runner
    from shardscope.trace.worker import explain

    def no_replay(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the request was not refused before the replay")

    monkeypatch.setattr(engine, "init_fake_process_group", no_replay)
    monkeypatch.setattr(pipeline, "init_fake_process_group", no_replay)

    def refuse(request: TraceRequest, _on_progress: object = None) -> None:
        try:
            engine.run_trace(request)
        except AssertionError:
            raise
        except Exception as error:  # as the worker: every failure becomes one line
            raise runner.TraceError(explain(error)) from None
        raise AssertionError("the trace did not refuse the request")

    monkeypatch.setattr(runner, "run_in_subprocess", refuse)
    return refuse
