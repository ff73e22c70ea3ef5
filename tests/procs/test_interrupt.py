"""Ctrl-C at `shardscope run`: the launcher ends at once with exit 130 and one line, every rank is killed and
reaped, and the run directory is removed (issue 17's fault tests). Ctrl-C in a terminal sends SIGINT to the
launcher's process group; the ranks run in sessions of their own, so the launcher must end them itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from test_launch import _marked

pytestmark = pytest.mark.distributed


def test_ctrl_c_ends_the_run_and_leaves_nothing(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    env = dict(os.environ, TMPDIR=str(tmp_path), SHARDSCOPE_TEST_MARKER=marker)
    root = tmp_path / f"shardscope-{os.getuid()}"
    argv = ["run", "--model", "tiny-gpt2", "--world-size", "2", "--steps", "100000", "--timeout", "120"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shardscope", *argv], env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(root.glob("run-*/attempt0/rank*.status"))) < 2 and time.monotonic() < deadline:
            assert launcher.poll() is None, "the run ended before its ranks started"
            time.sleep(0.05)
        assert len(_marked(marker)) == 3, "the launcher and its two ranks should be running"
        started = time.monotonic()
        os.killpg(launcher.pid, signal.SIGINT)
        _, err = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 130
    assert time.monotonic() - started < 15
    last = err.strip().splitlines()[-1]
    assert last == "shardscope run: interrupted" and "Traceback" not in err
    deadline = time.monotonic() + 5
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = _marked(marker)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert survivors == []
    assert list(root.glob("run-*")) == []
