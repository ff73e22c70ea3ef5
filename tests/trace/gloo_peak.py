"""Run as a script: a trace that replays gloo's collective buffers (JSON on stdout). Test helper, not shipped.

The logic lives in the trace (StepRecorder(backend="gloo"), shardscope/trace/tracker.py); this only asks for it
until TraceRequest carries the backend itself.

    python tests/trace/gloo_peak.py '<TraceRequest JSON>'
"""

from __future__ import annotations

import functools
import json
import os
import sys


def main() -> None:
    import shardscope.trace.engine as engine
    from shardscope.trace.request import request_from_json
    from shardscope.trace.tracker import StepRecorder

    engine.StepRecorder = functools.partial(StepRecorder, backend="gloo")  # type: ignore[misc]
    result = engine.run_trace(request_from_json(sys.argv[1]))
    sys.stdout.write(
        json.dumps(
            {"activations_bytes": result.per_rank.activations_bytes, "gloo_peak_bytes": result.per_rank.peak_bytes}
        )
    )
    sys.stdout.flush()
    os._exit(0)  # the fake process group is never destroyed cleanly


if __name__ == "__main__":
    main()
