"""Who may import the process and measuring packages: the trace uses the measuring package and a rank's
die-with-parent guard, never the runtime or the launcher; neither package imports the runtime."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch")

CHECK = """
import sys
import {modules}
loaded = sorted(name for name in sys.modules if name.startswith("shardscope."))
forbidden = [name for name in loaded if name.startswith({forbidden})]
assert not forbidden, forbidden
"""


@pytest.mark.parametrize(
    ("modules", "forbidden"),
    [
        ("shardscope.trace.engine, shardscope.trace.runner", ("shardscope.runtime", "shardscope.procs.launcher")),
        ("shardscope.measure.ledger, shardscope.measure.storage", ("shardscope.runtime", "shardscope.procs")),
        ("shardscope.procs.functions, shardscope.procs.launcher", ("shardscope.runtime", "shardscope.measure")),
    ],
)
def test_imports_follow_the_layers(modules: str, forbidden: tuple[str, ...]) -> None:
    code = CHECK.format(modules=modules, forbidden=forbidden)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
