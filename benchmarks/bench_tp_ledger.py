"""The predicted tensor and context parallel ledger against the teaching grid's measured one, row by row, and the
paper engine's activations and peak against the measured ones.

Each case runs `shardscope run` (the teaching ModelParallelTeaching inside ddp, 4 gloo ranks, fp32, micro-batch 2 x 32
tokens, 2 steps) and compares its measured ledger with `core.comm.run_ledger` of the same scenario by (phase, op,
group size, payload), the collectives and ring attention's send/recv alike (measure/ledger.py reads both at the c10d
ops). Each row's group (dp, tp, cp) is listed apart and not held to the prediction: the ledger names a row's group
from the ranks of the mesh axes a trainer hands it, and the teaching grid hands none, so its rows all read 'dp' (with
dp 1 its cp and data groups are the same ranks, which a group found by ranks cannot tell apart). Under sequence
parallelism the teaching linears all-gather their input again in backward, as Megatron-LM's do and the paper engine
predicts.
Run: .venv/bin/python benchmarks/bench_tp_ledger.py      (about a minute)
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from shardscope.core.comm import run_ledger
from shardscope.core.memory import estimate_memory
from shardscope.core.result import CollectiveRow
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


@dataclass(frozen=True, slots=True)
class Comparison:
    """One case's measured ledger and memory against the prediction."""

    matching: tuple[Key, ...]
    """Kinds of call, by (phase, op, group size, payload), measured as often as predicted."""
    differing: tuple[tuple[Key, int | None, int | None], ...]
    """(kind, predicted calls, measured calls) of each kind measured more or less often than predicted."""
    group_differing: tuple[tuple[Key, dict[str, int], dict[str, int]], ...]
    """(kind, predicted calls by group, measured calls by group) of the matching kinds whose group differs."""
    memory: str
    """Activations and peak, measured and predicted."""
    same_memory: bool
    """Whether the measured activations and peak equal the predicted bytes."""


def calls_by_group(rows: Iterable[CollectiveRow]) -> dict[Key, Counter[str]]:
    """Calls by (phase, op, group size, payload), each by the group it ran on."""
    counts: dict[Key, Counter[str]] = {}
    for row in rows:
        counts.setdefault((row.phase, row.op, row.group_size, row.payload_bytes), Counter())[row.group] += row.count
    return counts


def compare(model: str, tp: int, cp: int, sequence_parallel: bool) -> Comparison:
    """One case run and compared with its prediction."""
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
    measured, predicted = calls_by_group(result.ledger), calls_by_group(run_ledger(config.scenario()))
    empty: Counter[str] = Counter()
    keys = sorted(set(measured) | set(predicted))
    matching = [key for key in keys if measured.get(key, empty).total() == predicted.get(key, empty).total()]
    return Comparison(
        matching=tuple(matching),
        differing=tuple(
            (
                key,
                predicted[key].total() if key in predicted else None,
                measured[key].total() if key in measured else None,
            )
            for key in keys
            if key not in matching
        ),
        group_differing=tuple(
            (key, dict(predicted[key]), dict(measured[key])) for key in matching if measured[key] != predicted[key]
        ),
        memory=memory,
        same_memory=(rank.activations_bytes, rank.peak_bytes)
        == (estimate.per_rank.activations_bytes, estimate.per_rank.peak_bytes),
    )


def main() -> int:
    failed = 0
    for model, tp, cp, sequence_parallel in CASES:
        found = compare(model, tp, cp, sequence_parallel)
        failed += bool(found.differing) or not found.same_memory
        sp = "sp" if sequence_parallel else "no sp"
        point_to_point = sum(op in ("send", "recv") for _, op, _, _ in found.matching)
        print(
            f"{model} tp {tp} cp {cp} ({sp}): {len(found.matching)} rows match ({point_to_point} of them send/recv), "
            f"{len(found.differing)} differ; the group differs in {len(found.group_differing)} of the matching"
        )
        for key, predicted_calls, measured_calls in found.differing:
            print(f"  differs: {key}: predicted {predicted_calls}, measured {measured_calls}")
        for key, predicted_groups, measured_groups in found.group_differing:
            print(f"  group: {key}: predicted {predicted_groups}, measured {measured_groups}")
        print(f"  {found.memory}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
