import pytest

from shardscope.lesson import memory_calculator


def test_lesson_example_70b_on_8_gpus_fsdp() -> None:
    # The lesson's own example: 16-bit weights and gradients, fp32 Adam moments, no master copy:
    # (2 + 2 + 8) bytes x 70e9 / 8 GPUs = 105 GB per GPU.
    result = memory_calculator(70, num_gpus=8, sharding="fsdp")
    assert result["per_gpu_total_gb"] == pytest.approx(105.0)
    assert result["total_across_gpus_gb"] == pytest.approx(840.0)
    assert result["fits_on_80gb"] is False
    assert result["activations_gb"] == 0


def test_master_weights_add_the_fp32_copy() -> None:
    # With the fp32 master copy this is the ZeRO paper's 2 + 2 + 12 bytes per parameter.
    result = memory_calculator(7.5, num_gpus=64, sharding="zero3", master_weights=True)
    assert result["per_gpu_total_gb"] == pytest.approx(16 * 7.5 / 64)


def test_stages_shard_what_they_promise() -> None:
    none = memory_calculator(10, num_gpus=4)
    zero1 = memory_calculator(10, num_gpus=4, sharding="zero1")
    zero2 = memory_calculator(10, num_gpus=4, sharding="zero2")
    assert zero1["optimizer_gb"] == pytest.approx(none["optimizer_gb"] / 4)
    assert zero1["gradients_gb"] == none["gradients_gb"]
    assert zero2["gradients_gb"] == pytest.approx(none["gradients_gb"] / 4)
    assert zero2["weights_gb"] == none["weights_gb"]


def test_activations_only_with_a_shape() -> None:
    with_shape = memory_calculator(7, hidden_dim=4096, num_layers=32, sequence_length=2048)
    assert with_shape["activations_gb"] > 0
    with pytest.raises(ValueError, match="give both"):
        memory_calculator(7, hidden_dim=4096)


def test_unknown_sharding_is_an_error() -> None:
    with pytest.raises(ValueError, match="sharding='zero4' is not known; allowed: none, zero1"):
        memory_calculator(7, sharding="zero4")
