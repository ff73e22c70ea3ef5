"""The trace subprocess: `python -m shardscope.trace.worker` reads a TraceRequest (JSON) on stdin, writes progress
lines on stderr and one JSON document on stdout: the trace, or {"error": "..."} with exit code 2."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from shardscope.procs.rank import die_with_parent

PROGRESS_PREFIX = "shardscope-progress\t"


def _progress(text: str) -> None:
    sys.stderr.write(f"{PROGRESS_PREFIX}{text}\n")
    sys.stderr.flush()


def explain(error: BaseException) -> str:
    """One line saying what went wrong and what to do instead."""
    from shardscope.specs import SpecError
    from shardscope.trace.compat import TorchVersionError, data_dependent_errors
    from shardscope.trace.setup import TraceSetupError

    if isinstance(error, TorchVersionError | TraceSetupError | SpecError):
        return str(error)
    if isinstance(error, data_dependent_errors()):
        op = getattr(error, "func", None) or str(error).split("\n")[0]
        return (
            f"the model cannot run on fake tensors: op {op} needs real data (its output depends on the values, "
            f"e.g. routing or nonzero); use `shardscope estimate` for this model, or for an MoE model "
            f"--capacity-factor (the capacity rule's buffers have fixed shapes)"
        )
    first = str(error).strip().split("\n")[0][:300]
    return f"the trace failed: {type(error).__name__}: {first}"


def main() -> int:
    """Run one trace; the answer is on stdout either way."""
    die_with_parent()
    logging.disable(logging.CRITICAL)  # torch logs failed fake-tensor ops itself; the answer says what failed
    answer: dict[str, Any]
    code = 0
    try:
        from shardscope.trace.engine import run_trace
        from shardscope.trace.request import request_from_json

        request = request_from_json(sys.stdin.read())
        result = run_trace(request, progress=_progress)
        answer = result.to_json(request.scenario)
    except Exception as error:  # every failure becomes one line for the CLI
        answer, code = {"error": explain(error)}, 2
    sys.stdout.write(json.dumps(answer))
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown: the fake process group is never destroyed cleanly


if __name__ == "__main__":
    main()
