"""Expert parallelism's prediction: the weights one rank holds and the all-to-alls of its MoE layers.

Hand derivation for mixtral-8x7b (Mixtral of Experts; models.json: hidden 4096, 32 layers, FFN 14336, 8 experts, top-2,
32 heads and 8 KV heads of 128, vocabulary 32000, untied head):
- one expert (SwiGLU gate, up, down): 3 x 4096 x 14336 = 176,160,768; the experts of a layer 8 x that =
  1,409,286,144; of the model 32 x that = 45,097,156,608;
- the rest of a block: q and o 2 x 4096 x 4096, k and v 2 x 1024 x 4096, two norms 2 x 4096, the router 8 x 4096:
  41,984,000, so 1,343,488,000 for 32 blocks; the root: embedding and head 2 x 32000 x 4096 and the final norm
  4096 = 262,148,096. The model: 46,702,792,704.
- ep 8: one expert per layer on a rank, 32 x 176,160,768 = 5,637,144,576, and the rest whole:
  5,637,144,576 + 1,343,488,000 + 262,148,096 = 7,242,780,672 parameters before data-parallel sharding.
- ZeRO-1 on 8 GPUs (paper engine, bf16-mixed): 16-bit weights and gradients replicated over the data-parallel ranks,
  so 2 x 7,242,780,672 = 14,485,561,344 bytes each; the optimizer state (fp32 master, two moments: 12 bytes) sharded
  over dp_shard / ep = 1 rank for the experts and over 8 for the rest, which is 12 x 46,702,792,704 / 8 =
  70,054,189,056 bytes (plus Adam's 4-byte steps).
- all-to-all per MoE layer and micro-batch of 1 x 2048 tokens: each token sent to 2 experts, 4096 bf16 values each:
  2048 x 2 x 4096 x 2 = 33,554,432 bytes per dispatch and per combine, forward and backward: 4 calls per layer,
  64 forward and 64 backward per step; 7/8 of each (29,360,128 bytes) leaves the rank. Before each dispatch the
  ranks swap their row counts per expert: one all-to-all of 8 int64 = 64 bytes per layer in forward.
"""

import dataclasses

import pytest

from shardscope.core.comm import collective_ledger
from shardscope.core.engines import rules_for
from shardscope.core.expert_parallel import dispatch_bytes, expert_numel
from shardscope.core.network import Placement, collective_cost, network_model
from shardscope.core.params import param_layout, rank_layout
from shardscope.presets import gpu_preset, model_preset
from shardscope.presets.hardware import default_profile
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec

MIXTRAL = model_preset("mixtral-8x7b")
DISPATCH = 33_554_432


def scenario(name: str, ep: int, checkpointing: str = "none", engine: str = "paper") -> Scenario:
    return Scenario(
        model=MIXTRAL,
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=8, gpus_per_node=8),
        training=TrainingSpec(sequence_length=2048, checkpointing=checkpointing),
        strategy=Strategy(name=name, ep=ep, engine=engine),  # type: ignore[arg-type]
    )


def test_mixtral_parameters_per_rank() -> None:
    assert param_layout(MIXTRAL).total_numel == 46_702_792_704
    assert expert_numel(MIXTRAL) == 45_097_156_608
    assert expert_numel(MIXTRAL, ep=8) == 5_637_144_576
    assert rank_layout(scenario("zero1", 8)).total_numel == 7_242_780_672


def test_zero1_holds_its_experts_only_and_shards_the_optimizer_over_the_rest() -> None:
    states = rules_for(scenario("zero1", 8)).rank_memory(scenario("zero1", 8), 0).states
    assert states.parameters_bytes == 14_485_561_344
    assert states.gradients_bytes == 14_485_561_344
    assert states.optimizer_state_bytes == pytest.approx(70_054_189_056, abs=1024)  # 33 steps of 4 bytes, scaled
    without = rules_for(scenario("zero1", 1)).rank_memory(scenario("zero1", 1), 0).states
    assert without.parameters_bytes == 2 * 46_702_792_704


