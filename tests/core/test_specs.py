import pytest

from shardscope.choices import checkpoints_block
from shardscope.mesh import MeshError, Parallelism
from shardscope.presets import PresetError, gpu_preset, gpu_preset_names, model_preset
from shardscope.specs import ClusterSpec, ModelSpec, Scenario, SpecError, Strategy, TrainingSpec
from shardscope.units import GIB


def test_errors_name_field_value_and_allowed() -> None:
    with pytest.raises(SpecError, match=r"TrainingSpec.precision='fp8' is not known; allowed: fp32"):
        TrainingSpec(precision="fp8")
    with pytest.raises(SpecError, match=r"ClusterSpec.world_size=0 must be between 1"):
        ClusterSpec(gpu=gpu_preset("a100-80gb"), world_size=0)
    with pytest.raises(SpecError, match=r"world_size=12 must be a multiple of gpus_per_node=8"):
        ClusterSpec(gpu=gpu_preset("a100-80gb"), world_size=12, gpus_per_node=8)
    with pytest.raises(SpecError, match=r"sequence_length=0"):
        TrainingSpec(sequence_length=0)
    with pytest.raises(SpecError, match=r"declared_parameters"):
        ModelSpec(name="x", family="count", declared_parameters=10**30)


def test_hsdp_shard_group_must_divide_world() -> None:
    cluster = ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=16)
    model = model_preset("gpt2")
    with pytest.raises(SpecError, match="dp_replicate 5 x dp_shard 3 = 15, not the 16 GPUs given"):
        Scenario(model=model, cluster=cluster, strategy=Strategy(name="hsdp", shard_group=3))
    scenario = Scenario(model=model, cluster=cluster, strategy=Strategy(name="hsdp", shard_group=8))
    assert (scenario.shard_degree, scenario.replica_degree) == (8, 2)
    assert scenario.parallelism == Parallelism(dp_replicate=2, dp_shard=8)
    with pytest.raises(SpecError, match="only used by hsdp"):
        Strategy(name="zero3", shard_group=8)
    with pytest.raises(SpecError, match="needs sharded parameters"):
        Strategy(name="zero2", offload="optimizer+params")


def test_cluster_nodes() -> None:
    gpu = gpu_preset("h100-80gb")
    assert ClusterSpec(gpu=gpu, world_size=64, gpus_per_node=8).num_nodes == 8
    small = ClusterSpec(gpu=gpu, world_size=4, gpus_per_node=8)
    assert (small.num_nodes, small.ranks_per_node) == (1, 4)


def test_gpu_presets_store_bytes() -> None:
    assert set(gpu_preset_names()) == {
        "v100-32gb",
        "a100-40gb",
        "a100-80gb",
        "h100-80gb",
        "h100-pcie-80gb",
        "h100-nvl-94gb",
        "h200-141gb",
        "b200",
        "mi300x",
        "l40s",
        "rtx4090",
        "h100-80gb-500w",
        "h800-80gb",
        "gb200",
        "l4",
        "rtx-a6000",
        "mi250x-gcd",
        "mi325x",
        "gh200-96gb",
        "gh200-144gb",
    }
    assert gpu_preset("h100-80gb").memory_bytes == 80 * GIB
    assert gpu_preset("rtx4090").memory_bytes == 24 * GIB
    assert all(gpu_preset(name).source for name in gpu_preset_names())
    with pytest.raises(PresetError, match="unknown GPU preset 'h1000'"):
        gpu_preset("h1000")


@pytest.mark.parametrize(
    ("strategy", "group", "mesh"),
    [
        ("ddp", 0, Parallelism(dp_replicate=16)),
        ("zero1", 0, Parallelism(dp_shard=16)),
        ("zero2", 0, Parallelism(dp_shard=16)),
        ("zero3", 0, Parallelism(dp_shard=16)),
        ("fsdp", 0, Parallelism(dp_shard=16)),
        ("hsdp", 4, Parallelism(dp_replicate=4, dp_shard=4)),
    ],
)
def test_strategies_are_presets_over_the_data_parallel_degrees(strategy: str, group: int, mesh: Parallelism) -> None:
    cluster = ClusterSpec(gpu=gpu_preset("h100-80gb"), world_size=16)
    scenario = Scenario(
        model=model_preset("gpt2"), cluster=cluster, strategy=Strategy(name=strategy, shard_group=group)
    )
    assert scenario.parallelism == mesh
    assert mesh.world_size == 16
    assert mesh.to_json() == {
        "dp_replicate": mesh.dp_replicate,
        "dp_shard": mesh.dp_shard,
        "cp": 1,
        "tp": 1,
        "pp": 1,
        "ep": 1,
    }


def test_mesh_errors_name_the_degrees_and_their_values() -> None:
    with pytest.raises(MeshError, match=r"^pp 2 x dp_replicate 1 x dp_shard 2 x tp 4 = 16, not the 8 GPUs given$"):
        Parallelism(pp=2, dp_shard=2, tp=4).require_world_size(8)
    with pytest.raises(MeshError, match=r"tp=0 must be a whole number"):
        Parallelism(tp=0)
    with pytest.raises(MeshError, match=r"ep 3 must divide dp_shard 4 x cp 1 = 4"):
        Parallelism(dp_shard=4, ep=3)
    assert Parallelism(dp_shard=4, cp=2, ep=8).world_size == 8  # ep borrows dp_shard x cp, it adds no GPU


@pytest.mark.parametrize("word", ["every:0", "every:", "every:02", "every:-1", "every:1.5", "every:²", "Every:2"])
def test_bad_checkpointing_is_named(word: str) -> None:
    with pytest.raises(SpecError, match=f"TrainingSpec.checkpointing={word!r}"):
        TrainingSpec(checkpointing=word)


def test_every_n_checkpoints_the_n_th_blocks_as_torchtitan_counts_them() -> None:
    assert TrainingSpec(checkpointing="every:12").checkpointing == "every:12"
    assert [checkpoints_block("every:3", index) for index in range(6)] == [False, False, True, False, False, True]
    assert all(checkpoints_block("every:1", index) == checkpoints_block("full", index) for index in range(4))
    assert not any(checkpoints_block(mode, 0) for mode in ("none", "selective", "op"))
