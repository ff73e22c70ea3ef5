"""Ranks are launched by module entry point: the lesson works from a script without a main guard and from standard
input, and a launcher killed with SIGKILL (run, lesson, calibrate, validate) leaves no process behind, and its run
directory goes at the next start. Every launch here has a hard timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from shardscope.procs.rundir import run_directory

pytestmark = pytest.mark.distributed

DEMO = """from shardscope.lesson import run_distributed_demo
out = run_distributed_demo(world_size=2, num_steps=2, timeout=60)
print("round trip", out["fsdp_round_trip_all_ranks_ok"], out["param_sum_spread"] < 1e-12)
"""
LAUNCHERS = {
    "run": "from shardscope.runtime import run_training\n"
    "run_training(model='tiny-gpt2', world_size=2, timeout_s=60, fault='hang:0')\n",
    "lesson": "from shardscope.lesson import run_distributed_demo\n"
    "run_distributed_demo(world_size=2, num_steps=10**7, timeout=60)\n",
    "calibrate": "from shardscope.calibrate import calibrate\ncalibrate(world_size=2, repeats=10**6, timeout_s=60)\n",
    "validate": "from shardscope.validate.cases import ValidationCase\n"
    "from shardscope.validate.runner import validate_cases\n"
    "case = ValidationCase(model='tiny-gpt2', strategy='zero3', engine='paper', world_size=2)\n"
    "validate_cases([case], with_trace=False, steps=10**6)\n",
}


def test_lesson_from_a_script_without_a_main_guard(tmp_path: Path) -> None:
    script = tmp_path / "demo.py"
    script.write_text(DEMO)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "round trip True True"


def test_lesson_from_standard_input() -> None:
    done = subprocess.run([sys.executable, "-"], input=DEMO, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "round trip True True"


def test_ranks_do_not_import_torch_before_they_ask_to_die_with_the_launcher() -> None:
    code = "import sys, shardscope.procs.functions, shardscope.runtime.worker; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _marked(marker: str) -> list[int]:
    """Live processes whose environment carries the marker (the launcher passes its environment to every rank)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if marker.encode() in environ and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.mark.parametrize("kind", sorted(LAUNCHERS))
def test_sigkill_of_the_launcher_leaves_no_rank_and_its_directory_goes_next_start(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = f"SHARDSCOPE_TEST_MARKER={uuid.uuid4().hex}"
    env = dict(os.environ, TMPDIR=str(tmp_path), SHARDSCOPE_TEST_MARKER=marker.partition("=")[2])
    root = tmp_path / f"shardscope-{os.getuid()}"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHERS[kind]], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(root.glob("run-*/attempt0/rank*.status"))) < 2 and time.monotonic() < deadline:
            assert launcher.poll() is None, f"the {kind} launcher ended early"
            time.sleep(0.05)
        assert len(list(root.glob("run-*/attempt0/rank*.status"))) == 2, "ranks did not start"
        assert len(_marked(marker)) == 3  # the launcher and its two ranks
    finally:
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
    deadline = time.monotonic() + 5
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = _marked(marker)
    for pid in survivors:  # so a failure here leaves nothing running either
        os.kill(pid, signal.SIGKILL)
    assert survivors == []
    left = list(root.glob("run-*"))
    assert len(left) == 1  # SIGKILL runs no cleanup ...
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with run_directory() as fresh:
        assert sorted(root.iterdir()) == [fresh]  # ... the next start removes it


def test_a_failing_rank_is_named_and_a_hang_ends_at_the_deadline() -> None:
    from shardscope.procs.functions import run_function
    from shardscope.procs.launcher import RunError
    from shardscope.runtime.lesson_impl import _demo_rank

    with pytest.raises(RunError, match=r"rank [01] failed: KeyError: 'backend'"):
        run_function(_demo_rank, 2, {}, timeout_s=60)
    options = dict(backend="gloo", in_dim=4, hidden=4, out_dim=2, batch_size=2, lr=0.1, seed=0, timeout=60)
    started = time.monotonic()
    both_running = r"did not finish within 4s: the hung rank cannot be told apart: ranks 0, 1 got equally far"
    with pytest.raises(RunError, match=both_running):  # both busy and reporting: naming one would be a guess
        run_function(_demo_rank, 2, {**options, "num_steps": 10**7}, timeout_s=4)
    assert time.monotonic() - started < 4 + 10


def test_a_function_the_ranks_cannot_import_is_refused_before_any_rank_starts() -> None:
    from shardscope.procs.functions import run_function

    with pytest.raises(ValueError, match="must be a module-level function"):
        run_function(lambda *_: {}, 2, {}, timeout_s=10)
    code = (
        "from shardscope.procs.functions import run_function\ndef f(*_):\n    return {}\nrun_function(f, 2, {}, 10)\n"
    )
    done = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=60)
    assert "f is defined at a prompt or on standard input; define it in a module" in done.stderr
