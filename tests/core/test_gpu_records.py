"""Every GPU preset is one complete record of gpus.json: memory, peak FLOP/s, memory bandwidth, default links and
power, each positive and each with its datasheet; a record with a field missing is refused, never read as 0."""

from __future__ import annotations

from typing import Any

import pytest

from shardscope.presets import (
    GPU_RECORD_KEYS,
    LINK_ROLES,
    OPTIONAL_GPU_RECORD_KEYS,
    PresetError,
    gpu_kernels_file,
    gpu_preset,
    gpu_preset_names,
    gpu_record,
    gpus_file,
    parse_gpu_record,
)
from shardscope.presets.hardware import default_profile, interconnect_preset, interconnect_preset_names


@pytest.mark.parametrize("name", gpu_preset_names())
def test_every_gpu_record_is_complete(name: str) -> None:
    entry = gpus_file()["gpus"][name]
    assert set(GPU_RECORD_KEYS) <= set(entry) <= set(GPU_RECORD_KEYS + OPTIONAL_GPU_RECORD_KEYS)
    record = gpu_record(name)
    assert record.gpu == gpu_preset(name) and record.gpu.memory_bytes > 0
    flops = dict(record.gpu.peak_flops_per_s)
    # a dtype no found source states is left out (h800-80gb has no fp32), never filled in
    assert max(flops.get("bf16", 0), flops.get("fp16", 0)) > flops.get("fp32", 0) >= 0
    assert record.memory_bandwidth_bytes_per_s > 0 and record.tdp_watts > 0
    for source in (record.gpu.source, record.memory_bandwidth_source, record.tdp_source):
        # a vendor document by title, or the address of the page that states the figure
        assert "datasheet" in source or "whitepaper" in source or "https://" in source
    for role in LINK_ROLES:
        assert interconnect_preset(getattr(record, role)).bandwidth_bytes_per_s > 0
    profile = default_profile(record.gpu)
    assert profile.memory_bandwidth_bytes_per_s == record.memory_bandwidth_bytes_per_s
    assert profile.intra_node.id == record.intra_node and profile.inter_node.id == record.inter_node


def test_kernel_ceilings_are_sourced_and_name_real_gpus() -> None:
    data = gpu_kernels_file()
    for name, entry in data["architectures"].items():
        for key in ("gemm_tile", "matmul_fraction", "memory_fraction", "attention", "host_memory"):
            source = entry[f"{key}_source"]
            assert isinstance(source, str) and len(source) > 20, f"{name}.{key}_source"
        assert 0 < entry["matmul_fraction"] <= 1 and 0 < entry["memory_fraction"] <= 1
        fractions = [value for rows in entry["attention"].values() for pair in rows.values() for value in pair]
        assert fractions and all(0 < value <= 1 for value in fractions)
        assert entry["host_memory_bandwidth_bytes_per_s"] > 0
    assert set(data["sm_count"]) <= set(gpu_preset_names()) and data["sm_count_source"]
    for name in data["sm_count"]:
        assert gpu_record(name).architecture in data["architectures"]


def test_the_500w_h100_changes_only_its_power() -> None:
    """No source gives the H100's throughput at a 500 W cap, so only the power differs from h100-80gb, and the
    record's notes say so."""
    full, capped = gpu_record("h100-80gb"), gpu_record("h100-80gb-500w")
    assert capped.tdp_watts == 500 and full.tdp_watts == 700
    assert capped.gpu.peak_flops_per_s == full.gpu.peak_flops_per_s
    assert capped.gpu.memory_bytes == full.gpu.memory_bytes
    assert capped.memory_bandwidth_bytes_per_s == full.memory_bandwidth_bytes_per_s
    assert "does not" in capped.notes and not full.notes


def test_custom_gpu_links_are_links() -> None:
    links = gpus_file()["custom_gpu_links"]
    assert all(links[role] in interconnect_preset_names() for role in LINK_ROLES)


def _entry(**changes: Any) -> dict[str, Any]:
    entry = {**gpus_file()["gpus"]["h100-80gb"], **changes}
    return {key: value for key, value in entry.items() if value is not None}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"memory_bandwidth_bytes_per_s": None}, "'new-gpu' lacks memory_bandwidth_bytes_per_s; a record holds: name,"),
        ({"tdp_source": None}, "lacks tdp_source"),
        ({"hbm_bandwidth": 1e12}, "has unknown field hbm_bandwidth"),
        ({"memory_bandwidth_bytes_per_s": 0}, "memory_bandwidth_bytes_per_s=0 must be a positive number"),
        ({"tdp_watts": True}, "tdp_watts=True must be a positive number"),
        ({"peak_flops_per_s": {"bf16": -1.0}}, "peak_flops_per_s=.* must give a positive figure"),
        ({"tdp_source": " "}, "tdp_source=' ' must name the datasheet"),
        ({"links": {**_entry()["links"], "intra_node": "nvlink9"}}, "links.intra_node='nvlink9' is not a link"),
        ({"links": {"intra_node": "nvlink4"}}, "must name exactly intra_node, inter_node, host"),
    ],
)
def test_an_incomplete_record_is_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(PresetError, match=message):
        parse_gpu_record("new-gpu", _entry(**changes), interconnect_preset_names())
