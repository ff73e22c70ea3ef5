"""Tensor and context parallel degrees as inputs: the mesh they make, the errors that name their values, and the
tensor-parallel slice of the parameters one rank holds."""

import pytest

from shardscope.cli import main
from shardscope.core.params import param_layout, rank_facts
from shardscope.mesh import MeshError, data_parallel_mesh
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, SpecError, Strategy, TrainingSpec


def scenario(model: str, gpus: int, sequence: int = 2048, per_node: int = 8, **strategy: object) -> Scenario:
    cluster = ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=gpus, gpus_per_node=per_node)
    return Scenario(
        model=model_preset(model),
        cluster=cluster,
        training=TrainingSpec(sequence_length=sequence),
        strategy=Strategy(**strategy),  # type: ignore[arg-type]
    )


def test_the_world_is_divided_by_tp_and_cp_before_the_strategy_splits_it() -> None:
    mesh = data_parallel_mesh("fsdp", 32, tp=4, cp=2)
    assert (mesh.dp_replicate, mesh.dp_shard, mesh.cp, mesh.tp) == (1, 4, 2, 4)
    assert data_parallel_mesh("hsdp", 32, 2, tp=4).to_json() == {
        "dp_replicate": 4,
        "dp_shard": 2,
        "cp": 1,
        "tp": 4,
        "pp": 1,
        "ep": 1,
    }
    with pytest.raises(MeshError, match="cp 1 x tp 3 = 3 does not divide the 8 GPUs"):
        data_parallel_mesh("ddp", 8, tp=3)


def test_fsdp_shards_over_dp_shard_and_cp_as_torchtitan_does() -> None:
    fsdp = scenario("llama-3-8b", 32, name="fsdp", tp=4, cp=2)
    assert (fsdp.state_ranks, fsdp.shard_degree, fsdp.replica_degree) == (8, 8, 1)
    ddp = scenario("llama-3-8b", 32, name="ddp", tp=4, cp=2)
    assert (ddp.state_ranks, ddp.shard_degree, ddp.replica_degree) == (8, 8, 1)
    assert ddp.parallelism.dp_replicate == 4
    hsdp = scenario("llama-3-8b", 32, name="hsdp", shard_group=2, tp=4)
    assert (hsdp.shard_degree, hsdp.replica_degree) == (2, 4)
    # 4 data-parallel ranks of one 2048-token sequence each: tp and cp ranks share sequences
    assert fsdp.tokens_per_step == 4 * 2048


def test_sequence_parallel_defaults_to_on_with_tp_and_needs_tp() -> None:
    assert Strategy(name="fsdp", tp=2).uses_sequence_parallel
    assert not Strategy(name="fsdp", tp=2, sequence_parallel=False).uses_sequence_parallel
    assert not Strategy(name="fsdp").uses_sequence_parallel
    with pytest.raises(SpecError, match="sequence_parallel=True needs tensor parallelism"):
        Strategy(name="fsdp", sequence_parallel=True)
    assert Strategy(name="fsdp", tp=2, sequence_parallel=False).label == "fsdp+tp2(no-sp)"
    assert Strategy(name="hsdp", shard_group=4, tp=8, cp=2).label == "hsdp(4)+tp8+cp2"


@pytest.mark.parametrize(
    ("model", "gpus", "sequence", "degrees", "message"),
    [
        ("gpt2", 4, 1024, {"tp": 4}, "tp=4 must divide gpt2's vocab_size=50257"),
        ("llama-3-8b", 16, 2048, {"tp": 16}, "tp=16 must divide llama-3-8b's num_kv_heads=8"),
        ("llama-3-8b", 6, 2048, {"tp": 3}, "tp=3 must divide llama-3-8b's num_heads=32"),
        ("llama-3-8b", 8, 2050, {"cp": 4}, "cp=4 must split sequence_length=2050 into 2 x cp = 8 equal chunks"),
        ("llama-3-8b", 8, 2052, {"tp": 8}, "must be a multiple of cp x tp = 8"),
    ],
)
def test_bad_degrees_are_named_with_their_values(
    model: str, gpus: int, sequence: int, degrees: dict[str, int], message: str
) -> None:
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        scenario(model, gpus, sequence, name="fsdp", **degrees)


