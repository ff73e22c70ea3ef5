"""Pipeline parallelism's inputs and schedules: torchtitan's layer split, the mesh, the errors that name their values,
each schedule's micro-batches in flight, and the bubble of the simulated schedule against its formula."""

import pytest

from shardscope.core.pipeline import default_layer_split, pipeline_stages
from shardscope.core.pipeline_schedule import peak_in_flight, rank_actions, simulate_pipeline
from shardscope.mesh import MeshError, data_parallel_mesh
from shardscope.presets import gpu_preset, model_preset
from shardscope.specs import ClusterSpec, Scenario, SpecError, Strategy, TrainingSpec


def scenario(model: str = "llama-3-8b", gpus: int = 16, micro_batches: int = 8, **strategy: object) -> Scenario:
    return Scenario(
        model=model_preset(model),
        cluster=ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=gpus),
        training=TrainingSpec(grad_accum_steps=micro_batches),
        strategy=Strategy(**{"name": "fsdp", **strategy}),  # type: ignore[arg-type]
    )


def test_layers_split_as_torchtitan_splits_them_by_default() -> None:
    # torchtitan/distributed/pipeline_parallel.py, _generate_llm_fqn_per_model_part, at commit
    # b5bcd76c66d0acb1a08b176d9639425bc55e0b2a: the embeddings and the norm with the output head count as one layer
    # each; (L + 2) // S effective layers per stage, the first (L + 2) % S stages one more.
    assert default_layer_split(4, 32) == (8, 9, 8, 7)  # 34 effective: 9, 9, 8, 8
    assert default_layer_split(2, 32) == (16, 16)
    assert default_layer_split(16, 126) == (7,) + (8,) * 14 + (7,)  # llama-3.1-405b on pp 16
    assert default_layer_split(8, 8) == (1, 2, 1, 1, 1, 1, 1, 0)  # the last stage: only the norm and head
    assert default_layer_split(1, 32) == (32,)
    stages = pipeline_stages(scenario(pp=4))
    assert [(s.first_layer, s.layers, s.embedding, s.head) for s in stages] == [
        (0, 8, True, False),
        (8, 9, False, False),
        (17, 8, False, False),
        (25, 7, False, True),
    ]
    assert stages[0].described == "embed+layers 0-7" and stages[3].described == "layers 25-31+head"


def test_interleaved_stages_go_round_the_ranks_and_pp_layers_overrides_the_split() -> None:
    stages = pipeline_stages(scenario(pp=4, pp_schedule="interleaved-1f1b"))
    assert [s.rank for s in stages] == [0, 1, 2, 3, 0, 1, 2, 3]  # torch: stage = local index x pp + rank
    assert [s.layers for s in stages] == [4, 5, 4, 4, 4, 4, 4, 3]
    explicit = pipeline_stages(scenario(pp=2, pp_layers=(20, 12)))
    assert [(s.first_layer, s.layers) for s in explicit] == [(0, 20), (20, 12)]


