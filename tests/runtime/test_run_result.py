"""runtime.api.result_from_launch: rank 0's result file, turned into a RunResult, keeps every rank's ledger."""

from __future__ import annotations

from typing import Any

from shardscope.core.result import CollectiveRow
from shardscope.runtime import RunConfig
from shardscope.runtime.api import result_from_launch


def _rank(rank: int, op: str) -> dict[str, Any]:
    """A rank's entry as the worker writes it: its memory by category and its step's calls."""
    memory = {"parameters_bytes": 8 * (rank + 1), "peak_bytes": 16 * (rank + 1), "peak_composition": {}}
    row = {"phase": "forward", "op": op, "group": "pp", "group_size": 2, "payload_bytes": 64, "count": rank + 1}
    return {"rank": rank, "memory": memory, "ledger": [row], "step_time_s": 0.1 * (rank + 1)}


def test_every_ranks_ledger_in_rank_order_and_rank_0s_as_the_ledger() -> None:
    # a pipeline's ranks send and receive different calls (tests/distributed/test_pipeline_run.py compares each one)
    config = RunConfig.from_options(model="tiny-llama", world_size=3, precision="fp64")
    raw = {"ranks": [_rank(2, "recv"), _rank(0, "send"), _rank(1, "recv")], "max_abs_diff": 0.0}
    result = result_from_launch(config, raw)
    assert [ledger[0].count for ledger in result.ledgers] == [1, 2, 3]
    assert result.ledger == result.ledgers[0] == (CollectiveRow(**_rank(0, "send")["ledger"][0]),)
    assert [memory.parameters_bytes for memory in result.per_rank] == [8, 16, 24]
    assert result.to_json()["ledger"] == [result.ledgers[0][0].to_json()]  # the run document keeps rank 0's
    assert result.step_time_s == 0.1 * 3
