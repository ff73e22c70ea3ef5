"""Interconnect presets and hardware profile files."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardscope.presets import gpu_preset, gpu_preset_names
from shardscope.presets.hardware import (
    HardwareError,
    default_profile,
    interconnect_preset,
    interconnect_preset_names,
)
from shardscope.presets.profile_toml import load_profile, parse_profile, profile_to_toml


def test_every_interconnect_cites_a_source_and_has_a_speed() -> None:
    for name in interconnect_preset_names():
        link = interconnect_preset(name)
        assert link.source, name
        assert link.bandwidth_bytes_per_s > 0


def test_datasheet_bandwidths_per_direction() -> None:
    # NVIDIA H100 datasheet: NVLink 900 GB/s both directions; ConnectX-7: 400 Gb/s per port.
    assert interconnect_preset("nvlink4").bandwidth_bytes_per_s == 450e9
    assert interconnect_preset("ib-ndr").bandwidth_bytes_per_s == 50e9
    assert interconnect_preset("ib-hdr").bandwidth_bytes_per_s == 25e9
    assert interconnect_preset("pcie5-x16").bandwidth_bytes_per_s == 64e9


def test_every_gpu_preset_has_a_default_profile() -> None:
    for name in gpu_preset_names():
        profile = default_profile(gpu_preset(name))
        assert profile.memory_bandwidth_bytes_per_s > 0, name


def test_h100_nvl_is_its_datasheet_column() -> None:
    # NVIDIA H100 Tensor Core GPU datasheet, H100 NVL: 94 GB, 3.9 TB/s, BF16 1,671 TFLOPS with sparsity (835.5
    # dense), 350-400 W; its NVLink bridge joins two cards only, so a node's GPUs talk over PCIe Gen5.
    gpu = gpu_preset("h100-nvl-94gb")
    assert gpu.memory_bytes == 94 * 2**30
    assert gpu.peak_flops("bf16") == 835.5e12
    profile = default_profile(gpu)
    assert profile.memory_bandwidth_bytes_per_s == 3.9e12
    assert profile.intra_node.id == "pcie5-x16"


def test_profile_round_trips_through_toml(tmp_path: Path) -> None:
    profile = default_profile(gpu_preset("a100-80gb"))
    path = tmp_path / "profile.toml"
    path.write_text(profile_to_toml(profile))
    assert load_profile(path) == profile


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("schema = [", "not valid TOML"),
        ('schema = "other"', "schema"),
        ('schema = "shardscope.hardware/v1"\n[network]\nintra_node = "warp-drive"', "unknown interconnect"),
        (
            'schema = "shardscope.hardware/v1"\n[network.intra_node]\nbandwidth_bytes_per_s = 0\nlatency_s = 0',
            "bandwidth",
        ),
        ('schema = "shardscope.hardware/v1"\n[network.intra_node]\nlatency_s = 0', "missing"),
        ('schema = "shardscope.hardware/v1"\n[compute]\nefficiency = 2\n[network]\nintra_node = "nvlink4"', "effic"),
    ],
)
def test_bad_profiles_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(HardwareError, match=message):
        parse_profile(text)


def test_missing_profile_file(tmp_path: Path) -> None:
    with pytest.raises(HardwareError, match="cannot read"):
        load_profile(tmp_path / "absent.toml")


def test_a_first_version_profile_still_loads_with_no_overheads() -> None:
    text = (
        'schema = "shardscope.hardware/v1"\n[compute]\nkernel_overhead_s = 5e-6\n'
        "[network]\ncall_latency_s = 3e-4\noverlap = false\n"
        "[network.intra_node]\nbandwidth_bytes_per_s = 1e9\nlatency_s = 0.0\n"
    )
    profile = parse_profile(text)
    assert profile.kernel_overhead_s == 5e-6
    assert profile.op_costs == ()
    assert profile.backward_op_overhead_s == profile.fsdp_unit_overhead_s == profile.ddp_step_overhead_s == 0.0


def test_overheads_and_per_op_costs_round_trip(tmp_path: Path) -> None:
    import dataclasses

    from shardscope.presets.hardware import FamilyOpCost, HostOverheads, OpCost

    base = default_profile(gpu_preset("h100-80gb"))
    assert base.fsdp_unit_overhead_s > 0 and base.kernel_overhead_s == 0  # stated GPU defaults
    profile = dataclasses.replace(
        base,
        backward_op_overhead_s=3e-6,
        fsdp_unit_overhead_s=5e-3,
        op_costs=(OpCost(op="reduce_scatter", call_latency_s=5e-4, bandwidth_bytes_per_s=5e8),),
        host_overheads=HostOverheads(
            family_op_costs=(FamilyOpCost(family="llama", kernel_overhead_s=2e-6, backward_op_overhead_s=1e-6),)
        ),
    )
    path = tmp_path / "profile.toml"
    path.write_text(profile_to_toml(profile))
    assert load_profile(path) == profile


def test_a_per_op_cost_for_an_unknown_op_is_refused() -> None:
    text = (
        'schema = "shardscope.hardware/v1"\n[network]\nintra_node = "nvlink4"\n'
        "[network.ops.gossip]\nbandwidth_bytes_per_s = 1e9\n"
    )
    with pytest.raises(HardwareError, match="gossip"):
        parse_profile(text)


def test_a_family_uses_its_own_per_op_costs_and_the_others_the_default() -> None:
    text = (
        'schema = "shardscope.hardware/v1"\n[compute]\nkernel_overhead_s = 5e-6\nbackward_op_overhead_s = 4e-6\n'
        "[compute.families.llama]\nkernel_overhead_s = 2e-6\nbackward_op_overhead_s = 1e-6\n"
        '[network]\nintra_node = "nvlink4"\n'
    )
    profile = parse_profile(text)
    assert profile.op_overheads("llama") == (2e-6, 1e-6)
    assert profile.op_overheads("gpt2") == profile.op_overheads("moe") == (5e-6, 4e-6)
    with pytest.raises(HardwareError, match="mamba is not a model family"):
        parse_profile(text.replace("families.llama", "families.mamba"))
    with pytest.raises(HardwareError, match="must be a number"):
        parse_profile(text.replace("kernel_overhead_s = 2e-6", "kernel_overhead_s = -1.0"))
