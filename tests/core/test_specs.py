import pytest

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
    with pytest.raises(SpecError, match="shard_group=3 must divide world_size=16"):
        Scenario(model=model, cluster=cluster, strategy=Strategy(name="hsdp", shard_group=3))
    scenario = Scenario(model=model, cluster=cluster, strategy=Strategy(name="hsdp", shard_group=8))
    assert (scenario.shard_degree, scenario.replica_degree) == (8, 2)
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
        "h200-141gb",
        "b200",
        "mi300x",
        "l40s",
        "rtx4090",
    }
    assert gpu_preset("h100-80gb").memory_bytes == 80 * GIB
    assert gpu_preset("rtx4090").memory_bytes == 24 * GIB
    assert all(gpu_preset(name).source for name in gpu_preset_names())
    with pytest.raises(PresetError, match="unknown GPU preset 'h1000'"):
        gpu_preset("h1000")
