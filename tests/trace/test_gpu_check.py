"""benchmarks/gpu_check.py: its CPU path end to end, and docs/accuracy-gpu.md made from its saved GPU measurements."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


GPU_CHECK = _module()


@pytest.mark.slow
@pytest.mark.parametrize("worlds", ["2", pytest.param("2,4", marks=pytest.mark.long)])
def test_cpu_path_measures_every_case_and_times_the_kernels(
    tmp_path: Path, worlds: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each case is a process of its own, started by the script's main (called here; it times the kernels in this
    process): one world size by default, a second under -m long for the comparison."""
    out = tmp_path / "check.json"
    argv = ["--device", "cpu", "--model", "tiny-llama", "--blocks", "2", "--seq-len", "64", "--worlds", worlds]
    assert GPU_CHECK.main([*argv, "--modes", "none,full", "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    cases = {(row["world"], row["mode"]): row["measured"] for row in document["rows"]}
    sizes = [int(world) for world in worlds.split(",")]
    assert set(cases) == {(world, mode) for world in sizes for mode in ("none", "full")}
    for world in sizes:
        # Full checkpointing keeps only each block's input: the measured peak must fall.
        assert 0 < cases[world, "full"]["allocated_peak_bytes"] < cases[world, "none"]["allocated_peak_bytes"]
        assert cases[world, "none"]["reserved_peak_bytes"] is None  # no caching allocator on a CPU
        assert cases[world, "none"]["step_time_s"] > 0
    if 4 in sizes:  # more ranks share the sharded states: rank 0 holds less
        assert cases[4, "none"]["allocated_peak_bytes"] < cases[2, "none"]["allocated_peak_bytes"]
    kernels = {kernel["kernel"] for kernel in document["kernels"]}
    assert {"q_proj forward", "lm_head weight grad", "attention forward+backward", "device copy"} <= kernels
    assert f"| {sizes[-1]} | full |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "name", ["gpu_check-h200.json", "gpu_check-h200-32blocks.json", "gpu_check-h200-expandable.json"]
)
def test_accuracy_gpu_page_shows_todays_predictions(name: str) -> None:
    document = json.loads((REPO / "benchmarks" / "results" / name).read_text())
    page = (REPO / "docs" / "accuracy-gpu.md").read_text()
    assert GPU_CHECK.table(document) in page, (
        f"docs/accuracy-gpu.md is out of date for {name}: rerun the --table commands it names"
    )
