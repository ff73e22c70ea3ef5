"""Interconnect presets and hardware profiles: the links and speeds the time model runs on.

A hardware profile is a TOML file (`--hardware profile.toml`), written by `shardscope calibrate` or by hand:

    schema = "shardscope.hardware/v1"
    name = "my cluster"
    source = "where the numbers come from"
    [compute]
    matmul_flops_per_s = 0.0        # 0: the GPU preset's datasheet peak for the step's dtype
    efficiency = 0.5                # fraction of that peak a training step reaches
    kernel_overhead_s = 0.0         # launch/dispatch cost per kernel
    memory_bandwidth_bytes_per_s = 0.0
    [network]
    algorithm = "ring"              # ring, tree, hierarchical or auto
    call_latency_s = 8.4e-6
    overlap = true                  # communication runs concurrently with compute
    intra_node = "nvlink4"          # a preset id, or a table {name, bandwidth_bytes_per_s, latency_s}
    inter_node = "ib-ndr"
    host = "pcie5-x16"
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from shardscope.specs import GpuSpec, SpecError

PROFILE_SCHEMA = "shardscope.hardware/v1"
DEFAULT_EFFICIENCY = 0.5  # see core.compute: Megatron-LM's reported fraction of peak


class HardwareError(SpecError):
    """An unknown interconnect, an impossible speed, or a profile file that cannot be read."""


@dataclass(frozen=True, slots=True, kw_only=True)
class InterconnectSpec:
    """One link: its bandwidth per direction per GPU and its per-step latency, with where they come from."""

    id: str
    """Preset id, e.g. 'nvlink4', or 'custom'/'measured'."""
    name: str
    """Readable name."""
    bandwidth_bytes_per_s: float
    """Bytes per second in one direction, per GPU."""
    latency_s: float
    """Latency of one algorithm step."""
    source: str = ""
    """The datasheet or measurement the numbers come from."""

    def __post_init__(self) -> None:
        if not (
            isinstance(self.bandwidth_bytes_per_s, int | float)
            and self.bandwidth_bytes_per_s > 0
            and math.isfinite(self.bandwidth_bytes_per_s)
        ):
            raise HardwareError(
                f"interconnect {self.id!r}: bandwidth_bytes_per_s={self.bandwidth_bytes_per_s!r} "
                f"must be a positive number"
            )
        if not (isinstance(self.latency_s, int | float) and self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise HardwareError(f"interconnect {self.id!r}: latency_s={self.latency_s!r} must be zero or more")


@dataclass(frozen=True, slots=True, kw_only=True)
class HardwareProfile:
    """Everything the time model needs beyond the GPU preset: links, algorithm, compute speed assumptions."""

    name: str
    """What this profile describes."""
    intra_node: InterconnectSpec
    """GPU to GPU inside a node."""
    inter_node: InterconnectSpec
    """Per GPU across nodes."""
    host: InterconnectSpec
    """GPU to host, for offload copies."""
    call_latency_s: float
    """Fixed cost of one collective call."""
    algorithm: str = "ring"
    """Collective algorithm: 'ring', 'tree', 'hierarchical' or 'auto'."""
    overlap: bool = True
    """Communication runs on its own stream, concurrently with compute (GPUs); False serialises (CPU gloo)."""
    matmul_flops_per_s: float = 0.0
    """Measured matmul throughput; 0 means the GPU preset's datasheet peak."""
    efficiency: float = DEFAULT_EFFICIENCY
    """Fraction of the peak a training step's matmuls reach."""
    kernel_overhead_s: float = 0.0
    """Launch and dispatch cost of one kernel."""
    memory_bandwidth_bytes_per_s: float = 0.0
    """Device memory bandwidth (optimizer step); 0 means the GPU preset's datasheet figure, if known."""
    source: str = ""
    """Where the profile's numbers come from."""

    def __post_init__(self) -> None:
        if self.algorithm not in ("ring", "tree", "hierarchical", "auto"):
            raise HardwareError(
                f"profile {self.name!r}: algorithm={self.algorithm!r} is not known; allowed: ring, "
                f"tree, hierarchical, auto"
            )
        for name in ("call_latency_s", "matmul_flops_per_s", "kernel_overhead_s", "memory_bandwidth_bytes_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value >= 0 and math.isfinite(value)):
                raise HardwareError(f"profile {self.name!r}: {name}={value!r} must be a number, zero or more")
        if not (isinstance(self.efficiency, int | float) and 0 < self.efficiency <= 1):
            raise HardwareError(f"profile {self.name!r}: efficiency={self.efficiency!r} must be in (0, 1]")


@cache
def _data() -> dict[str, Any]:
    text = resources.files("shardscope.presets").joinpath("interconnects.json").read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def interconnect_preset_names() -> tuple[str, ...]:
    """Every interconnect preset id."""
    return tuple(_data()["interconnects"])


def interconnect_preset(name: str) -> InterconnectSpec:
    """The InterconnectSpec of a preset id such as 'ib-ndr'."""
    table = _data()["interconnects"]
    if name not in table:
        raise HardwareError(f"unknown interconnect {name!r}; known: {', '.join(table)}")
    entry = table[name]
    return InterconnectSpec(
        id=name,
        name=entry["name"],
        bandwidth_bytes_per_s=float(entry["bandwidth_bytes_per_s"]),
        latency_s=float(entry["latency_s"]),
        source=entry["source"],
    )


def gpu_memory_bandwidth(gpu: GpuSpec) -> float:
    """The GPU preset's datasheet memory bandwidth in bytes per second, or 0 when unknown."""
    entry = _data()["memory_bandwidth"].get(gpu.id)
    return float(entry["bytes_per_s"]) if isinstance(entry, dict) else 0.0


def default_profile(gpu: GpuSpec) -> HardwareProfile:
    """The datasheet profile of a GPU preset: its typical links, NCCL's latencies, the default efficiency."""
    data = _data()
    links = data["gpu_defaults"].get(gpu.id, data["gpu_defaults"]["custom"])
    return HardwareProfile(
        name=f"datasheet: {gpu.name}",
        intra_node=interconnect_preset(links["intra_node"]),
        inter_node=interconnect_preset(links["inter_node"]),
        host=interconnect_preset(links["host"]),
        call_latency_s=float(data["call_latency_s"]),
        memory_bandwidth_bytes_per_s=gpu_memory_bandwidth(gpu),
        source=f"{gpu.source}; links: interconnects.json; {data['call_latency_source']}",
    )


def _link(value: object, where: str) -> InterconnectSpec:
    if isinstance(value, str):
        return interconnect_preset(value)
    if not isinstance(value, dict):
        raise HardwareError(f"{where} must be an interconnect id or a table with bandwidth_bytes_per_s and latency_s")
    try:
        return InterconnectSpec(
            id=str(value.get("id", "custom")),
            name=str(value.get("name", where)),
            bandwidth_bytes_per_s=value["bandwidth_bytes_per_s"],
            latency_s=value["latency_s"],
            source=str(value.get("source", "")),
        )
    except KeyError as missing:
        raise HardwareError(f"{where} is missing {missing.args[0]!r}") from None


def parse_profile(text: str, origin: str = "profile") -> HardwareProfile:
    """A HardwareProfile from TOML text."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise HardwareError(f"{origin} is not valid TOML: {error}") from None
    if data.get("schema") != PROFILE_SCHEMA:
        raise HardwareError(f"{origin}: schema={data.get('schema')!r}, expected {PROFILE_SCHEMA!r}")
    compute, network = data.get("compute", {}), data.get("network", {})
    if not isinstance(compute, dict) or not isinstance(network, dict):
        raise HardwareError(f"{origin}: [compute] and [network] must be tables")
    try:
        return HardwareProfile(
            name=str(data.get("name", origin)),
            source=str(data.get("source", origin)),
            intra_node=_link(network.get("intra_node"), f"{origin}: network.intra_node"),
            inter_node=_link(network.get("inter_node", network.get("intra_node")), f"{origin}: network.inter_node"),
            host=_link(network.get("host", "pcie5-x16"), f"{origin}: network.host"),
            call_latency_s=network.get("call_latency_s", 0.0),
            algorithm=network.get("algorithm", "ring"),
            overlap=bool(network.get("overlap", True)),
            matmul_flops_per_s=compute.get("matmul_flops_per_s", 0.0),
            efficiency=compute.get("efficiency", DEFAULT_EFFICIENCY),
            kernel_overhead_s=compute.get("kernel_overhead_s", 0.0),
            memory_bandwidth_bytes_per_s=compute.get("memory_bandwidth_bytes_per_s", 0.0),
        )
    except TypeError as error:
        raise HardwareError(f"{origin}: a value has the wrong type ({error})") from None


def load_profile(path: str | Path) -> HardwareProfile:
    """Read a hardware profile file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise HardwareError(f"cannot read hardware profile {str(path)!r}: {error.strerror}") from None
    return parse_profile(text, origin=str(path))


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
        f"memory_bandwidth_bytes_per_s = {float(profile.memory_bandwidth_bytes_per_s)!r}",
        "",
        "[network]",
        f"algorithm = {_string(profile.algorithm)}",
        f"call_latency_s = {float(profile.call_latency_s)!r}",
        f"overlap = {'true' if profile.overlap else 'false'}",
        "",
    ]
    links = [_link_toml(name, getattr(profile, name)) for name in ("intra_node", "inter_node", "host")]
    return "\n".join(lines) + "\n" + "\n".join(links)
