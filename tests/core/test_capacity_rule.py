"""The capacity rule (ModelSpec.capacity_factor, expert_routing.py): which routed copies an expert takes, what the
layer computes, and what the core predicts a rank sends and computes.

Hand derivation for mixtral-8x7b (8 experts, top-2, hidden 4096) at capacity factor 1.25, one sequence of 2048 tokens,
bf16: each expert takes ceil(1.25 x 2048 x 2 / 8) = 640 rows of the sequence, so the experts run on 8 x 640 = 5,120
padded rows instead of 2048 x 2 = 4,096, and a rank's dispatch (and combine) buffer is 5,120 x 4096 x 2 B =
41,943,040 B, whatever the routing; no row counts are swapped first. The experts' matmuls see 640 rows each, 1.25
times the even share of 512.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from shardscope.cli import main  # noqa: E402
from shardscope.core.comm import collective_ledger  # noqa: E402
from shardscope.core.compute import stage_flops  # noqa: E402
from shardscope.core.expert_parallel import dispatch_bytes  # noqa: E402
from shardscope.expert_routing import capacity_rows  # noqa: E402
from shardscope.presets import gpu_preset, model_preset  # noqa: E402
from shardscope.reference_models import MoE  # noqa: E402
from shardscope.specs import ClusterSpec, Scenario, SpecError, Strategy, TrainingSpec  # noqa: E402

MIXTRAL = model_preset("mixtral-8x7b")
CAPPED = dataclasses.replace(MIXTRAL, capacity_factor=1.25)
DISPATCH = 41_943_040


def _scenario(model: object, ep: int = 8) -> Scenario:
    return Scenario(
        model=model,  # type: ignore[arg-type]
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=8, gpus_per_node=8),
        training=TrainingSpec(sequence_length=2048),
        strategy=Strategy(name="fsdp", ep=ep),
    )


def test_mixtral_rows_and_all_to_alls_under_the_capacity_rule() -> None:
    assert CAPPED.expert_capacity(2048) == 640
    assert CAPPED.expert_rows(1, 2048) == 5_120
    assert MIXTRAL.expert_rows(1, 2048) == 4_096
    assert dispatch_bytes(_scenario(CAPPED)) == DISPATCH
    rows = {(r.phase, r.payload_bytes): (r.op, r.group_size, r.count) for r in collective_ledger(_scenario(CAPPED))}
    ep_rows = {key: value for key, value in rows.items() if value[0] == "all_to_all"}
    assert ep_rows == {("forward", DISPATCH): ("all_to_all", 8, 64), ("backward", DISPATCH): ("all_to_all", 8, 64)}


def test_the_experts_matmuls_see_their_padded_rows() -> None:
    # dropless, each token's 2 experts: 2 x 2048 x 2 x (3 x 4096 x 14336) FLOPs a block; 640 rows an expert is
    # a quarter more
    training = TrainingSpec(sequence_length=2048)
    dropless, capped = (stage_flops(model, training)[1].forward_flops for model in (MIXTRAL, CAPPED))
    assert capped - dropless == pytest.approx(0.25 * 2 * 2048 * 2 * 3 * 4096 * 14336, rel=1e-12)


def _priority_kept(chosen: torch.Tensor, experts: int, capacity: int) -> set[tuple[int, int, int]]:
    """The copies (sequence, position, choice) an expert keeps, by the rule written out: first choices of every
    token before any second choice, then by position; each expert takes the first `capacity` of its sequence."""
    kept, taken = set(), {}
    sequences, positions, top_k = chosen.shape
    for sequence in range(sequences):
        for choice in range(top_k):
            for position in range(positions):
                expert = int(chosen[sequence, position, choice])
                if taken.get((sequence, expert), 0) < capacity:
                    taken[(sequence, expert)] = taken.get((sequence, expert), 0) + 1
                    kept.add((sequence, position, choice))
    return kept


@pytest.mark.parametrize("seed", range(5))
def test_each_expert_takes_its_first_copies_by_priority_up_to_its_capacity(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    experts, capacity = 4, 7
    chosen = torch.stack([torch.randperm(experts, generator=generator)[:2] for _ in range(3 * 20)]).view(3, 20, 2)
    rows = capacity_rows(chosen, experts, capacity).view(3, 20, 2)
    size = experts * 3 * capacity
    kept = {(s, p, c) for s in range(3) for p in range(20) for c in range(2) if rows[s, p, c] < size}
    assert kept == _priority_kept(chosen, experts, capacity)
    assert bool((rows <= size).all())
    kept_rows = [int(rows[s, p, c]) for s, p, c in kept]
    assert len(set(kept_rows)) == len(kept_rows)  # no row taken twice
    for s, p, c in kept:  # expert-major: the row lies in its expert's block of its sequence
        expert, row = int(chosen[s, p, c]), int(rows[s, p, c])
        assert (expert * 3 + s) * capacity <= row < (expert * 3 + s + 1) * capacity


def test_the_layer_adds_each_kept_copys_weighted_expert_output() -> None:
    torch.manual_seed(0)
    spec = dataclasses.replace(model_preset("tiny-moe"), capacity_factor=0.5)  # 4 rows of 16 an even share brings
    moe = MoE(spec).double()
    x = torch.randn(2, 16, spec.hidden_size, dtype=torch.float64)
    tokens = x.reshape(-1, spec.hidden_size)
    probs = torch.softmax(moe.router(tokens), dim=-1)
    weights, chosen = probs.topk(2, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    kept = _priority_kept(chosen.view(2, 16, 2), spec.num_experts, spec.expert_capacity(16))
    assert 0 < len(kept) < 64  # some copies dropped
    expected = torch.zeros_like(tokens)
    for sequence, position, choice in kept:
        token = sequence * 16 + position
        expert = moe.experts[int(chosen[token, choice])]
        expected[token] += weights[token, choice] * expert(tokens[token : token + 1])[0]
    assert torch.allclose(moe(x).reshape(-1, spec.hidden_size), expected, atol=1e-12)


def test_a_capacity_no_token_can_overflow_is_dropless() -> None:
    torch.manual_seed(0)
    spec = model_preset("tiny-moe")
    dropless = MoE(spec).double()
    full = MoE(dataclasses.replace(spec, capacity_factor=2.0)).double()  # num_experts / top-k: every token fits
    full.load_state_dict(dropless.state_dict())
    x = torch.randn(3, 16, spec.hidden_size, dtype=torch.float64)
    assert torch.allclose(full(x), dropless(x), atol=1e-12)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"capacity_factor": 1.25, "family": "llama", "num_experts": 0, "experts_per_token": 0}, "only allowed"),
        ({"capacity_factor": -1.0}, "must be 0 (dropless)"),
        ({"capacity_factor": 4.5}, "at most num_experts / experts_per_token = 4"),
        ({"capacity_factor": float("nan")}, "must be a number"),
        ({"capacity_factor": True}, "must be a number"),
    ],
)
def test_bad_capacity_factors_name_the_value(fields: dict[str, object], words: str) -> None:
    with pytest.raises(SpecError, match=words.replace("(", r"\(").replace(")", r"\)")):
        dataclasses.replace(MIXTRAL, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["estimate", "--model", "llama-3-8b", "--capacity-factor", "1.25"], "llama-3-8b has no experts"),
        (["estimate", "--model", "mixtral-8x7b", "--gpus", "16", "--tp", "2", "--capacity-factor", "1"], "tp 2"),
        (
            ["report", "--model", "mixtral-8x7b", "--global-batch-tokens", "4M", "--capacity-factor", "1.25"],
            "plans are searched for dropless routing only",
        ),
        (
            ["plan", "--model", "mixtral-8x7b", "--global-batch-tokens", "4M", "--tp", "1,2", "--capacity-factor", "1"],
            "--capacity-factor 1 with --tp 1,2",
        ),
    ],
)
def test_the_flag_refuses_in_one_line(argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert words in error and len(error.splitlines()) == 1, error


def test_estimate_reports_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    argv = ["estimate", "--model", "mixtral-8x7b", "--strategy", "fsdp", "--ep", "8", "--json", "--seq-len", "2048"]
    assert main([*argv, "--capacity-factor", "1.25"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["model"]["capacity_factor"] == 1.25


def test_plan_searches_data_and_expert_parallelism_under_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import jsonschema

    from shardscope.schemas import load_schema

    argv = ["plan", "--model", "mixtral-8x7b", "--seq-len", "4096", "--global-batch-tokens", "4M", "--ep", "1,8"]
    assert main([*argv, "--capacity-factor", "1.25", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    jsonschema.validate(document, load_schema(document["schema"]))
    assert document["model"]["capacity_factor"] == 1.25
    meshes = [plan["parallelism"] for plan in document["plans"]]
    assert meshes and all(mesh["tp"] == mesh["cp"] == mesh["pp"] == 1 for mesh in meshes)
