"""Tensor and context parallelism's calls in the ledger, where their groups sit, and their place in the step's time.

Expected bytes are worked by hand from llama-3-8b's shape (hidden 4096, 32 blocks, 8 KV heads of 128) at micro-batch 1
in bf16: one block's activation b x s x h x 2 bytes; the per-block calls are those of "Reducing Activation
Recomputation in Large Transformer Models" (Korthikanti et al.), Section 4.2.2 and its Figure 5 (g and f, and their
sequence-parallel forms), and ring attention's exchange as zhuzilin/ring-flash-attention sends it.
"""

import dataclasses

import pytest

from shardscope.core.comm import collective_ledger, comm_events, setup_ledger
from shardscope.core.compute import compute_model
from shardscope.core.kernels import stage_seconds
from shardscope.core.network import event_cost, network_model, placement
from shardscope.core.params import param_layout, rank_layout
from shardscope.core.result import CollectiveRow, merge_ledger
from shardscope.core.timeline import estimate_time
from shardscope.presets import gpu_preset, model_preset
from shardscope.presets.hardware import default_profile
from shardscope.specs import ClusterSpec, Scenario, Strategy, TrainingSpec

MIB = 1024 * 1024
BLOCKS = 32


def scenario(gpus: int, sequence: int = 2048, checkpointing: str = "none", **strategy: object) -> Scenario:
    return Scenario(
        model=model_preset("llama-3-8b"),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=gpus, gpus_per_node=8),
        training=TrainingSpec(sequence_length=sequence, checkpointing=checkpointing),
        strategy=Strategy(**{"name": "fsdp", **strategy}),  # type: ignore[arg-type]
    )


def rows(case: Scenario, group: str) -> dict[tuple[str, str, int], int]:
    """(phase, op, payload bytes) -> calls of the ledger's rows on `group`."""
    return {(row.phase, row.op, row.payload_bytes): row.count for row in collective_ledger(case) if row.group == group}


def test_sequence_parallel_gathers_and_scatters_each_block_both_ways() -> None:
    # b x s x h x 2 bytes = 1 x 2048 x 4096 x 2 = 16 MiB, the gathered buffer of every all-gather and reduce-scatter
    activation = 2048 * 4096 * 2
    assert activation == 16 * MIB
    tp = rows(scenario(8, tp=8), "tp")
    # forward: per block 2 all-gathers and 2 reduce-scatters; the embedding's output reduce-scattered to the sequence
    # shards, the head's input all-gathered
    assert tp[("forward", "all_gather", activation)] == 2 * BLOCKS + 1
    assert tp[("forward", "reduce_scatter", activation)] == 2 * BLOCKS + 1
    # backward: the conjugates (a reduce-scatter for each all-gather and the reverse)
    assert tp[("backward", "reduce_scatter", activation)] == 2 * BLOCKS + 1
    assert tp[("backward", "all_gather", activation)] == 2 * BLOCKS + 1
    # loss parallel: the max, the sum of exponentials and the target logit, 2048 fp32 values each
    assert tp[("forward", "all_reduce", 2048 * 4)] == 3
    # the two norm weights of every block and the final norm (4096 each), replicated over tp, reduced in bf16
    assert tp[("backward", "all_reduce", 4096 * 2)] == 2 * BLOCKS + 1
    assert len(tp) == 6
    assert all(row.group_size == 8 for row in collective_ledger(scenario(8, tp=8)) if row.group == "tp")


def test_without_sequence_parallelism_each_block_all_reduces_twice_each_way() -> None:
    activation = 16 * MIB
    tp = rows(scenario(8, tp=8, sequence_parallel=False), "tp")
    # g after o_proj and down_proj (and the vocabulary-parallel embedding's output); f before q/k/v and gate/up (and
    # the column-parallel head's input)
    assert tp == {
        ("forward", "all_reduce", activation): 2 * BLOCKS + 1,
        ("forward", "all_reduce", 2048 * 4): 3,
        ("backward", "all_reduce", activation): 2 * BLOCKS + 1,
    }


