"""Built-in model and GPU presets, shipped as package data, each citing where its numbers come from.

gpus.json holds one complete record per GPU (memory, peak FLOP/s, memory bandwidth, default links, power, sources) and
the links the records name, so a GPU cannot be added to one table and forgotten in another.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from shardscope.specs import GpuSpec, ModelSpec, SpecError

LINK_ROLES = ("intra_node", "inter_node", "host")
GPU_RECORD_KEYS = (
    "name",
    "memory_bytes",
    "peak_flops_per_s",
    "source",
    "memory_bandwidth_bytes_per_s",
    "memory_bandwidth_source",
    "links",
    "tdp_watts",
    "tdp_source",
)
OPTIONAL_GPU_RECORD_KEYS = ("notes", "architecture")
"""Fields a record may hold beside GPU_RECORD_KEYS: notes say what a record leaves out or assumes, and why; the
architecture names its kernel ceilings in gpu_kernels.json."""


class PresetError(SpecError):
    """An unknown preset id, or a preset record that is incomplete."""


@cache
def _load(name: str) -> dict[str, Any]:
    text = resources.files("shardscope.presets").joinpath(name).read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def gpus_file() -> dict[str, Any]:
    """gpus.json as parsed: the GPU records, the links they name, the default profile's latency and framework terms."""
    return _load("gpus.json")


def gpu_kernels_file() -> dict[str, Any]:
    """gpu_kernels.json as parsed: kernel ceilings per GPU architecture and SM counts per GPU preset, with sources."""
    return _load("gpu_kernels.json")


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuRecord:
    """Everything gpus.json says about one GPU: what the memory model reads (the GpuSpec) and what the time model
    reads (memory bandwidth, default links), each figure with its datasheet."""

    gpu: GpuSpec
    """Memory and dense peak FLOP/s per dtype; their datasheet is GpuSpec.source."""
    memory_bandwidth_bytes_per_s: float
    """Device memory bandwidth (the optimizer step's memory traffic runs at it)."""
    memory_bandwidth_source: str
    """The datasheet memory_bandwidth_bytes_per_s comes from."""
    intra_node: str
    """Id of the default GPU-to-GPU link inside a node (a key of gpus.json's 'links')."""
    inter_node: str
    """Id of the default per-GPU link across nodes."""
    host: str
    """Id of the default GPU-to-host link (offload copies)."""
    tdp_watts: float
    """Thermal design power, or the vendor's board power where that is its figure; not used by the model."""
    tdp_source: str
    """The datasheet tdp_watts comes from."""
    notes: str = ""
    """What the record leaves out, assumes or derives, and why (empty when it is the datasheet's figures only)."""
    architecture: str = ""
    """The GPU's architecture ('ampere', 'hopper'), the key of its kernel ceilings in gpu_kernels.json; empty: none."""

    def __post_init__(self) -> None:
        where = f"GPU preset {self.gpu.id!r}"
        flops = dict(self.gpu.peak_flops_per_s)
        if not flops or not all(_positive(value) for value in flops.values()):
            raise PresetError(f"{where}: peak_flops_per_s={flops!r} must give a positive figure per dtype")
        for name in ("memory_bandwidth_bytes_per_s", "tdp_watts"):
            if not _positive(getattr(self, name)):
                raise PresetError(f"{where}: {name}={getattr(self, name)!r} must be a positive number")
        sources = {
            "source": self.gpu.source,
            "memory_bandwidth_source": self.memory_bandwidth_source,
            "tdp_source": self.tdp_source,
        }
        for name, text in sources.items():
            if not isinstance(text, str) or not text.strip():
                raise PresetError(f"{where}: {name}={text!r} must name the datasheet the figure comes from")


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf


def parse_gpu_record(name: str, entry: Mapping[str, Any], link_ids: Collection[str]) -> GpuRecord:
    """The GpuRecord of one entry of gpus.json's 'gpus'; a missing, unknown or dangling field is an error."""
    missing = [key for key in GPU_RECORD_KEYS if key not in entry]
    unknown = [key for key in entry if key not in GPU_RECORD_KEYS + OPTIONAL_GPU_RECORD_KEYS]
    if missing or unknown:
        problem = f"lacks {', '.join(missing)}" if missing else f"has unknown field {', '.join(unknown)}"
        raise PresetError(f"GPU preset {name!r} {problem}; a record holds: {', '.join(GPU_RECORD_KEYS)}")
    links = entry["links"]
    if not isinstance(links, dict) or sorted(links) != sorted(LINK_ROLES):
        raise PresetError(f"GPU preset {name!r}: links={links!r} must name exactly {', '.join(LINK_ROLES)}")
    for role, link in links.items():
        if link not in link_ids:
            raise PresetError(f"GPU preset {name!r}: links.{role}={link!r} is not a link; known: {', '.join(link_ids)}")
    flops = entry["peak_flops_per_s"]
    gpu = GpuSpec(
        id=name,
        name=entry["name"],
        memory_bytes=entry["memory_bytes"],
        peak_flops_per_s=tuple(sorted(flops.items())) if isinstance(flops, dict) else (),
        source=entry["source"],
    )
    return GpuRecord(
        gpu=gpu,
        memory_bandwidth_bytes_per_s=entry["memory_bandwidth_bytes_per_s"],
        memory_bandwidth_source=entry["memory_bandwidth_source"],
        **{role: links[role] for role in LINK_ROLES},
        tdp_watts=entry["tdp_watts"],
        tdp_source=entry["tdp_source"],
        notes=entry.get("notes", ""),
        architecture=entry.get("architecture", ""),
    )


def model_preset_names() -> tuple[str, ...]:
    """Every model preset id, in the order of the data file."""
    return tuple(_load("models.json")["models"])


def gpu_preset_names() -> tuple[str, ...]:
    """Every GPU preset id."""
    return tuple(gpus_file()["gpus"])


@cache
def model_preset(name: str) -> ModelSpec:
    """The ModelSpec of a preset id such as 'llama-3-8b'."""
    models = _load("models.json")["models"]
    if name not in models:
        raise PresetError(f"unknown model preset {name!r}; known: {', '.join(models)}")
    return ModelSpec(name=name, **models[name])


@cache
def gpu_record(name: str) -> GpuRecord:
    """The whole record of a GPU preset id such as 'h100-80gb'."""
    gpus = gpus_file()["gpus"]
    if name not in gpus:
        raise PresetError(f"unknown GPU preset {name!r}; known: {', '.join(gpus)}")
    return parse_gpu_record(name, gpus[name], gpus_file()["links"])


def gpu_preset(name: str) -> GpuSpec:
    """The GpuSpec of a preset id such as 'h100-80gb'."""
    return gpu_record(name).gpu


def with_memory(gpu: GpuSpec, memory_bytes: int, given_as: str) -> GpuSpec:
    """The GPU with its memory replaced (--gpu-memory): a GPU of that kind with another capacity keeps its FLOP/s,
    its memory bandwidth and its links, so its id stays the preset's and only the name and source say so."""
    return dataclasses.replace(
        gpu,
        memory_bytes=memory_bytes,
        name=f"{gpu.name}, memory {given_as} (--gpu-memory)",
        source=f"{gpu.source}; memory {memory_bytes} bytes given on the command line",
    )


def custom_gpu(memory_bytes: int) -> GpuSpec:
    """A GPU known only by its memory size (what a local run on this machine reports against)."""
    return GpuSpec(id="custom", name="custom GPU", memory_bytes=memory_bytes, source="given on the command line")
