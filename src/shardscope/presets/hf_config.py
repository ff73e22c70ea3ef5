"""Read a Hugging Face config.json (a local file; never the network) into a ModelSpec."""

from __future__ import annotations

import json
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


def read_hf_config(path: str | Path) -> ModelSpec:
    """Parse a config.json of model type gpt2, llama, mistral, mixtral or qwen2; other fields are ignored."""
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
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{path}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
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