def test_the_re_forward_repeats_what_it_recomputes() -> None:
    # the re-forward runs during backward, so its calls are in the backward phase, as a run records them
    activation = 16 * MIB
    plain = rows(scenario(8, tp=8), "tp")
    full = rows(scenario(8, tp=8, checkpointing="full"), "tp")
    # the whole block again but its MLP's leaving reduce-scatter: the re-forward stops at the last saved tensor
    # (torch.utils.checkpoint's early stop; traced on torch's DTensor plan and measured on the teaching grid)
    for op, again in (("all_gather", 2), ("reduce_scatter", 1)):
        assert full[("forward", op, activation)] == plain[("forward", op, activation)]
        assert full[("backward", op, activation)] == plain[("backward", op, activation)] + again * BLOCKS
    # torchtitan's op policy saves the reduce-scatters' outputs: only the all-gathers run again
    op = rows(scenario(8, tp=8, checkpointing="op"), "tp")
    assert op[("backward", "all_gather", activation)] == plain[("backward", "all_gather", activation)] + 2 * BLOCKS
    assert op[("backward", "reduce_scatter", activation)] == plain[("backward", "reduce_scatter", activation)]
    # selective recomputes the attention core only, which holds no tp call
    assert rows(scenario(8, tp=8, checkpointing="selective"), "tp") == plain


def test_ring_attention_sends_k_and_v_round_the_ring() -> None:
    # cp 2 of a 4096-token sequence: 2048 tokens per rank; K and V of 8 heads of 128 in bf16:
    # 2 x 2048 x 8 x 128 x 2 = 8 MiB per step, one step (cp - 1) per block in forward
    kv = 2 * 2048 * 8 * 128 * 2
    assert kv == 8 * MIB
    cp = rows(scenario(2, sequence=4096, cp=2), "cp")
    assert cp == {
        ("forward", "send", kv): BLOCKS,
        ("forward", "recv", kv): BLOCKS,
    } | {("backward", op, kv): 3 * BLOCKS for op in ("send", "recv")}  # K/V once, dK/dV twice (cp times)
    # cp 4: 1024 tokens per rank, 4 MiB a step; 3 steps per block in forward, 3 of K/V and 4 of dK/dV in backward
    four = rows(scenario(4, sequence=4096, cp=4), "cp")
    assert (four[("forward", "send", 4 * MIB)], four[("backward", "send", 4 * MIB)]) == (3 * BLOCKS, 7 * BLOCKS)
    # with tp 8 each rank holds one KV head: 1 MiB per step
    assert ("forward", "send", MIB) in rows(scenario(16, sequence=4096, tp=8, cp=2), "cp")
    # the re-forward of full and selective checkpointing runs the attention core, and so the exchange, again
    selective = rows(scenario(2, sequence=4096, cp=2, checkpointing="selective"), "cp")
    assert selective[("backward", "send", kv)] == cp[("backward", "send", kv)] + BLOCKS


def test_tp_and_cp_1_has_only_data_parallel_rows() -> None:
    assert {row.group for row in collective_ledger(scenario(8))} == {"dp"}


def test_a_tp_and_a_dp_call_of_the_same_shape_are_different_rows() -> None:
    common = {"phase": "backward", "op": "all_reduce", "group_size": 8, "payload_bytes": MIB, "count": 1}
    merged = merge_ledger([CollectiveRow(**common, group="dp"), CollectiveRow(**common, group="tp")])  # type: ignore[arg-type]
    assert [row.group for row in merged] == ["dp", "tp"]
    assert merge_ledger([CollectiveRow(**common), CollectiveRow(**common)])[0].count == 2  # type: ignore[arg-type]


