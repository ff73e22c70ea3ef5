"""The predicted tensor and context parallel ledger against the teaching grid's measured one, row by row, and the
paper engine's activations and peak against the measured ones.

Each case runs `shardscope run` (the teaching ModelParallelTeaching inside ddp, 4 gloo ranks, fp32, micro-batch 2 x 32
tokens, 2 steps) and compares its measured ledger with `core.comm.run_ledger` of the same scenario by (phase, op,
group size, payload): the measurement knows neither a row's mesh group nor point-to-point calls (measure/ledger.py
reads collectives only), so the predicted send/recv rows of cp are listed apart. Under sequence parallelism the
teaching linears all-gather their input again in backward, as Megatron-LM's do and the paper engine predicts.
Run: .venv/bin/python benchmarks/bench_tp_ledger.py      (about a minute)
"""

from __future__ import annotations

import sys

from shardscope.core.comm import run_ledger
from shardscope.core.memory import estimate_memory
from shardscope.runtime.api import run_training
from shardscope.runtime.config import RunConfig
from shardscope.specs import Strategy, TrainingSpec

CASES = (  # (model, tp, cp, sequence parallelism)
    ("tiny-llama", 2, 1, True),
    ("tiny-gpt2", 2, 1, False),
    ("tiny-llama", 2, 2, True),
    ("tiny-gpt2", 4, 1, True),
)
Key = tuple[str, str, int, int]


def compare(model: str, tp: int, cp: int, sequence_parallel: bool) -> tuple[int, int, int, str, bool]:
    """(rows matching, rows differing, predicted send/recv rows, a line on memory, whether memory matches) of one
    case; prints the differing rows."""
    config = RunConfig(
        model=model,
        training=TrainingSpec(micro_batch_size=2, sequence_length=32, precision="fp32"),
        strategy=Strategy(name="ddp", engine="paper", tp=tp, cp=cp, sequence_parallel=sequence_parallel),
        world_size=4,
        steps=2,
    )
    result = run_training(config)
    rank, estimate = result.per_rank[0], estimate_memory(config.scenario())
    memory = (
        f"activations {rank.activations_bytes} B measured, {estimate.per_rank.activations_bytes} B predicted; "
        f"peak {rank.peak_bytes} B measured, {estimate.per_rank.peak_bytes} B predicted ({estimate.peak_moment})"
    )
    measured: dict[Key, int] = {}
    for row in result.ledger:
        key = (row.phase, row.op, row.group_size, row.payload_bytes)
        measured[key] = measured.get(key, 0) + row.count
    predicted: dict[Key, int] = {}
    point_to_point = 0
    for row in run_ledger(config.scenario()):
        if row.op in ("send", "recv"):
            point_to_point += 1
            continue
        key = (row.phase, row.op, row.group_size, row.payload_bytes)
        predicted[key] = predicted.get(key, 0) + row.count
    keys = sorted(set(measured) | set(predicted))
    differing = [key for key in keys if measured.get(key) != predicted.get(key)]
    for key in differing:
        print(f"  differs: {key}: predicted {predicted.get(key)}, measured {measured.get(key)}")
    same_memory = (rank.activations_bytes, rank.peak_bytes) == (
        estimate.per_rank.activations_bytes,
        estimate.per_rank.peak_bytes,
    )
    return len(keys) - len(differing), len(differing), point_to_point, memory, same_memory


def main() -> int:
    failed = 0
    for model, tp, cp, sequence_parallel in CASES:
        same, differ, p2p, memory, same_memory = compare(model, tp, cp, sequence_parallel)
        failed += differ > 0 or not same_memory
        sp = "sp" if sequence_parallel else "no sp"
        print(f"{model} tp {tp} cp {cp} ({sp}): {same} rows match, {differ} differ; {p2p} send/recv rows not measured")
        print(f"  {memory}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
