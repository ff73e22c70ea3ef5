"""Exact parameter counts: the core against transformers' own models built on the meta device, and published
figures."""

import json
import os
from pathlib import Path

import pytest

from shardscope.core.params import count_parameters, param_layout
from shardscope.presets import model_preset, model_preset_names
from shardscope.presets.hf_config import ConfigError, read_hf_config

HF_CONFIGS = Path(__file__).resolve().parents[1] / "data" / "hf-configs"
PUBLISHED = [name for name in model_preset_names() if not name.startswith("tiny-")]


def test_every_published_preset_has_a_config_file() -> None:
    # the folder also holds variants the hf trace tests use (no dropout, no sliding window) and a model type outside
    # the core's families
    assert set(PUBLISHED) <= {p.stem for p in HF_CONFIGS.glob("*.json")}


@pytest.mark.parametrize("name", PUBLISHED)
def test_config_reader_matches_preset(name: str) -> None:
    from_config = read_hf_config(HF_CONFIGS / f"{name}.json")
    assert count_parameters(from_config) == count_parameters(model_preset(name))


@pytest.mark.parametrize("name", PUBLISHED)
def test_count_equals_transformers_on_meta(name: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    data = json.loads((HF_CONFIGS / f"{name}.json").read_text())
    config = transformers.AutoConfig.for_model(**data)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    built = sum(p.numel() for p in model.parameters())
    assert count_parameters(model_preset(name)) == built


def test_published_counts() -> None:
    # Counts as the model cards state them exactly (Llama 2 7B: 6,738,415,616; GPT-2 small: 124,439,808).
    assert count_parameters(model_preset("llama-2-7b")) == 6_738_415_616
    assert count_parameters(model_preset("gpt2")) == 124_439_808
    assert count_parameters(model_preset("llama-3-8b")) == 8_030_261_248


def test_layout_units() -> None:
    layout = param_layout(model_preset("llama-3-8b"))
    assert layout.num_blocks == 32
    assert layout.root_numel == 2 * 128256 * 4096 + 4096
    assert layout.largest_unit_numel == layout.root_numel
    names = [t.name for t in layout.tensors()]
    assert names[0] == "embed_tokens.weight" and names[-1] == "lm_head.weight"
    assert len(names) == len(set(names))


def test_config_reader_errors(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "t5"}')
    with pytest.raises(ConfigError, match="model_type 't5' is not supported; supported: gpt2, llama"):
        read_hf_config(bad)
    bad.write_text('{"model_type": "llama", "hidden_size": 64')
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_hf_config(bad)
    bad.write_text('{"model_type": "llama", "hidden_size": 64}')
    with pytest.raises(ConfigError, match="missing field 'num_attention_heads'"):
        read_hf_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        read_hf_config(tmp_path / "missing.json")
