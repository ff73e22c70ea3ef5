"""Which rank hung, decided from fake reports: the silent rank or the one least far is named, a healthy rank never."""

from __future__ import annotations

from shardscope.procs.hang import STALE_MARGIN_S, RankReport, blame

NOW = 1_000_000.0


def _reports(*ranks: tuple[str, float | None]) -> dict[int, RankReport]:
    return {rank: RankReport(status=status, reported_at=at) for rank, (status, at) in enumerate(ranks)}


def test_a_silent_rank_among_equals_is_named() -> None:
    same = "step 12/50|31"
    message = blame(_reports((same, NOW), (same, NOW - 14.0), (same, NOW - 0.3), (same, NOW)))
    assert message.startswith("rank 1 hung at 'step 12/50, after 31 collectives' (stopped reporting 14.0s before")
    assert "rank 0 at 'step 12/50, after 31 collectives', rank 2" in message


def test_a_rank_least_far_is_named_while_all_report() -> None:
    message = blame(_reports(("step 1/2|7", NOW), ("step 1/2|6", NOW - 0.2)))
    assert message.startswith("rank 1 hung at 'step 1/2, after 6 collectives' (got least far)")


def test_the_silent_one_of_two_equally_behind_is_named() -> None:
    message = blame(_reports(("step 3/9|9", NOW), ("step 3/9|8", NOW - 9.0), ("step 3/9|8", NOW)))
    assert message.startswith("rank 1 hung at")
    assert "rank 2 hung" not in message


def test_equal_reports_within_the_margin_cannot_be_told_apart() -> None:
    same = "step 12/50|31"
    almost = STALE_MARGIN_S - 0.1
    message = blame(_reports((same, NOW), (same, NOW - almost), (same, NOW - 0.5), (same, NOW)))
    assert message.startswith("the hung rank cannot be told apart: ranks 0, 1, 2, 3 got equally far and reported")
    assert "hung at" not in message


def test_everyone_silent_cannot_be_told_apart() -> None:
    same = "step 2/5|0"
    message = blame(_reports((same, None), (same, None)))
    assert message.startswith("the hung rank cannot be told apart: ranks 0, 1 got equally far and none reported")


def test_a_silent_rank_ahead_of_a_live_one_behind_names_neither() -> None:
    message = blame(_reports(("step 5/9|3", NOW), ("step 6/9|3", NOW - 8.0), ("step 6/9|3", NOW)))
    assert message.startswith("the hung rank cannot be told apart: rank 0 got least far but rank 1 8.0s before")
    assert "hung at" not in message
