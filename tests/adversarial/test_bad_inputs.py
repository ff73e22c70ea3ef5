"""Every bad input of the catalogue (bad_inputs.py) is refused with exit code 2 and one line on stderr that names the
offending value, with no traceback; no process is started for any of them (a started one fails the test).

Each command line runs in-process through `shardscope.cli.main`, so the whole catalogue takes a few seconds.
"""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest
from bad_inputs import CASES, FILES

from shardscope.cli import COMMANDS, main

NEEDS_TORCH = ("run", "calibrate")  # their commands import torch before they read their flags


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The catalogue's bad files by name, and 'dir': the folder holding them."""
    _warm_font_cache()
    folder = tmp_path_factory.mktemp("bad-inputs")
    paths = {"dir": str(folder)}
    for name, text in FILES.items():
        (folder / name).write_text(text, encoding="utf-8")
        paths[name] = str(folder / name)
    return paths


def _warm_font_cache() -> None:
    """matplotlib scans the system fonts with `fc-list` the first time a chart is drawn on a fresh machine: a library's
    one-time cache, not a process the bad input started, so it is built before Popen is forbidden."""
    with contextlib.suppress(ImportError):  # matplotlib is optional: without it the report refuses first
        import matplotlib.font_manager  # noqa: F401  (importing it builds the font cache)


def _no_process(*args: object, **kwargs: object) -> None:
    raise AssertionError(f"a bad input started a process: {args!r}")


@pytest.mark.parametrize(("argv", "value"), CASES, ids=[" ".join(argv) for argv, _ in CASES])
def test_refused_in_one_line_naming_the_value(
    argv: list[str],
    value: str,
    bad_files: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if argv[0] in NEEDS_TORCH:
        pytest.importorskip("torch")
    monkeypatch.setattr(subprocess, "Popen", _no_process)
    argv = [bad_files[arg[1:-1]] if arg.startswith("{") else arg for arg in argv]
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert value in lines[0]


def test_the_catalogue_covers_every_command() -> None:
    assert len(CASES) >= 60
    assert {argv[0] for argv, _ in CASES} == set(COMMANDS)


def test_nothing_was_written(bad_files: dict[str, str]) -> None:
    """The refused reports and traces left no file behind."""
    assert sorted(path.name for path in Path(bad_files["dir"]).iterdir()) == sorted(FILES)
