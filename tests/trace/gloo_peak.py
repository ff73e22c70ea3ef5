"""Run as a script: a trace, plus the peak a gloo run of it has (JSON on stdout). Test helper, not shipped.

gloo's reduce-scatter (ProcessGroupGloo::reduce_scatter_tensor_coalesced) clones its whole, unsharded input,
all-reduces the clone and, at wait(), copies this rank's chunk out of it: for that moment the rank holds one more
copy of the reduce-scatter input, which NCCL (reduce-scatter in place) and so the trace do not. The gloo peak is the
larger of the trace's peak and, at each reduce-scatter, what was live plus the size of its input.

    python tests/trace/gloo_peak.py '<TraceRequest JSON>'
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def main() -> None:
    import torch

    import shardscope.trace.engine as engine
    from shardscope.trace.request import request_from_json
    from shardscope.trace.tracker import StepRecorder

    reduce_scatter = torch.ops.c10d._reduce_scatter_base_.default
    peaks = [0]

    class GlooRecorder(StepRecorder):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            live = self.live_total
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.recording and func is reduce_scatter:
                peaks[0] = max(peaks[0], live + args[1].untyped_storage().nbytes())
            return out

    engine.StepRecorder = GlooRecorder  # type: ignore[misc]
    result = engine.run_trace(request_from_json(sys.argv[1]))
    sys.stdout.write(
        json.dumps(
            {
                "activations_bytes": result.per_rank.activations_bytes,
                "peak_bytes": result.per_rank.peak_bytes,
                "gloo_peak_bytes": max(peaks[0], result.per_rank.peak_bytes),
            }
        )
    )
    sys.stdout.flush()
    os._exit(0)  # the fake process group is never destroyed cleanly


if __name__ == "__main__":
    main()
