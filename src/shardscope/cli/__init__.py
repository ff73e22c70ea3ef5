"""The `shardscope` command: one thin module per subcommand, `main(argv) -> int` so tests call it directly.

Each subcommand module defines `add_parser(subparsers)` and `run(args) -> int`. Bad input raises `CliError` (or a
`SpecError`/`UnitError` from the layers below) and becomes one line on stderr and exit code 2, never a traceback.
torch is imported only inside the subcommands that need it (trace, run, validate, calibrate).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
from collections.abc import Sequence

from shardscope.cli.errors import CliError, OneLineParser
from shardscope.specs import SpecError
from shardscope.units import UnitError

# name -> module under shardscope.cli; a command imports only its own module (see build_parser).
COMMANDS = {
    "estimate": "estimate",
    "demo": "demo",
    "trace": "trace",
    "timeline": "timeline",
    "plan": "plan",
    "report": "report",
    "calibrate": "calibrate",
    "run": "run",
    "validate": "validate",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser with every subcommand attached; with `only`, the others are bare names (their modules
    are not imported), which keeps a command's start-up to its own imports."""
    parser = OneLineParser(
        prog="shardscope",
        description="Per-rank memory, communication and step time of DDP, ZeRO-1/2/3, FSDP and HSDP, with tensor, "
        "context, pipeline and expert parallelism: predicted, replayed on fake tensors, and measured on "
        "torch.distributed.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name, module in COMMANDS.items():
        if only is None or name == only:
            importlib.import_module(f"shardscope.cli.{module}").add_parser(subparsers)
        else:
            subparsers.add_parser(name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 a check failed, 2 bad input)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_list[0] if args_list and args_list[0] in COMMANDS else None)
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exit_:  # argparse prints its own one-line usage error
        return int(exit_.code or 0)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(f"shardscope.cli.{COMMANDS[args.command]}")
    try:
        code: int = module.run(args)
    except (CliError, SpecError, UnitError) as error:
        print(f"shardscope {args.command}: error: {error}", file=sys.stderr)
        return getattr(error, "exit_code", 2)
    except KeyboardInterrupt:
        print(f"shardscope {args.command}: interrupted", file=sys.stderr)
        return 130
    return code


def console_main() -> None:
    """Entry point of the `shardscope` console script."""
    try:
        code = main()
        # The models' caches hold millions of small objects by the end of a plan; the interpreter's collections at
        # exit would walk them all (a tenth of a second of a 405B plan) to find no garbage worth freeing.
        gc.freeze()
        sys.stdout.flush()
    except BrokenPipeError:  # the reader (`| head`) went away: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    raise SystemExit(code)
