"""The lesson's example runs for real and its claims hold."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_importing_the_lesson_does_not_import_torch() -> None:
    code = "import sys, shardscope.lesson as l; assert 'torch' not in sys.modules; assert callable(l.memory_calculator)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.distributed
def test_lesson_example() -> None:
    from shardscope.lesson import run_distributed_demo

    out = run_distributed_demo(
        world_size=2, in_dim=16, hidden=12, out_dim=3, batch_size=4, num_steps=3, seed=11, timeout=60
    )
    assert out["world_size"] == 2 and out["backend"] == "gloo"
    assert out["fsdp_round_trip_all_ranks_ok"] is True
    assert out["param_sum_spread"] < 1e-12 and out["max_param_diff_across_ranks"] == 0.0
    assert out["manual_all_reduce_max_diff_vs_single_process"] < 1e-12
    assert len(out["losses"]) == 3
    stages = out["bytes_by_zero_stage_per_rank"][0]
    numel = 16 * 12 + 12 + 12 * 3 + 3  # 243 parameters, padded to 244 on 2 ranks
    assert stages["ddp"] == 4 * 244 * 8 + 4  # params, grads, two moments (float64), step
    assert stages["zero3"] == 4 * 122 * 8 + 4
    assert stages["ddp"] > stages["zero1"] > stages["zero2"] > stages["zero3"]
    assert numel == 243