def test_pp_is_the_outermost_mesh_dimension_and_divides_the_world() -> None:
    mesh = data_parallel_mesh("fsdp", 64, tp=4, pp=4)
    assert mesh.to_json() == {"dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 4, "pp": 4, "ep": 1}
    assert mesh.described == "pp 4 x dp_replicate 1 x dp_shard 4 x tp 4"
    with pytest.raises(MeshError, match="pp 3 x cp 1 x tp 2 = 6 does not divide the 16 GPUs given"):
        data_parallel_mesh("fsdp", 16, tp=2, pp=3)
    piped = scenario(pp=2, tp=2)
    assert (piped.state_ranks, piped.shard_degree, piped.strategy.label) == (4, 4, "fsdp+tp2+pp2(1f1b)")
    assert piped.tokens_per_step == 2048 * 8 * 4  # the micro-batches of dp 4; pp and tp ranks share them
    interleaved = scenario(pp=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=3)
    assert interleaved.strategy.label == "fsdp+pp2(interleaved-1f1b,v3)"


@pytest.mark.parametrize(
    ("strategy", "micro_batches", "message"),
    [
        ({"pp": 2, "pp_virtual_stages": 2}, 8, "pp_virtual_stages=2 needs pp_schedule='interleaved-1f1b', not '1f1b'"),
        ({"pp": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 1}, 8, "at least 2 stages per"),
        ({"pp": 16, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 3}, 16, "= 48 pipeline stages is more"),
        ({"pp": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 32}, 8, "= 64 pipeline stages"),
        ({"pp": 2, "pp_layers": (16, 15)}, 8, "adds up to 31 layers, not llama-3-8b's 32"),
        ({"pp": 2, "pp_layers": (8, 8, 16)}, 8, "has 3 stages (8,8,16), not pp 2 x virtual stages 1 = 2"),
        ({"pp": 4}, 3, "grad_accum_steps=3 < pp=4"),
        ({"pp": 2, "pp_schedule": "interleaved-1f1b"}, 7, "grad_accum_steps=7 must be a multiple of 3"),
    ],
)
def test_bad_pipelines_are_one_error_naming_the_values(
    strategy: dict[str, object], micro_batches: int, message: str
) -> None:
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        scenario(gpus=32, micro_batches=micro_batches, **strategy)


def test_gpipe_takes_any_micro_batches_and_interleaved_those_its_rounds_divide() -> None:
    assert scenario(pp=4, pp_schedule="gpipe", micro_batches=1).strategy.pp == 4
    assert scenario(pp=4, pp_schedule="interleaved-1f1b", micro_batches=10).strategy.virtual_stages == 2  # 2 rounds
    assert scenario(pp=4, pp_schedule="interleaved-1f1b", micro_batches=3).strategy.pipeline_stages == 8


def in_flight(schedule: str, pp: int, virtual: int, micro_batches: int) -> list[int]:
    """The most stage micro-batches each pipeline rank holds at once."""
    counts = []
    for rank in range(pp):
        actions = rank_actions(schedule, pp, virtual, micro_batches, rank)  # type: ignore[arg-type]
        assert len(actions) == 2 * micro_batches * virtual
        counts.append(peak_in_flight(actions, {stage: 1 for stage in range(rank, pp * virtual, pp)})[0])
    return counts


def test_each_schedule_keeps_the_micro_batches_torch_orders_it_to() -> None:
    assert in_flight("gpipe", 4, 1, 8) == [8, 8, 8, 8]  # every forward before any backward
    assert in_flight("1f1b", 4, 1, 8) == [4, 3, 2, 1]  # min(p - s, m)
    assert in_flight("1f1b", 4, 1, 2) == [2, 2, 2, 1]
    # Interleaved: rank r warms up with (V - 1) x round + 2 (p - 1 - r) forwards, then one more before its first
    # backward. Rank 0 with m a multiple of p: 2 (p - 1) + (V - 1) p + 1, as the Megatron-LM paper's interleaved
    # schedule ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Section 2.2.2)
    # warms up; 11 for p 4, V 2.
    assert in_flight("interleaved-1f1b", 4, 2, 8) == [11, 9, 7, 5]
    assert in_flight("interleaved-1f1b", 4, 3, 12)[0] == 2 * 3 + 2 * 4 + 1
    assert in_flight("interleaved-1f1b", 4, 2, 4) == [8, 8, 7, 5]  # capped at m V


def test_interleaved_first_stage_memory_is_korthikantis_factor_of_1f1b() -> None:
    # Each interleaved stage holds 1/V of the rank's layers, so rank 0 holds (2(p-1) + (V-1)p + 1)/V stage
    # micro-batches' worth of its layers: (1 + (p - 1)/(p V)) times 1F1B's p ("Reducing Activation Recomputation in
    # Large Transformer Models", Section 4.2.3).
    p, virtual = 8, 4
    interleaved = in_flight("interleaved-1f1b", p, virtual, 16)[0] / virtual
    assert interleaved == pytest.approx(p * (1 + (p - 1) / (p * virtual)))


@pytest.mark.parametrize(
    ("schedule", "pp", "virtual", "micro_batches"),
    [
        ("gpipe", 4, 1, 8),
        ("gpipe", 8, 1, 3),
        ("1f1b", 4, 1, 8),
        ("1f1b", 8, 1, 32),
        ("interleaved-1f1b", 4, 2, 8),
        ("interleaved-1f1b", 4, 3, 12),
        ("interleaved-1f1b", 8, 2, 16),
    ],
)
def test_the_simulated_bubble_equals_the_formula_for_uniform_stages(
    schedule: str, pp: int, virtual: int, micro_batches: int
) -> None:
    # "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Section 2.2: the bubble is
    # (p - 1)/(m + p - 1) of the step for GPipe and 1F1B, and its time divided by V for interleaved 1F1B.
    forward, backward = 1.0, 2.0
    stages = pp * virtual
    _, makespan = simulate_pipeline(
        schedule,  # type: ignore[arg-type]
        pp,
        virtual,
        micro_batches,
        [forward / virtual] * stages,
        [backward / virtual] * stages,
    )
    ideal = micro_batches * (forward + backward)
    bubble = makespan - ideal
    if virtual == 1:
        assert bubble / makespan == pytest.approx((pp - 1) / (micro_batches + pp - 1))
    assert bubble == pytest.approx((pp - 1) * (forward + backward) / virtual)


def test_messages_delay_the_pipeline_by_their_hops() -> None:
    # 1F1B, p 2, m 2, F 1, B 2, each message 0.5. Stage 1 (F0 B0 F1 B1): F0 at 1.5, B0 2.5-4.5, F1 4.5-5.5 (it
    # arrived at 2.5), B1 5.5-7.5. Stage 0 (F0 F1 B0 B1): B0 arrives at 5, runs to 7; B1 arrives at 8, ends at 10.
    timeline, makespan = simulate_pipeline("1f1b", 2, 1, 2, [1.0, 1.0], [2.0, 2.0], send_s=0.5)
    assert [(start, end) for _, start, end in timeline[1]] == [(1.5, 2.5), (2.5, 4.5), (4.5, 5.5), (5.5, 7.5)]
    first_backward = next(start for action, start, _ in timeline[0] if action.backward)
    assert first_backward == pytest.approx(1.0 + 0.5 + 1.0 + 2.0 + 0.5)
    assert makespan == pytest.approx(10.0)


def test_expert_parallelism_borrows_shard_gpus_of_moe_models_only() -> None:
    moe = scenario("mixtral-8x7b", gpus=16, ep=4)
    assert (moe.parallelism.ep, moe.parallelism.world_size, moe.strategy.label) == (4, 16, "fsdp+ep4")
    with pytest.raises(SpecError, match="'llama-3-8b' is a 'llama' model without experts"):
        scenario(ep=2)
    with pytest.raises(SpecError, match="must divide mixtral-8x7b's num_experts=8"):
        scenario("mixtral-8x7b", gpus=32, ep=16)
    with pytest.raises(MeshError, match="ep 2 must divide hsdp's shard group 1 x cp 1 = 1"):
        scenario("mixtral-8x7b", name="hsdp", shard_group=1, ep=2)
    assert scenario("mixtral-8x7b", name="ddp", ep=2).parallelism.dp_replicate == 16  # ddp lends its replicas


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_the_pipeline_ranks_make_the_whole_models_tensor_parallel_calls_between_them(sequence_parallel: bool) -> None:
    # every layer, the embeddings and the head are on one pipeline rank: the ranks' tp calls add up to the whole
    # model's, the embeddings' on the first rank only and the head's and the loss's on the last only
    from collections import Counter

    from shardscope.core.comm import collective_ledger
    from shardscope.core.pipeline_time import pipeline_rank_ledger

    def tp_calls(rows: object) -> Counter[tuple[str, str, int]]:
        return Counter(
            {(row.phase, row.op, row.payload_bytes): row.count for row in rows if row.group == "tp"}  # type: ignore[attr-defined]
        )

    pipeline = scenario("llama-3-8b", 16, 4, name="ddp", pp=2, tp=2, sequence_parallel=sequence_parallel)
    whole = scenario("llama-3-8b", 8, 4, name="ddp", tp=2, sequence_parallel=sequence_parallel)
    first, last = (tp_calls(pipeline_rank_ledger(pipeline, rank)) for rank in (0, 1))
    assert first + last == tp_calls(collective_ledger(whole))
    loss_values = pipeline.training.tokens_per_micro_batch * 4  # one fp32 value a token, 3 all-reduces a micro-batch
    assert ("forward", "all_reduce", loss_values) not in first and last[("forward", "all_reduce", loss_values)] == 12


def test_a_teaching_pipeline_rank_gathers_its_root_once_a_step_under_zero3() -> None:
    # the micro-batches in flight on a pipeline rank share its root unit (runtime/teaching/pipeline_data.py)
    from shardscope.core.pipeline_time import pipeline_rank_ledger

    pipeline = scenario("llama-3-8b", 16, 4, name="zero3", engine="paper", pp=2)
    gathers = [row for row in pipeline_rank_ledger(pipeline, 0) if row.op == "all_gather" and row.phase == "forward"]
    assert sorted(row.count for row in gathers) == [1, 16 * 4]  # the embeddings once; 16 blocks every micro-batch
