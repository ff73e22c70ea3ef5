"""Run a function on N local ranks: `run_function` on the launcher's side, `python -m shardscope.procs.functions`
on each rank's.

The ranks find the function by name (module and qualified name), never by pickling it, so the caller's `__main__`
is not imported again: the lesson's demo works from a script without a main guard and from standard input. A
function defined in a script is imported from the script's file under another name (its main guard then keeps the
script's own work from running again); one typed at a prompt or read from standard input cannot be found.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardscope.procs.rank import Status, die_with_parent, report_failure

RankFunction = Callable[[int, int, int, dict[str, Any]], dict[str, Any]]
SCRIPT_MODULE = "__shardscope_script__"


def function_target(function: RankFunction) -> str:
    """'module:qualname', or 'path/to/script.py:qualname' for a function of the running script."""
    module, name = function.__module__, function.__qualname__
    if "<locals>" in name or "<lambda>" in name:
        raise ValueError(f"{name} must be a module-level function: the ranks import it by name")
    if module == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)  # '<stdin>' for `python -`
        if not path or not Path(path).is_file():
            raise ValueError(f"{name} is defined at a prompt or on standard input; define it in a module")
        return f"{Path(path).resolve()}:{name}"
    return f"{module}:{name}"


def _resolve(target: str) -> RankFunction:
    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        sys.path.insert(0, str(Path(where).parent))  # as when the script runs: its sibling modules import
        spec = importlib.util.spec_from_file_location(SCRIPT_MODULE, where)
        assert spec is not None and spec.loader is not None, where
        module = importlib.util.module_from_spec(spec)
        sys.modules[SCRIPT_MODULE] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    found: Any = module
    for part in name.split("."):
        found = getattr(found, part)
    function: RankFunction = found
    return function


def run_function(function: RankFunction, world_size: int, options: dict[str, Any], timeout_s: float) -> dict[int, Any]:
    """function(rank, world_size, port, options) on world_size local ranks; returns each rank's report. function
    must live at module level, take and return JSON-compatible values, and join and leave the process group itself
    (every rank gets the same port). RunError names the rank that failed or hung."""
    from shardscope.procs.launcher import run_ranks
    from shardscope.procs.rundir import run_directory

    target = function_target(function)
    with run_directory() as run_dir:
        (run_dir / "options.json").write_text(json.dumps(options))
        done = run_ranks(
            "shardscope.procs.functions",
            lambda attempt: [target, str(run_dir / "options.json"), str(attempt)],
            world_size=world_size,
            timeout_s=timeout_s,
            run_dir=run_dir,
        )
        return {rank: json.loads((done / f"rank{rank}.json").read_text()) for rank in range(world_size)}


def main() -> None:
    """One rank: die with the launcher (before anything imports torch), call the function, write its report."""
    die_with_parent()
    target, options_file, run_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        Status(run_dir, rank)("running")
        report = _resolve(target)(
            rank, world_size, int(os.environ["MASTER_PORT"]), json.loads(options_file.read_text())
        )
        partial = run_dir / f"rank{rank}.json.partial"
        partial.write_text(json.dumps(report))
        partial.rename(run_dir / f"rank{rank}.json")
    except BaseException as error:
        report_failure(run_dir, rank, error)
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo ranks sometimes abort at interpreter exit (DESIGN.md)


if __name__ == "__main__":
    main()
