"""Read a Hugging Face config.json (a local file; never the network) into a ModelSpec."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from shardscope.specs import ModelSpec, SpecError

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "mixtral", "qwen2")


class ConfigError(SpecError):
    """A config.json that is missing, malformed or of an unsupported model type."""


def _field(config: dict[str, Any], path: Path, *names: str, default: Any = None) -> Any:
    for name in names:
        value = config.get(name)
        if value is not None:
            return value
    if default is not None:
        return default
    raise ConfigError(f"{path}: missing field {' or '.join(names)!r}")


def _int_field(config: dict[str, Any], path: Path, *names: str, default: int | None = None) -> int:
    value = _field(config, path, *names, default=default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path}: field {names[0]!r} is {value!r}, not a whole number")
    return value


def _head_dim(config: dict[str, Any], path: Path, hidden: int, heads: int, hidden_name: str, heads_name: str) -> int:
    """head_dim as stated, else hidden / heads, which must then divide exactly. A stated head_dim may differ from
    hidden / heads (Mistral NeMo: 5120 / 32 heads with head_dim 128), so only the derived one is checked."""
    if heads < 1:
        raise ConfigError(f"{path}: field {heads_name!r} is {heads}, not a positive number of heads")
    if config.get("head_dim") is not None:
        return _int_field(config, path, "head_dim")
    if hidden % heads:
        raise ConfigError(
            f"{path}: {hidden_name} {hidden} is not divisible by {heads_name} {heads} "
            f"(head_dim would be {hidden / heads:g}); give head_dim or fix the sizes"
        )
    return hidden // heads


class UnsupportedModelType(ConfigError):
    """A config.json whose model_type is outside the core's families (the trace can still replay it)."""

    def __init__(self, path: Path, model_type: str) -> None:
        super().__init__(
            f"{path}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
        self.model_type = model_type


def load_hf_config(path: str | Path) -> dict[str, Any]:
    """The JSON object of a config.json, or ConfigError naming the file and what is wrong with it."""
    path = Path(path)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"config file {path} cannot be read: {error}") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"config file {path} is not valid JSON ({error.msg} at line {error.lineno})") from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise ConfigError(f"config file {path} is nested too deeply to be a model config") from None
    if not isinstance(config, dict):
        raise ConfigError(f"config file {path} holds a {type(config).__name__}, not a JSON object")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f"{path}: field 'model_type' is {model_type!r}, not the name of a model type")
    return config


def read_hf_config(path: str | Path) -> ModelSpec:
    """Parse a config.json of model type gpt2, llama, mistral, mixtral or qwen2; other fields are ignored."""
    return spec_from_hf_config(load_hf_config(path), Path(path))


def spec_from_hf_config(config: dict[str, Any], path: Path) -> ModelSpec:
    """The ModelSpec of a config.json's object (read from `path`, which errors and the spec's name and source
    take)."""
    model_type = config["model_type"]
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelType(path, model_type)
    name = path.stem if path.stem != "config" else f"{model_type} ({path.parent.name or path})"
    if model_type == "gpt2":
        hidden = _int_field(config, path, "n_embd", "hidden_size")
        heads = _int_field(config, path, "n_head", "num_attention_heads")
        return ModelSpec(
            name=name,
            family="gpt2",
            hidden_size=hidden,
            num_layers=_int_field(config, path, "n_layer"),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=_head_dim({}, path, hidden, heads, "n_embd", "n_head"),
            ffn_hidden_size=_int_field(config, path, "n_inner", default=4 * hidden),
            vocab_size=_int_field(config, path, "vocab_size"),
            max_positions=_int_field(config, path, "n_positions", "max_position_embeddings"),
            tie_embeddings=bool(config.get("tie_word_embeddings", True)),
            source=str(path),
        )
    hidden = _int_field(config, path, "hidden_size")
    heads = _int_field(config, path, "num_attention_heads")
    is_moe = model_type == "mixtral"
    return ModelSpec(
        name=name,
        family="moe" if is_moe else "llama",
        hidden_size=hidden,
        num_layers=_int_field(config, path, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=_int_field(config, path, "num_key_value_heads", default=heads),
        head_dim=_head_dim(config, path, hidden, heads, "hidden_size", "num_attention_heads"),
        ffn_hidden_size=_int_field(config, path, "intermediate_size"),
        vocab_size=_int_field(config, path, "vocab_size"),
        max_positions=_int_field(config, path, "max_position_embeddings", default=0),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
        num_experts=_int_field(config, path, "num_local_experts") if is_moe else 0,
        experts_per_token=_int_field(config, path, "num_experts_per_tok") if is_moe else 0,
        source=str(path),
    )


PRESET_CONFIGS = "hf_configs"
"""The package folder of the presets' config.json files, named after the presets."""
SHAPE_FIELDS = tuple(
    name for name in ModelSpec.__dataclass_fields__ if name not in ("name", "source", "declared_parameters")
)


def same_shape(first: ModelSpec, second: ModelSpec) -> bool:
    """Whether two specs describe the same architecture (their names and sources aside)."""
    return all(getattr(first, name) == getattr(second, name) for name in SHAPE_FIELDS)


def hf_config_of(spec: ModelSpec) -> dict[str, Any]:
    """A config.json for a ModelSpec, as transformers spells it: gpt2 for the gpt2 family, mixtral for moe, qwen2
    for a llama with attention biases (Qwen2 puts them on q, k and v only, as the core counts), else llama. No
    dropout, as the reference models have none."""
    if not spec.has_shape:
        raise ConfigError(f"model {spec.name} has no shape (family {spec.family}) to write a config.json from")
    if spec.family == "gpt2":
        return {
            "model_type": "gpt2",
            "n_embd": spec.hidden_size,
            "n_layer": spec.num_layers,
            "n_head": spec.num_heads,
            "n_inner": spec.ffn_hidden_size,
            "vocab_size": spec.vocab_size,
            "n_positions": spec.max_positions,
            "tie_word_embeddings": spec.tie_embeddings,
            **dict.fromkeys(("attn_pdrop", "embd_pdrop", "resid_pdrop", "summary_first_dropout"), 0.0),
        }
    model_type = "mixtral" if spec.family == "moe" else "qwen2" if spec.attention_bias else "llama"
    config: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.ffn_hidden_size,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_positions,
        "tie_word_embeddings": spec.tie_embeddings,
        "attention_dropout": 0.0,
    }
    if spec.family == "moe":
        config |= {"num_local_experts": spec.num_experts, "num_experts_per_tok": spec.experts_per_token}
    return config


def preset_hf_config(spec: ModelSpec) -> dict[str, Any]:
    """The config.json a Hugging Face user of this model trains with: the preset's file in hf_configs/ when the
    spec is that preset (same name and shape), else one written from the spec (hf_config_of)."""
    file = resources.files("shardscope.presets").joinpath(PRESET_CONFIGS, f"{spec.name}.json")
    if file.is_file():
        config = json.loads(file.read_text(encoding="utf-8"))
        if same_shape(spec_from_hf_config(config, Path(f"{spec.name}.json")), spec):
            return dict(config)
    return hf_config_of(spec)