def test_fsdp_shards_are_those_without_ep_and_the_gathered_block_holds_one_expert() -> None:
    with_ep = rules_for(scenario("fsdp", 8)).rank_memory(scenario("fsdp", 8), 0).states
    without = rules_for(scenario("fsdp", 1)).rank_memory(scenario("fsdp", 1), 0).states
    assert with_ep.parameters_bytes == without.parameters_bytes == 2 * 46_702_792_704 // 8
    assert with_ep.optimizer_state_bytes == pytest.approx(without.optimizer_state_bytes, abs=1024)
    # the top block gathered in backward: 41,984,000 + 176,160,768 16-bit values instead of 8 experts'
    block_with_ep, block = 41_984_000 + 176_160_768, 41_984_000 + 1_409_286_144
    assert with_ep.backward_buffers_bytes - without.backward_buffers_bytes == 2 * (block_with_ep - block)


def test_fully_shard_zero2_keeps_its_parameters_sharded_at_rest_under_ep() -> None:
    # torch's zero2 is fully_shard(reshard_after_forward=False): its fp32 parameters are sharded at rest as zero3's
    # are, so with ep the rank holds the same shard bytes as without (46,702,792,704 x 4 / 8), not the experts' part
    held = {}
    for name, ep in (("zero2", 8), ("zero2", 1), ("fsdp", 8)):
        case = scenario(name, ep, engine="pytorch")
        held[name, ep] = rules_for(case).rank_memory(case, 0).states.parameters_bytes
    assert held["zero2", 8] == pytest.approx(held["zero2", 1], abs=1024) == 4 * 46_702_792_704 // 8
    assert held["zero2", 8] == held["fsdp", 8]


def test_all_to_all_rows_per_step() -> None:
    assert dispatch_bytes(scenario("fsdp", 8)) == DISPATCH
    rows = {(r.phase, r.payload_bytes): r for r in collective_ledger(scenario("fsdp", 8)) if r.group == "ep"}
    assert {key: (row.op, row.group_size, row.count) for key, row in rows.items()} == {
        ("forward", DISPATCH): ("all_to_all", 8, 64),
        ("forward", 64): ("all_to_all", 8, 32),
        ("backward", DISPATCH): ("all_to_all", 8, 64),
    }
    # Full checkpointing re-forwards every block, with its counts, dispatch and combine.
    again = {
        (r.phase, r.payload_bytes): r.count for r in collective_ledger(scenario("fsdp", 8, "full")) if r.group == "ep"
    }
    assert again == {("forward", DISPATCH): 64, ("forward", 64): 32, ("backward", DISPATCH): 128, ("backward", 64): 32}
    assert not [r for r in collective_ledger(scenario("fsdp", 1)) if r.op == "all_to_all"]


def test_all_to_all_wire_bytes_are_the_part_that_leaves_the_rank() -> None:
    net = network_model(default_profile(gpu_preset("h100-80gb")))
    cost = collective_cost("all_to_all", DISPATCH, Placement(size=8, per_node=8), net)
    assert cost.wire_bytes == 29_360_128
    assert cost.inter_node_bytes == 0
    link = net.for_op("all_to_all").intra_node
    expected = 7 * link.latency_s + 29_360_128 / link.bandwidth_bytes_per_s + net.for_op("all_to_all").call_latency_s
    assert cost.time_s == pytest.approx(expected)


def test_every_engine_predicts_expert_parallelism() -> None:
    for engine in ("paper", "pytorch", "deepspeed"):
        case = scenario("zero2", 8, engine=engine)
        assert rules_for(case).rank_memory(case, 0).states.parameters_bytes < 46_702_792_704


