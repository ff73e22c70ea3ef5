"""A hardware profile as the TOML file that presets.hardware.parse_profile reads back unchanged (what
`shardscope calibrate --out` writes)."""

from __future__ import annotations

import json

from shardscope.presets.hardware import FRAMEWORK_FIELDS, PROFILE_SCHEMA, HardwareProfile, InterconnectSpec


def _string(text: str) -> str:
    """A TOML basic string (JSON's escapes are a subset of TOML's)."""
    return json.dumps(text)


def _link_toml(name: str, link: InterconnectSpec) -> str:
    rows = [
        f"[network.{name}]",
        f"id = {_string(link.id)}",
        f"name = {_string(link.name)}",
        f"bandwidth_bytes_per_s = {float(link.bandwidth_bytes_per_s)!r}",
        f"latency_s = {float(link.latency_s)!r}",
        f"source = {_string(link.source)}",
    ]
    return "\n".join(rows) + "\n"


def profile_to_toml(profile: HardwareProfile) -> str:
    """The profile as a TOML file that parse_profile reads back unchanged."""
    lines = [
        f"schema = {_string(PROFILE_SCHEMA)}",
        f"name = {_string(profile.name)}",
        f"source = {_string(profile.source)}",
        "",
        "[compute]",
        f"matmul_flops_per_s = {float(profile.matmul_flops_per_s)!r}",
        f"efficiency = {float(profile.efficiency)!r}",
        f"kernel_overhead_s = {float(profile.kernel_overhead_s)!r}",
        f"backward_op_overhead_s = {float(profile.backward_op_overhead_s)!r}",
        f"optimizer_tensor_overhead_s = {float(profile.optimizer_tensor_overhead_s)!r}",
        f"memory_bandwidth_bytes_per_s = {float(profile.memory_bandwidth_bytes_per_s)!r}",
        "",
        "[framework]",
        *(f"{name} = {float(getattr(profile, name))!r}" for name in FRAMEWORK_FIELDS),
        "",
        "[network]",
        f"algorithm = {_string(profile.algorithm)}",
        f"call_latency_s = {float(profile.call_latency_s)!r}",
        f"overlap = {'true' if profile.overlap else 'false'}",
        "",
    ]
    links = [_link_toml(name, getattr(profile, name)) for name in ("intra_node", "inter_node", "host")]
    families = [
        f"[compute.families.{cost.family}]\nkernel_overhead_s = {float(cost.kernel_overhead_s)!r}\n"
        f"backward_op_overhead_s = {float(cost.backward_op_overhead_s)!r}\n"
        for cost in profile.family_op_costs
    ]
    ops = [
        f"[network.ops.{cost.op}]\ncall_latency_s = {float(cost.call_latency_s)!r}\n"
        f"bandwidth_bytes_per_s = {float(cost.bandwidth_bytes_per_s)!r}\n"
        for cost in profile.op_costs
    ]
    return "\n".join(lines) + "\n" + "\n".join(families + links + ops)
