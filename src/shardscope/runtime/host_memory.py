"""Refuse, before any rank starts, a local run whose ranks cannot fit in this machine's memory.

The core predicts each rank's tensor peak for the run's scenario; a rank process holds RANK_PROCESS_BYTES more (the
interpreter, torch, gloo). world_size ranks of that, against MemAvailable: a run that cannot fit would otherwise
grow until the kernel kills it. The figures are lower bounds (rank 0's single-process parity reference is not
counted), so a run refused here cannot fit; one let through may still not.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from shardscope.core.memory import estimate_memory
from shardscope.runtime.config import RunConfig
from shardscope.specs import SpecError
from shardscope.units import MIB, format_bytes

RANK_PROCESS_BYTES = 300 * MIB
"""What a rank process holds beyond its tensors. A rank's peak RSS less its measured tensor peak was 320 MiB
(tiny-gpt2 zero3 paper fp64) and 324 MiB (tiny-llama ddp pytorch fp64), world size 2, torch 2.13.0 on CPU, measured with
    python -c "import resource; from shardscope.runtime import run_training; r = run_training(model='tiny-gpt2',
    world_size=2); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    - max(b.peak_bytes for b in r.per_rank))"
and rounded down, so the check never refuses a run that would fit."""
MEMINFO = Path("/proc/meminfo")


def available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """The kernel's estimate of memory available to new processes (MemAvailable), or None where it cannot be read."""
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        words = value.split()
        if name == "MemAvailable" and len(words) == 2 and words[0].isdigit() and words[1] == "kB":
            return int(words[0]) * 1024
    return None


def predicted_bytes(config: RunConfig) -> int:
    """The run's host memory: world_size ranks, each its predicted tensor peak (the busiest rank's) plus a process."""
    return config.world_size * (estimate_memory(config.scenario()).per_rank.peak_bytes + RANK_PROCESS_BYTES)


def check_fits(configs: Sequence[RunConfig], meminfo: Path = MEMINFO) -> None:
    """SpecError (one line: predicted GiB, available GiB, ranks) when the largest of configs, run one after another
    on the same ranks, cannot fit in this machine's available memory. Skipped where MemAvailable cannot be read."""
    available = available_bytes(meminfo)
    if available is None or not configs:
        return
    config = max(configs, key=predicted_bytes)
    needed = predicted_bytes(config)
    if needed <= available or config.resolved_backend() == "nccl":  # tensors on GPUs; torch asked only here
        return
    raise SpecError(
        f"{config.model} {config.strategy.name} ({config.training.precision}) on {config.world_size} ranks needs "
        f"about {format_bytes(needed)} ({config.world_size} x predicted peak "
        f"{format_bytes(needed // config.world_size - RANK_PROCESS_BYTES)} + {format_bytes(RANK_PROCESS_BYTES)} per "
        f"process) but this machine has {format_bytes(available)} available; refused before starting any rank"
    )
