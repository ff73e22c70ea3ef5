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
    load_profile,
    parse_profile,
    profile_to_toml,
)


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
