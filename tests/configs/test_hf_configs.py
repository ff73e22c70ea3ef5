"""The presets' Hugging Face config.json files (src/shardscope/presets/hf_configs) read back to their presets, and
the config.json written from a ModelSpec reads back to that spec, for every preset."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from shardscope.presets import model_preset, model_preset_names
from shardscope.presets.hf_config import (
    ConfigError,
    hf_config_of,
    preset_hf_config,
    same_shape,
    spec_from_hf_config,
)
from shardscope.specs import ModelSpec

FILES = sorted(
    entry.name
    for entry in resources.files("shardscope.presets").joinpath("hf_configs").iterdir()
    if entry.name.endswith(".json")
)


def test_every_published_preset_has_its_file() -> None:
    published = {name for name in model_preset_names() if not name.startswith("tiny-")}
    assert {name.removesuffix(".json") for name in FILES} == published


@pytest.mark.parametrize("name", FILES)
def test_each_file_reads_back_to_its_preset(name: str) -> None:
    text = resources.files("shardscope.presets").joinpath("hf_configs", name).read_text(encoding="utf-8")
    preset = model_preset(name.removesuffix(".json"))
    assert same_shape(spec_from_hf_config(json.loads(text), Path(name)), preset)
    assert preset_hf_config(preset) == json.loads(text)  # the preset's own file, not one written from the spec


@pytest.mark.parametrize("name", model_preset_names())
def test_the_config_written_from_a_spec_reads_back_to_it(name: str) -> None:
    preset = model_preset(name)
    assert same_shape(spec_from_hf_config(hf_config_of(preset), Path("written.json")), preset)


def test_the_model_types_a_hugging_face_user_trains() -> None:
    """Mistral 7B v0.1's config.json has a 4096-token sliding window (mistralai/Mistral-7B-v0.1 config.json)."""
    kinds = {name: preset_hf_config(model_preset(name))["model_type"] for name in model_preset_names()}
    assert kinds["mistral-7b"] == "mistral" and kinds["qwen2.5-7b"] == "qwen2" and kinds["mixtral-8x7b"] == "mixtral"
    assert kinds["tiny-moe"] == "mixtral" and kinds["tiny-gpt2"] == "gpt2" and kinds["tiny-llama"] == "llama"
    assert preset_hf_config(model_preset("mistral-7b"))["sliding_window"] == 4096
    assert hf_config_of(model_preset("tiny-gpt2"))["resid_pdrop"] == 0.0  # the reference models have no dropout


def test_a_spec_that_differs_from_its_preset_gets_a_written_config() -> None:
    from dataclasses import replace

    deeper = replace(model_preset("llama-3-8b"), num_layers=40)
    assert preset_hf_config(deeper)["num_hidden_layers"] == 40
    assert "rope_parameters" not in preset_hf_config(deeper)


def test_a_count_has_no_config() -> None:
    count = ModelSpec(name="7B", family="count", declared_parameters=7_000_000_000)
    with pytest.raises(ConfigError, match="has no shape"):
        hf_config_of(count)
