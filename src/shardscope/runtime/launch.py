"""Launch a suite of run configs on world_size local ranks of `shardscope.runtime.worker` (shardscope.procs does
the launching, supervision and reaping) and read rank 0's results."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shardscope.procs.launcher import check_world_size, run_ranks
from shardscope.procs.rundir import run_directory
from shardscope.runtime.config import RunConfig, RunError
from shardscope.runtime.host_memory import check_fits


def launch(
    configs: Sequence[RunConfig], progress: Callable[[str], None] | None = None, run_dir: Path | None = None
) -> list[dict[str, Any]]:
    """Run configs one after another on the same world_size local processes; returns rank 0's result per config
    (raises RunError naming the failed rank; SpecError, before any rank starts, when they cannot fit in this
    machine's memory). The deadline is the sum of the configs' timeouts."""
    if len({(c.world_size, c.backend, c.rendezvous) for c in configs}) != 1:
        raise RunError("configs launched together must share world_size, backend and rendezvous")
    check_world_size(configs[0].world_size)
    check_fits(configs)
    with run_directory() if run_dir is None else contextlib.nullcontext(run_dir) as base:
        base.mkdir(parents=True, exist_ok=True)
        suite = base / "suite.json"
        suite.write_text(json.dumps([config.options() for config in configs]))
        done = run_ranks(
            "shardscope.runtime.worker",
            lambda attempt: ["--suite", str(suite), "--run-dir", str(attempt)],
            world_size=configs[0].world_size,
            timeout_s=sum(config.timeout_s for config in configs),
            run_dir=base,
            progress=progress,
        )
        results: list[dict[str, Any]] = json.loads((done / "result.json").read_text())
        return results