def test_groups_sit_on_the_mesh_tp_innermost() -> None:
    case = scenario(32, tp=4, cp=2)  # 32 GPUs, 8 per node: dp_shard 4 x cp 2 x tp 4
    events = comm_events(case)
    tp = next(event for event in events if event.group == "tp")
    cp = next(event for event in events if event.group == "cp")
    dp = next(event for event in events if event.group == "world")
    assert (placement(tp, case).per_node, placement(tp, case).nodes) == (4, 1)  # consecutive ranks
    assert (placement(cp, case).per_node, placement(cp, case).nodes) == (2, 1)  # strided by tp 4
    # FSDP's group: dp_shard x cp = 8 ranks strided by tp 4, 2 on each node: 4 nodes
    assert (placement(dp, case).size, placement(dp, case).per_node, placement(dp, case).nodes) == (8, 2, 4)
    hsdp = scenario(32, name="hsdp", shard_group=2, tp=4)  # replicas strided by shard group 2 x tp 4 = 8: 1 a node
    replica = next(event for event in comm_events(hsdp) if event.group == "replica")
    assert (placement(replica, hsdp).size, placement(replica, hsdp).per_node) == (4, 1)


def test_tp_traffic_uses_the_intra_node_link() -> None:
    case = scenario(16, tp=8)
    net = network_model(default_profile(case.cluster.gpu))
    slow_network = dataclasses.replace(
        net,
        inter_node=dataclasses.replace(
            net.inter_node, bandwidth_bytes_per_s=net.inter_node.bandwidth_bytes_per_s / 1000
        ),
    )
    events = comm_events(case)
    tp = next(event for event in events if event.group == "tp" and event.row.payload_bytes == 16 * MIB)
    dp = next(event for event in events if event.group == "world")
    assert event_cost(tp, case, slow_network) == event_cost(tp, case, net)
    assert event_cost(tp, case, net).inter_node_bytes == 0
    # 7/8 of the 16 MiB at NVLink's bandwidth, plus latency
    assert event_cost(tp, case, net).time_s > 7 / 8 * 16 * MIB / net.intra_node.bandwidth_bytes_per_s
    # the data-parallel pair, strided by tp 8, spans the two nodes
    assert event_cost(dp, case, slow_network).time_s > event_cost(dp, case, net).time_s


def test_tp_calls_are_on_the_critical_path() -> None:
    estimate = estimate_time(scenario(8, tp=8))
    spans = estimate.spans
    tp_spans = [span for span in spans if span.stream == "model_parallel"]
    assert tp_spans
    # nothing hides them: the compute stream waits while each runs
    assert estimate.exposed_comm_s >= sum(span.duration_s for span in tp_spans) * (1 - 1e-9)
    block = next(span for span in spans if span.name == "forward block 3")
    gathers = [span for span in tp_spans if span.name.endswith("tp forward block 3") and span.category == "all_gather"]
    assert gathers and all(span.end_s <= block.start_s + 1e-12 for span in gathers)


def test_the_ring_exchange_hides_behind_the_attention() -> None:
    case = scenario(2, sequence=8192, cp=2)
    estimate = estimate_time(case)
    spans = estimate.spans
    block = next(span for span in spans if span.name == "forward block 3")
    previous = next(span for span in spans if span.name == "forward block 2")
    sends = [span for span in spans if span.name == "send cp forward K/V block 3" and span.category == "send"]
    assert len(sends) == 1
    # inside one node the 32 MiB step is shorter than the attention it overlaps: the block starts right after the
    # previous one, before its exchange is done
    assert block.start_s == previous.end_s
    assert block.start_s < sends[0].end_s


def test_an_exchange_longer_than_the_attention_delays_the_block_by_the_rest() -> None:
    # cp 2 across two nodes of one GPU each: the 1 MiB K/V step of a 512-token sequence crosses the inter-node
    # link, slower than the attention of the short sequence
    case = dataclasses.replace(
        scenario(2, sequence=512, cp=2, name="ddp"),  # no per-block gathers to wait for
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=2, gpus_per_node=1),
    )
    spans = estimate_time(case).spans
    block = next(span for span in spans if span.name == "forward block 3")
    previous = next(span for span in spans if span.name == "forward block 2")
    send = next(span for span in spans if span.name == "send cp forward K/V block 3" and span.category == "send")
    selective = dataclasses.replace(case, training=dataclasses.replace(case.training, checkpointing="selective"))
    compute = compute_model(case, default_profile(case.cluster.gpu))
    attention = stage_seconds(selective, compute)[1][1]  # the re-forward of 'selective' is the attention core
    assert send.duration_s > attention / 2  # more than the one chunk's attention it overlaps
    assert block.start_s > previous.end_s
    assert block.start_s == pytest.approx(send.end_s - attention / 2, rel=1e-12)


