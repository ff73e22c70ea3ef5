"""The shared record of a read config: the settings it gives (argparse destinations and values), which field gave
each one, and the fields shardscope does not model."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from shardscope.cli.errors import CliError


class ConfigError(CliError):
    """A config file that cannot be read: one line naming the file and the field."""


@dataclass
class ConfigMapping:
    """What one config file gave: `settings` by argparse destination, `fields[dest]` the field(s) that gave it,
    `unmodelled` each field shardscope does not model (with why)."""

    path: str
    format: str
    settings: dict[str, Any] = field(default_factory=dict)
    fields: dict[str, str] = field(default_factory=dict)
    unmodelled: dict[str, str] = field(default_factory=dict)

    def set(self, dest: str, value: Any, source: str) -> None:
        self.settings[dest] = value
        self.fields[dest] = source

    def skip(self, name: str, why: str = "not modelled") -> None:
        self.unmodelled[name] = why

    def as_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "mapping": [
                {"field": self.fields[dest], "flag": "--" + dest.replace("_", "-"), "value": value}
                for dest, value in self.settings.items()
            ],
            "unmodelled": dict(self.unmodelled),
        }

    def lines(self) -> list[str]:
        """The mapping as printed: one line per setting, then the unmodelled fields."""
        out = [f"read {self.format} config {self.path}:"]
        for dest, value in self.settings.items():
            out.append(f"  {self.fields[dest]} -> --{dest.replace('_', '-')} {value}")
        for name, why in self.unmodelled.items():
            out.append(f"  {name}: {why}")
        return out


def leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted names of every leaf of a nested mapping (tables and sections are walked into)."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from leaves(value, name + ".")
        else:
            yield name


def skip_unread(mapping: ConfigMapping, tree: Mapping[str, Any], read: set[str]) -> None:
    """List every leaf field that was not read (or lies under a read section)."""
    for name in leaves(tree):
        if name not in read and not any(name.startswith(section + ".") for section in read):
            mapping.skip(name)


def validate(path: str, tree: Any, schema_name: str) -> None:
    """Check the fields shardscope reads against src/shardscope/schemas/<schema_name>.schema.json (jsonschema)."""
    try:
        import jsonschema  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigError("--from needs jsonschema: pip install 'shardscope[configs]'") from None
    text = resources.files("shardscope.schemas").joinpath(f"{schema_name}.schema.json").read_text(encoding="utf-8")
    validator = jsonschema.Draft202012Validator(json.loads(text))
    error = jsonschema.exceptions.best_match(validator.iter_errors(tree))
    if error is not None:
        where = ".".join(str(part) for part in error.absolute_path) or "(top level)"
        raise ConfigError(f"{path}: {where}: {error.message}")
