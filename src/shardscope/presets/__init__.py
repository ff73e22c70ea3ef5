"""Built-in model and GPU presets, shipped as package data, each citing where its numbers come from."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

from shardscope.specs import GpuSpec, ModelSpec, SpecError


class PresetError(SpecError):
    """An unknown preset id."""


@cache
def _load(name: str) -> dict[str, Any]:
    text = resources.files("shardscope.presets").joinpath(name).read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def model_preset_names() -> tuple[str, ...]:
    """Every model preset id, in the order of the data file."""
    return tuple(_load("models.json")["models"])


def gpu_preset_names() -> tuple[str, ...]:
    """Every GPU preset id."""
    return tuple(_load("gpus.json")["gpus"])


@cache
def model_preset(name: str) -> ModelSpec:
    """The ModelSpec of a preset id such as 'llama-3-8b'."""
    models = _load("models.json")["models"]
    if name not in models:
        raise PresetError(f"unknown model preset {name!r}; known: {', '.join(models)}")
    return ModelSpec(name=name, **models[name])


@cache
def gpu_preset(name: str) -> GpuSpec:
    """The GpuSpec of a preset id such as 'h100-80gb'."""
    gpus = _load("gpus.json")["gpus"]
    if name not in gpus:
        raise PresetError(f"unknown GPU preset {name!r}; known: {', '.join(gpus)}")
    entry = dict(gpus[name])
    flops = tuple(sorted(entry.pop("peak_flops_per_s").items()))
    return GpuSpec(id=name, peak_flops_per_s=flops, **entry)


def custom_gpu(memory_bytes: int) -> GpuSpec:
    """A GPU known only by its memory size (from --gpu-memory)."""
    return GpuSpec(id="custom", name="custom GPU", memory_bytes=memory_bytes, source="given on the command line")
