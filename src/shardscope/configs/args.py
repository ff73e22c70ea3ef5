"""The --from and --from-format flags: a config file fills the flags the command line left at their defaults, so
explicit flags override the file."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from shardscope.configs import FORMATS, ConfigError, read_config

PLAN_TAKES = frozenset({"model", "seq_len", "precision", "optimizer", "engine"})
"""The settings `plan` keeps fixed; the mesh, batch shape, offload and checkpointing are what it searches."""
FILLED = "_from_filled"  # the destinations the file set, so that --from-format may read it again


def _apply(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> None:
    path = getattr(namespace, "from_file", None)
    if path is None:
        return
    try:
        mapping = read_config(path, getattr(namespace, "from_format", None), getattr(namespace, "gpus", 8))
    except ConfigError as error:
        parser.error(str(error))
    filled: set[str] = getattr(namespace, FILLED, set())
    for dest, value in list(mapping.settings.items()):
        if not hasattr(namespace, dest) or (parser.prog.endswith(" plan") and dest not in PLAN_TAKES):
            mapping.skip(mapping.fields.pop(dest), f"{parser.prog} searches --{dest.replace('_', '-')} itself")
            del mapping.settings[dest]
        elif dest in filled or getattr(namespace, dest) == parser.get_default(dest):
            setattr(namespace, dest, value)
            filled.add(dest)
        else:
            mapping.skip(mapping.fields.pop(dest), f"--{dest.replace('_', '-')} on the command line overrides it")
            del mapping.settings[dest]
    setattr(namespace, FILLED, filled)
    namespace.config_source = mapping


class FromFile(argparse.Action):
    """--from FILE: read it now; the flags that follow still override it."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        namespace.from_file = values
        _apply(parser, namespace)


class FromFormat(argparse.Action):
    """--from-format NAME: force the format (and read --from again if it came first)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        namespace.from_format = values
        _apply(parser, namespace)


def add_from_arguments(parser: argparse.ArgumentParser) -> None:
    """--from FILE and --from-format."""
    parser.add_argument(
        "--from",
        dest="from_file",
        metavar="FILE",
        action=FromFile,
        help="read the scenario from a DeepSpeed JSON, a torchtitan job TOML or an Accelerate YAML; flags given on "
        "the command line after it override it, and the mapping used is printed on stderr",
    )
    parser.add_argument("--from-format", choices=FORMATS, action=FromFormat, help="the --from file's format")
    parser.set_defaults(config_source=None)


def print_source(args: argparse.Namespace, stream: Any = None) -> None:
    """Print the mapping --from used (once), on stderr."""
    mapping = getattr(args, "config_source", None)
    if mapping is None or getattr(args, "_from_printed", False):
        return
    args._from_printed = True
    print("\n".join(f"shardscope {args.command}: {line}" for line in mapping.lines()), file=stream or sys.stderr)


def source_json(args: argparse.Namespace) -> dict[str, Any] | None:
    """The mapping as the JSON output's `source`, or None without --from."""
    mapping = getattr(args, "config_source", None)
    return None if mapping is None else dict(mapping.as_json())


__all__: Sequence[str] = ["add_from_arguments", "print_source", "source_json"]