def test_tp_across_nodes_is_allowed_with_a_warning() -> None:
    wide = scenario("llama-3-8b", 16, per_node=4, name="fsdp", tp=8)
    assert "tp 8 is more than the 4 GPUs of a node" in wide.warnings[0]
    assert not scenario("llama-3-8b", 16, name="fsdp", tp=8).warnings


def test_a_tensor_parallel_rank_holds_its_slice_of_every_weight() -> None:
    # Llama 3 8B (hidden 4096, 32 heads, 8 KV heads of 128, FFN 14336, vocabulary 128256, untied) under tp 4:
    # q/k/v/gate/up split their rows, o/down their columns, the embedding and head their vocabulary rows; norms whole.
    hidden, heads, kv, head_dim, ffn, vocab, layers = 4096, 32, 8, 128, 14336, 128256, 32
    tp = 4
    block = (
        2 * hidden  # the two RMSNorm weights
        + hidden * heads * head_dim // tp  # q
        + 2 * hidden * kv * head_dim // tp  # k, v
        + heads * head_dim // tp * hidden  # o
        + 3 * hidden * ffn // tp  # gate, up, down
    )
    root = 2 * vocab // tp * hidden + hidden
    total, layout = rank_facts(scenario("llama-3-8b", 8, name="fsdp", tp=tp))
    assert layout is not None and total == root + layers * block
    shapes = {t.name: t.shape for t in layout.block}
    assert shapes["attn.k_proj.weight"] == (kv * head_dim // tp, hidden)
    assert shapes["attn.o_proj.weight"] == (hidden, heads * head_dim // tp)
    assert shapes["mlp.down_proj.weight"] == (hidden, ffn // tp)
    assert param_layout(model_preset("llama-3-8b"), 1).total_numel == 8_030_261_248  # the published 8.03B


def test_gpt2_fused_qkv_splits_by_heads_and_row_parallel_biases_stay_whole() -> None:
    from shardscope.specs import ModelSpec

    model = ModelSpec(
        name="gpt2-even-vocab",
        family="gpt2",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        ffn_hidden_size=256,
        vocab_size=128,
        max_positions=32,
    )
    shapes = {t.name: t.shape for t in param_layout(model, 2).block}
    assert shapes["attn.c_attn.weight"] == (96, 64) and shapes["attn.c_attn.bias"] == (96,)
    assert shapes["attn.c_proj.weight"] == (64, 32) and shapes["attn.c_proj.bias"] == (64,)
    assert shapes["mlp.c_fc.weight"] == (128, 64) and shapes["mlp.c_proj.bias"] == (64,)


def test_the_cli_takes_the_degrees_and_refuses_bad_ones_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["estimate", "--model", "llama-3-8b", "--gpus", "16", "--strategy", "fsdp"]
    assert main([*base, "--tp", "4", "--cp", "2"]) == 0
    assert "fsdp+tp4+cp2" in capsys.readouterr().out
    assert main([*base, "--tp", "16"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "num_kv_heads=8" in error
    assert main([*base, "--sequence-parallel"]) == 2
    assert "needs tensor parallelism" in capsys.readouterr().err


def test_the_terminal_and_the_json_show_the_mesh(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    base = ["estimate", "--model", "llama-3-8b", "--gpus", "16", "--strategy", "fsdp", "--tp", "4", "--cp", "2"]
    assert main(base) == 0
    assert "dp_replicate 1 x dp_shard 2 x cp 2 x tp 4" in capsys.readouterr().out
    assert main([*base, "--no-sequence-parallel", "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["strategies"]
    assert entry["parallelism"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 4, "pp": 1, "ep": 1}
    assert entry["sequence_parallel"] is False and entry["shard_group"] == 4  # FSDP over dp_shard x cp
