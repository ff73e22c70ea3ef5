"""Run a plain function on N local ranks (the lesson's demo, the bandwidth benchmark) under the rules of every real
run: each rank dies with its parent, the whole thing ends by a deadline, and every process is reaped."""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import time
from collections.abc import Callable
from typing import Any

import torch

from shardscope.runtime.config import RunError
from shardscope.runtime.launch import free_port
from shardscope.runtime.worker import die_with_parent

RankFunction = Callable[[int, int, int, dict[str, Any]], dict[str, Any]]


def _entry(function: RankFunction, rank: int, world: int, port: int, options: dict[str, Any], results: Any) -> None:
    die_with_parent()
    try:
        torch.set_num_threads(1)
        results.put((rank, function(rank, world, port, options)))
    except BaseException as error:
        results.put((rank, {"error": f"{type(error).__name__}: {error}"}))
        code = 1
    else:
        code = 0
    results.close()
    results.join_thread()  # flush the report before os._exit skips the queue's feeder thread
    os._exit(code)


def run_on_ranks(function: RankFunction, world_size: int, options: dict[str, Any], timeout: float) -> dict[int, Any]:
    """function(rank, world_size, port, options) on world_size spawned processes; returns each rank's report.
    function must live at module level (it is pickled) and must join and leave the process group itself."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_entry, args=(function, rank, world_size, port, options, results), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    reports: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(reports) < world_size:
            try:
                rank, report = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_module.Empty as error:
                silent = sorted(set(range(world_size)) - set(reports))
                raise RunError(f"did not finish within {timeout:g}s: rank(s) {silent} never reported") from error
            if "error" in report:
                raise RunError(f"rank {rank} failed: {report['error']}")
            reports[rank] = report
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
    return reports
