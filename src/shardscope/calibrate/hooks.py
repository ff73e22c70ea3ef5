"""Two costs of the teaching strategies' way of communicating, each measured by its own micro-benchmark on the
calibration's stack of tiny Linear units (never on a benchmark's model):

- a Python hook: the teaching strategies drive their collectives from module forward hooks and post-accumulate-grad
  hooks, and every call of one crosses from torch into Python and back;
- compute beside an async collective: teaching DDP (like torch's DDP) starts a unit's all-reduce with async_op=True
  and backward goes on, so gloo's thread and autograd share the rank's core.

Both are differences of timings taken in pairs, one window of each variant right after the other, so that a
shared machine's drift from one second to the next hits both halves of a pair alike; the figure is the median of
the differences (a stall lands in one half of a pair at random, so the median, not a mean, is the typical
difference).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardscope.calibrate.collectives import _time_calls
from shardscope.calibrate.overheads import FRAMEWORK_UNITS, FRAMEWORK_WIDTH, WINDOW_S, _stack

# The async benchmark: ~2 ms of small ops (one block's backward on a tiny model) beside a 64 KiB all-reduce (~0.4 ms
# here: one tiny unit's gradients), so the collective is in flight under compute from start to end.
SEGMENT_OPS = 60
ASYNC_PAYLOAD_BYTES = 64 * 1024


def _window_s(work: Callable[[], Any], count: int, clock: Callable[[], float]) -> float:
    start = clock()
    for _ in range(count):
        work()
    return (clock() - start) / count


def _paired_difference_s(
    plain: Callable[[], Any],
    variant: Callable[[], Any],
    repeats: int,
    count: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median over `repeats` pairs of (variant window - plain window) per call, each window `count` calls."""
    plain()
    variant()
    return statistics.median(-_window_s(plain, count, clock) + _window_s(variant, count, clock) for _ in range(repeats))


def hook_calls_per_step() -> int:
    """Hook calls of one step of the hooked stack: a forward pre-hook and a forward hook per unit, and a
    post-accumulate-grad hook per parameter (weight and bias)."""
    return 2 * FRAMEWORK_UNITS + 2 * FRAMEWORK_UNITS


def hooked_stack(hook: Callable[..., None]) -> torch.nn.Sequential:
    """The calibration stack with `hook` registered as the teaching strategies register theirs: a forward pre-hook
    and a forward hook on every unit, a post-accumulate-grad hook on every parameter."""
    stack = _stack()
    for unit in stack:
        unit.register_forward_pre_hook(hook)
        unit.register_forward_hook(hook)
    for param in stack.parameters():
        param.register_post_accumulate_grad_hook(hook)
    return stack


def measure_hook_s(repeats: int = 21) -> float:
    """Seconds per hook call: a forward and backward of the stack with no-op hooks of the kinds the teaching
    strategies register (module forward pre-hook and forward hook, post-accumulate-grad hook), less the same step
    without them, divided by the hook calls; CPU time of the calling thread."""
    inputs = torch.randn(FRAMEWORK_WIDTH, FRAMEWORK_WIDTH)
    plain, hooked = _stack(), hooked_stack(lambda *_: None)

    def step(module: torch.nn.Module) -> None:
        module(inputs).sum().backward()
        module.zero_grad(set_to_none=True)

    first = _window_s(lambda: step(plain), 1, time.perf_counter)
    count = max(1, math.ceil(WINDOW_S / max(first, 1e-9)))  # windows of about a small model's step, as elsewhere
    # A hook is work on the calling thread alone, a microsecond or so: its thread's CPU time measures it, where wall
    # time differences of that size drown in a shared machine's scheduling.
    extra = _paired_difference_s(lambda: step(plain), lambda: step(hooked), repeats, count, time.thread_time)
    return max(0.0, extra / hook_calls_per_step())


def measure_async_slowdown(repeats: int = 21) -> float:
    """Extra time per second of an async collective in flight beside compute, over running the two one after the
    other: (issue a 64 KiB all_reduce async, compute a ~2 ms segment, wait) - (segment, then the same all_reduce
    blocking), over the all_reduce's own time (as the sweep times it). Both ranks run it at once, as in training; 0
    where the overlap costs nothing extra (a machine with a spare core for gloo's thread comes out at 0, not below:
    the serial model does not claim the time overlap saves)."""
    x = torch.randn(FRAMEWORK_WIDTH, FRAMEWORK_WIDTH)
    payload = torch.zeros(ASYNC_PAYLOAD_BYTES // 4)

    def segment() -> None:
        y = x
        for _ in range(SEGMENT_OPS):
            y = torch.tanh(y * 1.01 + 0.1)

    def serial() -> None:
        segment()
        dist.all_reduce(payload)

    def overlapped() -> None:
        work = dist.all_reduce(payload, async_op=True)
        segment()
        assert work is not None
        work.wait()

    # one call per window: every rank must make the same collective calls in the same order
    extra = _paired_difference_s(serial, overlapped, repeats, 1)
    call = _time_calls(lambda: dist.all_reduce(payload), repeats, torch.device("cpu"))
    return max(0.0, extra / call) if call > 0 else 0.0
