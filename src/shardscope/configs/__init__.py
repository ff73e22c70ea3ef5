"""--from FILE: read a DeepSpeed JSON, a torchtitan job TOML or an Accelerate YAML into shardscope's flags."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from typing import Any

from shardscope.configs.accelerate import read_accelerate
from shardscope.configs.deepspeed import read_deepspeed
from shardscope.configs.mapping import ConfigError, ConfigMapping
from shardscope.configs.torchtitan import read_torchtitan

FORMATS = ("deepspeed", "torchtitan", "accelerate")
READERS: dict[str, Callable[[str, dict[str, Any], int], ConfigMapping]] = {
    "deepspeed": read_deepspeed,
    "torchtitan": read_torchtitan,
    "accelerate": read_accelerate,
}

__all__ = ["FORMATS", "ConfigError", "ConfigMapping", "read_config"]


def _parse_yaml(text: str) -> Any:
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigError("--from needs PyYAML for an Accelerate config: pip install 'shardscope[configs]'") from None
    return yaml.safe_load(text)


def _parse(path: str, text: str, forced: str | None) -> tuple[str, Any]:
    """(format, tree): JSON is DeepSpeed's, TOML torchtitan's, YAML Accelerate's; tried in that order unless forced."""
    parsers: list[tuple[str, Callable[[str], Any], type[Exception] | tuple[type[Exception], ...]]] = [
        ("deepspeed", json.loads, (json.JSONDecodeError, RecursionError)),
        ("torchtitan", tomllib.loads, tomllib.TOMLDecodeError),
        ("accelerate", _parse_yaml, Exception),  # yaml.YAMLError, imported lazily
    ]
    if forced is not None:
        parsers = [entry for entry in parsers if entry[0] == forced]
    problems = []
    for name, parse, errors in parsers:
        try:
            tree = parse(text)
        except errors as error:
            problems.append(f"not {name} ({str(error).splitlines()[0]})")
            continue
        return name, tree
    raise ConfigError(f"{path}: is not a DeepSpeed JSON, torchtitan TOML or Accelerate YAML: {'; '.join(problems)}")


def read_config(path: str, forced: str | None, world_size: int) -> ConfigMapping:
    """Read `path` (format recognised by content, or `forced`) into a ConfigMapping; ConfigError when it cannot."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(1 << 22)
    except OSError as error:
        raise ConfigError(f"--from {path}: {error.strerror or error}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"--from {path}: is not a text file (not UTF-8)") from None
    if not text.strip():
        raise ConfigError(f"--from {path}: is empty")
    name, tree = _parse(path, text, forced)
    if not isinstance(tree, dict):
        raise ConfigError(f"--from {path}: holds a {type(tree).__name__}, not a mapping of fields")
    return READERS[name](path, tree, world_size)
