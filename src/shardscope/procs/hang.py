"""Which rank hung, from what every live rank last reported: how far it got and when it last reported.

A rank reports its stage and the collectives it entered whenever they change, and a heartbeat every HEARTBEAT_S
(rank.Status), so a live rank blocked in a collective, waiting for a peer, keeps reporting and a stopped or frozen one
does not. Evidence is weighed so that a healthy rank is never named: a rank is named when it stopped reporting
clearly before the others (and is not ahead of a rank that got less far), or when it alone got least far; otherwise
the message says the culprit cannot be told apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shardscope.procs.rank import HEARTBEAT_S

STAGES = ("starting", "rendezvous", "setup", "step", "parity", "done")
STALE_MARGIN_S = 6 * HEARTBEAT_S
"""A rank's last report is clearly older than the others' when it is older than the newest by more than this: a live
rank would have to miss six heartbeats in a row; one blocked in a collective does not (the wait releases the GIL)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankReport:
    """What a live rank last told the launcher."""

    status: str
    """'stage|collectives entered', as rank.Status writes it."""
    reported_at: float | None
    """Wall-clock time of its last report (a stage, a collective or a heartbeat); None if it never reported."""


def progress(status: str) -> tuple[int, ...]:
    """How far a rank got: collectives entered (ranks waiting inside one have entered one more than a rank that
    hangs outside), then the run of a suite ('run 2/3'), its stage, and the step ('step 5/50')."""
    stage, _, calls = status.partition("|")
    words = stage.split()

    def number_after(word: str) -> int:
        index = words.index(word) if word in words[:-1] else -1
        count = words[index + 1].partition("/")[0] if index >= 0 else ""
        return int(count) if count.isdigit() else 0

    stages = [STAGES.index(word) for word in words if word in STAGES]
    return (int(calls or 0), number_after("run"), stages[-1] if stages else 0, number_after("step"))


def describe(status: str) -> str:
    """'stage, after N collectives'."""
    stage, _, calls = status.partition("|")
    return f"{stage}, after {calls or 0} collectives"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _where(reports: Mapping[int, RankReport], ranks: list[int]) -> str:
    return ", ".join(f"rank {rank} at '{describe(reports[rank].status)}'" for rank in ranks)


def blame(reports: Mapping[int, RankReport]) -> str:
    """The sentence naming the rank(s) that hung, or saying they cannot be told apart; reports has every live rank."""
    ranks = sorted(reports)
    least = min(progress(reports[rank].status) for rank in ranks)
    behind = [rank for rank in ranks if progress(reports[rank].status) == least]
    times = [report.reported_at for report in reports.values() if report.reported_at is not None]
    newest = max(times, default=None)

    def silent_for(rank: int) -> float:
        reported_at = reports[rank].reported_at
        return float("inf") if newest is None or reported_at is None else newest - reported_at

    stale = [rank for rank in ranks if silent_for(rank) > STALE_MARGIN_S]
    some_stale = 0 < len(stale) < len(ranks)
    some_behind = len(behind) < len(ranks)
    if some_stale and (not some_behind or set(stale) <= set(behind)):
        why = {rank: f"stopped reporting {silent_for(rank):.1f}s before the others" for rank in stale}
    elif some_stale:  # a silent rank ahead of a live one that got less far: both stories hold
        silent = ", ".join(f"rank {rank} {silent_for(rank):.1f}s before the others" for rank in stale)
        return (
            f"the hung rank cannot be told apart: {_ranks(behind)} got least far but {silent} stopped "
            f"reporting ({_where(reports, ranks)})"
        )
    elif some_behind and len(behind) == 1:
        why = {behind[0]: "got least far"}
    else:
        alike = "none reported" if newest is None else f"reported within {STALE_MARGIN_S:g}s of each other"
        return (
            f"the hung rank cannot be told apart: {_ranks(behind)} got equally far and {alike} "
            f"({_where(reports, ranks)})"
        )
    named = " and ".join(f"rank {rank} hung at '{describe(reports[rank].status)}' ({why[rank]})" for rank in why)
    waiting = [rank for rank in ranks if rank not in why]
    return named + (f"; {_where(reports, waiting)} waiting" if waiting else "")
