"""The paper engine predicts what a teaching tensor- or context-parallel run holds: the teaching implementations are
the paper's accounting made real (Reducing Activation Recomputation in Large Transformer Models, Korthikanti et al.
2022, Table 2: with sequence parallelism the column-parallel linears keep their rank's seq/tp tokens and all-gather
them again in backward, as Megatron-LM does; core/rank_share.py)."""

from __future__ import annotations

import pytest

from shardscope.core.memory import estimate_memory
from shardscope.runtime import RunConfig, RunResult, run_suite

pytestmark = pytest.mark.distributed
MICRO_BATCH, SEQUENCE = 2, 32
OPTIONS = {
    "model": "tiny-llama",
    "strategy": "ddp",
    "engine": "paper",
    "world_size": 2,
    "precision": "fp32",
    "micro_batch_size": MICRO_BATCH,
    "sequence_length": SEQUENCE,
    "steps": 2,
    "timeout_s": 60,
}
CASES = {"tp2-sequence-parallel": {"tp": 2, "sequence_parallel": True}, "cp2": {"cp": 2}}


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[RunResult, int, int]]:
    """Each case's run (one launch, a hard deadline) with the paper engine's activations and peak for it."""
    configs = {name: RunConfig.from_options(**OPTIONS, **extra) for name, extra in CASES.items()}
    results = run_suite(list(configs.values()))
    found = {}
    for (name, config), result in zip(configs.items(), results, strict=True):
        predicted = estimate_memory(config.scenario()).per_rank
        found[name] = (result, predicted.activations_bytes, predicted.peak_bytes)
    return found


def test_context_parallel_run_holds_what_the_paper_engine_predicts(runs: dict[str, tuple[RunResult, int, int]]) -> None:
    result, activations, peak = runs["cp2"]
    assert result.parity.ok, result.parity
    for rank in result.per_rank:
        assert (rank.activations_bytes, rank.peak_bytes) == (activations, peak)


def test_sequence_parallel_run_holds_what_the_paper_engine_predicts_but_the_loss_masks(
    runs: dict[str, tuple[RunResult, int, int]],
) -> None:
    # Megatron-LM's vocab-parallel embedding and cross entropy (tensor_parallel.py) each keep a one-byte mask per
    # token of where the token or the target falls outside the rank's vocabulary slice, and the cross entropy keeps
    # no 4-byte total weight: the core's token-id and loss terms (core/activations.py) count torch's cross entropy.
    # At the peak, the start of backward, the loss itself (4 bytes) is live as well.
    result, activations, peak = runs["tp2-sequence-parallel"]
    assert result.parity.ok, result.parity
    masks = 2 * MICRO_BATCH * SEQUENCE
    for rank in result.per_rank:
        assert rank.activations_bytes - activations == masks - 4
        assert rank.peak_bytes - peak == masks
