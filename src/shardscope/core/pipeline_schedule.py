"""The order each pipeline rank runs its forwards and backwards in, as torch.distributed.pipelining's schedules
order them (torch 2.13, torch/distributed/pipelining/schedules.py), and what that order keeps in flight.

- GPipe (ScheduleGPipe): every micro-batch's forward, then every backward, so each stage holds all m.
- 1F1B (Schedule1F1B): stage s runs min(m, p - s) forwards, then alternates one backward and one forward, then the
  remaining backwards, so it holds at most min(p - s, m) micro-batches ("Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", Narayanan et al., Section 2.2.1, the default schedule).
- Interleaved 1F1B (ScheduleInterleaved1F1B): rank r holds V stages; micro-batches go in rounds of
  m // max(1, m // p); rank r warms up with (V - 1) x round + 2 (p - 1 - r) forwards (at most m V), then runs one
  forward and one backward at a time, the stage chosen by the round ("depth first"). Rank 0 thus holds
  2 (p - 1) + (V - 1) p + 1 stage-micro-batches when m is a multiple of p, each of 1/V of its layers: the
  Megatron-LM paper's interleaved schedule (Section 2.2.2), whose first-stage activations are (1 + (p - 1)/(p V))
  times 1F1B's ("Reducing Activation Recomputation in Large Transformer Models", Korthikanti et al., Section 4.2.3).
"""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache
from typing import NamedTuple

from shardscope.choices import PipelineSchedule
from shardscope.core.kept import kept


class Action(NamedTuple):
    """One forward or backward of one micro-batch on one stage."""

    stage: int
    """The stage (0 to pp x V - 1)."""
    backward: bool
    """A backward (else a forward)."""
    micro_batch: int
    """Which micro-batch."""


def rank_actions(schedule: PipelineSchedule, pp: int, virtual: int, micro_batches: int, rank: int) -> list[Action]:
    """The actions pipeline rank `rank` runs, in its order."""
    return list(_rank_actions(schedule, pp, virtual, micro_batches, rank))


@lru_cache(maxsize=1024)
def _rank_actions(schedule: PipelineSchedule, pp: int, virtual: int, micro_batches: int, rank: int) -> list[Action]:
    """`rank_actions`, kept: the planner asks every pipeline rank's order of thousands of scenarios that share a few
    shapes (callers get a copy)."""
    if schedule == "gpipe":
        return [Action(rank, False, i) for i in range(micro_batches)] + [
            Action(rank, True, i) for i in range(micro_batches)
        ]
    if schedule == "1f1b":
        return _one_f_one_b(pp, micro_batches, rank)
    return _interleaved(pp, virtual, micro_batches, rank)


def _one_f_one_b(pp: int, micro_batches: int, rank: int) -> list[Action]:
    warmup = min(micro_batches, pp - rank)
    actions = [Action(rank, False, i) for i in range(warmup)]
    forward, backward = warmup, 0
    while backward < micro_batches:
        actions.append(Action(rank, True, backward))
        backward += 1
        if forward < micro_batches:
            actions.append(Action(rank, False, forward))
            forward += 1
    return actions


def _interleaved(pp: int, virtual: int, micro_batches: int, rank: int) -> list[Action]:
    per_round = micro_batches // max(1, micro_batches // pp)
    warmup = min((virtual - 1) * per_round + 2 * (pp - 1 - rank), micro_batches * virtual)
    total = micro_batches * virtual
    next_micro_batch: dict[tuple[int, bool], int] = defaultdict(int)

    def take(stage: int, backward: bool) -> Action:
        index = next_micro_batch[stage, backward]
        next_micro_batch[stage, backward] = index + 1
        return Action(stage, backward, index)

    def forward_stage(step: int) -> int:
        return (step // per_round) % virtual * pp + rank

    def backward_stage(step: int) -> int:
        return (virtual - 1 - ((step - warmup) // per_round) % virtual) * pp + rank

    actions = [take(forward_stage(step), False) for step in range(warmup)]
    for step in range(warmup, total):
        actions.append(take(forward_stage(step), False))
        actions.append(take(backward_stage(step), True))
    for step in range(total, total + warmup):
        actions.append(take(backward_stage(step), True))
    return actions


def peak_in_flight(actions: list[Action], weights: dict[int, int]) -> tuple[int, dict[int, int]]:
    """The most of `weights` (bytes per micro-batch of each stage) that forwards not yet matched by their backward
    hold at once, and how many micro-batches of each stage are in flight at that moment. Kept: the planner's tens of
    thousands of pipeline memory estimates ask a few thousand orders and weights (callers get a copy)."""
    key = (tuple(actions), tuple(weights.items()))
    peak, counts = kept(_peaks, key, lambda: _peak_in_flight(actions, weights), CACHED_PEAKS)
    return peak, dict(counts)


CACHED_PEAKS = 16384
_peaks: dict[tuple[tuple[Action, ...], tuple[tuple[int, int], ...]], tuple[int, dict[int, int]]] = {}


def _peak_in_flight(actions: list[Action], weights: dict[int, int]) -> tuple[int, dict[int, int]]:
    in_flight: dict[int, int] = defaultdict(int)
    best, best_counts = 0, {stage: 0 for stage in weights}
    held = 0
    for action in actions:
        step = -1 if action.backward else 1
        in_flight[action.stage] += step
        held += step * weights[action.stage]
        if held > best:
            best, best_counts = held, {stage: in_flight[stage] for stage in weights}
    return best, best_counts


def simulate_pipeline(
    schedule: PipelineSchedule,
    pp: int,
    virtual: int,
    micro_batches: int,
    forward_s: list[float],
    backward_s: list[float],
    send_s: float = 0.0,
) -> tuple[list[list[tuple[Action, float, float]]], float]:
    """List-schedule every rank's actions: each starts when its rank is free and what it needs has arrived (a
    forward the previous stage's forward of the micro-batch, a backward the next stage's backward, each `send_s`
    after it ended). `forward_s` and `backward_s` are per stage and micro-batch. Returns, per rank, its actions with
    their start and end, and the makespan."""
    orders = [rank_actions(schedule, pp, virtual, micro_batches, rank) for rank in range(pp)]
    last_stage = pp * virtual - 1
    done: dict[Action, float] = {}
    free = [0.0] * pp
    position = [0] * pp
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for rank in range(pp):
            while position[rank] < len(orders[rank]):
                action = orders[rank][position[rank]]
                ready = _ready_at(action, done, last_stage, send_s)
                if ready is None:
                    break
                start = max(free[rank], ready)
                duration = backward_s[action.stage] if action.backward else forward_s[action.stage]
                done[action] = free[rank] = start + duration
                timeline[rank].append((action, start, start + duration))
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} pipeline deadlocked (pp {pp}, V {virtual}, m {micro_batches})")
    return timeline, max(free)


def _ready_at(action: Action, done: dict[Action, float], last_stage: int, send_s: float) -> float | None:
    """When the input of `action` is on its rank, or None while it is not made yet."""
    stage, micro_batch = action.stage, action.micro_batch
    if not action.backward:
        if stage == 0:
            return 0.0
        end = done.get(Action(stage - 1, False, micro_batch))
        return None if end is None else end + send_s
    own_forward = done.get(Action(stage, False, micro_batch))
    if own_forward is None:
        return None
    if stage == last_stage:
        return own_forward
    end = done.get(Action(stage + 1, True, micro_batch))
    return None if end is None else max(own_forward, end + send_s)
