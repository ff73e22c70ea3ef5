"""A rank that raises, exits or hangs ends the whole run in time, naming the rank; no process is left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shardscope.runtime import RunConfig, RunError, run_training

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("raise:1", r"rank 1 failed: RuntimeError: injected fault on rank 1"),
        pytest.param("exit:0", r"rank 0 failed: exited with code 3", marks=pytest.mark.long),
        ("hang:1", r"within 15s: rank 1 hung at 'step 1/2"),
    ],
)
def test_fault_ends_the_run_naming_the_rank(
    tmp_path: Path, fault: str, message: str, leftover: Callable[[str], list[int]]
) -> None:
    started = time.monotonic()
    with pytest.raises(RunError, match=message):
        run_training(
            model="tiny-gpt2", strategy="zero3", world_size=2, steps=2, timeout_s=15, fault=fault, run_dir=tmp_path
        )
    assert time.monotonic() - started < 15 + 10
    assert leftover(str(tmp_path)) == []


def test_killing_the_launcher_kills_the_workers(tmp_path: Path, leftover: Callable[[str], list[int]]) -> None:
    script = (
        f"from shardscope.runtime import run_training\n"
        f"run_training(model='tiny-gpt2', world_size=2, timeout_s=60, fault='hang:0', "
        f"run_dir=__import__('pathlib').Path({str(tmp_path)!r}))\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        deadline = time.monotonic() + 40
        while len(set(leftover(str(tmp_path))) - {launcher.pid}) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(set(leftover(str(tmp_path))) - {launcher.pid}) == 2, "workers did not start"
        statuses = [tmp_path / "attempt0" / f"rank{rank}.status" for rank in range(2)]
        while not all(path.exists() for path in statuses) and time.monotonic() < deadline:
            time.sleep(0.05)  # both workers are running (past their prctl), not just exec'd
    finally:
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
    deadline = time.monotonic() + 10
    while leftover(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftover(str(tmp_path)) == []


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"strategy": "zero4"}, "Strategy.name='zero4' is not known"),
        ({"world_size": 0}, "RunConfig.world_size=0 must be at least 1"),
        ({"strategy": "hsdp", "world_size": 4, "shard_group": 3}, "dp_replicate 1 x dp_shard 3 = 3, not the 4 GPUs"),
        ({"engine": "deepspeed"}, "RunConfig.engine='deepspeed' is not known"),
        ({"model": "gpt2", "sequence_length": 2048}, "exceeds gpt2's max_positions=1024"),
    ],
)
def test_impossible_requests_fail_before_any_process(fields: dict[str, object], message: str) -> None:
    from shardscope.specs import SpecError

    with pytest.raises(SpecError, match=message):
        RunConfig.from_options(**fields)  # type: ignore[arg-type]


def _rank_pids(run_dir: Path, leftover: Callable[[str], list[int]]) -> dict[int, int]:
    """The worker processes of a launch in run_dir, by their RANK."""
    ranks = {}
    for pid in leftover(str(run_dir)):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        rank = next((item[5:] for item in environ if item.startswith(b"RANK=")), None)
        if b"shardscope.runtime.worker" in cmdline and rank is not None:
            ranks[int(rank)] = pid
    return ranks


@pytest.mark.long  # waits out a 45 s deadline; by default the hang:1 fault above ends a run at its deadline naming
# the hung rank, and tests/procs/test_hang.py names the silent rank among equals from its reports
def test_a_stopped_rank_is_named_not_the_ranks_waiting_for_it(
    tmp_path: Path, leftover: Callable[[str], list[int]]
) -> None:
    script = (
        "from pathlib import Path\nfrom shardscope.runtime import run_training\n"
        f"run_training(model='tiny-gpt2', strategy='zero3', world_size=3, steps=10**6, timeout_s=45, "
        f"run_dir=Path({str(tmp_path)!r}))\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", script], stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    stopped = 0
    try:
        statuses = [tmp_path / "attempt0" / f"rank{rank}.status" for rank in range(3)]
        deadline = time.monotonic() + 35
        while time.monotonic() < deadline and not all("step" in _read_or_empty(path) for path in statuses):
            time.sleep(0.1)
        assert all("step" in _read_or_empty(path) for path in statuses), "ranks did not start training"
        stopped = _rank_pids(tmp_path, leftover)[1]
        os.kill(stopped, signal.SIGSTOP)
        _, stderr = launcher.communicate(timeout=60)
        assert launcher.returncode != 0
        assert "rank 1 hung at 'step" in stderr, stderr[-2000:]
        assert "stopped reporting" in stderr
        assert "rank 0 hung" not in stderr and "rank 2 hung" not in stderr
    finally:
        if stopped:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stopped, sig)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    deadline = time.monotonic() + 10
    while leftover(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftover(str(tmp_path)) == []


def _read_or_empty(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@pytest.mark.long
def test_a_hang_in_a_later_run_of_a_suite_is_named_not_a_collective_timeout(
    tmp_path: Path, leftover: Callable[[str], list[int]]
) -> None:
    from shardscope.runtime import run_suite

    configs = [
        RunConfig.from_options(model="tiny-gpt2", world_size=2, steps=1, timeout_s=20, fault=fault)
        for fault in ("", "hang:1")
    ]
    with pytest.raises(RunError, match=r"did not finish within 40s: rank 1 hung at 'run 2/2 step 1/1"):
        run_suite(configs, run_dir=tmp_path)  # the ranks' collective timeout must not end it first, blaming rank 0
    assert leftover(str(tmp_path)) == []