def test_estimate_takes_ep_and_its_document_is_valid(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import jsonschema

    from shardscope.cli import main
    from shardscope.schemas import load_schema

    argv = ["estimate", "--model", "mixtral-8x7b", "--strategy", "zero1", "--ep", "8", "--engine", "paper", "--json"]
    assert main([*argv, "--time"]) == 0
    document = json.loads(capsys.readouterr().out)
    jsonschema.validate(document, load_schema(document["schema"]))
    strategy = document["strategies"][0]
    assert strategy["parallelism"]["ep"] == 8
    assert strategy["per_rank"]["parameters_bytes"] == 14_485_561_344
    # without --strategy the comparison holds every stage (ddp lends its replicas to ep, the others their shards)
    assert main(["estimate", "--model", "mixtral-8x7b", "--ep", "8", "--json"]) == 0
    compared = [entry["strategy"] for entry in json.loads(capsys.readouterr().out)["strategies"]]
    assert compared == ["ddp", "zero1", "zero2", "zero3"]  # the ep degree is in each entry's parallelism object


def test_offloaded_shards_are_those_without_ep() -> None:
    # the optimizer shards are X / D with or without ep, so the host holds the same (DeepSpeed offloads in its states)
    for engine in ("paper", "deepspeed"):
        with_ep, without = (
            dataclasses.replace(case, strategy=dataclasses.replace(case.strategy, offload="optimizer"))
            for case in (scenario("zero2", 8, engine=engine), scenario("zero2", 1, engine=engine))
        )
        host = rules_for(with_ep).rank_memory(with_ep, 0).states.host_bytes
        assert host == pytest.approx(rules_for(without).rank_memory(without, 0).states.host_bytes, rel=1e-6)
        assert host > 0


def test_paper_fsdp_makes_each_blocks_experts_a_unit_over_the_ranks_holding_them() -> None:
    # The teaching run (runtime/teaching/expert_data_parallel.py) on 8 GPUs, ep 8: the root (262,148,096) and each
    # block's dense weights (41,984,000) over 8 ranks, each block's one expert (176,160,768) over the 8 / 8 = 1 rank
    # holding it: 32,768,512 + 32 x (5,248,000 + 176,160,768) = 5,837,849,088 elements, 12 bytes each of optimizer state
    # and one 4-byte Adam step for each of 1 + 2 x 32 flat buffers (exact, not scaled).
    case = scenario("fsdp", 8)
    states = rules_for(case).rank_memory(case, 0).states
    assert states.parameters_bytes == 2 * 5_837_849_088
    assert states.optimizer_state_bytes == 12 * 5_837_849_088 + 65 * 4
    ledger = collective_ledger(case)
    calls = {(r.phase, r.op, r.group_size, r.payload_bytes): r.count for r in ledger if r.group == "dp"}
    dense, expert = 2 * 41_984_000, 2 * 176_160_768
    assert calls == {
        ("forward", "all_gather", 8, 2 * 262_148_096): 1,
        ("forward", "all_gather", 8, dense): 32,
        ("forward", "all_gather", 1, expert): 32,
        ("backward", "all_gather", 8, dense): 32,
        ("backward", "all_gather", 1, expert): 32,
        ("backward", "reduce_scatter", 8, dense): 32,
        ("backward", "reduce_scatter", 1, expert): 32,
        ("backward", "reduce_scatter", 8, 2 * 262_148_096): 1,
    }
    # the pytorch engine keeps one call per block, its experts inside it
    torch_case = scenario("fsdp", 8, engine="pytorch")
    assert {r.group_size for r in collective_ledger(torch_case) if r.group == "dp"} == {8}


def test_paper_zero2_makes_each_blocks_experts_a_bucket_over_the_ranks_holding_them() -> None:
    # The teaching zero2 on 8 GPUs, ep 2: whole parameters, the root (262,148,096) and each block's dense weights
    # (41,984,000) in flat buffers sharded over 8 ranks, each block's 4 experts (704,643,072) in one sharded over the
    # 8 / 2 = 4 ranks holding them: 262,148,096 + 32 x (41,984,000 + 704,643,072) = 24,154,214,400 parameters, and
    # gradient shards of 32,768,512 + 32 x (5,248,000 + 176,160,768) = 5,837,849,088 (as zero3's parameters above).
    case = scenario("zero2", 2)
    states = rules_for(case).rank_memory(case, 0).states
    assert states.parameters_bytes == 2 * 24_154_214_400
    assert states.gradients_bytes == 2 * 5_837_849_088
    calls = {
        (r.phase, r.op, r.group_size, r.payload_bytes): r.count for r in collective_ledger(case) if r.group == "dp"
    }
    dense, experts, root = 2 * 41_984_000, 2 * 704_643_072, 2 * 262_148_096
    assert calls == {
        ("backward", "reduce_scatter", 8, dense): 32,
        ("backward", "reduce_scatter", 4, experts): 32,
        ("backward", "reduce_scatter", 8, root): 1,
        ("optimizer", "all_gather", 8, dense): 32,
        ("optimizer", "all_gather", 4, experts): 32,
        ("optimizer", "all_gather", 8, root): 1,
    }
