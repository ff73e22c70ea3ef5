"""The --from and --from-format flags: a config file fills every setting the command line did not give, so flags
given explicitly win over the file wherever they stand, even when they repeat a default."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from shardscope.configs import FORMATS, ConfigError, read_config

PLAN_TAKES = frozenset({"model", "seq_len", "precision", "optimizer", "engine"})
"""The settings `plan` keeps fixed; the mesh, batch shape, offload and checkpointing are what it searches."""
MODEL_SOURCES = ("model", "config", "params")
"""The mutually exclusive flags that name the model: any of them given keeps the file's model out."""


def explicit_destinations(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The destinations the command line gave, whatever their values: argv parsed again with every default
    suppressed, so only the flags that were given appear in the namespace (a flag given at its default value
    counts, which comparing values with the defaults cannot tell)."""
    saved = [(action, action.default) for action in parser._actions]
    saved_defaults = dict(parser._defaults)
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        parser._defaults.clear()
        given, _ = argparse.ArgumentParser.parse_known_args(parser, list(argv), argparse.Namespace())
    finally:
        for action, default in saved:
            action.default = default
        parser._defaults.update(saved_defaults)
    return set(vars(given))


def plans(namespace: argparse.Namespace, command: str) -> bool:
    """Whether the command searches plans (plan, and report with --global-batch-tokens), keeping only PLAN_TAKES."""
    return command.split()[-1] == "plan" or getattr(namespace, "global_batch_tokens", None) is not None


def apply_config_file(parser: argparse.ArgumentParser, namespace: argparse.Namespace, explicit: set[str]) -> None:
    """Read --from into the namespace: each setting of the file goes to its flag unless that flag was given
    explicitly (or the command searches it itself: plan); the mapping used is kept as namespace.config_source."""
    path = getattr(namespace, "from_file", None)
    if path is None:
        return
    try:
        mapping = read_config(path, getattr(namespace, "from_format", None), getattr(namespace, "gpus", 8))
    except ConfigError as error:
        parser.error(str(error))
    searches = plans(namespace, parser.prog)
    for dest in list(mapping.settings):
        flag = "--" + dest.replace("_", "-")
        if not hasattr(namespace, dest) or (searches and dest not in PLAN_TAKES):
            why = f"{parser.prog} searches {flag} itself"
        elif dest in explicit or (dest in MODEL_SOURCES and explicit.intersection(MODEL_SOURCES)):
            given = next(name for name in (dest, *MODEL_SOURCES) if name in explicit)
            why = f"--{given.replace('_', '-')} on the command line overrides it"
        else:
            setattr(namespace, dest, mapping.settings[dest])
            continue
        mapping.skip(mapping.fields.pop(dest), why)
        del mapping.settings[dest]
    namespace.config_source = mapping


def _parse_then_apply(parser: argparse.ArgumentParser) -> Any:
    """parse_known_args of this parser, followed by apply_config_file once the whole command line is read."""

    def parse_known_args(args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        parsed, extras = argparse.ArgumentParser.parse_known_args(parser, argv, namespace)
        if getattr(parsed, "from_file", None) is not None:
            apply_config_file(parser, parsed, explicit_destinations(parser, argv))
        return parsed, extras

    return parse_known_args


def add_from_arguments(parser: argparse.ArgumentParser) -> None:
    """--from FILE and --from-format; the file is read once the whole command line is parsed (the parser's
    parse_known_args is wrapped: a subcommand's parser is parsed through it by argparse's subparsers action)."""
    parser.add_argument(
        "--from",
        dest="from_file",
        metavar="FILE",
        help="read the scenario from a DeepSpeed JSON, a torchtitan job TOML or an Accelerate YAML; flags given on "
        "the command line override it, and the mapping used is printed on stderr",
    )
    parser.add_argument("--from-format", choices=FORMATS, help="the --from file's format")
    parser.set_defaults(config_source=None)
    parser.parse_known_args = _parse_then_apply(parser)  # type: ignore[method-assign]


def print_source(args: argparse.Namespace, stream: Any = None) -> None:
    """Print the mapping --from used (once), on stderr."""
    mapping = getattr(args, "config_source", None)
    if mapping is None or getattr(args, "_from_printed", False):
        return
    args._from_printed = True
    print("\n".join(f"shardscope {args.command}: {line}" for line in mapping.lines()), file=stream or sys.stderr)


def with_source(document: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """A command's JSON document with the --from mapping under `source` (the document as it is without --from);
    every command that reads --from and prints JSON goes through here, so they all carry it the same way."""
    mapping = getattr(args, "config_source", None)
    return document if mapping is None else {**document, "source": mapping.as_json()}


__all__: Sequence[str] = [
    "add_from_arguments",
    "apply_config_file",
    "explicit_destinations",
    "plans",
    "print_source",
    "with_source",
]
