"""A local run is refused before any rank starts when its ranks cannot fit in the machine's available memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardscope.runtime.config import RunConfig
from shardscope.runtime.host_memory import RANK_PROCESS_BYTES, available_bytes, check_fits, predicted_bytes
from shardscope.specs import SpecError
from shardscope.units import GIB, MIB

TINY = RunConfig.from_options(model="tiny-gpt2", world_size=2, backend="gloo")
HUGE = RunConfig.from_options(model="llama-3.1-405b", world_size=2, backend="gloo")


def _meminfo(tmp_path: Path, available_bytes: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(
        f"MemTotal:       99999999 kB\nMemFree:          1000 kB\nMemAvailable:   {available_bytes // 1024} kB\n"
    )
    return path


def test_available_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    assert available_bytes(_meminfo(tmp_path, 3 * GIB)) == 3 * GIB
    assert available_bytes(tmp_path / "missing") is None
    (tmp_path / "odd").write_text("MemTotal: 1 kB\n")
    assert available_bytes(tmp_path / "odd") is None


def test_a_tiny_run_is_accepted() -> None:
    assert predicted_bytes(TINY) < 2 * (RANK_PROCESS_BYTES + 10 * MIB)
    check_fits([TINY])  # this machine: a tiny model fits wherever the tests run


def test_a_run_that_cannot_fit_is_refused_naming_the_bytes(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as refused:
        check_fits([TINY, HUGE], _meminfo(tmp_path, 64 * GIB))
    message = str(refused.value)
    assert message.startswith("llama-3.1-405b zero3 (fp64) on 2 ranks needs about 12,373.")
    assert "GiB (2 x predicted peak" in message and "but this machine has 64.00 GiB available" in message
    assert "\n" not in message


def test_the_process_cost_alone_can_refuse(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"on 2 ranks needs about 0\.5"):
        check_fits([TINY], _meminfo(tmp_path, 100 * MIB))


def test_the_check_is_skipped_where_available_memory_cannot_be_read(tmp_path: Path) -> None:
    check_fits([HUGE], tmp_path / "missing")
