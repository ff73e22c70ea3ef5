"""The paper engine predicts what a teaching tensor- or context-parallel run holds and sends, byte for byte: the
teaching implementations are the paper's accounting made real (Reducing Activation Recomputation in Large
Transformer Models, Korthikanti et al. 2022, Table 2: with sequence parallelism the column-parallel linears keep their
rank's seq/tp tokens and all-gather them again in backward, as Megatron-LM does; core/rank_share.py), with
Megatron-LM's vocabulary-parallel embedding and cross entropy (a one-byte mask per token each; core/activations.py)
and the grid's backward through the output head and the top block (core/engines/paper.py, `_grid_backward`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import pytest

from shardscope.core.comm import run_ledger
from shardscope.core.memory import estimate_memory
from shardscope.core.result import CollectiveRow
from shardscope.runtime import RunConfig, RunResult
from shared_launch import register

pytestmark = pytest.mark.distributed
OPTIONS = {
    "strategy": "ddp",
    "engine": "paper",
    "precision": "fp32",
    "micro_batch_size": 2,
    "sequence_length": 32,
    "steps": 2,
    "timeout_s": 60,
}
CASES = {  # name: (world size, options); where each case peaks is in its test below
    "llama tp2 sequence-parallel": (2, {"model": "tiny-llama", "tp": 2, "sequence_parallel": True}),
    "llama cp2": (2, {"model": "tiny-llama", "cp": 2}),
    "gpt2 tp2 sequence-parallel": (2, {"model": "tiny-gpt2", "tp": 2, "sequence_parallel": True}),
    "llama tp2 cp2": (4, {"model": "tiny-llama", "tp": 2, "cp": 2, "sequence_parallel": False}),
    "gpt2 tp4 sequence-parallel": (4, {"model": "tiny-gpt2", "tp": 4, "sequence_parallel": True}),
    "llama tp2 cp2 bf16-mixed": (
        4,
        {"model": "tiny-llama", "tp": 2, "cp": 2, "sequence_parallel": False, "precision": "bf16-mixed"},
    ),
}
Key = tuple[str, str, int, int]


CONFIGS = {
    name: RunConfig.from_options(**{**OPTIONS, **extra, "world_size": world}) for name, (world, extra) in CASES.items()
}
register(__name__, CONFIGS)


@pytest.fixture(scope="module")
def runs(shared_runs: dict[str, dict[str, RunResult]]) -> dict[str, tuple[RunConfig, RunResult]]:
    """Each case's run, launched with the other modules' runs of its world size (shared_launch.py; a hard deadline)."""
    return {name: (config, shared_runs[__name__][name]) for name, config in CONFIGS.items()}


def calls(rows: Iterable[CollectiveRow]) -> Counter[Key]:
    """Calls by (phase, op, group size, payload), ring attention's send/recv included. Not by group: the teaching
    grid hands the ledger no mesh axes, so its rows all read 'dp'. Under cp alone the teaching tp operators still call
    their one-rank group, which moves nothing and is not predicted."""
    counts: Counter[Key] = Counter()
    for row in rows:
        if row.group_size > 1:
            counts[(row.phase, row.op, row.group_size, row.payload_bytes)] += row.count
    return counts


@pytest.mark.parametrize(
    ("case", "moment"),
    [
        ("llama tp2 sequence-parallel", "start of backward"),  # the cross entropy's gradient, the loss live
        ("llama cp2", "optimizer step"),
        # the tied head's weight gradient held through backward, the top block's output projection's gradients
        ("gpt2 tp2 sequence-parallel", "top block's backward"),
        # 32 tokens a rank: lm_head's weight gradient (128 x 64) outweighs the logits' (32 x 128)
        ("llama tp2 cp2", "output head's backward"),
        # the head's sequence-parallel entry reduce-scattering its input's gradient: the gradient, its contiguous
        # copy and gloo's clone of it (tokens x hidden each) outweigh the head's weight gradient (64 x 64)
        ("gpt2 tp4 sequence-parallel", "output head's backward"),
    ],
)
def test_a_teaching_model_parallel_run_holds_and_sends_what_the_paper_engine_predicts(
    runs: dict[str, tuple[RunConfig, RunResult]], case: str, moment: str
) -> None:
    config, result = runs[case]
    assert result.parity.ok, result.parity
    predicted = estimate_memory(config.scenario())
    assert predicted.peak_moment == moment
    expected = predicted.per_rank
    for rank in result.per_rank:
        assert (rank.parameters_bytes, rank.gradients_bytes, rank.optimizer_state_bytes) == (
            expected.parameters_bytes,
            expected.gradients_bytes,
            expected.optimizer_state_bytes,
        )
        assert (rank.activations_bytes, rank.peak_bytes) == (expected.activations_bytes, expected.peak_bytes)
    # under sequence parallelism every column-parallel entry all-gathers its input again in backward
    assert calls(result.ledger) == calls(run_ledger(config.scenario()))


def test_the_teaching_ring_keeps_its_log_sum_exp_in_fp32(
    runs: dict[str, tuple[RunConfig, RunResult]],
) -> None:
    # The teaching ring attention (ring_attention.py) keeps its log-sum-exp in fp32 under bf16-mixed, as torch's ring
    # attention merger (convert_to_f32) and FlashAttention's kernels do, and as the core counts it: activations, peak
    # and the ledger equal the prediction (it kept bf16 before, 2 x (2 x 2 x 16 x 2) bytes fewer per rank).
    config, result = runs["llama tp2 cp2 bf16-mixed"]
    predicted = estimate_memory(config.scenario())
    for rank in result.per_rank:
        assert rank.activations_bytes == predicted.per_rank.activations_bytes
        assert rank.peak_bytes == predicted.per_rank.peak_bytes
    assert calls(result.ledger) == calls(run_ledger(config.scenario()))