def test_sequence_parallelism_reduces_every_replicated_weight_of_gpt2() -> None:
    # tiny-gpt2 (hidden 64, 2 blocks, 64 positions) in bf16 under FSDP2: per block ln_1 and ln_2 weight and bias and
    # the two row-parallel biases (attn.c_proj, mlp.c_proj), 6 tensors of 64; the root's learned positions (64 x 64)
    # and final norm weight and bias, as the teaching TensorParallelLM.sum_replicated_gradients reduces them
    case = dataclasses.replace(
        scenario(2, tp=2), model=model_preset("tiny-gpt2"), training=TrainingSpec(sequence_length=64)
    )
    reduced = rows(case, "tp")
    assert reduced[("backward", "all_reduce", 64 * 2)] == 6 * 2 + 2
    assert reduced[("backward", "all_reduce", 64 * 64 * 2)] == 1


def test_the_paper_engine_follows_the_teaching_grid_under_tp() -> None:
    # ModelParallelTeaching (runtime/teaching/model_parallel.py): rank 0's whole model broadcast to the 4 ranks tensor
    # by tensor, then every micro-batch one all-reduce of each tensor's tp slice over the dp ranks holding it
    model = model_preset("tiny-llama")
    case = Scenario(
        model=model,
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=4, gpus_per_node=4),
        training=TrainingSpec(sequence_length=32, grad_accum_steps=2, precision="fp32"),
        strategy=Strategy(name="ddp", engine="paper", tp=2),
    )
    dp = [row for row in collective_ledger(case) if row.group == "dp"]
    sliced = rank_layout(case)
    assert {(row.op, row.group_size) for row in dp} == {("all_reduce", 2)}
    assert sum(row.count for row in dp) == 2 * sliced.tensor_count
    assert sum(row.total_payload_bytes for row in dp) == 2 * sliced.total_numel * 4
    setup = setup_ledger(case)
    assert {(row.op, row.group_size) for row in setup} == {("broadcast", 4)}
    assert sum(row.total_payload_bytes for row in setup) == param_layout(model).total_numel * 4


def test_one_rank_per_tp_slice_sends_no_data_parallel_calls() -> None:
    # 8 GPUs, tp 8: dp_shard x cp = 1, so FSDP's groups are single ranks; only the tp calls remain
    case = scenario(8, tp=8)
    assert {row.group for row in collective_ledger(case)} == {"tp"}
    assert all(row.group_size > 1 for row in setup_ledger(case))


def test_megatron_sequence_parallelism_gathers_each_entrys_input_again_in_backward() -> None:
    # The paper engine runs Megatron-LM's column-parallel linears (the teaching TensorParallelLM): they keep their
    # rank's tokens and all-gather them again in backward, once per entry (q/k/v and the MLP's first linears of
    # every block, and the head), where torch's DTensor keeps the gathered input.
    activation = 16 * MIB
    torch_tp = rows(scenario(8, tp=8), "tp")
    paper_tp = rows(scenario(8, tp=8, engine="paper"), "tp")
    gathers = ("backward", "all_gather", activation)
    assert paper_tp[gathers] == torch_tp[gathers] + 2 * BLOCKS + 1 == 4 * BLOCKS + 2
    assert {key: count for key, count in paper_tp.items() if key != gathers} == {
        key: count for key, count in torch_tp.items() if key != gathers
    }
    # without sequence parallelism nothing is gathered
    assert rows(scenario(8, tp=8, engine="paper", sequence_parallel=False), "tp") == rows(
        scenario(8, tp=8, sequence_parallel=False), "tp"
    )
